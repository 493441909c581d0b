"""A model directory whose config uses another release's layer-type name still loads and serves
(transformers 5.17 and vLLM say qwen_sparse_attention, 5.23 indexed_attention, shipped full_attention)."""

import json
import shutil

import pytest

from nextserve import LLM, SamplingParams


@pytest.mark.parametrize("name", ["qwen_sparse_attention", "full_attention"])
def test_other_layer_type_names_load(tiny_model_dir, tmp_path, name: str) -> None:
    d = tmp_path / "m"
    shutil.copytree(tiny_model_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["layer_types"] = [name if t == "indexed_attention" else t for t in cfg["layer_types"]]
    (d / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(d), dtype="float32", kv_capacity=512, max_context=256, max_concurrency=1)
    (out,) = llm.generate(["def f(x):"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out.token_ids) == 4 and llm.tokenizer is not None


def test_tokenizer_load_does_not_parse_the_model_config(tiny_model_dir, monkeypatch) -> None:
    """transformers 5.17 rejects a 5.23 qwen4_exp config; loading the tokenizer must not ask it to."""
    import transformers

    def refuse(*args, **kwargs):
        raise ValueError("Unsupported Qwen4-Exp layer types: ['indexed_attention'].")

    # transformers 5.17's AutoTokenizer parses config.json (seen on the GPU machine); both refuse here.
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    from nextserve.engine.engine import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    assert tok.decode(tok.encode("def f(x):")) == "def f(x):"
