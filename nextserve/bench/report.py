"""The run's results side by side: nextserve over transformers ratios, and a few lines for a terminal."""

from __future__ import annotations

from typing import Any

_KEY = {"prefill": "prompt_len", "decode": "concurrency"}


def _pairs(ns: dict[str, Any], hf: dict[str, Any], phase: str) -> list[tuple[dict, dict]]:
    """Each of nextserve's `phase` rows with transformers' row of the same prompt length / concurrency
    ({} where transformers has none, or only an error)."""
    key = _KEY[phase]
    theirs = {r[key]: r for r in hf.get(phase, []) if "error" not in r}
    return [(r, theirs.get(r[key], {})) for r in ns[phase]]


def _ratio(ours: dict[str, Any], theirs: dict[str, Any], field: str) -> float | None:
    a, b = ours[field], theirs[field]
    return round(a / b, 4) if a and b else None


def ratios(ns: dict[str, Any], hf: dict[str, Any]) -> dict[str, Any]:
    if not hf.get("ran"):
        return {}
    out: dict[str, Any] = {}
    for r, h in _pairs(ns, hf, "prefill"):
        if h:
            out[f"prefill_tok_per_s@{r['prompt_len']}"] = _ratio(r, h, "prefill_tok_per_s")
            # Same weights and prompt: the greedy first tokens should agree (bf16 near-ties aside).
            out[f"same_first_token@{r['prompt_len']}"] = r["first_token"] == h["first_token"]
    for r, h in _pairs(ns, hf, "decode"):
        if h:
            out[f"decode_tok_per_s@c{r['concurrency']}"] = _ratio(r, h, "decode_tok_per_s")
            out[f"J_per_token@c{r['concurrency']}"] = _ratio(r, h, "J_per_token")
    return out


def summary(res: dict[str, Any]) -> str:
    """A few lines for a terminal: what the JSON says, side by side."""
    hf = res.get("transformers", {})
    lines = [
        f"copy bandwidth {res['copy_bandwidth']['GB_per_s']} GB/s; transformers ran: {hf.get('ran')} "
        f"{hf.get('reason', '') or hf.get('error', '')}"
    ]
    for r, h in _pairs(res["nextserve"], hf, "prefill"):
        lines.append(
            f"prefill {r['prompt_len']:>6}: nextserve {r['prefill_tok_per_s']:>9} tok/s "
            f"ttft {r['ttft_s']:.3f} s J/tok {r['J_per_token']} | "
            f"transformers {h.get('prefill_tok_per_s')} tok/s ttft {h.get('ttft_s')}"
        )
    for r, h in _pairs(res["nextserve"], hf, "decode"):
        lines.append(
            f"decode c{r['concurrency']:<3}: nextserve {r['decode_tok_per_s']:>8} tok/s "
            f"({100 * r['roofline_fraction']:.2f}% of {r['roofline']['tok_per_s']}) "
            f"J/tok {r['J_per_token']} | "
            f"transformers {h.get('decode_tok_per_s')} tok/s J/tok {h.get('J_per_token')}"
        )
    prof = res["nextserve"].get("profile_decode_c1")
    if prof:
        lines.append(f"decode step c1 self ms by module: {prof['self_ms_per_module_kind']}")
        lines.append(
            f"profiled step {prof.get('profiled_step_ms')} ms, device busy {prof.get('device_busy_ms')} ms, "
            f"{prof.get('device_activities')} device activities"
        )
    lines += [f"skipped: {s}" for s in res["skipped"]]
    return "\n".join(lines)
