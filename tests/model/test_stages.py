"""Pipeline-stage foundation: a model split into layer ranges, each stage holding only its own layers'
state (stage-local state slots and KV planes), gives the whole model's streams and logits bit for bit,
for chunked prefill and for batched decode steps (DESIGN.md C1: activations move between stages bit
for bit)."""

from __future__ import annotations

import pytest
import torch
from hf_oracle import TINY, hf_model, nextserve_model

from nextserve.cache.decode_rows import DecodeRows
from nextserve.cache.kv_pool import KVPool
from nextserve.cache.sequence import SequenceCache
from nextserve.cache.states import KindRange, StateSlots
from nextserve.model.batch import DecodeBatch, ForwardBatch, SeqChunk
from nextserve.model.flash_next import FlashNext

DT = torch.float64
PAGE = 16


def _stage(cfg, full: FlashNext, layers: range, tokens: int):
    """A FlashNext for `layers` with the full model's weights, and a one-sequence cache of its own."""
    model = FlashNext(cfg, layers).to(DT)
    own = model.state_dict()
    model.load_state_dict({k: v for k, v in full.state_dict().items() if k in own}, strict=True)
    kinds = KindRange.of(cfg, layers)
    slots = StateSlots(cfg, 1, len(kinds.attn), DT, kinds=kinds)
    pool = KVPool(cfg, len(kinds.attn), -(-tokens // PAGE) + 1, PAGE, DT, first_attn=kinds.attn.start)
    seq = SequenceCache(pool, slots)
    seq.reserve(tokens)
    return model.eval(), seq


def _run(stages, ids: torch.Tensor, prefill: int, chunk: int):
    """Prefill ids[:prefill] in chunks, then one decode step per remaining id, through the stages in
    order; returns the last stage's streams of every row [len(ids), nH]."""
    rows = []
    with torch.no_grad():
        for s in range(0, prefill, chunk):
            e = min(s + chunk, prefill)
            x = None
            for model, seq in stages:
                x = model(ForwardBatch(ids[s:e], torch.arange(s, e), [SeqChunk(seq, s, e - s)], False), x)
            rows.append(x)
            for _, seq in stages:
                seq.length = e
        for t in range(prefill, len(ids)):
            x = None
            for model, seq in stages:
                pos = torch.tensor([t])
                table = torch.tensor([seq.block_table], dtype=torch.int32)
                cache = DecodeRows(seq.pool, seq.slots, torch.tensor([seq.slot]), pos, table)
                x = model.decode(DecodeBatch(ids[t : t + 1], pos, cache), x)
            rows.append(x)
            for _, seq in stages:
                seq.length = t + 1
    return torch.cat(rows)


@pytest.mark.parametrize("cuts", [(2,), (1, 3), (3,)])
def test_stages_give_the_whole_models_bits(cuts: tuple[int, ...]) -> None:
    hf = hf_model(TINY, seed=4, dtype=DT)
    cfg, full = nextserve_model(hf, DT)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(2, 256, (60,), generator=g)
    ids[[7, 8, 30]] = cfg.eos_token_id
    bounds = [0, *cuts, cfg.num_hidden_layers]
    whole = _run([_stage(cfg, full, range(0, cfg.num_hidden_layers), 64)], ids, prefill=40, chunk=16)
    split = _run(
        [_stage(cfg, full, range(a, b), 64) for a, b in zip(bounds, bounds[1:], strict=False)],
        ids, prefill=40, chunk=16,
    )  # fmt: skip
    assert torch.equal(split, whole)
    assert torch.equal(full.logits(split, row_invariant=True), full.logits(whole, row_invariant=True))


def test_a_stage_refuses_state_it_does_not_hold(oracle_config) -> None:
    cfg = oracle_config
    kinds = KindRange.of(cfg, range(0, 2))
    assert len(kinds.attn) == 0 and kinds.gdn == range(0, 2)
    slots = StateSlots(cfg, 1, 0, torch.float32, kinds=kinds)
    with pytest.raises(IndexError, match="not held here"):
        slots.gdn_planes(2)
    last = KindRange.of(cfg, range(2, cfg.num_hidden_layers))
    assert last.attn == range(0, len(cfg.qsa_layers) + 1)  # its QSA layers and the MTP layer
    pool = KVPool(cfg, len(last.attn), 2, 16, torch.float32, first_attn=last.attn.start)
    with pytest.raises(IndexError, match="not held here"):
        pool.planes(len(last.attn))
