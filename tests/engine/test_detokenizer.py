"""Incremental detokenization equals a full decode, holds back split characters, and is stable."""

from transformers import AutoTokenizer

from nextserve.engine.detokenizer import Detokenizer

TEXT = 'def naïve(x):\n    return x ** 2  # 平方 ✓ ok\n\n<tool_call>{"a": 1}</tool_call> end'


def test_incremental_equals_full_decode_and_prefixes_are_stable(tiny_model_dir) -> None:
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    ids = tok.encode(TEXT, add_special_tokens=False)
    det = Detokenizer(tok)
    seen = ""
    for t in ids:
        text = det.add(t)
        assert text.startswith(seen)
        assert "\ufffd" not in text
        seen = text
    assert seen == tok.decode(ids, skip_special_tokens=True)


def test_decode_window_stays_short(tiny_model_dir) -> None:
    """Each step decodes a window of a few tokens, not the whole output (no quadratic cost)."""
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    ids = tok.encode(TEXT * 20, add_special_tokens=False)
    det = Detokenizer(tok)
    windows: list[int] = []
    real = det._decode
    det._decode = lambda window: (windows.append(len(window)), real(window))[1]
    for t in ids:
        det.add(t)
    assert max(windows) <= 8, max(windows)
