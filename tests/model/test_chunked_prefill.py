"""Chunked prefill against one-shot prefill, and resuming from a sequence image on the chunk grid."""

import pytest
import torch
from hf_oracle import TINY, hf_model, new_sequence, nextserve_model, run_serial


@pytest.fixture(scope="module")
def tiny():
    hf = hf_model(TINY, seed=5, dtype=torch.float32)
    with torch.no_grad():
        hf.lm_head.weight.mul_(30)
    return nextserve_model(hf, torch.float32)


def _prompt(n: int) -> torch.Tensor:
    ids = torch.randint(2, 256, (n,), generator=torch.Generator().manual_seed(6))
    ids[[3, 4, 7, 21, 63, 64]] = 1  # adjacent eos, eos on the 7- and 64-token chunk boundaries
    return ids


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_matches_one_shot(tiny, chunk: int) -> None:
    cfg, model = tiny
    prompt = _prompt(90)
    _, _, one_shot = run_serial(model, new_sequence(cfg, torch.float32, 90), prompt, chunk=90)
    _, _, chunked = run_serial(model, new_sequence(cfg, torch.float32, 90), prompt, chunk=chunk)
    rel = ((chunked - one_shot).abs().max() / one_shot.abs().max()).item()
    assert rel < 5e-6, rel


def test_resume_from_image_is_bit_exact(tiny) -> None:
    """A snapshot on the grid, restored into another sequence, continues with the very same bits."""
    from nextserve.model.batch import ForwardBatch, SeqChunk

    cfg, model = tiny
    prompt = _prompt(80)
    cold = new_sequence(cfg, torch.float32, 100, slots=2)
    ids, _, ref = run_serial(model, cold, prompt, chunk=16, new_tokens=10)

    seq = new_sequence(cfg, torch.float32, 100, slots=2)
    with torch.no_grad():
        for s in (0, 16, 32):
            model(ForwardBatch(prompt[s : s + 16], torch.arange(s, s + 16), [SeqChunk(seq, s, 16)], False))
        seq.length = 48
        image = seq.snapshot()
        # Scribble over the live sequence, then go back to the image.
        model(ForwardBatch(prompt[48:64].flip(0), torch.arange(48, 64), [SeqChunk(seq, 48, 16)], False))
        seq.restore(image)
        seq.reserve(100)
    # Continue from position 48 on the grid exactly as the cold run did.
    rows = []
    with torch.no_grad():
        for s in (48, 64):
            e = min(s + 16, 80)
            rows.append(model(ForwardBatch(ids[s:e], torch.arange(s, e), [SeqChunk(seq, s, e - s)], False)))
        for t in range(80, 89):
            rows.append(model(ForwardBatch(ids[t : t + 1], torch.tensor([t]), [SeqChunk(seq, t, 1)], True)))
        logits = model.logits(torch.cat(rows))
    assert torch.equal(logits, ref[48:])
    seq.release_image(image)
