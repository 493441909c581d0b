"""Random checkpoints (make_model) and their tokenizer (tokenizer_build) against transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import (
    AutoTokenizer,
    PreTrainedTokenizerFast,
    Qwen4ExpForCausalLM,
    Qwen4ExpForConditionalGeneration,
)

from nextserve.config import GDN, QSA, ModelConfig
from nextserve.model.make_model import make_model
from nextserve.model.presets import PRESETS, text_config
from nextserve.model.tokenizer_build import SPECIAL_TOKENS, build_tokenizer, default_corpus


def _hf_load(cls, model_dir: Path):
    model, info = cls.from_pretrained(model_dir, output_loading_info=True, experts_implementation="eager")
    return model.eval(), info


def _assert_clean(info: dict) -> None:
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert not info["error_msgs"], info


def _ids(vocab: int, n: int, eos: int) -> torch.Tensor:
    ids = torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(0))
    ids[0, [5, 6, 20]] = eos  # PLE resets its n-gram context at eos
    return ids


# ---- checkpoints in transformers -------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "small_model_dir"])
def test_preset_loads_in_causal_lm_and_runs_forward(fixture: str, request: pytest.FixtureRequest) -> None:
    model_dir = request.getfixturevalue(fixture)
    model, info = _hf_load(Qwen4ExpForCausalLM, model_dir)
    _assert_clean(info)
    cfg = ModelConfig.from_dir(model_dir)
    with torch.no_grad():
        logits = model(_ids(cfg.vocab_size, 24, cfg.eos_token_id)).logits
    assert logits.shape == (1, 24, cfg.vocab_size)
    assert torch.isfinite(logits).all()
    # Tame but not flat: a trained-looking logit spread.
    assert 0.3 < logits.std().item() < 10


def test_multimodal_sharded_fused_loads_in_both_transformers_classes(tmp_path: Path) -> None:
    model_dir = make_model("tiny", tmp_path / "mm", layout="multimodal", fused_experts=True, shard_mib=0.05)
    cg, info = _hf_load(Qwen4ExpForConditionalGeneration, model_dir)
    _assert_clean(info)
    clm, info = _hf_load(Qwen4ExpForCausalLM, model_dir)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    ids = _ids(512, 24, ModelConfig.from_dir(model_dir).eos_token_id)
    with torch.no_grad():
        torch.testing.assert_close(cg(ids).logits, clm(ids).logits)


def test_tiny_config_is_flash_next_section_5(tiny_model_dir: Path) -> None:
    raw = json.loads((tiny_model_dir / "config.json").read_text())
    assert raw["model_type"] == "qwen4_exp_text"
    assert raw["architectures"] == ["Qwen4ExpForCausalLM"]
    assert raw["mtp_num_hidden_layers"] == 1
    cfg = ModelConfig.from_dir(tiny_model_dir)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (512, 64, 4)
    assert cfg.layer_types == (GDN, GDN, GDN, QSA)
    assert cfg.ple_layer_ids == (1, 3) and cfg.split_ngram_parts == 1
    assert (cfg.indexer_budget, cfg.block_topk, cfg.rotary_dim) == (8, 2, 16)
    assert cfg.max_position_embeddings == 4096
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert isinstance(raw["eos_token_id"], int)
    assert raw["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")
    gen = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg.eos_token_id


def test_small_preset_shape(small_model_dir: Path) -> None:
    cfg = ModelConfig.from_dir(small_model_dir)
    assert cfg.qsa_layers == (3, 7) and cfg.ple_layers == (1, 5)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.hc_lowrank, cfg.vocab_size) == (16, 4, 16, 2048)


def test_ple_buffers_equal_transformers_own(tiny_model_dir: Path) -> None:
    # A fresh transformers model computes the primes, offsets and hash multipliers itself.
    loaded, _ = _hf_load(Qwen4ExpForCausalLM, tiny_model_dir)
    fresh = Qwen4ExpForCausalLM(loaded.config)
    ours = dict(loaded.named_buffers())
    ple = [(n, b) for n, b in fresh.named_buffers() if ".ple." in n]
    assert len(ple) == 6  # two PLE layers x (multipliers, vocab sizes, offsets)
    for name, buf in ple:
        assert torch.equal(ours[name], buf), name


def test_checkpoint_names_mirror_transformers_save(tiny_model_dir: Path, tmp_path: Path) -> None:
    model, _ = _hf_load(Qwen4ExpForCausalLM, tiny_model_dir)
    model.save_pretrained(tmp_path / "resaved")
    ours = load_file(tiny_model_dir / "model.safetensors")
    theirs = load_file(tmp_path / "resaved" / "model.safetensors")
    extra = {k for k in ours if k.startswith("mtp.")}
    assert set(ours) - extra == set(theirs)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name


def test_no_zero_init_hides_a_path(tiny_model_dir: Path) -> None:
    tensors = load_file(tiny_model_dir / "model.safetensors")
    for name, t in tensors.items():
        if t.is_floating_point():
            assert t.abs().min() > 0 or t.numel() > 64, name  # small tensors: no exact zeros at all
            assert t.std() > 0.01, name
    norms = [n for n in tensors if "norm" in n.split(".")[-2] and "linear_attn.norm" not in n]
    assert any(".ple.norm_" in n for n in norms) and any("hc_norm" in n for n in norms)
    assert any("q_layernorm" in n for n in norms) and any("pre_fc_norm" in n for n in norms)
    for name in norms:  # (1+w) norms: w around 0, not 0
        assert tensors[name].abs().mean() > 0.02, name
    gated = tensors["model.layers.0.linear_attn.norm.weight"]  # plain weight: around 1
    assert 0.7 < gated.mean() < 1.3
    a = tensors["model.layers.0.linear_attn.A_log"].exp()
    assert (a >= 0.01).all() and (a <= 16).all()
    assert tensors["model.layers.0.ple.conv1d.weight"].abs().mean() > 0.05
    assert tensors["model.layers.0.ple.ple_embedding.layer_multipliers"].dtype == torch.int64


def test_mtp_weights_named_like_a_qsa_layer(tiny_model_dir: Path) -> None:
    with safe_open(tiny_model_dir / "model.safetensors", "pt") as f:
        names = set(f.keys())
    mtp = {n for n in names if n.startswith("mtp.")}
    layer = {n[len("mtp.layers.0.") :] for n in mtp if n.startswith("mtp.layers.0.")}
    qsa = {n[len("model.layers.3.") :] for n in names if n.startswith("model.layers.3.")}
    assert layer == qsa
    assert "mtp.hyper_connection_mixer.block_inject_weight.weight" in mtp
    for name in ("fc_embedding", "fc_hidden", "pre_fc_norm_embedding", "pre_fc_norm_hidden"):
        assert f"mtp.{name}.weight" in mtp
    assert not any("embed" in n and "fc_" not in n or "lm_head" in n for n in mtp)


def test_values_depend_only_on_seed(tmp_path: Path, tiny_model_dir: Path) -> None:
    same = load_file(make_model("tiny", tmp_path / "a", seed=0, with_mtp=False) / "model.safetensors")
    ref = load_file(tiny_model_dir / "model.safetensors")
    assert all(torch.equal(t, ref[n]) for n, t in same.items())  # MTP on/off leaves the rest alone
    other = load_file(make_model("tiny", tmp_path / "b", seed=1) / "model.safetensors")
    assert not torch.equal(other["lm_head.weight"], ref["lm_head.weight"])
    tokenizer_json = (tmp_path / "a" / "tokenizer.json").read_bytes()
    assert tokenizer_json == (tiny_model_dir / "tokenizer.json").read_bytes()


def test_sharded_index(tmp_path: Path) -> None:
    model_dir = make_model("tiny", tmp_path / "s", shard_mib=0.1, dtype=torch.bfloat16)
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    total, seen = 0, set()
    for fname in files:
        with safe_open(model_dir / fname, "pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                assert index["weight_map"][name] == fname
                assert t.dtype in (torch.bfloat16, torch.int64)
                total += t.numel() * t.element_size()
                seen.add(name)
    assert seen == set(index["weight_map"]) and index["metadata"]["total_size"] == total
    assert not (model_dir / "model.safetensors").exists()
    assert json.loads((model_dir / "config.json").read_text())["dtype"] == "bfloat16"


def test_overrides_and_presets() -> None:
    cfg = text_config("small", {"rope_parameters": {"rope_theta": 1e6}, "num_experts": 32})
    assert cfg["rope_parameters"]["rope_theta"] == 1e6
    assert cfg["rope_parameters"]["mrope_section"] == [3, 3, 2]  # merged, not replaced
    assert cfg["num_experts"] == 32 and PRESETS["small"]["num_experts"] == 16
    with pytest.raises(ValueError, match="unknown preset"):
        text_config("huge")


# ---- tokenizer -------------------------------------------------------------------------------------------


def test_tokenizer_round_trips(tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert len(tok) <= 512
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    text = "def f(x):\n    return x + 1  # héllo wörld 🤖 12345\n\n\tdone"
    assert tok.decode(tok.encode(text)) == text
    marked = "<|im_start|>assistant\n<think>\nhm\n</think>\n<tool_call>\n{}\n</tool_call><|im_end|>"
    ids = tok.encode(marked)
    assert tok.decode(ids) == marked
    # Tool-call and think markup survive skip_special_tokens (the server parses them); ChatML does not.
    assert (
        tok.decode(ids, skip_special_tokens=True)
        == "assistant\n<think>\nhm\n</think>\n<tool_call>\n{}\n</tool_call>"
    )


def test_chat_template_with_tools_and_generation_prompt(tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}],
        },
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Nice"}'}},
            ],
        },
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": [{"type": "text", "text": "rain"}]},
    ]
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    expected = (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        + json.dumps(tools[0])
        + "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\nChecking.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Nice"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert text == expected


def test_chat_template_plain_and_thinking_off(tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello.", "reasoning_content": "greet"},
        {"role": "user", "content": "Bye"},
    ]
    text = tok.apply_chat_template(messages, tokenize=False)
    assert text == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\ngreet\n</think>\n\nHello.<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
    )
    prompt = tok.apply_chat_template(
        messages, add_generation_prompt=True, enable_thinking=False, tokenize=False
    )
    assert prompt == text + "<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_build_tokenizer_is_deterministic(tmp_path: Path) -> None:
    texts = default_corpus(50_000)
    build_tokenizer(texts, 400, tmp_path / "a")
    build_tokenizer(iter(texts), 400, tmp_path / "b")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(texts, 100, tmp_path / "c")


def test_default_corpus() -> None:
    corpus = default_corpus(100_000)
    assert sum(map(len, corpus)) == 100_000
    assert corpus == default_corpus(100_000)
    assert default_corpus(1000)[0] == corpus[0][:1000]
    assert default_corpus(0) == []


def test_the_reference_recipe_draws_a_checkpoint_that_loads(tmp_path: Path) -> None:
    """benchmarks/reference/make_ckpt.py (a copy of the recipe the project is compared on, which imports
    make_model's former private names) still runs, here at the tiny preset on the CPU, and its checkpoint
    loads."""
    import os
    import subprocess
    import sys

    from nextserve.model.loader import load_weights

    recipe = Path(__file__).resolve().parents[2] / "benchmarks" / "reference" / "make_ckpt.py"
    env = os.environ | {"PRESET": "tiny", "CUDA_VISIBLE_DEVICES": ""}
    subprocess.run(
        [sys.executable, str(recipe), str(tmp_path), "2"], check=True, env=env, capture_output=True
    )
    cfg = ModelConfig.from_dir(tmp_path)
    assert cfg.num_hidden_layers == 2
    assert load_weights(tmp_path, cfg)
