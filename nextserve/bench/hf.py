"""The transformers workload: Qwen4ExpForCausalLM with the same weights, greedy with a DynamicCache."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from ..model.flash_next import FlashNext
from .meters import EnergyMeter, Window, peak_memory, reset_peak
from .model import default_dtype
from .workload import WARM_DECODE_STEPS


def transformers_model(
    raw_config: dict[str, Any], ns_model: FlashNext, device: torch.device, dtype: torch.dtype
):
    """transformers' Qwen4ExpForCausalLM on `device` in `dtype` holding ns_model's weights."""
    import transformers
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    fields = {k: v for k, v in raw_config.items() if k != "model_type"}
    config = Qwen4ExpTextConfig(**fields)
    with default_dtype(dtype), torch.device(device):
        hf = Qwen4ExpForCausalLM(config)
    state = {(k if k.startswith("lm_head.") else f"model.{k}"): v for k, v in ns_model.state_dict().items()}
    result = hf.load_state_dict(state, strict=False)
    buffers = {n for n, _ in hf.named_buffers()}
    missing = [k for k in result.missing_keys if k not in buffers]
    if missing or result.unexpected_keys:
        raise RuntimeError(
            f"weights do not map: missing {missing[:5]}, unexpected {result.unexpected_keys[:5]}"
        )
    hf.eval()
    info = {
        "version": transformers.__version__,
        "module": transformers.__file__,
        "attn_implementation": getattr(hf.config, "_attn_implementation", None),
        "experts_implementation": getattr(hf.config, "_experts_implementation", None),
    }
    try:
        import fla  # noqa: F401

        info["flash_linear_attention"] = True
    except ImportError:
        info["flash_linear_attention"] = False
    return hf, info


@torch.inference_mode()
def hf_run(
    hf, prompts: list[list[int]], new_tokens: int, device: torch.device, meter: EnergyMeter, warm: int = 0
) -> dict:
    """Greedy decode with a DynamicCache, as `generate` runs it: one forward over the whole batch of prompts
    (equal lengths, no padding), then one forward per token (`warm` untimed, then `new_tokens` timed).
    Returns timings and the tokens."""
    ids = torch.tensor(prompts, dtype=torch.long, device=device)
    B = ids.shape[0]
    reset_peak(device)
    with Window(device, meter) as wp:
        out = hf(input_ids=ids, use_cache=True, logits_to_keep=1)
        tok = out.logits[:, -1].argmax(-1)
        tokens = [tok.tolist()]
    cache = out.past_key_values
    for _ in range(warm):
        out = hf(input_ids=tok[:, None], past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1].argmax(-1)
        tokens.append(tok.tolist())
    step_s = []
    with Window(device, meter) as wd:
        for _ in range(new_tokens):
            t0 = time.perf_counter()
            out = hf(input_ids=tok[:, None], past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1].argmax(-1)
            tokens.append(tok.tolist())
            step_s.append(time.perf_counter() - t0)
    del cache, out
    return {"prefill": wp, "decode": wd, "step_s": step_s, "tokens": tokens, "B": B}


def hf_prefill(hf, prompt: list[int], device: torch.device, meter: EnergyMeter) -> dict[str, Any]:
    r = hf_run(hf, [prompt], 0, device, meter)
    w = r["prefill"]
    return {
        "prompt_len": len(prompt),
        "first_token": r["tokens"][0][0],
        "ttft_s": round(w.seconds, 4),
        "prefill_tok_per_s": round(len(prompt) / w.seconds, 1),
        **w.energy(len(prompt)),
        "peak_memory_bytes": peak_memory(device),
    }


def hf_decode(hf, prompts: list[list[int]], steps: int, device: torch.device, meter: EnergyMeter) -> dict:
    r = hf_run(hf, prompts, steps, device, meter, warm=WARM_DECODE_STEPS)
    w, tokens = r["decode"], len(prompts) * steps
    return {
        "concurrency": len(prompts),
        "prompt_len": len(prompts[0]),
        "decode_steps": steps,
        "decode_tok_per_s": round(tokens / w.seconds, 2),
        "decode_tok_per_s_median_step": round(len(prompts) / statistics.median(r["step_s"]), 2),
        "step_s_median": round(statistics.median(r["step_s"]), 5),
        "step_s_min": round(min(r["step_s"]), 5),
        "step_s_max": round(max(r["step_s"]), 5),
        "ttft_s_first": round(r["prefill"].seconds, 4),
        "ttft_s_last": round(r["prefill"].seconds, 4),
        **w.energy(tokens),
        "peak_memory_bytes": peak_memory(device),
    }
