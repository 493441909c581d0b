"""The reasoning split (issue 20): `<think>...</think>` apart from the answer, whole and streamed, with the
text cut at every pair of character boundaries, a template that opens `<think>` in the prompt, and output
without reasoning left whole."""

from __future__ import annotations

import pytest

from nextserve.server.reasoning import ReasoningSplitter, split_reasoning

CASES = [
    ("<think>\nlet me see\nok\n</think>\n\nThe answer is 4.", False, ("let me see\nok", "The answer is 4.")),
    ("let me see\n</think>\n\nFour.", True, ("let me see", "Four.")),  # the prompt opened <think>
    ("\n\n</think>\n\nNo thoughts.", True, ("", "No thoughts.")),
    ("Just an answer.", False, (None, "Just an answer.")),
    ("<think>\nnever closes", False, ("never closes", "")),
    ("  <think>a</think>b", False, ("a", "b")),
    ("a <think> inside is text", False, (None, "a <think> inside is text")),
    ("<thin", False, (None, "<thin")),
    ("<think>x</thi", False, ("x</thi", "")),
    (
        "<think>one\n\ntwo</think>three <think>four</think>",
        False,
        ("one\n\ntwo", "three <think>four</think>"),
    ),
]


@pytest.mark.parametrize("text,opened,want", CASES)
def test_split_whole_and_at_every_pair_of_boundaries(text: str, opened: bool, want) -> None:
    assert split_reasoning(text, opened) == want
    for a in range(len(text) + 1):
        for b in range(a, len(text) + 1):
            s = ReasoningSplitter(opened)
            parts = [s.feed(text[:a]), s.feed(text[a:b]), s.feed(text[b:], final=True)]
            assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == (want[0] or "", want[1])


def test_one_character_at_a_time() -> None:
    text = "<think>\nstep 1\nstep 2\n</think>\n\nDone."
    s = ReasoningSplitter(False)
    parts = [s.feed(c) for c in text] + [s.feed("", final=True)]
    assert "".join(p[0] for p in parts) == "step 1\nstep 2" and "".join(p[1] for p in parts) == "Done."
    assert all(not (r and a) for r, a in parts)  # no delta mixes the two


# ---- through the server: the output forced into the thinking form by a regex ---------------------------
THINKING = r"<think>\n[a-z]{2,6} [a-z]{2,6}\n</think>\n\n[a-z]{2,6} [a-z]{2,6}\."
USER = [{"role": "user", "content": "hi"}]


def test_chat_and_messages_split_the_reasoning(server) -> None:
    import anthropic
    from live_server import MODEL_NAME

    c = server.client()
    body = {"guided_regex": THINKING, "temperature": 0}
    whole = c.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=40, extra_body=body)
    msg = whole.choices[0].message
    assert msg.reasoning_content and " " in msg.reasoning_content and "<think>" not in msg.reasoning_content
    assert msg.content.endswith(".") and "think>" not in msg.content
    chunks = list(c.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=40, stream=True,
                                            extra_body=body))  # fmt: skip
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == msg.reasoning_content
    assert "".join(d.content or "" for d in deltas) == msg.content
    plain = c.chat.completions.create(
        model=MODEL_NAME, messages=USER, max_tokens=5, extra_body={"temperature": 0}
    )
    assert getattr(plain.choices[0].message, "reasoning_content", None) is None  # no <think>: all answer

    a = anthropic.Anthropic(base_url=server.base_url.removesuffix("/v1"), api_key="none", max_retries=0)
    m = a.messages.create(model=MODEL_NAME, max_tokens=40, messages=USER, extra_body=body)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == msg.reasoning_content and m.content[1].text == msg.content
    with a.messages.stream(model=MODEL_NAME, max_tokens=40, messages=USER, extra_body=body) as s:
        streamed = s.get_final_message()
    assert [b.type for b in streamed.content] == ["thinking", "text"]
    assert (
        streamed.content[0].thinking == m.content[0].thinking
        and streamed.content[1].text == m.content[1].text
    )


def test_enable_thinking_false_renders_a_closed_block(server) -> None:
    """chat_template_kwargs.enable_thinking false: the template closes <think> in the prompt, so the answer
    has no reasoning part; through the Messages dialect, thinking {"type": "disabled"} asks the same."""
    import anthropic
    from live_server import MODEL_NAME

    c = server.client()
    closed = {"chat_template_kwargs": {"enable_thinking": False}}
    off = c.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=4, extra_body=closed)
    on = c.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=4)
    assert off.usage.prompt_tokens > on.usage.prompt_tokens  # the closed block is in the prompt
    assert off.choices[0].message.reasoning_content is None
    a = anthropic.Anthropic(base_url=server.base_url.removesuffix("/v1"), api_key="none", max_retries=0)
    n = a.messages.count_tokens(model=MODEL_NAME, messages=USER, thinking={"type": "disabled"}).input_tokens
    assert n == off.usage.prompt_tokens


def test_reasoning_off_closes_thinking_unless_a_request_asks(tiny_model_dir, server) -> None:
    from live_server import MODEL_NAME, live_server

    from nextserve.cli import build_parser

    assert build_parser().parse_args(["serve", "--reasoning", "off"]).reasoning == "off"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--reasoning", "maybe"])
    on = server.client().chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=1)
    with live_server(tiny_model_dir, reasoning=False) as srv:
        c = srv.client()
        off = c.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=1)
        think = {"chat_template_kwargs": {"enable_thinking": True}}
        asked = c.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=1, extra_body=think)
    assert off.usage.prompt_tokens > on.usage.prompt_tokens == asked.usage.prompt_tokens
