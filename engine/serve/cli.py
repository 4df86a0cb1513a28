"""`tierkv-engine serve`: the server's flags (the engine's come from engine.cli)."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from tierkv.engine.llm import LLM
from tierkv.engine.serve.config import ServeConfig
from tierkv.storage_backends.knobs import knob_help


def add_serve_options(p: argparse.ArgumentParser) -> None:
    d, sc = ServeConfig(), ServeConfig
    s = p.add_argument_group("server (ServeConfig)")
    s.add_argument("--host", default=d.host, help=knob_help(sc, "host"))
    s.add_argument("--port", type=int, default=d.port, help=knob_help(sc, "port"))
    s.add_argument("--api-key", default=None, help=knob_help(sc, "api_key"))
    s.add_argument(
        "--served-model-name", default=None, help=knob_help(sc, "model_name", "--model's name")
    )
    s.add_argument(
        "--max-pending", type=int, default=d.max_pending, help=knob_help(sc, "max_pending")
    )
    s.add_argument(
        "--default-max-tokens",
        type=int,
        default=d.default_chat_max_tokens,
        help=knob_help(sc, "default_chat_max_tokens"),
    )
    s.add_argument(
        "--pd-flush-timeout",
        type=float,
        default=d.pd_flush_timeout_s,
        help=knob_help(sc, "pd_flush_timeout_s"),
    )
    e = p.add_argument_group("KV cache events (vLLM's KVEventsConfig)")
    e.add_argument("--kv-events-endpoint", default=None, help=knob_help(sc, "kv_events_endpoint"))
    e.add_argument(
        "--kv-events-replay-endpoint",
        default=None,
        help=knob_help(sc, "kv_events_replay_endpoint"),
    )
    e.add_argument(
        "--kv-events-topic", default=d.kv_events_topic, help=knob_help(sc, "kv_events_topic")
    )
    e.add_argument(
        "--kv-events-buffer-steps",
        type=int,
        default=d.kv_events_buffer_steps,
        help=knob_help(sc, "kv_events_buffer_steps"),
    )


def config_of(args: argparse.Namespace) -> ServeConfig:
    name = args.served_model_name or args.model or args.random_config
    return ServeConfig(
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        model_name=name,
        max_pending=args.max_pending,
        default_chat_max_tokens=args.default_max_tokens,
        pd_flush_timeout_s=args.pd_flush_timeout,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint,
        kv_events_topic=args.kv_events_topic,
        kv_events_buffer_steps=args.kv_events_buffer_steps,
    )


def run(args: argparse.Namespace, llm: LLM, connector: Any) -> int:
    from tierkv.engine.serve.app import Server, serve

    asyncio.run(serve(Server(llm, config_of(args), connector)))
    return 0
