"""Warm-up at start (issue 18): after it, no request triggers a Triton compile, whatever its prefill chunk
lengths or whether it resumes from a prefix image. Run this file in a process of its own (kernels compiled
by earlier tests of the process would hide a missing warm-up): `pytest -m gpu tests/gpu/test_warm_up.py`."""

import sys

import pytest
import torch

from nextserve import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def compiled_kernels() -> dict[str, int]:
    """Compiled binaries held by each Triton kernel of nextserve's modules (and of fla's, which run its
    16-bit GDN prefill chunks), by module and kernel name."""
    counts, seen = {}, 0
    for name, mod in list(sys.modules.items()):
        if not name.startswith(("nextserve.ops", "fla.")):
            continue
        for obj in vars(mod).values():
            fn = obj if hasattr(obj, "device_caches") else getattr(obj, "fn", None)  # an autotuner wraps one
            # NOTE: duck-typed (Triton's JITFunction class moves between releases): a kernel keeps, per
            # device, a tuple whose first item is its dict of compiled binaries
            caches = getattr(fn, "device_caches", None)
            if not isinstance(caches, dict):
                continue
            seen += 1
            counts[f"{name}.{getattr(fn, '__name__', '?')}"] = sum(len(c[0]) for c in caches.values())
    assert seen > 10, "no Triton kernels found"
    return counts


def _requests(llm) -> None:
    g = torch.Generator().manual_seed(3)
    base = torch.randint(8, 500, (70,), generator=g).tolist()
    prompts = [base[:5], base[:37], base, base + [7, 8, 9], base[:64] + [11], base[:64] + list(range(20, 53))]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for p in prompts:  # one at a time: later ones resume from earlier ones' images
        llm.generate([p], params)
    llm.generate([base[:5], base[1:6], base[2:70], list(range(9, 140))], params)  # at once


@pytest.mark.parametrize("batch_chunks", [1, 4])
def test_no_compile_after_the_warm_up(tiny_model_dir, batch_chunks: int) -> None:
    flags = dict(device="cuda", dtype="bfloat16", prefill_chunk=32, page_size=16, kv_capacity=4096,
                 max_context=1024, max_concurrency=4, prefill_batch_chunks=batch_chunks)  # fmt: skip
    llm = LLM(tiny_model_dir, **flags)
    before = compiled_kernels()
    assert sum(before.values()) > 0  # the warm-up and the graph capture compiled them
    assert llm.stats()["prefix_images"] == 0  # the warm-up's images are gone
    _requests(llm)
    after = compiled_kernels()
    new = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
    assert not new, f"compiled after the warm-up: {new}"
    assert llm.stats()["prefix_images"] > 0


@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_no_compile_after_the_warm_up_at_any_experts_block(tmp_path, quantization: str) -> None:
    """Chunks whose lengths give the routed experts' prefill kernel each of its BLOCK_M values (the small
    preset, 16 experts, 4 a token: 16 up to 32 tokens, 32 up to 96, 64, and 128 from 256) compile
    nothing after the warm-up: cold prompts, and prompts resumed from an image at the chunk."""
    from nextserve.model.make_model import make_model

    overrides = {"hidden_size": 256, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128}
    model = make_model("small", tmp_path / "small", overrides=overrides)
    flags = dict(device="cuda", dtype="bfloat16", prefill_chunk=512, page_size=16, kv_capacity=8192,
                 max_context=2048, max_concurrency=2, quantization=quantization)  # fmt: skip
    llm = LLM(str(model), **flags)
    before = compiled_kernels()
    g = torch.Generator().manual_seed(4)
    base = torch.randint(8, 2000, (512,), generator=g).tolist()
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for n in (45, 64, 150, 160, 300, 320, 511):
        llm.generate([base[:n]], params)  # cold, one chunk of n tokens
        llm.generate([base + base[:n]], params)  # a full chunk (resumed after the first), then n
    new = {k: c - before.get(k, 0) for k, c in compiled_kernels().items() if c != before.get(k, 0)}
    assert not new, f"compiled after the warm-up: {new}"


def test_no_compile_after_the_warm_up_at_any_fla_tune_class(tmp_path) -> None:
    """fla's L2 norm (in its chunked GDN call) is autotuned per cdiv(tokens * key heads, 65,536). At 32 key
    heads every 2,048 tokens is another class: a chunk of 8,192 meets classes 1-4, and chunks of 2,048, 4,500
    and 4,608 tokens (classes 1, 3, 3; 4,500 not a multiple of 16) compile and tune nothing after the
    warm-up, cold or resumed. 9067f4a's warm-up failed it (26 L2-norm binaries after it, H100)."""
    from nextserve.model.make_model import make_model

    overrides = {"hidden_size": 256, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128}
    overrides |= {"linear_num_key_heads": 32, "linear_num_value_heads": 32, "max_position_embeddings": 32768}
    model = make_model("small", tmp_path / "small", overrides=overrides)
    flags = dict(device="cuda", dtype="bfloat16", prefill_chunk=8192, page_size=64, kv_capacity=65536,
                 max_context=20000, max_concurrency=2)  # fmt: skip
    llm = LLM(str(model), **flags)
    before = compiled_kernels()
    g = torch.Generator().manual_seed(5)
    base = torch.randint(8, 2000, (8192,), generator=g).tolist()
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for n in (2048, 4500, 4608):
        llm.generate([base[:n]], params)  # cold, one chunk of n tokens
        llm.generate([base + base[:n]], params)  # a full chunk (resumed after the first), then n
    new = {k: c - before.get(k, 0) for k, c in compiled_kernels().items() if c != before.get(k, 0)}
    assert not new, f"compiled after the warm-up: {new}"
