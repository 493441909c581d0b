"""The benchmark's model: the preset's config and a FlashNext with random weights drawn on the device."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ..config import DTYPES, ModelConfig
from ..engine_config import EngineConfig
from ..model.flash_next import FlashNext
from ..model.loader import INT4_GROUP, fp8_capable, materialize, meta_device
from ..model.params import INT4_SCALE, SCALE
from ..model.presets import preset_overrides, text_config
from ..model.quant import default_fp8
from ..model.random_tensors import initial_values, seed_for
from ..model.shapes import expected_shapes
from ..ops.fp8 import BLOCK, quantize
from ..ops.int4 import quantize_int4

BENCH_EOS = 2  # make-model's <|im_end|> id; prompts are drawn from ids >= FIRST_PROMPT_ID, so never eos
_FILL_CHUNK_ELEMS = 1 << 27  # random fill in slices of at most 128M elements (0.5 GB of fp32 temporaries)


def bench_config(
    preset: str = "flash-next", layers: int | None = None, ngram_vocab_base: int | None = None
) -> tuple[ModelConfig, dict[str, Any]]:
    """The preset's text config (with make-model's --layers / --ngram-vocab-base) as a ModelConfig and as
    the raw dict transformers' Qwen4ExpTextConfig takes."""
    text = text_config(preset, preset_overrides(preset, layers, ngram_vocab_base))
    raw = {"model_type": "qwen4_exp_text", "eos_token_id": BENCH_EOS} | text
    return ModelConfig.from_dict(raw), raw


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


def fp8_names(model: FlashNext) -> set[str]:
    """What `--quantization fp8` holds in FP8 of a model (`fp8_held` of its FP8-capable tensors)."""
    return fp8_held(fp8_capable(model), model.cfg)


def int4_names(model: FlashNext) -> set[str]:
    """What `--quantization int4` holds in int4 of a model (`int4_held` of its FP8-capable tensors)."""
    return int4_held(fp8_capable(model), {n: tuple(p.shape) for n, p in model.named_parameters()})


def fp8_held(capable: Iterable[str], cfg: ModelConfig) -> set[str]:
    """Of the tensors an FP8 op reads (`capable`), those `--quantization fp8` holds in FP8: the projections
    and experts that model/quant.py's DEFAULT_NOT_CONVERTED converts, the experts when their gate and up rows
    start on scale blocks."""
    scheme = default_fp8()
    aligned = cfg.moe_intermediate_size % BLOCK == 0
    return {
        n
        for n in capable
        if scheme.converted(n.removesuffix(".weight")) and (aligned or ".mlp.experts." not in n)
    }


def int4_held(capable: Iterable[str], shapes: dict[str, tuple[int, ...]]) -> set[str]:
    """Of the tensors an int4 op reads (`capable`, shapes by name), those `--quantization int4` of a
    checkpoint holds in int4: the ones DEFAULT_NOT_CONVERTED converts whose input dimension INT4_GROUP
    divides."""
    scheme = default_fp8()
    return {
        n for n in capable if scheme.converted(n.removesuffix(".weight")) and shapes[n][-1] % INT4_GROUP == 0
    }


def random_flash_next(
    cfg: ModelConfig,
    device: torch.device | str,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    fp8: bool = False,
    ple_host: bool = False,
    int4: bool = False,
    experts_host: bool = False,
    router_skew: float = 0.0,
) -> FlashNext:
    """A whole FlashNext with random weights drawn directly on `device` in `dtype`: no checkpoint.

    Every parameter is one of `expected_shapes(cfg)` (the loader's runtime names and shapes) and gets the
    distribution make-model gives the tensor of that name (`random_tensors.initial_values`: 1/sqrt(fan_in)
    projections, unit embeddings, non-zero norm weights), drawn from a generator on the device seeded by
    (seed, name). The values therefore differ from a make-model checkpoint of the same seed; the
    distributions do not.
    Each parameter is allocated once, in its final dtype (no float32 copy of a 45 GB model): with `fp8`
    the projections and experts are block-wise FP8 (`fp8_names`), quantized as drawn, chunk by chunk (with
    `int4`: W4A16 in groups of INT4_GROUP, `int4_names`, symmetric round-to-nearest); with `ple_host` (on a
    GPU) the n-gram tables are in pinned host memory, drawn on the device and copied; with `experts_host` the
    routed experts too. `router_skew` A > 0 scales each router's row of the expert ranked r (a random order
    per layer, from the seed) by (r + 1) ** -A, the rows' mean square kept: wider logits land in the top-k
    more often, so routing is skewed as trained routers' is (uniform at 0).
    """
    device = torch.device(device)
    with meta_device():
        model = FlashNext(cfg)
    shapes = expected_shapes(cfg)
    assert not (fp8 and int4), "one weight format"
    quantized = fp8_names(model) if fp8 else set()
    packed = {n: (INT4_GROUP, dtype, True) for n in int4_names(model)} if int4 else {}
    host = {n for n in shapes if "ngram_embedding" in n} if ple_host else set()
    host |= {n for n in shapes if ".mlp.experts." in n} if experts_host else set()
    materialize(model, device, dtype, quantized, host, packed)
    suffix = INT4_SCALE if int4 else SCALE
    params = {n: p for n, p in model.named_parameters() if not n.endswith(suffix)}
    scales = {n[: -len(suffix)]: p for n, p in model.named_parameters() if n.endswith(suffix)}
    if set(params) != set(shapes):
        raise RuntimeError(
            f"FlashNext parameters and loader names differ: only in model "
            f"{sorted(set(params) - set(shapes))}, only in loader {sorted(set(shapes) - set(params))}"
        )
    with torch.no_grad():
        for name, shape in shapes.items():
            p = params[name]
            held = (*p.shape[:-1], p.shape[-1] * 8) if int4 and name in scales else tuple(p.shape)  # (words)
            if held != shape:
                raise RuntimeError(f"{name}: model shape {tuple(p.shape)}, loader shape {shape}")
            gen = torch.Generator(device=device).manual_seed(seed_for(seed, name))
            row = max(1, math.prod(shape) // max(1, shape[0]))
            step = max(1, _FILL_CHUNK_ELEMS // row)
            if name in scales and len(shape) == 2:  # whole 128-row scale blocks a chunk
                step = max(BLOCK, step // BLOCK * BLOCK)
            for start in range(0, shape[0], step):
                part = p[start : start + step]
                # initial_values draws with torch.randn/rand: on the device's generator
                with torch.device(device):
                    values = initial_values(name, (*part.shape[:-1], shape[-1]), gen)
                if name not in scales:
                    part.copy_(values)
                    continue
                if int4:  # rows (or experts) as they are: a group never crosses a row
                    w = quantize_int4(values, INT4_GROUP, dtype)
                    part.copy_(w.packed)
                    scales[name][start : start + step].copy_(w.scale)
                    continue
                q, s = quantize(values)
                part.copy_(q)
                first = start if len(shape) == 3 else start // BLOCK  # experts: a chunk of whole experts
                scales[name][first : first + s.shape[0]].copy_(s)
        if router_skew:
            _skew_routers(model, router_skew, seed)
    return model.eval()


def _skew_routers(model: FlashNext, skew: float, seed: int) -> None:
    """Scale each MoE router's rows (`random_flash_next`'s router_skew)."""
    for name, p in model.named_parameters():
        if not name.endswith(".mlp.gate.weight"):
            continue
        E = p.shape[0]
        rank = torch.randperm(E, generator=torch.Generator().manual_seed(seed_for(seed, name)))
        scale = (rank.double() + 1) ** -skew
        scale /= scale.square().mean().sqrt()
        p.mul_(scale.to(device=p.device, dtype=torch.float32)[:, None].to(p.dtype))


def engine_for_model(model: FlashNext, device: torch.device, dtype: torch.dtype, **engine_flags: Any):
    """A real LLMEngine (scheduler, pool, state slots, runner) around an already-built model; no
    tokenizer, so prompts are token ids. Everything else is the engine as `LLM` runs it."""
    from ..engine.engine import LLMEngine

    dtype_name = next(name for name, dt in DTYPES.items() if dt == dtype)
    return LLMEngine(EngineConfig(device=str(device), dtype=dtype_name, **engine_flags), model=model)


def start_decoding(engine, count: int, prompt_len: int, params, gen: torch.Generator) -> None:
    """Add `count` requests of random prompt ids and step the engine until every one is decoding (its
    prefill done and its first token sampled)."""
    vocab = engine.model_config.vocab_size
    for _ in range(count):
        engine.add_request(torch.randint(0, vocab, (prompt_len,), generator=gen).tolist(), params)
    sched = engine.scheduler
    while any(s.in_prefill or not s.output_ids for s in sched.running) or sched.waiting:
        engine.step()
