"""C2 / issue 3: an error in one sequence fails that sequence only; the others beside it in the same
step finish exactly as they would alone, and every page and slot comes back."""

from __future__ import annotations

from pool_check import assert_pool_full

from nextserve import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPT_A, PROMPT_B = list(range(2, 30)), list(range(40, 60))


class FailingConstraint:
    """A grammar that breaks after a few tokens, in `allowed` (sampling) or `accept` (update)."""

    def __init__(self, where: str) -> None:
        self.where, self.n = where, 0

    def allowed(self, vocab_size: int):
        if self.where == "allowed" and self.n >= 2:
            raise RuntimeError("grammar failed in allowed")
        return None

    def accept(self, token_id: int) -> None:
        self.n += 1
        if self.where == "accept" and self.n >= 3:
            raise RuntimeError("grammar failed in accept")

    def is_terminated(self) -> bool:
        return False


def test_sampling_error_fails_only_its_request(oracle_llm, solo_run) -> None:
    _check_isolation(oracle_llm, solo_run, "allowed")


def test_update_error_fails_only_its_request(oracle_llm, solo_run) -> None:
    _check_isolation(oracle_llm, solo_run, "accept")


def _check_isolation(oracle_llm, solo_run, where: str) -> None:
    llm = oracle_llm()
    eng = llm.engine
    a = eng.add_request(PROMPT_A, GREEDY, constraint=FailingConstraint(where))
    b = eng.add_request(PROMPT_B, GREEDY)
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    assert done[a].finish_reason == "error" and "grammar failed" in done[a].error
    assert done[b].finish_reason == "length" and done[b].error is None
    assert done[b].token_ids == solo_run(PROMPT_B, GREEDY).token_ids
    assert_pool_full(llm)
