"""load_weights: runtime names and shapes, values equal to transformers' own load, and clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen4ExpForCausalLM, Qwen4ExpForConditionalGeneration

import nextserve.model.checkpoint as checkpoint
import nextserve.model.loader as loader
from nextserve.config import ConfigError, ModelConfig
from nextserve.model.loader import load_weights
from nextserve.model.make_model import make_model
from nextserve.model.ple import table_rows as ple_table_rows
from nextserve.model.shapes import expected_shapes

_PLE_BUFFERS = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")


def _hf_runtime_state(model_dir: Path, multimodal: bool) -> dict[str, torch.Tensor]:
    """transformers' loaded state dict, renamed to nextserve runtime names (buffers and vision dropped)."""
    cls = Qwen4ExpForConditionalGeneration if multimodal else Qwen4ExpForCausalLM
    model = cls.from_pretrained(model_dir, experts_implementation="eager")
    prefix = "model.language_model." if multimodal else "model."
    return {
        k.removeprefix(prefix): v
        for k, v in model.state_dict().items()
        if not k.startswith("model.visual.") and not k.endswith(_PLE_BUFFERS)
    }


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def _rewrite(src: Path, dst: Path, edit) -> Path:
    """Copy a single-file checkpoint and apply edit(tensors) to its tensors."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def tiny_cfg(tiny_model_dir: Path) -> ModelConfig:
    return ModelConfig.from_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def tiny_weights(tiny_model_dir: Path, tiny_cfg: ModelConfig) -> dict[str, torch.Tensor]:
    return load_weights(tiny_model_dir, tiny_cfg)


# ---- key sets, shapes and values -------------------------------------------------------------------------


def test_keys_and_shapes_are_the_runtime_names(tiny_weights: dict, tiny_cfg: ModelConfig) -> None:
    shapes = expected_shapes(tiny_cfg)
    assert list(tiny_weights) == list(shapes)
    assert {k: tuple(v.shape) for k, v in tiny_weights.items()} == shapes
    H, E, I = tiny_cfg.hidden_size, tiny_cfg.num_experts, tiny_cfg.moe_intermediate_size
    assert shapes["layers.0.mlp.experts.gate_up_proj"] == (E, 2 * I, H)
    assert shapes["layers.0.mlp.experts.down_proj"] == (E, H, I)
    # Primes [101, 103, 107, 109] -> 420 rows; [113, 127, 131, 137] -> 508 rows (FLASH_NEXT.md section 5).
    assert shapes["layers.0.ple.ple_embedding.ngram_embedding.weight"] == (420, 8)
    assert shapes["layers.2.ple.ple_embedding.ngram_embedding.weight"] == (508, 8)
    assert "hyper_connection_mixer.block_inject_weight.weight" not in shapes
    assert not any(k.startswith("mtp.") or k.endswith(_PLE_BUFFERS) for k in shapes)
    assert all(v.dtype == torch.float32 for v in tiny_weights.values())


def test_values_equal_transformers_load(tiny_model_dir: Path, tiny_weights: dict) -> None:
    _assert_same(tiny_weights, _hf_runtime_state(tiny_model_dir, multimodal=False))


def test_gate_rows_come_first(tiny_model_dir: Path, tiny_weights: dict) -> None:
    raw = load_file(tiny_model_dir / "model.safetensors")
    fused = tiny_weights["layers.1.mlp.experts.gate_up_proj"]  # [E, 2I, H]
    inter = fused.shape[1] // 2
    assert torch.equal(fused[5, :inter], raw["model.layers.1.mlp.experts.5.gate_proj.weight"])
    assert torch.equal(fused[5, inter:], raw["model.layers.1.mlp.experts.5.up_proj.weight"])


@pytest.mark.parametrize(
    "layout, fused, shard_mib",
    [("multimodal", False, None), ("multimodal", True, 0.05), ("text", True, 0.02), ("text", False, 0.1)],
)
def test_layouts_load_the_same_weights(
    tmp_path: Path, tiny_weights: dict, layout: str, fused: bool, shard_mib: float | None
) -> None:
    # make_model's values depend only on the seed, so every layout must load to the same tensors.
    model_dir = make_model("tiny", tmp_path / "m", layout=layout, fused_experts=fused, shard_mib=shard_mib)
    cfg = ModelConfig.from_dir(model_dir)
    assert cfg.layout == layout
    got = load_weights(model_dir, cfg)
    _assert_same(got, tiny_weights)
    if layout == "multimodal" and fused:
        _assert_same(got, _hf_runtime_state(model_dir, multimodal=True))


def test_small_preset_with_two_ple_shards(small_model_dir: Path) -> None:
    cfg = ModelConfig.from_dir(small_model_dir)
    got = load_weights(small_model_dir, cfg)
    assert got["layers.5.ple.ple_embedding.ngram_embedding.weight"].shape == (ple_table_rows(cfg, 1), 16)
    _assert_same(got, _hf_runtime_state(small_model_dir, multimodal=False))


def test_layer_range_keeps_global_indices(
    tiny_model_dir: Path, tiny_cfg: ModelConfig, tiny_weights: dict
) -> None:
    got = load_weights(tiny_model_dir, tiny_cfg, layers=range(2, 4), with_embed=False, with_head=False)
    assert {k.split(".")[1] for k in got} == {"2", "3"}
    assert all(k.startswith("layers.") for k in got)
    _assert_same(got, {k: v for k, v in tiny_weights.items() if k.startswith(("layers.2.", "layers.3."))})
    first = load_weights(tiny_model_dir, tiny_cfg, layers=range(0, 1), with_head=False)
    assert "embed_tokens.weight" in first and "lm_head.weight" not in first
    last = load_weights(tiny_model_dir, tiny_cfg, layers=range(3, 4), with_embed=False)
    assert {"lm_head.weight", "hyper_connection_mixer.hc_norm.weight"} <= set(last)
    assert "embed_tokens.weight" not in last


def test_mtp_weights(tiny_model_dir: Path, tiny_cfg: ModelConfig) -> None:
    raw = load_file(tiny_model_dir / "model.safetensors")
    got = load_weights(
        tiny_model_dir, tiny_cfg, layers=range(0), with_embed=False, with_head=False, with_mtp=True
    )
    assert all(k.startswith("mtp.") for k in got)
    assert {k: tuple(v.shape) for k, v in got.items()} == {
        k: v for k, v in expected_shapes(tiny_cfg, with_mtp=True).items() if k.startswith("mtp.")
    }
    H = tiny_cfg.hidden_size
    assert got["mtp.fc_hidden.weight"].shape == (H, H)
    assert got["mtp.pre_fc_norm_hidden.weight"].shape == (tiny_cfg.hc_hidden,)
    assert "mtp.hyper_connection_mixer.block_inject_weight.weight" not in got
    assert "mtp.layer.attn_hyper_connection.block_inject_weight.weight" in got
    assert got["mtp.layer.mlp.experts.gate_up_proj"].shape == (tiny_cfg.num_experts, 64, H)
    assert torch.equal(got["mtp.layer.self_attn.q_proj.weight"], raw["mtp.layers.0.self_attn.q_proj.weight"])
    assert not any(k.startswith("mtp.layers.") or "embed_tokens" in k or "lm_head" in k for k in got)


def test_dtype_and_device(tiny_model_dir: Path, tiny_cfg: ModelConfig, tiny_weights: dict) -> None:
    got = load_weights(tiny_model_dir, tiny_cfg, dtype=torch.bfloat16, device="cpu")
    assert all(v.dtype == torch.bfloat16 and v.device.type == "cpu" for v in got.values())
    assert torch.equal(got["lm_head.weight"], tiny_weights["lm_head.weight"].bfloat16())
    fused = got["layers.0.mlp.experts.gate_up_proj"]  # assembled from pieces: cast on the way in
    assert torch.equal(fused, tiny_weights["layers.0.mlp.experts.gate_up_proj"].bfloat16())


def test_unknown_tensors_are_ignored(
    tmp_path: Path, tiny_model_dir: Path, tiny_cfg: ModelConfig, tiny_weights
) -> None:
    def add(t: dict) -> None:
        t["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)
        t["model.layers.0.ple.hashstats_counts"] = torch.zeros(7)
        t["model.layers.0.ple.token_lookup"] = torch.zeros(5, dtype=torch.int64)
        t["model.hyper_connection_mixer.block_inject_weight.weight"] = torch.zeros(4, 256)

    model_dir = _rewrite(tiny_model_dir, tmp_path / "extra", add)
    _assert_same(load_weights(model_dir, tiny_cfg), tiny_weights)


def test_opens_only_needed_files_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir = make_model("tiny", tmp_path / "s", shard_mib=0.02)
    cfg = ModelConfig.from_dir(model_dir)
    opened: list[str] = []
    real = checkpoint.safe_open

    def spy(path, *args, **kwargs):
        opened.append(Path(path).name)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "safe_open", spy)
    load_weights(model_dir, cfg, layers=range(3, 4), with_embed=False, with_head=False)
    weight_map = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    needed = {f for name, f in weight_map.items() if name.startswith("model.layers.3.")}
    assert sorted(opened) == sorted(needed)


def test_progress_bar_for_big_loads(
    tiny_model_dir: Path, tiny_cfg: ModelConfig, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    load_weights(tiny_model_dir, tiny_cfg)
    assert "loading weights" not in capsys.readouterr().err
    monkeypatch.setattr(loader, "PROGRESS_MIN_BYTES", 1)
    load_weights(tiny_model_dir, tiny_cfg)
    assert "loading weights" in capsys.readouterr().err


# ---- errors ----------------------------------------------------------------------------------------------


def test_missing_directory(tmp_path: Path, tiny_cfg: ModelConfig) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_weights(tmp_path / "nowhere", tiny_cfg)
    with pytest.raises(ConfigError, match="does not exist"):
        ModelConfig.from_dir(tmp_path / "nowhere")


def test_no_safetensors_files(tmp_path: Path, tiny_model_dir: Path, tiny_cfg: ModelConfig) -> None:
    shutil.copy(tiny_model_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(ConfigError, match=r"no \*\.safetensors files"):
        load_weights(tmp_path, tiny_cfg)


def test_no_config_and_unknown_model_type(tmp_path: Path, tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_dir(tmp_path)
    raw = json.loads((tiny_model_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(raw | {"model_type": "llama"}))
    with pytest.raises(ConfigError, match="unknown model_type 'llama'"):
        ModelConfig.from_dir(tmp_path)


def test_index_names_a_missing_file(tmp_path: Path) -> None:
    model_dir = make_model("tiny", tmp_path / "s", shard_mib=0.05)
    cfg = ModelConfig.from_dir(model_dir)
    weight_map = json.loads((model_dir / "model.safetensors.index.json").read_text())["weight_map"]
    gone = sorted(set(weight_map.values()))[1]
    (model_dir / gone).unlink()
    with pytest.raises(ConfigError, match=f"names '{gone}', which is missing"):
        load_weights(model_dir, cfg)


def test_malformed_index(tmp_path: Path, tiny_model_dir: Path, tiny_cfg: ModelConfig) -> None:
    model_dir = Path(shutil.copytree(tiny_model_dir, tmp_path / "m"))
    (model_dir / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ConfigError, match="weight_map"):
        load_weights(model_dir, tiny_cfg)


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.3.self_attn.indexer.k_layernorm.weight",
        "model.layers.1.mlp.experts.6.up_proj.weight",
        "model.hyper_connection_mixer.input_mix_weight_up.weight",
        "lm_head.weight",
    ],
)
def test_missing_tensor_is_named(
    tmp_path: Path, tiny_model_dir: Path, tiny_cfg: ModelConfig, name: str
) -> None:
    model_dir = _rewrite(tiny_model_dir, tmp_path / "m", lambda t: t.pop(name))
    with pytest.raises(ConfigError, match=f"missing tensor '{name}'"):
        load_weights(model_dir, tiny_cfg)


def test_missing_tensor_outside_the_range_is_fine(
    tmp_path: Path, tiny_model_dir: Path, tiny_cfg: ModelConfig
) -> None:
    model_dir = _rewrite(tiny_model_dir, tmp_path / "m", lambda t: t.pop("lm_head.weight"))
    load_weights(model_dir, tiny_cfg, layers=range(0, 2), with_head=False)


def test_missing_experts_and_ple_table(tmp_path: Path, tiny_model_dir: Path, tiny_cfg: ModelConfig) -> None:
    def drop(t: dict) -> None:
        for k in [k for k in t if k.startswith("model.layers.2.mlp.experts.")]:
            del t[k]

    model_dir = _rewrite(tiny_model_dir, tmp_path / "experts", drop)
    with pytest.raises(
        ConfigError, match=r"model\.layers\.2\.mlp\.experts\.gate_up_proj.*experts\.0\.gate_proj"
    ):
        load_weights(model_dir, tiny_cfg)
    ple = "model.layers.2.ple.ple_embedding.ngram_embedding.shard_0.weight"
    model_dir = _rewrite(tiny_model_dir, tmp_path / "ple", lambda t: t.pop(ple))
    with pytest.raises(ConfigError, match=f"missing tensor '{ple}'"):
        load_weights(model_dir, tiny_cfg)


@pytest.mark.parametrize(
    "name, shape, expected",
    [
        ("model.layers.0.linear_attn.in_proj_qkv.weight", (160, 63), "[160, 64]"),
        ("model.layers.3.self_attn.q_proj.weight", (128, 64), "[256, 64]"),
        ("model.layers.0.mlp.experts.2.down_proj.weight", (32, 64), "[64, 32]"),
        ("mtp.fc_hidden.weight", (64, 256), "[64, 64]"),
    ],
)
def test_wrong_shape_is_named(
    tmp_path: Path, tiny_model_dir: Path, tiny_cfg: ModelConfig, name: str, shape: tuple, expected: str
) -> None:
    model_dir = _rewrite(tiny_model_dir, tmp_path / "m", lambda t: t.__setitem__(name, torch.zeros(shape)))
    got = str(list(shape))
    with pytest.raises(ConfigError, match=rf"'{name}' has shape \{got}, expected \{expected}"):
        load_weights(model_dir, tiny_cfg, with_mtp=True)


def test_wrong_fused_expert_shape(tmp_path: Path, tiny_cfg: ModelConfig) -> None:
    model_dir = make_model("tiny", tmp_path / "f", fused_experts=True)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    model_dir = _rewrite(model_dir, tmp_path / "m", lambda t: t.__setitem__(name, torch.zeros(8, 32, 64)))
    with pytest.raises(ConfigError, match=rf"'{name}' has shape \[8, 32, 64\], expected \[8, 64, 64\]"):
        load_weights(model_dir, tiny_cfg)


def test_wrong_ple_rows(tmp_path: Path, tiny_model_dir: Path, tiny_cfg: ModelConfig) -> None:
    name = "model.layers.0.ple.ple_embedding.ngram_embedding.shard_0.weight"
    model_dir = _rewrite(tiny_model_dir, tmp_path / "m", lambda t: t.__setitem__(name, torch.zeros(400, 8)))
    with pytest.raises(ConfigError, match="has 400 rows in all, expected 420"):
        load_weights(model_dir, tiny_cfg)


def test_mtp_asked_but_absent(tmp_path: Path) -> None:
    model_dir = make_model("tiny", tmp_path / "nomtp", with_mtp=False)
    cfg = ModelConfig.from_dir(model_dir)
    assert not any(k.startswith("mtp.") for k in load_weights(model_dir, cfg))
    with pytest.raises(ConfigError, match=r"checkpoint has no MTP weights \(mtp\.\*\)"):
        load_weights(model_dir, cfg, with_mtp=True)


def test_layer_range_out_of_bounds(tiny_model_dir: Path, tiny_cfg: ModelConfig) -> None:
    with pytest.raises(ConfigError, match="outside the model's 4 layers"):
        load_weights(tiny_model_dir, tiny_cfg, layers=range(2, 6))
