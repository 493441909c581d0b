"""W4A16 checkpoints as they ship (compressed-tensors pack-quantized, written here by the compressed-tensors
library itself): nextserve reads them as the weights they stand for. Its float64 tokens and logprobs equal the
float64 model on the library's dequantized weights, symmetric and asymmetric; its logits are within float32
rounding of transformers' on them; make-model's writer is read back by the library; the embedded model
quantized to int4 keeps its held-out loss within 10% (and a wrong nibble order does not); every checkpoint
that cannot be read right is a ConfigError naming the tensor."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from checkpoint_files import logit_error_against_transformers, read_tensors, w4a16_converted, write_checkpoint
from hf_oracle import TINY, save_hf_model
from safetensors.torch import save_file

from nextserve import LLM, SamplingParams
from nextserve.config import ConfigError, ModelConfig
from nextserve.model.loader import load_weights
from nextserve.model.make_model import make_model

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.lifecycle.forward import dequantize  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

FLAGS = dict(
    device="cpu", max_concurrency=2, page_size=16, prefill_chunk=16, kv_capacity=512, max_context=256
)
IGNORE = ["lm_head", "re:.*embed_tokens$", "re:.*mlp\\.gate$", "re:.*shared_expert_gate$", "re:.*ngram.*",
          "re:.*hyper_connection.*"]  # fmt: skip
PROMPT = [5, 6, 7, 1, 1, 9, 40, 41, 42, 1, 80, 81, 82, 83, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
PARAMS = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return save_hf_model(TINY, 7, tmp_path_factory.mktemp("hf_int4_src"))


def _library_weight(out: dict, args: QuantizationArgs, shape) -> torch.Tensor:
    """The library's dequantization of its packed tensors. (Its decompress unpacks the zero points of some
    shapes through a strided view, which fails; the same bits come from its unpacking of the transposed
    words, then its dequantize.)"""
    if args.symmetric:
        return PackedQuantizationCompressor.decompress(
            dict(out), QuantizationScheme(targets=["Linear"], weights=args)
        )["weight"]
    zp_shape = (shape[0], out["weight_scale"].shape[-1])
    z = out["weight_zero_point"]
    words = torch.empty((z.shape[1], z.shape[0]), dtype=torch.int32).copy_(z.T)  # (fresh strides)
    zero = unpack_from_int32(words, 4, zp_shape[::-1]).T
    q = unpack_from_int32(out["weight_packed"], 4, torch.Size(shape))
    return dequantize(x_q=q, scale=out["weight_scale"], zero_point=zero, args=args)


def _checkpoints(src: Path, root: Path, symmetric: bool, strategy: str, group: int | None):
    """(the library's W4A16 checkpoint of src, the plain checkpoint of its dequantized weights)."""
    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy=strategy, group_size=group)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    packed, deq = {}, {}
    for name, t in read_tensors(src).items():
        if not w4a16_converted(name, t):
            packed[name], deq[name] = t, t
            continue
        w = t.to(torch.bfloat16)  # (16-bit scales, as checkpoints ship: q * s is exact in float32)
        k = w.shape[-1]
        g = k if strategy == "channel" else group
        parts = w.float().unflatten(-1, (k // g, g))
        scale, zero = calculate_qparams(parts.amin(-1), parts.amax(-1), args)
        state = {"weight": w, "weight_scale": scale.to(w.dtype), "weight_zero_point": zero.to(torch.int8)}
        out = PackedQuantizationCompressor.compress(state, scheme)
        module = name.removesuffix(".weight")
        packed |= {f"{module}.{k}": v for k, v in out.items()}
        deq[name] = _library_weight(out, args, w.shape).float()
    group_cfg = {"targets": ["Linear"], "weights": args.model_dump(), "input_activations": None,
                 "format": "pack-quantized"}  # fmt: skip
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized",
          "quantization_status": "compressed", "config_groups": {"group_0": group_cfg},
          "ignore": IGNORE}  # fmt: skip
    tag = f"{'sym' if symmetric else 'asym'}_{strategy}_{group}"
    return write_checkpoint(root / f"int4_{tag}", src, packed, qc), write_checkpoint(
        root / f"deq_{tag}", src, deq, None
    )


@pytest.mark.parametrize(
    "symmetric,strategy,group",
    [(True, "group", 32), (True, "group", 16), (False, "group", 32), (True, "channel", None)],
)
def test_w4a16_equals_its_dequantized_weights_in_float64(
    hf_dir, tmp_path, symmetric, strategy, group
) -> None:
    int4_dir, deq_dir = _checkpoints(hf_dir, tmp_path, symmetric, strategy, group)
    want = LLM(str(deq_dir), dtype="float64", **FLAGS).generate([PROMPT], PARAMS)[0]
    got = LLM(str(int4_dir), dtype="float64", **FLAGS).generate([PROMPT], PARAMS)[0]
    assert got.token_ids == want.token_ids
    assert [lp.logprob for lp in got.logprobs] == [lp.logprob for lp in want.logprobs]


def test_w4a16_logits_are_transformers_on_the_dequantized_weights(hf_dir, tmp_path) -> None:
    int4_dir, deq_dir = _checkpoints(hf_dir, tmp_path, True, "group", 32)
    rel, _ = logit_error_against_transformers(int4_dir, deq_dir, PROMPT)
    assert rel < 5e-6, rel


def test_make_model_int4_is_read_back_by_the_library(tmp_path) -> None:
    """make-model's own writer (per-expert tensors, sharded): the library's decompression of each module is
    what nextserve loads."""
    d = make_model("tiny", tmp_path / "q", seed=2, quantization="int4", group_size=16, shard_mib=0.05)
    assert len(list(d.glob("*.safetensors"))) > 1
    qc = json.loads((d / "config.json").read_text())["quantization_config"]
    args = QuantizationArgs(**qc["config_groups"]["group_0"]["weights"])
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    tensors = read_tensors(d)
    cfg = ModelConfig.from_dir(d)
    ours = load_weights(d, cfg, with_mtp=True)
    module = "model.layers.0.mlp.experts.3.down_proj"
    state = {k.split(".")[-1]: v for k, v in tensors.items() if k.startswith(module + ".")}
    lib = PackedQuantizationCompressor.decompress(state, scheme)["weight"]
    assert torch.equal(ours["layers.0.mlp.experts.down_proj"][3], lib.float())
    out = LLM(str(d), dtype="float32", **FLAGS).generate([PROMPT], PARAMS)[0]
    assert len(out.token_ids) == 16


def _nibbles_swapped(packed: torch.Tensor) -> torch.Tensor:
    """The same words with each byte's two nibbles exchanged: a wrong nibble order."""
    u = packed.view(torch.uint8)
    return ((u << 4) | (u >> 4)).view(torch.int32)


def test_the_embedded_model_in_int4_keeps_its_held_out_loss(tmp_path, capsys) -> None:
    from tokenizers import Tokenizer

    from nextserve.engine_config import DEFAULT_MODEL
    from nextserve.model.make_int4 import quantize_checkpoint
    from nextserve.train import data
    from nextserve.train.evaluate import load, validation_loss

    int4 = quantize_checkpoint(Path(DEFAULT_MODEL), tmp_path / "int4", 128)
    tok = Tokenizer.from_file(str(int4 / "tokenizer.json"))
    _, held = data.split_files()
    ids = [i for _, text in held[:4] for i in tok.encode(text).ids]
    loss = {}
    for name, d in (("bf16", Path(DEFAULT_MODEL)), ("int4", int4)):
        _, model, _ = load(d)
        loss[name] = validation_loss(model, ids, 256, 4)["val_loss"]
    # the same checkpoint with a wrong nibble order
    bad = {
        k: _nibbles_swapped(v) if k.endswith("weight_packed") else v for k, v in read_tensors(int4).items()
    }
    wrong = write_checkpoint(tmp_path / "wrong", int4, bad, None)
    _, model, _ = load(wrong)
    loss["wrong nibble order"] = validation_loss(model, ids, 256, 4)["val_loss"]
    with capsys.disabled():
        print(
            "\nheld-out loss (perplexity): "
            + ", ".join(f"{k} {v:.3f} ({math.exp(v):.1f})" for k, v in loss.items())
        )
    assert math.exp(loss["int4"]) < 1.10 * math.exp(loss["bf16"]), loss
    assert math.exp(loss["wrong nibble order"]) > 1.10 * math.exp(loss["bf16"]), loss


# ---- checkpoints that cannot be read right -------------------------------------------------------------


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return make_model(
        "tiny", tmp_path_factory.mktemp("int4_good") / "m", seed=1, quantization="int4", group_size=16
    )


def _edited(good: Path, out: Path, tensors=None, qc=None) -> Path:
    shutil.copytree(good, out)
    if tensors is not None:
        for f in out.glob("*.safetensors"):
            f.unlink()
        save_file({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors")
    if qc is not None:
        config = json.loads((out / "config.json").read_text())
        config["quantization_config"] = qc(config["quantization_config"])
        (out / "config.json").write_text(json.dumps(config))
    return out


P = "model.layers.3.self_attn.o_proj"


def _group(qc: dict, **w) -> dict:
    qc["config_groups"]["group_0"]["weights"] |= w
    return qc


def _format(qc: dict, **g) -> dict:
    qc["config_groups"]["group_0"] |= g
    return qc | ({"format": g["format"]} if "format" in g else {})


def _swap(part: str, make) -> object:
    return lambda t: t | {f"{P}.{part}": make(t[f"{P}.{part}"])}


AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}
BAD = [
    ("packed shape", _swap("weight_packed", lambda v: v[:, :-1]), None, "weight_packed"),
    ("scale shape", _swap("weight_scale", lambda v: v[:, :-1]), None, "weight_scale"),
    ("no scales", lambda t: {k: v for k, v in t.items() if k != f"{P}.weight_scale"}, None, "weight_scale"),
    ("packed dtype", _swap("weight_packed", lambda v: v.to(torch.int64)), None, "int32"),
    ("stray zero point", lambda t: t | {f"{P}.weight_zero_point": torch.zeros(1, 1, dtype=torch.int32)}, None,
     "symmetric"),
    ("group does not divide K", None, lambda qc: _group(qc, group_size=24), "does not divide"),
    ("8-bit ints", None, lambda qc: _group(qc, num_bits=8), "4-bit"),
    ("activation order", None, lambda qc: _group(qc, actorder="group"), "actorder"),
    ("tensor strategy", None, lambda qc: _group(qc, strategy="tensor"), "strategy"),
    ("another format", None, lambda qc: _format(qc, format="marlin-24"), "marlin-24"),
    ("quantized activations", None, lambda qc: _format(qc, input_activations={"num_bits": 8, "type": "int"}),
     "W4A16"),
    ("awq", None, lambda qc: AWQ, "awq"),
]  # fmt: skip


@pytest.mark.parametrize("tensors,qc,word", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_w4a16_checkpoints_are_config_errors_naming_the_problem(
    good, tmp_path, tensors, qc, word
) -> None:
    edit = None if tensors is None else tensors(read_tensors(good))
    d = _edited(good, tmp_path / "bad", edit, qc)
    with pytest.raises(ConfigError, match=word):
        load_weights(d, ModelConfig.from_dir(d), with_mtp=True)


def test_fp8_quantization_of_an_int4_checkpoint_is_refused(good) -> None:
    with pytest.raises(ConfigError, match="quantize quantized weights again"):
        LLM(str(good), quantization="fp8", **FLAGS)


# ---- int4 in memory ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "asymmetric"])
def test_w4a16_stays_int4_in_memory_with_the_outputs_of_its_dequantized_values(
    hf_dir, tmp_path, symmetric
) -> None:
    int4_dir, _ = _checkpoints(hf_dir, tmp_path, symmetric, "group", 32)
    held = LLM(str(int4_dir), dtype="float64", **FLAGS)
    m = held.engine.model
    assert m.layers["3"].self_attn.o_proj.weight.dtype == torch.int32  # packed words, 4 bits a value
    assert m.layers["3"].self_attn.o_proj.weight_scale.dtype == torch.bfloat16
    assert hasattr(m.layers["3"].self_attn.o_proj, "weight_zero") != symmetric
    assert m.lm_head.weight.dtype == torch.float64  # (the ignore list's modules stay as they are)
    none = LLM(str(int4_dir), dtype="float64", quantization="none", **FLAGS)
    assert none.engine.model.layers["3"].self_attn.o_proj.weight.dtype == torch.float64
    got, want = held.generate([PROMPT], PARAMS)[0], none.generate([PROMPT], PARAMS)[0]
    assert got.token_ids == want.token_ids
    assert [lp.logprob for lp in got.logprobs] == [lp.logprob for lp in want.logprobs]


def test_quantization_int4_of_a_plain_checkpoint_is_the_w4a16_checkpoint_rtn_writes(tmp_path) -> None:
    """--quantization int4 quantizes on load exactly as make_int4 writes a checkpoint (round-to-nearest,
    symmetric, groups of 128): the same words and scales in memory, the same outputs; weights whose input
    dimension 128 does not divide stay plain either way."""
    from nextserve.model.make_int4 import quantize_checkpoint

    plain = make_model("small", tmp_path / "plain", seed=3, dtype=torch.bfloat16)
    written = quantize_checkpoint(plain, tmp_path / "written", 128)
    on_load = LLM(str(plain), dtype="float32", quantization="int4", **FLAGS)
    loaded = LLM(str(written), dtype="float32", **FLAGS)
    ours = dict(on_load.engine.model.named_parameters())
    theirs = dict(loaded.engine.model.named_parameters())
    assert ours.keys() == theirs.keys()
    held = [n for n, p in ours.items() if p.dtype == torch.int32]
    assert any("experts.gate_up_proj" in n for n in held) and any("o_proj" in n for n in held), held
    assert not any("experts.down_proj" in n for n in held)  # (the small preset's I = 64: not a group)
    for n in ours:
        assert torch.equal(ours[n], theirs[n]), n
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert on_load.generate([PROMPT], sp)[0].token_ids == loaded.generate([PROMPT], sp)[0].token_ids


def test_the_memory_plan_counts_int4_weights_as_they_are_held(tmp_path) -> None:
    from nextserve.engine.memory_plan import _predicted_bytes, module_bytes
    from nextserve.model.shapes import expected_shapes

    d = make_model("tiny", tmp_path / "q", seed=4, quantization="int4", group_size=16, dtype=torch.bfloat16)
    llm = LLM(str(d), dtype="float32", **FLAGS)
    cfg = ModelConfig.from_dir(d)
    from contextlib import ExitStack

    from nextserve.model.loader import CheckpointReader, model_fp8_capable

    shapes = expected_shapes(cfg, with_mtp=False)
    with ExitStack() as stack:
        int4 = CheckpointReader(d, cfg, shapes, stack).int4_names(model_fp8_capable(cfg).__contains__, "auto")
    predicted = _predicted_bytes(shapes, set(), set(), torch.float32, int4)
    assert predicted == module_bytes(llm.engine.model)
    assert (
        predicted[("experts", "device")]
        < sum(4 * math.prod(s) for n, s in shapes.items() if "experts" in n) / 6
    )  # (4 bits and a 2-byte scale per 16 values against float32's 32 bits)


def test_int4_through_pipeline_stages_and_mtp_speculation_gives_one_process_tokens(good) -> None:
    """Each stage and the MTP block load their own int4 weights: the serial engine's tokens (C1)."""
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = LLM(str(good), dtype="float32", **FLAGS).generate([PROMPT], sp)[0].token_ids
    staged = LLM(str(good), dtype="float32", pipeline_stages=2, **FLAGS)
    try:
        assert staged.generate([PROMPT], sp)[0].token_ids == want
    finally:
        staged.close()
    mtp = LLM(str(good), dtype="float32", speculative_method="mtp", speculative_tokens=2, **FLAGS)
    assert any(
        n.startswith("mtp.") for n in mtp.engine.plan.int4
    )  # (the MTP block's projections are int4 too)
    assert mtp.generate([PROMPT], sp)[0].token_ids == want
