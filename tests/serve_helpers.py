"""A tiny random checkpoint with a word-level tokenizer and chat template, and tierkv serve
run in this process (a thread); as a subprocess it is tierkv.cacheserver.launch.ServeProcess."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

from tests.test_hf_match import save_checkpoint
from tierkv.cacheserver.launch import free_port

# Roles as words: the word-level tokenizer encodes each rendered word to one token, and a
# reply decodes to words that re-encode to the same ids (turn N's prompt prefixes turn N+1's).
TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}w1 {% elif m['role'] == 'user' %}"
    "w2 {% else %}w4 {% endif %}{{ m['content'] }} w5 {% endfor %}"
    "{% if add_generation_prompt %}w4 {% endif %}"
)


def tiny_checkpoint(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    save_checkpoint(path, eos_token_id=3)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return path


def words(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


class ThreadServer:
    """tierkv serve on a free port, its event loop on a thread of this process."""

    def __init__(self, llm: Any, **config: Any) -> None:
        from tierkv.engine.serve.app import Server
        from tierkv.engine.serve.config import ServeConfig

        self.port = free_port()
        self.server = Server(llm, ServeConfig(port=self.port, model_name="tiny", **config))
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        from aiohttp import web

        async def main() -> None:
            runner = web.AppRunner(self.server.app(), handler_cancellation=True, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.port).start()
            self.runner = runner
            self.ready.set()

        self.loop.run_until_complete(main())
        self.loop.run_forever()
        self.loop.run_until_complete(self.runner.cleanup())

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        self.ready.wait(30)
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
