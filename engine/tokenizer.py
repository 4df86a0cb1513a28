"""A checkpoint's tokenizer and chat template: text <-> token ids, and chat messages -> prompt."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

Message = dict[str, str]  # {"role": "system" | "user" | "assistant", "content": ...}


@dataclass(slots=True)
class Tokenizer:
    """Owns a `tokenizers.Tokenizer` and the checkpoint's chat template (Jinja, as in
    Hugging Face's tokenizer_config.json or GGUF's tokenizer.chat_template)."""

    backend: Any
    chat_template: str | None = None
    bos_token: str = ""
    eos_token: str = ""
    special: dict[str, Any] = field(default_factory=dict)  # extra names the template may read

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; add_special_tokens adds what the tokenizer's post-processor adds (a
        BOS for Llama 2's). A rendered chat prompt carries its special tokens as text."""
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(ids, skip_special_tokens=skip_special_tokens))

    def token_id(self, token: str) -> int | None:
        got = self.backend.token_to_id(token)
        return None if got is None else int(got)

    def apply_chat_template(
        self, messages: list[Message], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text for messages, rendered by the checkpoint's own template in a
        sandbox (a template is data from a file: it may not touch Python objects)."""
        if self.chat_template is None:
            raise ValueError("this checkpoint has no chat template; pass a plain prompt")
        check_messages(messages)
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ValueError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **self.special,
        )


def check_messages(messages: list[Message]) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("content"), str):
            raise ValueError(f"bad message {m!r}: needs a string 'content'")
        if m.get("role") not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"bad message role {m.get('role')!r}")


def from_dir(path: Path) -> Tokenizer | None:
    """tokenizer.json, with the chat template and special tokens of tokenizer_config.json
    (or chat_template.jinja) when present; None without tokenizer.json."""
    if not (path / "tokenizer.json").exists():
        return None
    from tokenizers import Tokenizer as Backend

    conf: dict[str, Any] = {}
    if (path / "tokenizer_config.json").exists():
        conf = json.loads((path / "tokenizer_config.json").read_text())
    template = conf.get("chat_template")
    if (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text()
    return Tokenizer(
        Backend.from_file(str(path / "tokenizer.json")),
        template if isinstance(template, str) else None,
        token_text(conf.get("bos_token")),
        token_text(conf.get("eos_token")),
    )


def token_text(tok: Any) -> str:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(tok, dict):
        return str(tok.get("content", ""))
    return tok if isinstance(tok, str) else ""
