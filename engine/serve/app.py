"""The aiohttp application: OpenAI routes over one EngineLoop, bearer auth, JSON errors."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from tierkv.engine.llm import LLM
from tierkv.engine.serve.cache_events import CacheEvents, start_events
from tierkv.engine.serve.config import ServeConfig
from tierkv.engine.serve.engine_loop import EngineLoop, Job, Overloaded, Update
from tierkv.engine.serve.fields import APIError
from tierkv.engine.serve.metrics import ServeMetrics
from tierkv.engine.serve.output import Shaper
from tierkv.engine.serve.pd import FIELD, Handoff, Transfer, parse_transfer
from tierkv.engine.serve.protocol import ParsedRequest, parse
from tierkv.engine.serve.run import Run

log = logging.getLogger("tierkv.engine.serve")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(e: APIError) -> web.Response:
    return web.json_response(e.body(), status=e.status)


class Server:
    def __init__(self, llm: LLM, config: ServeConfig, connector: Any = None) -> None:
        self.llm, self.config = llm, config
        self.metrics = ServeMetrics(connector)
        self.engine = EngineLoop(llm, config.max_pending, self.metrics, config.idle_wait_s)
        self.handoff = Handoff(connector, config.model_name, config.pd_flush_timeout_s)
        self.connector = connector
        self.events: CacheEvents | None = None

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.config.max_body_bytes, middlewares=[self._middleware]
        )
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)

        async def start(_: web.Application) -> None:
            self.events = start_events(self.config, self.llm, self.connector)
            self.engine.start()

        async def stop(_: web.Application) -> None:
            await asyncio.to_thread(self.engine.stop)
            if self.events is not None:
                self.events.close()

        app.on_startup.append(start)
        app.on_cleanup.append(stop)
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        key = self.config.api_key
        if key is not None and request.path.startswith("/v1"):
            got = request.headers.get("Authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {key}".encode()):
                return error_response(
                    APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")
                )
        try:
            return await handler(request)
        except APIError as e:
            return error_response(e)
        except web.HTTPException as e:  # unknown route, wrong method, body too large
            if e.status < 400:
                raise
            return error_response(APIError(e.status, e.reason or "error"))

    async def models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.config.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "tierkv",
            "max_model_len": self.llm.max_model_len,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def health(self, request: web.Request) -> web.Response:
        ok = self.engine.thread.is_alive()
        return web.json_response(
            {"status": "ok" if ok else "engine stopped"}, status=200 if ok else 503
        )

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"}
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = json.loads(await request.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}") from None
        try:
            req = parse(body, chat, self.llm, self.config)
        except ValueError as e:  # SamplingParams' own checks
            raise APIError(400, str(e)) from None
        transfer = parse_transfer(body)
        if transfer is not None:
            self._decode_side(transfer, req)
        q: asyncio.Queue[list[Update]] = asyncio.Queue()
        loop, n = asyncio.get_running_loop(), req.params.n
        jobs = [
            Job(p, req.params, loop, q, base=i * n, kv_hint=req.kv_hint)
            for i, p in enumerate(req.prompts)
        ]
        submitted: list[Job] = []
        try:
            for job in jobs:
                self.engine.submit(job)
                submitted.append(job)
        except Overloaded as e:
            for job in submitted:
                self.engine.abort(job)
            self.metrics.rejected.inc()
            raise APIError(429, str(e), kind="rate_limit_exceeded") from None
        run = Run(self.engine, req, jobs, Shaper(chat, self.config.model_name), self.llm)
        try:
            if req.stream:
                return await run.stream(request)
            out = await run.collect()
            if transfer is not None:
                out[FIELD] = await self._prefill_side(transfer, req, jobs[0])
            return web.json_response(out)
        finally:
            if not run.finished():  # the client left (the handler is cancelled) or an error
                for job in jobs:
                    self.engine.abort(job)

    def _decode_side(self, t: Transfer, req: ParsedRequest) -> None:
        """Check a handoff before the request runs; a decode counts what it was handed."""
        self.handoff.check(t, req.prompts)
        if t.prefill and req.stream:
            raise APIError(400, f"a prefill ('{FIELD}.do_remote_decode') cannot stream", FIELD)
        if t.decode:
            why = self.handoff.accepts(t, req.prompts[0], req.params.cache_salt)  # type: ignore[arg-type]
            self.metrics.pd_decodes.inc()
            if why is not None:  # the decode loads its own keys only: a recompute, counted
                self.metrics.pd_refused.inc()
                log.info("decode handoff refused (%s): the prompt is recomputed", why)

    async def _prefill_side(self, t: Transfer, req: ParsedRequest, job: Job) -> dict | None:
        """After a prefill: its KV made durable, and the parameters the decode side needs."""
        if not t.prefill or job.request is None:
            return None
        tokens: list[int] = req.prompts[0]  # type: ignore[assignment]
        params = await asyncio.to_thread(
            self.handoff.hand_over, job.request.request_id, tokens, req.params.cache_salt
        )
        self.metrics.pd_prefills.inc()
        section = params["tierkv"]
        if section["durable"] < section["chunks"]:
            self.metrics.pd_not_durable.inc()
        return params


async def serve(server: Server) -> None:
    """Run until SIGINT or SIGTERM."""
    cfg = server.config
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its
    # request in the engine (the finally in _generate).
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, cfg.host, cfg.port)
    await site.start()
    addrs = [s.getsockname() for s in (site._server.sockets if site._server else [])]  # type: ignore[union-attr,attr-defined]
    port = addrs[0][1] if addrs else cfg.port
    print(f"tierkv serve: {cfg.model_name} on http://{cfg.host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
