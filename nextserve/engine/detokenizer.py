"""Incremental detokenization: each new token costs a decode of a few tokens, not of the whole output."""

from __future__ import annotations


class Detokenizer:
    """Text of a growing token list, stable as it grows (a streamed prefix never changes).

    # NOTE: decodes a short window [prefix, end) and emits what it adds beyond [prefix, read); a
    # trailing U+FFFD is an unfinished multi-byte character, held until its other bytes arrive.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0
        self._read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(self.ids)
        return self.text
