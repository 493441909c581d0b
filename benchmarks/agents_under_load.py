"""Many agent sessions on one engine: what each session feels while the others decode and send long prompts.

    python benchmarks/agents_under_load.py [--model DIR] --sessions 16 [--first 8192 --max-prompt 61440 ...]
        [--out FILE] [--name value ...]

Every session starts from one shared system prompt and grows its own history turn by turn, as a coding
agent does: turn 1 is the system prompt and a first message; each later turn is the previous prompt, the
reply and a tool result. Replies are tool-call sized (drawn around --reply tokens); the requests carry no
max_tokens: the harness ends a reply at its drawn length (as a stop sequence would), so the engine admits
them not knowing how long they run. Sessions start --stagger seconds apart and send their next turn as soon
as a reply ends, until their prompt passes --max-prompt or --turns are done. Each turn names where its last
message starts (a message checkpoint), so the next one resumes from a prefix image. Token-id prompts,
greedy; any further `--name value` is an engine flag (EngineConfig field, dashes for underscores).

Prints one JSON object: TTFT p50/p99 (by turn too), inter-token latency p50/p99 of running decodes, alone
and while another session's prompt of --loaded-prompt tokens or more is being prefilled, tokens/s in all,
the prompt tokens resumed from prefix images, preemptions. --model defaults to the embedded default model
(a CPU run: `--sessions 2 --first 96 --grow 32 --max-prompt 256 --reply 8 --system 64`).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from nextserve_side import engine_flags  # noqa: E402

from nextserve.bench.provenance import git_info, hardware  # noqa: E402
from nextserve.engine.engine import LLMEngine  # noqa: E402
from nextserve.engine.sampling import SamplingParams  # noqa: E402
from nextserve.engine_config import DEFAULT_MODEL, EngineConfig  # noqa: E402


class Session:
    """One agent: its prompt so far, the turn it is on, and what each turn measured."""

    def __init__(self, index: int, system: list[int], args: argparse.Namespace, rng: random.Random) -> None:
        self.index, self.args, self.rng = index, args, rng
        self.prompt = system + self._tokens(args.first - len(system))
        self.last_message = len(system)
        self.turn, self.request_id, self.reply_len = 0, None, 0
        self.start = index * args.stagger
        self.done = False

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(10, 200) for _ in range(max(1, n))]

    def send(self, engine: LLMEngine) -> dict:
        """Queue this session's next turn; the record its tokens will fill in."""
        self.turn += 1
        self.reply_len = self.rng.randint(max(1, self.args.reply // 2), self.args.reply * 3 // 2)
        params = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
        self.request_id = engine.add_request(self.prompt, params, checkpoints=(self.last_message,))
        sent = time.perf_counter()
        return {"session": self.index, "turn": self.turn, "prompt_len": len(self.prompt), "sent": sent,
                "times": [], "cached": 0}  # fmt: skip

    def reply_ended(self, reply: list[int]) -> None:
        """Grow the history by the reply and a tool result, or end the session."""
        self.last_message = len(self.prompt) + len(reply)
        self.prompt = self.prompt + reply + self._tokens(self.args.grow)
        self.request_id = None
        self.done = self.turn >= self.args.turns or len(self.prompt) > self.args.max_prompt


def run(engine: LLMEngine, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    system = [rng.randrange(10, 200) for _ in range(args.system)]
    sessions = [Session(i, system, args, random.Random(args.seed * 1000 + i)) for i in range(args.sessions)]
    records: dict[str, dict] = {}
    replies: dict[str, list[int]] = {}
    before = engine.stats()
    t0 = time.perf_counter()
    while not all(s.done for s in sessions):
        now = time.perf_counter() - t0
        for s in sessions:
            if not s.done and s.request_id is None and now >= s.start:
                rec = s.send(engine)
                records[s.request_id] = rec
                replies[s.request_id] = []
        outs = engine.step(deltas=True)
        stamp = time.perf_counter()
        for out in outs:
            rec = records[out.request_id]
            rec["times"] += [stamp] * len(out.token_ids)
            rec["cached"] = max(rec["cached"], out.cached_tokens)
            replies[out.request_id] += out.token_ids
        for s in sessions:
            rid = s.request_id
            if rid is not None and len(replies[rid]) >= s.reply_len:
                engine.abort(rid)  # (the stop sequence the agent waits for)
                s.reply_ended(replies[rid][: s.reply_len])
        if not outs and all(s.done or s.request_id is None for s in sessions):
            time.sleep(0.001)  # (waiting for a staggered start)
    engine.step()  # forgets the aborted requests
    wall = time.perf_counter() - t0
    return summarise(list(records.values()), engine.stats(), before, wall, args)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return round(v[min(len(v) - 1, int(q * len(v)))], 5)


def summarise(records: list[dict], after: dict, before: dict, wall: float, args: argparse.Namespace) -> dict:
    """TTFTs, inter-token latencies (alone and beside a long prefill), throughput, reuse, preemptions."""
    ttft = [r["times"][0] - r["sent"] for r in records if r["times"]]
    prefilling = [
        (r["sent"], r["times"][0]) for r in records if r["times"] and r["prompt_len"] >= args.loaded_prompt
    ]
    itl, loaded = [], []
    for r in records:
        for a, b in zip(r["times"], r["times"][1:], strict=False):
            gap = b - a
            if gap == 0:
                continue  # (tokens of one verify window arrive together)
            (loaded if any(s < b and f > a for s, f in prefilling) else itl).append(gap)
    tokens = sum(len(r["times"]) for r in records)
    prompt = sum(r["prompt_len"] for r in records)
    by_turn = {}
    for turn in sorted({r["turn"] for r in records}):
        ts = [r["times"][0] - r["sent"] for r in records if r["turn"] == turn and r["times"]]
        by_turn[turn] = {"requests": len(ts), "ttft_p50_s": _pct(ts, 0.5), "ttft_p99_s": _pct(ts, 0.99)}
    return {
        "requests": len(records),
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 2),
        "generated_tokens": tokens,
        "ttft_p50_s": _pct(ttft, 0.5),
        "ttft_p99_s": _pct(ttft, 0.99),
        "ttft_by_turn": by_turn,
        "itl_p50_s": _pct(itl, 0.5),
        "itl_p99_s": _pct(itl, 0.99),
        "itl_samples": len(itl),
        "itl_beside_long_prefill_p50_s": _pct(loaded, 0.5),
        "itl_beside_long_prefill_p99_s": _pct(loaded, 0.99),
        "itl_beside_long_prefill_samples": len(loaded),
        "prompt_tokens": prompt,
        "prompt_tokens_resumed": sum(r["cached"] for r in records),
        "prefix_reuse_rate": round(sum(r["cached"] for r in records) / prompt, 4) if prompt else None,
        "preemptions": after["preemptions"] - before["preemptions"],
        "max_concurrency": None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="model directory (default: the embedded model)")
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6, help="turns a session sends at most")
    ap.add_argument("--system", type=int, default=4096, help="the shared system prompt's tokens")
    ap.add_argument("--first", type=int, default=8192, help="turn 1's prompt tokens (system included)")
    ap.add_argument("--grow", type=int, default=8192, help="a tool result's tokens, added each turn")
    ap.add_argument(
        "--max-prompt", type=int, default=61440, help="a session ends once its prompt passes this"
    )
    ap.add_argument("--reply", type=int, default=128, help="a reply's mean tokens (drawn in [R/2, 3R/2])")
    ap.add_argument("--stagger", type=float, default=0.5, help="seconds between sessions' first turns")
    ap.add_argument("--loaded-prompt", type=int, default=32768, help="a 'long prefill' for the loaded ITL")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args, rest = ap.parse_known_args()
    flags = {"skip_tokenizer": True} | engine_flags(rest)
    engine = LLMEngine(EngineConfig(model=args.model, **flags))
    res = {**git_info(), "hardware": hardware(engine.device), "command": " ".join(sys.argv), "flags": flags,
           "workload": {k: v for k, v in vars(args).items() if k not in ("model", "out")}}  # fmt: skip
    res |= run(engine, args)
    res["max_concurrency"] = engine.config.max_concurrency
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
