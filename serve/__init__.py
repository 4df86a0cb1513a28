"""tierkv's OpenAI-compatible HTTP server over the engine (`tierkv-engine serve`)."""

from tierkv.serve.config import ServeConfig

__all__ = ["ServeConfig"]
