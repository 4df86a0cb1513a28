"""`tierkv-engine serve`: the server's flags (the engine's come from engine.cli)."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from tierkv.engine.llm import LLM
from tierkv.engine.serve.config import ServeConfig


def add_serve_options(p: argparse.ArgumentParser) -> None:
    d = ServeConfig()
    s = p.add_argument_group("server (see ServeConfig)")
    s.add_argument("--host", default=d.host, help="address to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=d.port)
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1")
    s.add_argument("--served-model-name", default=None, help="model id (default: --model)")
    s.add_argument(
        "--max-pending", type=int, default=d.max_pending, help="requests held at once; more get 429"
    )
    s.add_argument(
        "--default-max-tokens",
        type=int,
        default=d.default_chat_max_tokens,
        help="chat max_tokens when a request omits it",
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
    )


def run(args: argparse.Namespace, llm: LLM, connector: Any) -> int:
    from tierkv.engine.serve.app import Server, serve

    asyncio.run(serve(Server(llm, config_of(args), connector)))
    return 0
