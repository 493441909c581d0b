"""The model's reasoning apart from its answer: Flash-Next thinks in `<think>...</think>` before it answers
(the tags are added tokens, kept in the decoded text), and the chat template may open `<think>` in the
prompt itself. `ReasoningSplitter` splits the generated text as it streams, whatever way the tags are cut
across decode steps.

# NOTE: as vLLM's Qwen3 reasoning parser: output that does not start in `<think>` (and whose prompt did not
# open one) is all answer; reasoning that never closes is all reasoning. The newlines the template puts
# around the reasoning and after `</think>` belong to neither part.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def _partial_tail(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def prompt_opens_thinking(tokenizer, ids: list[int]) -> bool:
    """Whether the rendered prompt ends inside an open `<think>` (the template opened it)."""
    tail = tokenizer.decode(ids[-4:], skip_special_tokens=False)
    head, sep, after = tail.rpartition(OPEN)
    return bool(sep) and CLOSE not in after and not after.strip()


def reasoning_opened(srv, ids: list[int]) -> bool | None:
    """None where answers are not split (no thinking tags in the vocabulary); else whether the prompt
    opened `<think>` itself."""
    return prompt_opens_thinking(srv.tokenizer, ids) if srv.thinks else None


def thinks(tokenizer) -> bool:
    """Whether the model's vocabulary has the thinking tags (the split applies only then)."""
    if tokenizer is None:
        return False
    vocab = tokenizer.get_vocab()
    return OPEN in vocab and CLOSE in vocab


class ReasoningSplitter:
    """Generated text in, (reasoning, answer) deltas out: start -> (open ->) after -> answer."""

    def __init__(self, opened: bool) -> None:
        self.state = "open" if opened else "start"
        self.buf = ""
        self.said = False  # any reasoning handed out yet (its leading newlines are the template's)

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, answer) text that `text` completes; with `final`, everything held back too."""
        self.buf += text
        reasoning, answer = "", ""
        while True:
            if self.state == "start":
                s = self.buf.lstrip()
                if s.startswith(OPEN):
                    self.buf, self.state = s[len(OPEN) :], "open"
                elif not final and (not s or OPEN.startswith(s)):
                    break  # whitespace, or a `<think` cut short: wait for more
                else:
                    self.state = "answer"
            elif self.state == "open":
                if not self.said:
                    self.buf = self.buf.lstrip("\n")
                i = self.buf.find(CLOSE)
                if i >= 0:
                    reasoning += self.buf[:i].rstrip("\n")
                    self.buf, self.state = self.buf[i + len(CLOSE) :], "after"
                    continue
                # hold a cut `</think` and trailing newlines (they may be the ones before `</think>`)
                tag = _partial_tail(self.buf, CLOSE)
                rest = self.buf[: len(self.buf) - tag]
                hold = 0 if final else tag + len(rest) - len(rest.rstrip("\n"))
                out, self.buf = self.buf[: len(self.buf) - hold], self.buf[len(self.buf) - hold :]
                reasoning += out
                self.said = self.said or bool(out)
                break
            elif self.state == "after":
                self.buf = self.buf.lstrip("\n")
                if not self.buf and not final:
                    break
                self.state = "answer"
            else:
                answer, self.buf = answer + self.buf, ""
                break
        return reasoning, answer


def split_reasoning(text: str, opened: bool | None) -> tuple[str | None, str]:
    """(reasoning, or None where the output had no reasoning part; answer) of a whole output; `opened`
    None (no split: `reasoning_opened`) gives the text whole."""
    if opened is None:
        return None, text
    splitter = ReasoningSplitter(opened)
    reasoning, answer = splitter.feed(text, final=True)
    had = opened or text.lstrip().startswith(OPEN)
    return (reasoning if had else None), answer
