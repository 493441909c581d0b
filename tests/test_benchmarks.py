"""benchmarks/ as a user meets it: every script answers --help, every command BENCHMARKS.md and
benchmarks/README.md print names a script that exists and flags that script takes, and the CPU-sized tools
run for real and print their JSON."""

from __future__ import annotations

import contextlib
import io
import json
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from nextserve.cli import main as cli_main
from nextserve.engine_config import EngineConfig

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py"))
KERNELS = sorted(p.stem for p in (BENCH / "kernels").glob("*.py") if p.stem != "__init__")
DOCS = [ROOT / "BENCHMARKS.md", BENCH / "README.md"]
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def help_text(script: str, *args: str) -> str:
    """What `python benchmarks/SCRIPT [args] --help` prints, run in this process (a subprocess a script
    would import torch anew each time); sys.path and sys.modules are put back after."""
    path, modules, argv = list(sys.path), set(sys.modules), sys.argv
    out = io.StringIO()
    sys.argv = [str(BENCH / script), *args, "--help"]
    try:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
            runpy.run_path(str(BENCH / script), run_name="__main__")
        assert done.value.code in (0, None), (script, args, done.value.code)
    finally:
        sys.path[:], sys.argv = path, argv
        for name in set(sys.modules) - modules:
            if name == "kernels" or name.startswith("kernels.") or name in ("workload",):
                del sys.modules[name]
    return out.getvalue()


def doc_commands() -> list[str]:
    """Every `python benchmarks/...` and `nextserve bench ...` command the two docs print."""
    cmds = []
    for doc in DOCS:
        text = doc.read_text()
        cmds += re.findall(r"`((?:PYTHONPATH=\S+ )?python3? benchmarks/[^`]+)`", text)
        cmds += re.findall(r"`(nextserve bench [^`]+)`", text)
    return cmds


def test_benchmarks_has_about_a_dozen_tools_each_listed_in_its_readme() -> None:
    readme = (BENCH / "README.md").read_text()
    assert 8 <= len(SCRIPTS) <= 20, SCRIPTS
    for script in SCRIPTS:
        assert f"`{script}`" in readme, f"{script} is not listed in benchmarks/README.md"
    for name in KERNELS:
        assert name in (BENCH / "bench_kernels.py").read_text(), f"bench_kernels.py does not list {name}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_answers_help(script: str) -> None:
    assert "usage" in help_text(script).lower() or script == "bench_kernels.py"


@pytest.mark.parametrize("name", KERNELS)
def test_every_kernel_benchmark_answers_help(name: str) -> None:
    assert f"bench_kernels.py {name}" in help_text("bench_kernels.py", name)


def test_an_unknown_kernel_benchmark_is_refused(capsys) -> None:
    sys.path.insert(0, str(BENCH))
    try:
        from bench_kernels import main
    finally:
        sys.path.remove(str(BENCH))
    assert main(["no_such_kernel"]) == 2
    assert "one of:" in capsys.readouterr().err


def test_the_docs_print_commands_at_all() -> None:
    cmds = doc_commands()
    assert len(cmds) >= 20, cmds
    assert any("nextserve_side.py" in c for c in cmds) and any("nextserve bench" in c for c in cmds)


@pytest.mark.parametrize("cmd", doc_commands())
def test_every_printed_command_names_a_script_and_flags_it_takes(cmd: str) -> None:
    if cmd.startswith("nextserve bench"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
            cli_main(["bench", "--help"])
        known, flags = out.getvalue(), FLAG.findall(cmd)
    else:
        rel = re.search(r"benchmarks/(\S+\.py)", cmd).group(1)
        assert (BENCH / rel).exists(), f"{cmd}: no benchmarks/{rel}"
        if rel.startswith("reference/"):
            return  # the shared recipe, run as it ships
        words = cmd.split(rel, 1)[1].split()
        if rel == "bench_kernels.py":
            assert words and words[0] in KERNELS, cmd
            known = help_text(rel, words[0])
        else:
            known = help_text(rel)
        flags = FLAG.findall(cmd.split(rel, 1)[1])
        if rel == "nextserve_side.py":
            # its flags are engine flags, EngineConfig's fields with dashes
            for flag in flags:
                assert flag[2:].replace("-", "_") in EngineConfig.__dataclass_fields__, (cmd, flag)
            return
        if rel in ("rigs.py", "agents_under_load.py"):  # its own flags, then engine flags
            flags = [f for f in flags if f[2:].replace("-", "_") not in EngineConfig.__dataclass_fields__]
    for flag in flags:
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", known), (
            f"{cmd}: {flag} is not a flag of it"
        )


def run_json(*argv: str) -> dict:
    """A CPU tool run for real as a user runs it: its last stdout JSON object."""
    done = subprocess.run(
        [sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    start = done.stdout.index("{")
    return json.loads(done.stdout[start:])


@pytest.mark.parametrize(
    "argv",
    [
        ["benchmarks/bench_prefix.py", "--turns", "2", "--system-tokens", "64", "--message-tokens", "16",
         "--reply-tokens", "4", "--prefill-chunk", "32"],
        ["benchmarks/bench_speculative.py", "--tokens", "8", "--widths", "1", "--rounds", "1",
         "--threads", "1"],
        ["benchmarks/mtp_acceptance.py", "--files", "1", "--prompt-tokens", "32", "--new-tokens", "8",
         "--val-windows", "1", "--threads", "1"],
        ["benchmarks/agents_under_load.py", "--sessions", "2", "--first", "96", "--grow", "32",
         "--max-prompt", "200", "--reply", "6", "--system", "64", "--stagger", "0.01",
         "--loaded-prompt", "150", "--device", "cpu", "--dtype", "float32", "--page-size", "16",
         "--prefill-chunk", "32", "--kv-capacity", "4096"],
        ["benchmarks/rigs.py", "--layout", "B", "--modes", "serial", "decode groups", "--tokens", "4",
         "--long", "64", "--kv-dtype", "int8"],
        ["benchmarks/bench_stage_hop.py", "--sizes", "4096", "--trips", "5", "--one-process"],
    ],
    ids=["bench_prefix", "bench_speculative", "mtp_acceptance", "agents_under_load", "rigs", "stage_hop"],
)  # fmt: skip
def test_the_cpu_sized_tools_run(argv: list[str]) -> None:
    res = run_json(*argv)
    text = json.dumps(res)
    assert "revision" in text and "hardware" in text, sorted(res)
    if argv[0].endswith("bench_prefix.py"):
        # the cold side resumes nothing (it did while prefix reuse, on by default, was left on there)
        assert set(res["cold"]["cached_tokens"]) == {0} and res["prefix_reuse"]["cached_tokens"][1] > 0, res
        assert res["outputs_identical"] is True
    if argv[0].endswith("rigs.py"):
        # layout B's 8,8,17,15 of 48 layers on the default model's 8, each stage's card scaled to it, with
        # the 8-bit KV cache the seed ran it with
        assert res["stage_layers"] == [1, 1, 4, 2] and len(res["stage_memory_gib"]) == 4, res
        assert 0 < min(res["stage_memory_gib"]) and res["caps_applied"] is False and res["kv"] == "int8"
        for mode in ("one process", "serial", "decode groups"):
            row = res["modes"][mode]
            assert row["outputs_equal"] == "4 of 4" and row["decode_4_tok_per_s"] > 0 and row["ttft_64_s"] > 0
    if argv[0].endswith("bench_stage_hop.py"):
        # each channel between two processes and within one (the tensor came back bit for bit, or it raised)
        got = {(r["channel"], r["processes"]) for r in res["rows"] if r["us_a_hop"] > 0}
        assert got == {("host", 2), ("shm", 2), ("host", 1), ("shm", 1)}, res["rows"]
        for r in res["rows"]:  # one process: the channel's parts of a hop, timed apart (CPU: no copies)
            parts = r.get("us_by_part", {"channel_send": 0, "channel_recv": 0, "channel_flush": 0})
            assert set(parts) == {"channel_send", "channel_recv", "channel_flush"}, r
            assert r["processes"] == 2 or min(parts.values()) > 0, r
    if argv[0].endswith("agents_under_load.py"):
        # 2 sessions, each until its prompt passes 200 tokens (96, then 32 + a reply of 3-9 more a turn)
        assert res["requests"] == 6 and set(res["ttft_by_turn"]) == {"1", "2", "3"}, res
        assert res["prefix_reuse_rate"] > 0.3 and res["preemptions"] == 0 and res["max_concurrency"] == 16
        assert 0 < res["itl_p50_s"] <= res["itl_p99_s"] and res["generated_tokens"] >= 6 * 3


def test_rig_caps_keep_the_real_cards_room_after_their_weights() -> None:
    """rigs.py's caps: each stage's own weights plus the room its real card keeps after the released stage's
    weights, in the chosen format; a card the released stage does not fit is refused by name; the 16-layer
    stage of layout A is the 24 GB card's; the experts in host memory leave the cards their bytes."""
    sys.path.insert(0, str(BENCH))
    import rigs

    from nextserve.bench.model import bench_config

    cfg, _ = bench_config("flash-next", layers=8, ngram_vocab_base=200000)
    released, _ = bench_config("flash-next", layers=48)
    ple = frozenset({"PLE"})
    split, caps = rigs.scaled_caps(cfg, "A", "int4", ple)
    assert split == [1, 1, 1, 1, 4] and caps[4] == max(caps)
    ours = rigs.stage_weight_bytes(cfg, split, "int4", ple)
    theirs = rigs.stage_weight_bytes(released, [8, 8, 8, 8, 16], "int4", ple)
    for cap, card, a, b in zip(caps, [12, 12, 12, 12, 24], ours, theirs, strict=True):
        assert abs(cap * 2**30 - (a + card * 2**30 - b)) < 2**30 * 1e-4
        assert 0 < card * 2**30 - b < 3 * 2**30  # int4 leaves a real card under 3 GiB
    bf16 = rigs.stage_weight_bytes(cfg, split, "none", ple)
    assert all(w > 2 * q for w, q in zip(bf16, ours, strict=True))  # (the embeddings and norms stay 16-bit)
    with pytest.raises(SystemExit, match=r"layout B: card 0 \(12 GB\) .* --quantization none"):
        rigs.scaled_caps(cfg, "B", "none", ple)
    _, host = rigs.scaled_caps(cfg, "A", "int4", ple | {"experts"})
    assert all(h > c + 5 for h, c in zip(host, caps, strict=True))


def test_bench_pipeline_splits_a_decode_item_by_stage(tmp_path) -> None:
    """--trace: the stages' own trace gives each stage's decode items as waiting, computing and sending."""
    res = run_json(
        "benchmarks/bench_pipeline.py", "--requests", "1", "--tokens", "5", "--rounds", "1", "--groups", "1",
        "--stage-transport", "shm", "--trace", str(tmp_path),
    )  # fmt: skip
    mode = res["modes"]["2 stages, 1 groups, shm"]
    assert mode["tokens_equal_one_process"] is True
    stages = mode["decode_item_us_by_stage"]
    assert len(stages) == 2 and all(s["items"] == 4 for s in stages), stages  # 5 tokens: 4 decode steps
    assert all(s["compute"] > 0 and s["wait"] >= 0 and s["send"] >= 0 for s in stages), stages
    assert "decode_item_us_by_stage" not in res["modes"]["one process"]
