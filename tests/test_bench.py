"""`nextserve bench` end to end on a tiny CPU model, the flash-next preset and the roofline's byte count."""

from __future__ import annotations

import json

import pytest
import torch

from nextserve import bench
from nextserve.cli import main
from nextserve.config import GDN, QSA
from nextserve.model.presets import preset_overrides, text_config
from nextserve.model.shapes import expected_shapes


@pytest.fixture
def one_thread():
    # NOTE: the run is a few thousand tiny ops; on a busy two-core CI box, two intra-op threads spin-wait
    # each other and take minutes instead of seconds.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_bench_at_concurrency_one_only(capsys, one_thread) -> None:
    """--concurrency 1 alone: the warm-up asks no more requests than the engine runs at once (it asked
    two, and the second waited, which the decode check took for a stalled step)."""
    argv = [
        "bench", "--device", "cpu", "--preset", "tiny", "--prompt-lens", "16", "--concurrency", "1",
        "--decode-steps", "2", "--decode-prompt-len", "8", "--copy-mib", "8", "--no-transformers",
        "--no-profile", "--no-async-scheduling",
    ]  # fmt: skip
    assert main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["engine"]["async_scheduling"] is False
    assert [r["concurrency"] for r in res["nextserve"]["decode"]] == [1]


def test_bench_cli_tiny_cpu_prints_json(capsys, tmp_path, one_thread) -> None:
    out_file = tmp_path / "bench.json"
    argv = [
        "bench", "--device", "cpu", "--preset", "tiny", "--prompt-lens", "24", "40",
        "--concurrency", "1", "3", "--decode-steps", "2", "--decode-prompt-len", "12",
        "--copy-mib", "8", "--out", str(out_file),
    ]  # fmt: skip
    assert main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    assert json.loads(out_file.read_text()) == res
    for key in (
        "command", "git", "hardware", "date_utc", "copy_bandwidth", "model", "engine", "nextserve",
        "transformers", "ratios_nextserve_over_transformers", "energy_counter", "skipped",
    ):  # fmt: skip
        assert key in res, key
    assert res["hardware"]["device"] == "cpu" and res["model"]["preset"] == "tiny"
    # on a CPU run the weights are on the device: none count as host memory (the GPU's pinned n-gram table)
    assert res["model"]["weight_bytes"] > 0 and res["model"]["host_weight_bytes"] == 0
    assert res["copy_bandwidth"]["GB_per_s"] > 0

    ns = res["nextserve"]
    assert [r["prompt_len"] for r in ns["prefill"]] == [24, 40]
    for r in ns["prefill"]:
        assert r["ttft_s"] > 0 and r["prefill_tok_per_s"] > 0 and r["J_per_token"] is None
    assert [r["concurrency"] for r in ns["decode"]] == [1, 3]
    for r in ns["decode"]:
        assert r["decode_steps"] == 2 and r["decode_tok_per_s"] > 0
        assert r["roofline"]["tok_per_s"] > 0 and 0 < r["roofline_fraction"]
        assert r["roofline"]["bytes_per_step"]["concurrency"] == r["concurrency"]
    prof = ns["profile_decode_c1"]
    assert {"gdn", "qsa_attention", "moe_routed_and_router", "hyper_connection", "ple"} <= set(
        prof["self_ms_per_module_kind"]
    )
    assert prof["top_ops_by_self_cpu"]

    hf = res["transformers"]
    assert hf["ran"] is True, hf
    assert [r["prompt_len"] for r in hf["prefill"]] == [24, 40]
    assert [r["concurrency"] for r in hf["decode"]] == [1, 3]
    ratios = res["ratios_nextserve_over_transformers"]
    assert ratios["decode_tok_per_s@c1"] > 0 and "prefill_tok_per_s@24" in ratios
    # Same weights, same prompt, float32: both greedy paths pick the same first token.
    assert ratios["same_first_token@24"] and ratios["same_first_token@40"]


def test_bench_runs_the_engines_default_chunk_and_page_size() -> None:
    """`nextserve bench` without flags measures the engine `nextserve serve` runs (it once prefilled in
    chunks of 1,024 where the engine's default is 4,096)."""
    import argparse

    from nextserve.bench.run import add_arguments
    from nextserve.engine_config import EngineConfig

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args([])
    assert (args.prefill_chunk, args.page_size) == (EngineConfig().prefill_chunk, EngineConfig().page_size)


def test_random_model_matches_loader_names_and_is_finite() -> None:
    cfg, _ = bench.bench_config("tiny")
    model = bench.random_flash_next(cfg, "cpu", torch.bfloat16, seed=1)
    params = dict(model.named_parameters())
    assert {k: tuple(v.shape) for k, v in params.items()} == expected_shapes(cfg)
    assert all(p.dtype == torch.bfloat16 and torch.isfinite(p).all() for p in params.values())
    assert params["layers.0.mlp.experts.gate_up_proj"].float().std() > 0
    again = bench.random_flash_next(cfg, "cpu", torch.bfloat16, seed=1)
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)


@pytest.mark.parametrize("form", ["int8", "fp8"])
def test_bench_runs_with_an_8_bit_kv_cache(capsys, one_thread, form) -> None:
    argv = [
        "bench", "--device", "cpu", "--preset", "tiny", "--prompt-lens", "16", "--concurrency", "2",
        "--decode-steps", "3", "--decode-prompt-len", "8", "--copy-mib", "8", "--no-transformers",
        "--no-profile", "--kv-dtype", form,
    ]  # fmt: skip
    assert main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["engine"]["kv_dtype"] == form and res["nextserve"]["decode"][0]["decode_tok_per_s"] > 0
    with pytest.raises(SystemExit):
        main(argv[:-1] + ["int4"])


def test_bench_with_host_experts_reports_the_expert_cache(capsys, one_thread) -> None:
    """--experts host with a small --expert-cache-gib: each decode run's cache counters over its timed
    window, exactly the window's routed pairs (bug: the cache's first read in a window reached back to the
    earlier prefill runs' pairs, and the H100's 48-layer window at one request counted 7.8M misses and
    9.1 GB of link a token); the host link is measured on a GPU only."""
    cfg, _ = bench.bench_config("tiny")
    argv = [
        "bench", "--device", "cpu", "--preset", "tiny", "--prompt-lens", "16", "--concurrency", "1", "2",
        "--decode-steps", "16", "--decode-prompt-len", "8", "--copy-mib", "8", "--no-transformers",
        "--no-profile", "--experts", "host", "--expert-cache-gib", "0.0001", "--router-skew", "1.5",
    ]  # fmt: skip
    assert main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["model"]["experts"] == "host" and res["model"]["router_skew"] == 1.5
    assert res["host_link"]["GB_per_s"] is None
    for r in res["nextserve"]["decode"]:
        c = r["expert_cache"]
        assert 0 < c["slots"] < cfg.num_experts * cfg.num_hidden_layers
        pairs_a_step = r["concurrency"] * cfg.num_experts_per_tok * cfg.num_hidden_layers
        assert c["hits"] + c["misses"] == 16 * pairs_a_step, c
        assert 0 <= c["hit_rate"] <= 1 and c["link_bytes_per_token"] >= 0


def test_router_skew_skews_the_routing() -> None:
    """A skewed random router sends more pairs to its widest rows: the busiest eighth of the experts gets
    1.4 times the top-k picks it gets unskewed."""
    from nextserve.ops.moe import route

    cfg, _ = bench.bench_config("small")
    x = torch.randn(512, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    shares = []
    for skew in (0.0, 1.5):
        model = bench.random_flash_next(cfg, "cpu", torch.float32, seed=1, router_skew=skew)
        _, ids = route(x @ model.layers["0"].mlp.gate.weight.T, cfg.num_experts_per_tok, True)
        counts = torch.bincount(ids.flatten(), minlength=cfg.num_experts).sort(descending=True).values
        shares.append(counts[: cfg.num_experts // 8].sum().item() / ids.numel())
    assert shares[1] > 1.4 * shares[0], shares


def test_flash_next_preset_widths_and_layers() -> None:
    text = text_config("flash-next")
    assert text["num_hidden_layers"] == 8 and text["hidden_size"] == 2560 and text["vocab_size"] == 248320
    assert [i for i, t in enumerate(text["layer_types"]) if t == QSA] == [3, 7]
    assert text["ple_layer_ids"] == [2] and text["ngram_vocab_size_base"] == 200000
    deep = text_config("flash-next", preset_overrides("flash-next", layers=48, ngram_vocab_base=20_000_000))
    assert deep["layer_types"] == [QSA if i % 4 == 3 else GDN for i in range(48)]
    assert deep["ngram_vocab_size_base"] == 20_000_000
    assert preset_overrides("flash-next", layers=1)["ple_layer_ids"] == []  # layer 2 is gone
    with pytest.raises(ValueError):
        preset_overrides("flash-next", layers=0)


def test_decode_bytes_of_the_reference_config() -> None:
    """Issue 6: a decode step of the 8-layer reference config reads 3.35 GB of weights."""
    cfg, _ = bench.bench_config("flash-next")
    one = bench.decode_step_bytes(cfg, concurrency=1, context=1024)
    assert 3.34e9 < one["weights_read"] < 3.36e9
    assert one["expected_distinct_experts_per_layer"] == 10.0
    # Six GDN layers' float32 recurrent state is read and written: 6 * 48 * 128 * 128 * 4 bytes each way.
    assert one["state_written"] >= 6 * 48 * 128 * 128 * 4
    many = bench.decode_step_bytes(cfg, concurrency=32, context=1024)
    assert one["weights_dense"] == many["weights_dense"]
    assert 10 < many["expected_distinct_experts_per_layer"] < 320


def test_profile_prefill_times_every_family_of_a_cold_prefill(one_thread) -> None:
    """The prefill profile on a tiny CPU engine: each of its four prefills runs cold (no prefix image
    resumes the repeats: prefix_cache=False), and the module families of the model all show."""
    from nextserve.bench.profile import profile_prefill

    cfg, _ = bench.bench_config("tiny")
    model = bench.random_flash_next(cfg, "cpu", torch.float32, seed=1)
    engine = bench.engine_for_model(
        model, torch.device("cpu"), torch.float32, max_context=256, prefill_chunk=16, prefix_cache=False
    )
    res = profile_prefill(engine, list(range(3, 43)), top=5)
    assert res["tokens"] == 40 and res["ttft_s"] > 0 and res["ttft_s_profiled"] > 0
    assert {"gdn", "qsa_attention", "qsa_indexer", "moe_routed_and_router", "hyper_connection", "ple"} <= set(
        res["self_ms_per_module_kind"]
    )
    assert isinstance(res["top_ops"], list)  # device time per op: none on the CPU
    assert not engine.has_unfinished()


def test_gap_table_sums_the_device_idle_between_kernels_by_neighbours() -> None:
    """Idle stretches are measured from the latest end so far (overlapping kernels hide none), and gaps
    shorter than min_us are left out."""
    from types import SimpleNamespace

    from nextserve.bench.profile import gap_table

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def ev(name, start, end, device=cuda):
        return SimpleNamespace(
            name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end)
        )

    events = [ev("a", 0, 100), ev("b", 50, 300), ev("host", 300, 900, cpu), ev("c", 400, 450),
              ev("d", 455, 500), ev("a", 600, 700), ev("b", 800, 810)]  # fmt: skip
    res = gap_table(SimpleNamespace(events=lambda: events), top=5, min_us=20)
    assert res["gaps"] == 3 and res["idle_ms_total"] == 0.3
    pairs = {(r["after"], r["before"]): (r["ms"], r["count"]) for r in res["top"]}
    assert pairs == {("b", "c"): (0.1, 1), ("d", "a"): (0.1, 1), ("a", "b"): (0.1, 1)}


def test_ttft_by_mode_times_every_mode_and_length_after_a_warm_round(one_thread) -> None:
    """Each mode's switch runs before each of its prompts; round 0 is not counted; one row per (mode,
    length), sorted by length then mode."""
    from nextserve.bench.timing import ttft_by_mode

    cfg, _ = bench.bench_config("tiny")
    model = bench.random_flash_next(cfg, "cpu", torch.float32, seed=1)
    engine = bench.engine_for_model(
        model, torch.device("cpu"), torch.float32, max_context=128, prefill_chunk=16, prefix_cache=False
    )
    switched: list[str] = []
    modes = {"b": lambda: switched.append("b"), "a": lambda: switched.append("a")}
    rows = ttft_by_mode(engine, modes, [20, 9], rounds=2, seed=3)
    assert switched == ["b", "a"] * 6
    assert [(r["mode"], r["prompt_tokens"]) for r in rows] == [("a", 9), ("b", 9), ("a", 20), ("b", 20)]
    assert all(r["ttft_s"] > 0 and r["tok_s"] > 0 for r in rows) and not engine.has_unfinished()
