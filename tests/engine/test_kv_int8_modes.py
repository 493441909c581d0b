"""C1 with an 8-bit KV cache (`--kv-dtype int8`, `fp8`): the default model's serial reference with int8 KV
gives the same tokens and logprobs in every speed mode (batched decode, MTP and n-gram speculation, prefix
reuse, two uneven pipeline stages, images spilled to the host store and brought back), and with fp8 KV in
batched decode, MTP and two uneven stages; the pool is full again after each. 8-bit KV changes outputs
against 16-bit KV (not a speed mode); its held-out loss stays within 2% in either form."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from pool_check import assert_pool_full
from spec_cases import MODE_FLAGS, MODE_PARAMS, same, serial_reference

from nextserve import LLM
from nextserve.config import ConfigError
from nextserve.engine.setup import check_kv_dtype
from nextserve.engine_config import DEFAULT_MODEL, EngineConfig

FLAGS = MODE_FLAGS | dict(kv_dtype="int8")
PARAMS = MODE_PARAMS


@pytest.fixture(scope="module")
def serial():
    """The serial reference with int8 KV."""
    llm, prompts, outputs = serial_reference(FLAGS, PARAMS)
    pool = llm.engine.pool
    assert pool.k.dtype == torch.int8 and pool.quantized and len(pool.scales) == 3
    return prompts, outputs


@pytest.mark.parametrize(
    "flags",
    [
        dict(max_concurrency=3),
        dict(max_concurrency=3, speculative_method="mtp", speculative_tokens=3),
        dict(max_concurrency=3, speculative_method="ngram", speculative_tokens=3),
        dict(max_concurrency=3, pipeline_stages=2, stage_layers="3,5"),
        dict(max_concurrency=3, prefix_cache_images=1, host_state_slots=4),
    ],
    ids=["batched", "mtp", "ngram", "two uneven stages", "host store"],
)
def test_int8_kv_speed_modes_give_the_serial_outputs(serial, flags, one_torch_thread) -> None:
    prompts, want = serial
    llm = LLM(DEFAULT_MODEL, **(FLAGS | flags))
    for i, p in enumerate(PARAMS):
        same(want[i], llm.generate(prompts, p))
    # a second pass resumes from the prefix images the first one left (from the host store too)
    same(want[0], llm.generate(prompts, PARAMS[0]))
    assert_pool_full(llm)
    if "host_state_slots" in flags:
        assert llm.stats()["host_image_hits"] > 0, llm.stats()


@pytest.fixture(scope="module")
def serial_fp8():
    """The serial reference with fp8 KV."""
    llm, prompts, outputs = serial_reference(FLAGS | dict(kv_dtype="fp8"), PARAMS)
    k, _, _ = llm.engine.pool.planes(0)
    assert llm.engine.pool.k.dtype == torch.int8 and k.values.dtype == torch.float8_e4m3fn
    return prompts, outputs


@pytest.mark.parametrize(
    "flags",
    [
        dict(max_concurrency=3),
        dict(max_concurrency=3, speculative_method="mtp", speculative_tokens=3),
        dict(max_concurrency=3, pipeline_stages=2, stage_layers="3,5"),
    ],
    ids=["batched", "mtp", "two uneven stages"],
)
def test_fp8_kv_speed_modes_give_the_serial_outputs(serial_fp8, flags, one_torch_thread) -> None:
    prompts, want = serial_fp8
    llm = LLM(DEFAULT_MODEL, **(FLAGS | dict(kv_dtype="fp8") | flags))
    for i, p in enumerate(PARAMS):
        same(want[i], llm.generate(prompts, p))
    same(want[0], llm.generate(prompts, PARAMS[0]))
    assert_pool_full(llm)


def test_fp8_kv_is_not_int8_kv(serial, serial_fp8) -> None:
    """Bug guard: fp8 planes that held int8 codes would give int8 KV's outputs exactly."""
    (_, fp8), (_, int8) = serial_fp8, serial
    assert any(
        a.token_ids != b.token_ids
        or [lp.logprob for lp in a.logprobs or []] != [lp.logprob for lp in b.logprobs or []]
        for i in fp8
        for a, b in zip(fp8[i], int8[i], strict=True)
    )


def test_int8_kv_is_not_16_bit_kv_and_holds_under_half_its_bytes(serial) -> None:
    """Bug guard: an int8 pool that silently kept 16-bit planes would give 16-bit KV's tokens exactly."""
    prompts, want = serial
    llm = LLM(DEFAULT_MODEL, max_concurrency=1, **(FLAGS | dict(kv_dtype="auto", dtype="bfloat16")))
    q = LLM(DEFAULT_MODEL, max_concurrency=1, **(FLAGS | dict(dtype="bfloat16")))
    assert q.engine.pool.page_bytes < 0.56 * llm.engine.pool.page_bytes
    a = llm.generate(prompts, PARAMS[0])
    b = q.generate(prompts, PARAMS[0])
    assert [o.token_ids for o in a] != [o.token_ids for o in b] or any(
        x.logprobs != y.logprobs for x, y in zip(a, b, strict=True)
    )


def test_the_default_model_keeps_its_held_out_loss_with_int8_kv(capsys) -> None:
    from tokenizers import Tokenizer

    from nextserve.train import data
    from nextserve.train.evaluate import load, validation_loss

    tok = Tokenizer.from_file(str(Path(DEFAULT_MODEL) / "tokenizer.json"))
    _, held = data.split_files()
    ids = [i for _, text in held[:4] for i in tok.encode(text).ids]
    _, model, _ = load(Path(DEFAULT_MODEL), torch.bfloat16)
    loss = {
        kv: validation_loss(model, ids, 256, 4, torch.bfloat16, kv_dtype=kv)["val_loss"]
        for kv in ("bf16", "int8", "fp8")
    }
    with capsys.disabled():
        print(
            "\nheld-out loss (perplexity), KV "
            + ", ".join(f"{k} {v:.4f} ({math.exp(v):.2f})" for k, v in loss.items())
        )
    for form in ("int8", "fp8"):
        assert loss[form] != loss["bf16"]  # the 8-bit planes are read
        assert math.exp(loss[form]) < 1.02 * math.exp(loss["bf16"]), loss


@pytest.mark.parametrize("bad", ["e4m3", "int4", "float16", "", None, 8])
def test_kv_dtype_values(bad) -> None:
    with pytest.raises(ConfigError, match="kv_dtype"):
        EngineConfig(kv_dtype=bad)


def test_kv_dtype_against_the_model_dtype() -> None:
    cpu = torch.device("cpu")
    check_kv_dtype(EngineConfig(kv_dtype="bf16"), torch.bfloat16, cpu)
    check_kv_dtype(EngineConfig(kv_dtype="int8"), torch.float32, cpu)
    check_kv_dtype(EngineConfig(kv_dtype="fp8"), torch.float32, cpu)
    with pytest.raises(ConfigError, match="bf16 keeps the model dtype"):
        check_kv_dtype(EngineConfig(kv_dtype="bf16"), torch.float32, cpu)
    with pytest.raises(ConfigError, match="bf16 keeps the model dtype"):
        LLM(DEFAULT_MODEL, device="cpu", dtype="float32", kv_dtype="bf16")


def test_fp8_kv_needs_an_sm_89_gpu(monkeypatch) -> None:
    """--kv-dtype fp8 on a GPU older than sm_89 (no E4M3 conversions) is refused by name, every stage's
    device checked; int8 is what such a card takes."""
    caps = {0: (9, 0), 1: (8, 6)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: caps[i])
    cuda0 = torch.device("cuda", 0)
    check_kv_dtype(EngineConfig(kv_dtype="fp8"), torch.bfloat16, cuda0)
    check_kv_dtype(EngineConfig(kv_dtype="int8"), torch.bfloat16, torch.device("cuda", 1))
    with pytest.raises(ConfigError, match="cuda:1 is sm_86: use --kv-dtype int8"):
        check_kv_dtype(EngineConfig(kv_dtype="fp8"), torch.bfloat16, torch.device("cuda", 1))
    staged = EngineConfig(kv_dtype="fp8", device="cpu", pipeline_stages=2)
    object.__setattr__(staged, "pipeline_devices", "0,1")  # (a CUDA rig's devices, checked here alone)
    with pytest.raises(ConfigError, match="cuda:1 is sm_86"):
        check_kv_dtype(staged, torch.bfloat16, cuda0)
