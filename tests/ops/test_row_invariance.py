"""C1: a decode-sized call (up to 16 rows, and batched decode) gives each row the bits it gets alone."""

import pytest
import torch
from hf_oracle import TINY, hf_model, new_sequence, nextserve_model
from qsa_reference import select_tokens

from nextserve.ops.attention import sparse_attention
from nextserve.ops.conv import causal_conv
from nextserve.ops.linear import linear
from nextserve.ops.moe import experts, route
from nextserve.ops.norms import rms_norm, rms_norm_gated

ROWS = [1, 2, 5, 16]


def _alone_vs_together(fn, x: torch.Tensor) -> None:
    together = fn(x)
    for i in range(x.shape[0]):
        assert torch.equal(fn(x[i : i + 1])[0], together[i]), f"row {i} of {x.shape[0]} differs"


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_norms_moe(rows: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 320, generator=g).to(dtype)
    w = torch.randn(257, 320, generator=g).to(dtype)
    _alone_vs_together(lambda t: linear(t, w, row_invariant=True), x)
    nw = torch.randn(320, generator=g).to(dtype)
    _alone_vs_together(lambda t: rms_norm(t, nw, 1e-6, group=80), x)
    _alone_vs_together(lambda t: rms_norm_gated(t, t.flip(-1), nw, 1e-6, "sigmoid"), x)
    gate_up = torch.randn(6, 64, 320, generator=g).to(dtype) * 0.1
    down = torch.randn(6, 320, 32, generator=g).to(dtype) * 0.1
    router = torch.randn(6, 320, generator=g).to(dtype)

    def moe(t):
        wts, ids = route(linear(t, router, True), 2, True)
        return experts(t, wts, ids, gate_up, down, row_invariant=True)

    _alone_vs_together(moe, x)


@pytest.mark.parametrize("rows", ROWS)
def test_attention_rows(rows: int) -> None:
    g = torch.Generator().manual_seed(7)
    q = torch.randn(rows, 4, 32, generator=g)
    k = torch.randn(100, 2, 32, generator=g)
    v = torch.randn(100, 2, 32, generator=g)
    qi = torch.randn(rows, 2, 32, generator=g)
    bk = torch.randn(25, 32, generator=g)
    positions = list(range(100 - rows, 100))
    sel = select_tokens(qi, bk, positions, 4, 3)
    out = sparse_attention(q, k, v, sel, 32**-0.5)
    for i, t in enumerate(positions):
        (s1,) = select_tokens(qi[i : i + 1], bk, [t], 4, 3)
        assert torch.equal(s1, sel[i])
        assert torch.equal(sparse_attention(q[i : i + 1], k, v, [s1], 32**-0.5)[0], out[i])


def test_conv_rows() -> None:
    g = torch.Generator().manual_seed(8)
    x, hist, w = (
        torch.randn(16, 40, generator=g),
        torch.randn(40, 9, generator=g),
        torch.randn(40, 4, generator=g),
    )
    together, _ = causal_conv(x, hist, w, dilation=3)
    h = hist
    for i in range(16):
        row, h = causal_conv(x[i : i + 1], h, w, dilation=3)
        assert torch.equal(row[0], together[i])


def test_batched_decode_forward_is_row_invariant() -> None:
    """The whole model: a decode step of 5 sequences together equals each one's step alone."""
    from nextserve.model.batch import ForwardBatch, SeqChunk

    hf = hf_model(TINY, seed=9, dtype=torch.float32)
    cfg, model = nextserve_model(hf, torch.float32)
    g = torch.Generator().manual_seed(10)
    seqs, lasts = [], []
    with torch.no_grad():
        for i in range(5):
            n = 20 + 7 * i
            ids = torch.randint(2, 256, (n,), generator=g)
            seq = new_sequence(cfg, torch.float32, n + 1)
            model(ForwardBatch(ids, torch.arange(n), [SeqChunk(seq, 0, n)], False))
            seq.length = n
            seqs.append((seq, n))
            lasts.append(int(ids[-1]))
        images = [s.snapshot() for s, _ in seqs]
        tokens = torch.tensor(lasts)
        pos = torch.tensor([n for _, n in seqs])
        chunks = [SeqChunk(s, n, 1) for s, n in seqs]
        together = model.logits(model(ForwardBatch(tokens, pos, chunks, True)))
        for i, ((seq, n), image) in enumerate(zip(seqs, images, strict=True)):
            seq.restore(image)
            seq.reserve(n + 1)
            alone = model.logits(
                model(ForwardBatch(tokens[i : i + 1], pos[i : i + 1], [SeqChunk(seq, n, 1)], True))
            )
            assert torch.equal(alone[0], together[i])
