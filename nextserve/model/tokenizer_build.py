"""Train a small byte-level BPE tokenizer with a Qwen-style ChatML template, for random test checkpoints.

The files written load with `transformers.AutoTokenizer.from_pretrained(out_dir)` as a fast tokenizer, so
the same directory serves nextserve and the transformers oracle.
"""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Order fixes the ids: the trainer gives special tokens the lowest ids, 0..6.
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, "<tool_call>", "</tool_call>", "<think>", "</think>")
# Markup tokens that must survive `skip_special_tokens=True` decoding, because the server parses tool calls
# and reasoning out of the decoded text (Qwen2.5/Qwen3 mark them special=False for the same reason).
_NON_SKIPPED = {"<tool_call>", "</tool_call>", "<think>", "</think>"}
_BYTE_ALPHABET = 256
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}

# Qwen2's split pattern: single digits, letters with one leading non-letter, punctuation runs, newlines.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML in the Qwen3 style. Content is a string or a list of {"type": "text", "text": ...} parts; tool calls
# and tool results follow Qwen2.5/Qwen3 (`<tool_call>` JSON in the assistant turn, results as a user turn of
# `<tool_response>` blocks); `reasoning_content` renders as a `<think>` block.
CHAT_TEMPLATE = r"""{%- macro render_content(content) -%}
    {%- if content is none -%}
    {%- elif content is string -%}
        {{- content -}}
    {%- else -%}
        {%- for part in content -%}
            {%- if part is string -%}
                {{- part -}}
            {%- elif part.type == 'text' -%}
                {{- part.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages and messages[0].role == 'system' %}
        {{- render_content(messages[0].content) + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n" }}
    {{- "You are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments " }}
    {{- "within <tool_call></tool_call> XML tags:\n<tool_call>\n" }}
    {{- "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages and messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + render_content(messages[0].content) + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- set content = render_content(message.content) %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\n' }}
        {%- if message.reasoning_content is defined and message.reasoning_content %}
            {{- '<think>\n' + message.reasoning_content.strip('\n') + '\n</think>\n\n' }}
        {%- endif %}
        {{- content }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function is defined %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {%- if loop.first and content %}
                    {{- '\n' }}
                {%- elif not loop.first %}
                    {{- '\n' }}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""


def build_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: Path) -> None:
    """Train a byte-level BPE on `texts` (at most `vocab_size` ids in all) and write it to `out_dir`.

    Writes `tokenizer.json` and `tokenizer_config.json` (eos `<|im_end|>`, pad `<|endoftext|>`, ChatML
    template). Ids 0..6 are SPECIAL_TOKENS in order; the same texts always give the same files.
    """
    min_vocab = len(SPECIAL_TOKENS) + _BYTE_ALPHABET
    if vocab_size < min_vocab:
        raise ValueError(f"vocab_size {vocab_size} is below the {min_vocab} ids of specials + byte alphabet")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        # Every byte gets an id even if the corpus lacks it, so any text encodes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)

    raw = json.loads(tok.to_str())
    for added in raw["added_tokens"]:
        if added["content"] in _NON_SKIPPED:
            added["special"] = False
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(json.dumps(raw, ensure_ascii=False, indent=2) + "\n")
    (out_dir / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(raw), indent=2) + "\n")


def _tokenizer_config(raw: dict) -> dict:
    added = {
        str(t["id"]): {
            "content": t["content"],
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t["special"],
        }
        for t in raw["added_tokens"]
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
        "model_max_length": 131072,
        "chat_template": CHAT_TEMPLATE,
    }


def default_corpus(max_chars: int) -> list[str]:
    """Source files of the running interpreter's standard library, in sorted path order, up to max_chars.

    Third-party packages installed into the stdlib tree are skipped, so the corpus depends only on the
    Python version.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place so os.walk never descends into third-party trees.
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        rel = Path(dirpath).relative_to(root)
        found += [(rel / f).as_posix() for f in filenames if f.endswith(".py")]
    texts: list[str] = []
    left = max_chars
    for rel_path in sorted(found):
        if left <= 0:
            break
        try:
            text = (root / rel_path).read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        texts.append(text[:left])
        left -= len(texts[-1])
    return texts
