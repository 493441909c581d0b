"""The batched decode step (`FlashNext.decode` through `DecodeRows`, what the runner and the CUDA
graphs run) against the chunk path (`FlashNext.forward` with one-token row-invariant chunks, the path
the transformers oracle tests drive): the same logits and the same state, bit for bit, on the CPU."""

from __future__ import annotations

import torch
from test_batched_exactness import STATE, TIGHT, workload


def test_decode_step_equals_the_chunk_path(oracle_llm) -> None:
    llm = oracle_llm(**TIGHT, async_scheduling=False)  # every decode step through runner.execute
    eng, pool, slots = llm.engine, llm.engine.pool, llm.engine.slots
    # NOTE: block_keys is left out: the decode step also writes a placeholder key for a block that is
    # still open (overwritten when it completes, never read before), which the chunk path does not.
    planes = [pool.k, pool.v] + [getattr(slots, n) for n in STATE]
    checked, failures = 0, []
    execute = eng.runner.execute

    def probe(plan):
        nonlocal checked
        if plan.decodes:
            saved = [t.clone() for t in planes] + [pool.block_keys.clone()]
            with torch.inference_mode():
                step = eng.runner.decode_logits(plan.decodes)[0]
                after_step = [t.clone() for t in planes]
                for t, s in zip(planes + [pool.block_keys], saved, strict=True):
                    t.copy_(s)
                batch = eng.runner._batch(plan.decodes, row_invariant=True)
                chunk = eng.model.logits(eng.model(batch), row_invariant=True)
            if not torch.equal(step, chunk):
                failures.append((checked, "logits"))
            for name, a, b in zip(["k", "v", *STATE], after_step, planes, strict=True):
                if not torch.equal(a, b):
                    failures.append((checked, name))
            for t, s in zip(planes + [pool.block_keys], saved, strict=True):
                t.copy_(s)  # the step itself runs below, from the state it found
            checked += len(plan.decodes)
        return execute(plan)

    eng.runner.execute = probe
    reqs = workload(seed=5, n=16)
    outs = llm.generate([ids for ids, _ in reqs], [p for _, p in reqs])
    assert all(o.error is None for o in outs)
    assert checked >= 50
    assert not failures, failures[:10]
