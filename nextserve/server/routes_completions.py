"""POST /v1/completions: a prompt as text or token ids, echo, logprobs with text offsets, n."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from ..engine.outputs import RequestOutput
from . import protocol as P
from .body import parse_body
from .checks import check_common, check_completion, check_length, sampling_params
from .constraints import output_constraint
from .errors import bad
from .generation import Generation, finite
from .state import ServerState
from .streaming import TextStream


async def completions(srv: ServerState, request: Request) -> Response:
    async with srv.prep.admit():
        raw = await request.body()
        req = await srv.prep.run(request, parse_body, raw, P.CompletionRequest, srv.limits, srv.max_context)
        check_common(srv, req)
        check_completion(req)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise bad("send one prompt per request (batched prompts are not supported)", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            try:
                ids = await srv.prep.run(request, srv.encode, prompt)
            except ValueError as exc:
                raise bad(str(exc), param="prompt") from None
            prompt_text = prompt
        else:
            ids = list(prompt)
            if any(t < 0 or t >= srv.vocab_size for t in ids):
                raise bad(f"prompt token ids must be in [0, {srv.vocab_size})", param="prompt")
            prompt_text = srv.decode(ids) if req.echo else ""
        check_length(srv, len(ids), req.max_tokens, "prompt")
        params = sampling_params(srv, req, req.max_tokens, req.logprobs)
        compiled = await output_constraint(srv, request, req, None, None)
        gen = Generation(srv, request, "completions", req, ids, params, compiled)
    echo = prompt_text if req.echo else ""
    if req.stream:
        return gen.stream_response([_CompletionChoice(gen, req, echo, i) for i in range(len(gen.rids))])

    def choice(out: RequestOutput, index: int) -> dict[str, Any]:
        lps = None
        if req.logprobs is not None:
            lps = _logprobs(srv, out, 0, gen.visible_count(out), len(echo))
        return {"index": index, "text": echo + out.text, "logprobs": lps, "finish_reason": out.finish_reason}

    return await gen.respond(request, choice)


def _logprobs(srv: ServerState, out: RequestOutput, start: int, end: int, offset: int) -> dict[str, Any]:
    res: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for lp in (out.logprobs or [])[start:end]:
        tok, _ = srv.token_info(lp.token_id)
        res["tokens"].append(tok)
        res["token_logprobs"].append(finite(lp.logprob))
        res["top_logprobs"].append({srv.token_info(t)[0]: finite(v) for t, v in lp.top} if lp.top else None)
        res["text_offset"].append(offset)
        offset += len(tok)
    return res


class _CompletionChoice:
    """The chunks of one streamed completion choice: the echo with its first token, text deltas with their
    logprobs, then the finish."""

    def __init__(self, gen: Generation, req: P.CompletionRequest, echo: str, index: int) -> None:
        self.gen, self.want_logprobs, self.echo, self.index = gen, req.logprobs is not None, echo, index
        self.texts = TextStream(gen.params.stop)
        self.lp_sent, self.offset = 0, len(echo)
        self.opened = False

    def _chunk(
        self, text: str, lps: dict | None = None, finish=None, out: RequestOutput | None = None
    ) -> str:
        choice = {"index": self.index, "text": text, "logprobs": lps, "finish_reason": finish}
        return self.gen.chunk(choice, out)

    def chunks(self, out: RequestOutput) -> Iterator[str]:
        lps = None
        if self.want_logprobs:
            visible = self.gen.visible_count(out)
            if visible > self.lp_sent:
                lps = _logprobs(self.gen.srv, out, self.lp_sent, visible, self.offset)
                self.offset += sum(len(t) for t in lps["tokens"])
                self.lp_sent = visible
        delta = self.texts.delta(out.text, out.finished)
        if not self.opened:
            self.opened = True
            delta = self.echo + delta
        if delta or lps is not None or self.gen.token_ids:
            yield self._chunk(delta, lps, out=out)

    def final(self, out: RequestOutput) -> str:
        return self._chunk("", finish=out.finish_reason, out=out)
