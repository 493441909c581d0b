"""Block-wise FP8 checkpoints (E4M3, 128 x 128 blocks) in both formats users meet, written here by the
test's own quantizer from a transformers model: nextserve's float64 tokens equal the float64 model on the
dequantized weights, its logits are within float32 rounding of transformers' on them, and every checkpoint
that cannot be read right is a ConfigError naming the problem."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from checkpoint_files import logit_error_against_transformers, read_tensors, write_checkpoint
from hf_oracle import TINY, save_hf_model
from safetensors.torch import save_file

from nextserve import LLM, SamplingParams
from nextserve.config import ConfigError, ModelConfig
from nextserve.model.loader import load_weights
from nextserve.ops.fp8 import FP8, Fp8Weight, dequantize, quantize, scale_shape

# experts of 128 rows (whole scale blocks): they stay FP8 in memory; hidden 64 is a partial block
CFG = dict(TINY, moe_intermediate_size=128, shared_expert_intermediate_size=128)
NOT_CONVERTED = ["lm_head", "embed_tokens", "mlp.gate", "shared_expert_gate", "ngram_embedding"]
FLAGS = dict(
    device="cpu", max_concurrency=2, page_size=16, prefill_chunk=16, kv_capacity=512, max_context=256
)


def _test_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The test's own block quantizer, block by block (scale = amax / 448)."""
    n, k = w.shape[-2:]
    rows, cols = math.ceil(n / 128), math.ceil(k / 128)
    flat = w.reshape(-1, n, k).float()
    q = torch.empty(flat.shape, dtype=torch.float8_e4m3fn)
    s = torch.empty((flat.shape[0], rows, cols), dtype=torch.float32)
    for e in range(flat.shape[0]):
        for r in range(rows):
            for c in range(cols):
                block = flat[e, r * 128 : (r + 1) * 128, c * 128 : (c + 1) * 128]
                amax = block.abs().max().item()
                s[e, r, c] = scale = amax / 448.0 if amax > 0 else 1.0
                q[e, r * 128 : (r + 1) * 128, c * 128 : (c + 1) * 128] = (
                    (block / scale).clamp(-448, 448).to(q.dtype)
                )
    return q.reshape(w.shape), s.reshape(*w.shape[:-2], rows, cols)


def _test_dequantize(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    n, k = q.shape[-2:]
    return q.double() * s.double().repeat_interleave(128, -2).repeat_interleave(128, -1)[..., :n, :k]


def _projection(name: str, t: torch.Tensor) -> bool:
    """What a FineGrainedFP8 / llm-compressor run converts: nn.Linear weights (2-D, not norms or
    embeddings), and transformers' fused expert tensors."""
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        return True
    return name.endswith(".weight") and t.dim() == 2 and "norm" not in name and "embedding" not in name


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return save_hf_model(CFG, 5, tmp_path_factory.mktemp("hf_fp8_src"))


def _fp8_checkpoints(src: Path, root: Path, fmt: str, shards: int = 1) -> tuple[Path, Path]:
    """(an FP8 checkpoint of `fmt`, the plain float64 checkpoint of its dequantized values)."""
    plain, fp8, deq = read_tensors(src), {}, {}
    suffix = "_scale_inv" if fmt == "fp8" else "_scale"
    for name, t in plain.items():
        module = name.removesuffix(".weight")
        skip = any(f".{m}." in f".{module}." for m in NOT_CONVERTED)
        if _projection(name, t) and not skip:
            q, s = _test_quantize(t)
            fp8[name], fp8[name + suffix] = q, s
            deq[name] = _test_dequantize(q, s)
        else:  # (integer tensors, such as the PLE's index buffers, stay integers)
            fp8[name], deq[name] = t, t.double() if t.is_floating_point() else t
    if fmt == "fp8":
        qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [128, 128], "modules_to_not_convert": NOT_CONVERTED}  # fmt: skip
    else:
        weights = {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128],
                   "symmetric": True, "dynamic": False}  # fmt: skip
        inputs = {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128, "dynamic": True}
        group = {
            "targets": ["Linear"],
            "weights": weights,
            "input_activations": inputs,
            "format": "float-quantized",
        }
        ignore = [
            "lm_head",
            "re:.*embed_tokens$",
            "re:.*mlp\\.gate$",
            "re:.*shared_expert_gate$",
            "re:.*ngram_embedding.*",
        ]
        qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ignore,
              "quantization_status": "compressed", "config_groups": {"group_0": group}}  # fmt: skip
    return (
        write_checkpoint(root / f"fp8_{fmt}", src, fp8, qc, shards),
        write_checkpoint(root / f"deq_{fmt}", src, deq, None),
    )


PROMPT = [5, 6, 7, 1, 1, 9, 40, 41, 42, 1, 80, 81, 82, 83, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
PARAMS = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2)


@pytest.mark.parametrize("fmt, shards", [("fp8", 3), ("compressed-tensors", 1)])
def test_fp8_checkpoint_equals_its_dequantized_weights_in_float64(hf_dir, tmp_path, fmt, shards):
    fp8_dir, deq_dir = _fp8_checkpoints(hf_dir, tmp_path, fmt, shards)
    fp8 = LLM(str(fp8_dir), dtype="float64", **FLAGS)
    m = fp8.engine.model
    # projections and 128-row experts stay FP8 in memory; what the lists name stays plain
    assert m.layers["0"].mlp.experts.gate_up_proj.dtype == FP8
    assert m.layers["3"].self_attn.o_proj.weight.dtype == FP8
    assert m.lm_head.weight.dtype == torch.float64 and m.layers["0"].mlp.gate.weight.dtype == torch.float64
    assert (
        m.layers["0"].attn_hyper_connection.input_mix_weight_down.weight.dtype == torch.float64
    )  # dequantized
    want = LLM(str(deq_dir), dtype="float64", **FLAGS).generate([PROMPT], PARAMS)[0]
    got = fp8.generate([PROMPT], PARAMS)[0]
    assert got.token_ids == want.token_ids
    assert [lp.logprob for lp in got.logprobs] == [lp.logprob for lp in want.logprobs]
    # --quantization none dequantizes on load: the same outputs
    none = LLM(str(fp8_dir), dtype="float64", quantization="none", **FLAGS)
    assert none.engine.model.layers["3"].self_attn.o_proj.weight.dtype == torch.float64
    assert none.generate([PROMPT], PARAMS)[0].token_ids == want.token_ids


def test_fp8_logits_are_transformers_on_the_dequantized_weights(hf_dir, tmp_path):
    fp8_dir, deq_dir = _fp8_checkpoints(hf_dir, tmp_path, "fp8")
    # (in float32 for transformers, which takes a float64 file's dtype for its own computations; the
    # float32 rounding of the exact q * s is what nextserve's float32 dequantization computes)
    deq = read_tensors(deq_dir)
    deq32 = write_checkpoint(
        tmp_path / "deq32",
        hf_dir,
        {k: v.float() if v.is_floating_point() else v for k, v in deq.items()},
        None,
    )
    rel, held = logit_error_against_transformers(fp8_dir, deq32, PROMPT)
    assert "layers.0.mlp.experts.gate_up_proj" in held and "lm_head.weight" not in held
    assert rel < 5e-6, rel


def test_quantize_and_dequantize():
    w = torch.randn(200, 300) * 3
    w[:128, 128:256] = 0  # an all-zero block: scale 1
    q, s = quantize(w)
    assert q.dtype == FP8 and s.shape == scale_shape(w.shape) == (2, 3) and s[0, 1] == 1.0
    back = dequantize(q, s, torch.float64)
    assert torch.equal(back, _test_dequantize(q, s))
    assert ((back - w.double()).abs() <= w.abs().amax().item() / 448 * 32).all()  # E4M3 keeps 3 mantissa bits
    tq, ts = _test_quantize(w)
    assert torch.equal(tq.view(torch.uint8), q.view(torch.uint8)) and torch.equal(ts, s)
    fw = Fp8Weight(q, s)
    assert fw.rows(128, 200).shape == (72, 300) and fw.rows(128, 200).scale.shape == (1, 3)
    with pytest.raises(ValueError):
        Fp8Weight(q, s[:1])


def test_quantization_fp8_quantizes_a_plain_checkpoint_on_load(tiny_model_dir, tmp_path):
    from nextserve.model.make_model import make_model

    fp8_dir = make_model("tiny", tmp_path / "f8", seed=0, quantization="fp8")  # the same draws, quantized
    config = json.loads((fp8_dir / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"
    flags = FLAGS | {"dtype": "float32"}
    on_load = LLM(str(tiny_model_dir), quantization="fp8", **flags)
    assert on_load.engine.model.layers["3"].self_attn.o_proj.weight.dtype == FP8
    written = LLM(str(fp8_dir), **flags)
    p = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    assert on_load.generate([PROMPT], p)[0].token_ids == written.generate([PROMPT], p)[0].token_ids


# ---- what cannot be read right --------------------------------------------------------------------------
def _edit(src: Path, out: Path, config=None, tensors=None) -> Path:
    shutil.copytree(src, out)
    if config is not None:
        c = json.loads((out / "config.json").read_text())
        config(c)
        (out / "config.json").write_text(json.dumps(c))
    if tensors is not None:
        t = read_tensors(out)
        tensors(t)
        for f in out.glob("*.safetensors"):
            f.unlink()
        (out / "model.safetensors.index.json").unlink(missing_ok=True)
        save_file(t, out / "model.safetensors")
    return out


O_PROJ = "model.layers.3.self_attn.o_proj.weight"
QC = "quantization_config"
INT_SCALE = {O_PROJ + "_scale_inv": torch.ones(1, 1, dtype=torch.int32)}
GATE_SCALE = {"model.layers.0.mlp.gate.weight_scale_inv": torch.ones(1, 1)}


@pytest.mark.parametrize(
    "name, config, tensors, match",
    [
        ("method", lambda c: c[QC].update(quant_method="awq"), None, "quant_method 'awq'"),
        ("fmt", lambda c: c[QC].update(fmt="e5m2"), None, "fmt 'e5m2'"),
        ("static", lambda c: c[QC].update(activation_scheme="static"), None, "static"),
        ("block", lambda c: c[QC].update(weight_block_size=[64, 64]), None, "weight_block_size"),
        ("no-config", lambda c: c.pop(QC), None, "no quantization_config"),
        ("no-scale", None, lambda t: t.pop(O_PROJ + "_scale_inv"), "has no scales"),
        ("scale-shape", None, lambda t: t.update({O_PROJ + "_scale_inv": torch.ones(3, 3)}), "has shape"),
        ("scale-dtype", None, lambda t: t.update(INT_SCALE), "scales are float32"),
        ("not-converted", lambda c: c[QC]["modules_to_not_convert"].append("o_proj"), None, "not converted"),
        ("e5m2", None, lambda t: t.update({O_PROJ: t[O_PROJ].to(torch.float8_e5m2)}), "float8_e4m3fn"),
        ("unexpected", None, lambda t: t.update({"model.layers.0.mystery.weight": torch.zeros(2)}),
         "does not read"),
        ("stray-scale", None, lambda t: t.update(GATE_SCALE), "not FP8 but has scales"),
    ],
)  # fmt: skip
def test_checkpoints_that_cannot_be_read_right_are_refused(hf_dir, tmp_path, name, config, tensors, match):
    fp8_dir, _ = _fp8_checkpoints(hf_dir, tmp_path, "fp8")
    bad = _edit(fp8_dir, tmp_path / f"bad_{name}", config, tensors)
    with pytest.raises(ConfigError, match=match):
        LLM(str(bad), dtype="float32", **FLAGS)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda g: g["weights"].update(strategy="channel"), "not FP8_BLOCK"),
        (lambda g: g["weights"].update(num_bits=4), "not FP8_BLOCK"),
        (lambda g: g["input_activations"].update(dynamic=False), "static"),
    ],
)
def test_compressed_tensors_that_are_not_fp8_block_are_refused(hf_dir, tmp_path, edit, match):
    fp8_dir, _ = _fp8_checkpoints(hf_dir, tmp_path, "compressed-tensors")
    bad = _edit(
        fp8_dir, tmp_path / "bad_ct", lambda c: edit(c["quantization_config"]["config_groups"]["group_0"])
    )
    with pytest.raises(ConfigError, match=match):
        LLM(str(bad), dtype="float32", **FLAGS)


def test_skipped_tensors_are_only_the_documented_ones(tiny_model_dir, tmp_path):
    extra = {
        "model.visual.blocks.0.attn.qkv.weight": torch.zeros(3, 3),
        "model.layers.0.ple.hashstats_counts": torch.zeros(7),
        "mtp.shared_head.head.weight": torch.zeros(2, 2),
    }
    ok = _edit(tiny_model_dir, tmp_path / "ok", tensors=lambda t: t.update(extra))
    cfg = ModelConfig.from_dir(ok)
    assert "mtp.shared_head.head.weight" not in load_weights(ok, cfg, with_mtp=True)
    bad = _edit(
        tiny_model_dir,
        tmp_path / "bad",
        tensors=lambda t: t.update({"model.layers.0.extra.bias": torch.zeros(2)}),
    )
    with pytest.raises(ConfigError, match="model.layers.0.extra.bias"):
        load_weights(bad, ModelConfig.from_dir(bad))
