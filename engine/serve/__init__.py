"""tierkv's OpenAI-compatible HTTP server over the engine (`tierkv-engine serve`)."""

from tierkv.engine.serve.config import ServeConfig

__all__ = ["ServeConfig"]
