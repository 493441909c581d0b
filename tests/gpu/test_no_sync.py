"""A prefill step whose chunks sample nothing queues its work without waiting for the GPU: the host never
blocks on the device between chunks, so the GPU never idles while the host prepares the next launches
(torch's sync debug mode raises at any call that would block)."""

import pytest
import torch

from nextserve import LLM, SamplingParams
from nextserve.ops.pinned import upload

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_upload_queues_the_copy_without_waiting() -> None:
    values = list(range(-3, 5000))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        t = upload(values, torch.long, "cuda")
        table = upload(torch.arange(12, dtype=torch.int32).reshape(3, 4).numpy(), torch.int32, "cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert t.device.type == "cuda" and t.dtype == torch.long and t.tolist() == values
    assert table.dtype == torch.int32 and table.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_prefill_steps_before_the_last_chunk_never_wait(tiny_model_dir, prefix_cache: bool) -> None:
    flags = dict(device="cuda", dtype="bfloat16", prefill_chunk=32, page_size=16, kv_capacity=4096,
                 max_context=1024, max_concurrency=2, prefill_batch_chunks=1)  # fmt: skip
    flags["prefix_cache"] = prefix_cache
    llm = LLM(tiny_model_dir, **flags)
    engine = llm.engine
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(8, 500, (4 * 32 + 5,), generator=g).tolist()
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    expected = llm.generate([prompt], params)[0].token_ids  # the same prompt, run without the check
    engine.clear_prefix_cache()
    rid = engine.add_request(prompt, params)
    seq = engine.sequences[rid]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):  # the four full chunks: none samples
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not seq.output_ids
    while engine.has_unfinished():
        engine.step()
    assert seq.output_ids == expected
