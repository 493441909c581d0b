"""nextserve's model against transformers' Qwen4ExpForCausalLM (the oracle nextserve did not write)."""

import pytest
import torch
from hf_oracle import TINY, WIDE, hf_model, new_sequence, nextserve_model, run_serial

# Max |logit difference| relative to max |logit|, over a 72-token prompt and 32 decode steps.
# float64: transformers computes its norms, rotary tables and GDN recurrence in float32 whatever the
# dtype, so float64 agrees to float32 rounding, not better.
TOLERANCE = {torch.float32: 5e-6, torch.float64: 5e-7}
CONFIGS = {"tiny": TINY, "wide": WIDE}


def _prompt(cfg: dict, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, cfg["vocab_size"], (n,), generator=g)
    eos = cfg["eos_token_id"]
    ids[[5, 6, 7, 13, 26, 40]] = eos  # three adjacent, two on 13-token chunk boundaries
    return ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_prefill_and_decode(name: str, dtype: torch.dtype) -> None:
    raw = CONFIGS[name]
    hf = hf_model(raw, seed=1, dtype=dtype)
    with torch.no_grad():
        hf.lm_head.weight.mul_(30)
    cfg, model = nextserve_model(hf, dtype)
    prompt = _prompt(raw, 72, seed=2)
    # Greedy continuation from nextserve (prefill in 13-token chunks, then 32 decode steps), then one
    # transformers forward over the same 104 tokens.
    ids, _, logits = run_serial(model, new_sequence(cfg, dtype, 104), prompt, chunk=13, new_tokens=33)
    ids = ids[:-1]
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert ref.shape == logits.shape
    rel = ((logits - ref).abs().max() / ref.abs().max()).item()
    print(f"{name} {dtype}: max |dlogit| / max |logit| = {rel:.2e}")
    assert rel < TOLERANCE[dtype]


def test_prompt_exceeds_budget_and_selection_drops_blocks() -> None:
    """The tiny config's budget is 8 tokens; a 72-token prompt must select fewer than t+1 tokens."""
    from qsa_reference import select_tokens

    q = torch.randn(1, 2, 32)
    keys = torch.randn(17, 32)
    (sel,) = select_tokens(q, keys, [70], compress_ratio=4, block_topk=2)
    assert sel.numel() == 2 * 4 + (70 + 1 - 17 * 4)
    assert sel.tolist() == sorted(sel.tolist())


def test_greedy_generate_equals_transformers_float64() -> None:
    hf = hf_model(TINY, seed=3, dtype=torch.float64)
    with torch.no_grad():
        hf.lm_head.weight.mul_(30)
    cfg, model = nextserve_model(hf, torch.float64)
    prompt = _prompt(TINY, 45, seed=4)
    with torch.no_grad():
        ref = hf.generate(
            prompt[None], max_new_tokens=40, min_new_tokens=40, do_sample=False, eos_token_id=None
        )[0].tolist()
    ids, _, _ = run_serial(model, new_sequence(cfg, torch.float64, 90), prompt, chunk=64, new_tokens=40)
    assert ids.tolist() == ref
