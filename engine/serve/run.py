"""One HTTP request's run: its choices fed by the engine's updates, answered whole (collect)
or as server-sent events (stream)."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from tierkv.engine.llm import LLM
from tierkv.engine.serve.engine_loop import EngineLoop, Job, Update
from tierkv.engine.serve.fields import APIError
from tierkv.engine.serve.output import Choice, Shaper, usage
from tierkv.engine.serve.protocol import ParsedRequest


class Run:
    """One HTTP request's choices as the engine's updates arrive."""

    def __init__(
        self, engine: EngineLoop, req: ParsedRequest, jobs: list[Job], shaper: Shaper, llm: LLM
    ) -> None:
        self.engine, self.req, self.jobs, self.shaper = engine, req, jobs, shaper
        n = req.params.n
        self.choices = [Choice(i, llm.tokenizer, req.stop) for i in range(len(jobs) * n)]
        self.finals: list[dict[str, Any] | None] = [None] * len(self.choices)

    def finished(self) -> bool:
        return all(f is not None for f in self.finals)

    def apply(self, up: Update) -> tuple[Choice, str, int, int, bool, int]:
        """Feed one update to its choice: (choice, new text, first token, end token, whether
        the choice ended with it, character offset of the new text)."""
        if up.error is not None:
            raise APIError(400, up.error)
        c = self.choices[up.index]
        was_done, start, offset = c.finish_reason is not None, len(c.token_ids), c.sent
        text, used = c.feed(up)
        if up.usage is not None:
            self.finals[up.index] = up.usage
        ended = not was_done and c.finish_reason is not None
        if ended and up.finish_reason is None:  # a stop string: the engine may stop the sample
            n = self.req.params.n
            self.engine.finish_sample(self.jobs[up.index // n], up.index % n)
        return c, text, start, start + used, ended, offset

    def usage(self) -> dict[str, Any]:
        return usage([f for f in self.finals if f is not None], self.req.params.n)

    async def collect(self) -> dict[str, Any]:
        while not self.finished():
            for up in await self.jobs[0].queue.get():
                self.apply(up)
        sh, lp = self.shaper, self.req.logprobs
        choices = [
            sh.choice(c, c.text, 0, len(c.token_ids), 0, lp, True, False) for c in self.choices
        ]
        return sh.body(choices, False, self.usage())

    async def stream(self, request: web.Request) -> web.StreamResponse:
        q = self.jobs[0].queue
        first = await q.get()  # a request the engine refuses is still answered with a 400
        for up in first:
            if up.error is not None:
                raise APIError(400, up.error)
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        sh, lp = self.shaper, self.req.logprobs

        async def send(obj: Any) -> None:
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        if sh.chat:  # the first chunk of each choice names the role
            for c in self.choices:
                d = {
                    "index": c.index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                await send(sh.body([d], True))
        batch: list[Update] | None = first
        try:
            while batch is not None:
                for up in batch:
                    c, text, a, b, ended, offset = self.apply(up)
                    if text or ended or (lp and b > a):
                        await send(
                            sh.body([sh.choice(c, text, a, b, offset, lp, ended, True)], True)
                        )
                batch = None if self.finished() else await q.get()
        except APIError as e:  # a later prompt of a batch was refused
            await send(e.body())
        if self.req.include_usage:
            await send(sh.body([], True, self.usage()))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
