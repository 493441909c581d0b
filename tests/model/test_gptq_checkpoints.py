"""GPTQ W4A16 checkpoints (AutoGPTQ's, GPTQModel's and AutoRound's `quant_method: "gptq"` export): nextserve
reads them as the weights they stand for, and keeps them int4 in memory.

# NOTE: GPTQModel (7.7, the maintained GPTQ library) needs torch 2.14 or newer, so it cannot be a test
# dependency here. These checkpoints are written by `_gptq_tensors` below from the format's published layout,
# and the oracle is GPTQModel's own dequantization written out in `_library_weight` (TorchQuantLinear's
# dequantize_weight after its "gptq" -> "gptq_v2" conversion: unpack the words with shifts 0, 4, ..., 28, add
# one to the stored zero points, scales[g_idx] * (weight - zeros[g_idx]) in the scales' float16), which shares
# no code with nextserve's reader (model/packed.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoint_files import logit_error_against_transformers, read_tensors, w4a16_converted, write_checkpoint
from hf_oracle import TINY, save_hf_model

from nextserve import LLM, SamplingParams
from nextserve.config import ConfigError, ModelConfig
from nextserve.model.loader import load_weights

FLAGS = dict(
    device="cpu", max_concurrency=2, page_size=16, prefill_chunk=16, kv_capacity=512, max_context=256
)
PROMPT = [5, 6, 7, 1, 1, 9, 40, 41, 42, 1, 80, 81, 82, 83, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
PARAMS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)
SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return save_hf_model(TINY, 11, tmp_path_factory.mktemp("hf_gptq_src"))


def _pack_columns_of_rows(codes: torch.Tensor) -> torch.Tensor:
    """[R, C] values 0..15 -> [R / 8, C] int32: word (i, c) holds rows 8i..8i+7 of column c, lowest first."""
    r, c = codes.shape
    parts = codes.to(torch.int64).reshape(r // 8, 8, c) << SHIFTS.to(torch.int64)[None, :, None]
    words = parts.sum(dim=1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _gptq_tensors(w: torch.Tensor, group: int, symmetric: bool, fmt: str = "gptq") -> dict[str, torch.Tensor]:
    """GPTQ's tensors of a weight w [N, K] by min-max round-to-nearest (GPTQ's own quantizer with no
    calibration error to spread: the layout, not the algorithm, is under test)."""
    n, k = w.shape
    g = k if group == -1 else group
    parts = w.double().reshape(n, k // g, g)
    if symmetric:
        scale = (parts.abs().amax(-1) / 7.5).to(torch.float16)
        zero = torch.full((n, k // g), 8, dtype=torch.int64)
    else:
        lo, hi = parts.amin(-1).clamp(max=0), parts.amax(-1).clamp(min=0)
        scale = ((hi - lo) / 15).to(torch.float16)
        zero = torch.round(-lo / scale.double()).clamp(0, 15).to(torch.int64)
    s = scale.double().clamp(min=1e-8).repeat_interleave(g, -1)
    q = (torch.round(w.double() / s) + zero.repeat_interleave(g, -1)).clamp(0, 15).to(torch.int64)  # [N, K]
    stored_zero = zero - (1 if fmt == "gptq" else 0)  # "gptq" (v1) stores the zero point less one
    pad = -n % 8
    zeros = torch.nn.functional.pad(stored_zero.T, (0, pad))  # [G, N + pad]
    return {
        "qweight": _pack_columns_of_rows(q.T.contiguous()),
        "qzeros": _pack_columns_of_rows(zeros.T.contiguous()).T.contiguous(),
        "scales": scale.T.contiguous(),
        "g_idx": (torch.arange(k) // g).to(torch.int32),
    }


def _library_weight(t: dict[str, torch.Tensor], fmt: str = "gptq") -> torch.Tensor:
    """GPTQModel's dequantization of a module's tensors (the module NOTE): the weight [N, K] in float16."""
    qweight, qzeros, scales, g_idx = t["qweight"], t["qzeros"], t["scales"], t["g_idx"].long()
    zeros = (qzeros.unsqueeze(2).expand(-1, -1, 8) >> SHIFTS[None, None, :]) & 0xF
    zeros = zeros.reshape(qzeros.shape[0], -1)[:, : scales.shape[1]]
    if fmt == "gptq":  # the v1 -> v2 conversion
        zeros = zeros + 1
    weight = (qweight.unsqueeze(1).expand(-1, 8, -1) >> SHIFTS[None, :, None]) & 0xF
    weight = weight.reshape(-1, weight.shape[2])  # [K, N]
    w = scales[g_idx] * (weight.to(torch.float16) - zeros[g_idx].to(torch.float16))
    return w.T


def _checkpoints(src: Path, root: Path, group: int, symmetric: bool, fmt: str = "gptq"):
    """(a GPTQ checkpoint of src, the plain checkpoint of the library's dequantized weights)."""
    packed, deq = {}, {}
    for name, t in read_tensors(src).items():
        if not w4a16_converted(name, t):
            packed[name], deq[name] = t, t
            continue
        tensors = _gptq_tensors(t, group, symmetric, fmt)
        module = name.removesuffix(".weight")
        packed |= {f"{module}.{k}": v for k, v in tensors.items()}
        deq[name] = _library_weight(tensors, fmt).float()
    qc = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False, "sym": symmetric,
          "checkpoint_format": fmt, "damp_percent": 0.01, "true_sequential": True}  # fmt: skip
    tag = f"{group}_{symmetric}_{fmt}"
    return write_checkpoint(root / f"gptq_{tag}", src, packed, qc, shards=2), write_checkpoint(
        root / f"deq_{tag}", src, deq, None
    )


def test_the_writer_is_the_library_layout() -> None:
    """The oracle reads back the codes the writer packed (a sanity check of the two test helpers)."""
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(0))
    for sym in (True, False):
        t = _gptq_tensors(w, 32, sym)
        back = _library_weight(t).double()
        assert (back - w).abs().max() < t["scales"].double().max() * 0.51 + 1e-3


@pytest.mark.parametrize(
    "group,symmetric,fmt",
    [(32, True, "gptq"), (16, False, "gptq"), (-1, True, "gptq"), (32, False, "gptq_v2")],
)
def test_gptq_equals_its_dequantized_weights_in_float64(hf_dir, tmp_path, group, symmetric, fmt) -> None:
    gptq_dir, deq_dir = _checkpoints(hf_dir, tmp_path, group, symmetric, fmt)
    want = LLM(str(deq_dir), dtype="float64", **FLAGS).generate([PROMPT], PARAMS)[0]
    llm = LLM(str(gptq_dir), dtype="float64", **FLAGS)
    got = llm.generate([PROMPT], PARAMS)[0]
    assert got.token_ids == want.token_ids
    assert [lp.logprob for lp in got.logprobs] == [lp.logprob for lp in want.logprobs]
    o_proj = llm.engine.model.layers["3"].self_attn.o_proj
    assert o_proj.weight.dtype == torch.int32  # held as int4 words
    assert hasattr(o_proj, "weight_zero") != symmetric


def test_gptq_logits_are_transformers_on_the_dequantized_weights(hf_dir, tmp_path) -> None:
    gptq_dir, deq_dir = _checkpoints(hf_dir, tmp_path, 32, True)
    rel, held = logit_error_against_transformers(gptq_dir, deq_dir, PROMPT)
    assert rel < 5e-6, rel
    assert any(".mlp.experts." in n for n in held)


# ---- checkpoints that cannot be read right -------------------------------------------------------------

P = "model.layers.3.self_attn.o_proj"


@pytest.fixture(scope="module")
def good(hf_dir, tmp_path_factory) -> Path:
    return _checkpoints(hf_dir, tmp_path_factory.mktemp("gptq_good"), 32, True)[0]


def _rewrite(good: Path, out: Path, tensors=None, qc=None) -> Path:
    import json

    t = read_tensors(good)
    config = json.loads((good / "config.json").read_text())["quantization_config"]
    return write_checkpoint(out, good, tensors(t) if tensors else t, qc(dict(config)) if qc else config)


def _swap(part: str, make):
    return lambda t: t | {f"{P}.{part}": make(t[f"{P}.{part}"])}


BAD = [
    ("desc_act", None, lambda qc: qc | {"desc_act": True}, "desc_act"),
    ("8 bits", None, lambda qc: qc | {"bits": 8}, "bits"),
    ("group size not a multiple of 8", None, lambda qc: qc | {"group_size": 12}, "group_size"),
    ("group does not divide K", None, lambda qc: qc | {"group_size": 24}, "does not divide"),
    ("unknown checkpoint format", None, lambda qc: qc | {"checkpoint_format": "marlin"}, "marlin"),
    ("per-module overrides", None, lambda qc: qc | {"dynamic": {"-:.*": {}}}, "dynamic"),
    ("sym not a bool", None, lambda qc: qc | {"sym": "yes"}, "sym"),
    ("qweight shape", _swap("qweight", lambda v: v[:, :-1]), None, "scales"),
    ("scales shape", _swap("scales", lambda v: v[:-1]), None, "scales"),
    ("qzeros shape", _swap("qzeros", lambda v: v[:, :-1]), None, "qzeros"),
    ("qweight dtype", _swap("qweight", lambda v: v.to(torch.int64)), None, "int32"),
    ("no qzeros", lambda t: {k: v for k, v in t.items() if k != f"{P}.qzeros"}, None, "qzeros"),
    ("stray scales", lambda t: t | {"model.layers.0.foo.scales": torch.ones(1, 8)}, None, "no packed weight"),
    ("permuted g_idx", _swap("g_idx", lambda v: v.flip(0)), None, "desc_act"),
    ("g_idx shape", _swap("g_idx", lambda v: v[:-1]), None, "g_idx"),
    ("sym but zero points off the midpoint", _swap("qzeros", lambda v: v ^ 1), None, "midpoint"),
]  # fmt: skip


@pytest.mark.parametrize("tensors,qc,word", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_gptq_checkpoints_are_config_errors_naming_the_problem(good, tmp_path, tensors, qc, word) -> None:
    d = _rewrite(good, tmp_path / "bad", tensors, qc)
    with pytest.raises(ConfigError, match=word):
        load_weights(d, ModelConfig.from_dir(d), with_mtp=False)
