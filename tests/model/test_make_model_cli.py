"""`nextserve make-model`: the written dtype, and that the checkpoint serves."""

from __future__ import annotations

import pytest
from safetensors import safe_open

from nextserve import LLM, SamplingParams
from nextserve.cli import main


def _float_dtypes(out) -> set[str]:
    found = set()
    for f in out.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            found |= {st.get_slice(k).get_dtype() for k in st.keys()}
    return {d for d in found if d.startswith(("F", "BF"))}  # integer tensors (PLE hashing) stay


def test_make_model_writes_the_asked_dtype_and_serves(tmp_path, capsys) -> None:
    out = tmp_path / "tiny-bf16"
    assert main(["make-model", "--preset", "tiny", "--out", str(out), "--dtype", "bfloat16"]) == 0
    assert _float_dtypes(out) == {"BF16"}
    (res,) = LLM(str(out), device="cpu", kv_capacity=256).generate(
        [[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    )
    assert len(res.token_ids) == 3 and res.error is None


def test_make_model_rejects_an_unknown_dtype(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["make-model", "--preset", "tiny", "--out", str(tmp_path / "x"), "--dtype", "int8"])
    assert exc.value.code == 2
    assert "--dtype" in capsys.readouterr().err
