"""A server's bearer tokens: TOKEN=NAMESPACE pairs from the tokens knob or from a file only its
owner may read, each namespace checked."""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

from tierkv.storage_backends.build import ConfigError
from tierkv.storage_backends.names import check_namespace


def parse_tokens(value: str | Mapping[str, str]) -> dict[str, str]:
    """'tok1=ns1,tok2=ns2' or a mapping -> {token: namespace}, each namespace checked."""
    if isinstance(value, Mapping):
        pairs = [(str(k), str(v)) for k, v in value.items()]
    else:
        pairs = []
        for item in filter(None, (s.strip() for s in str(value).split(","))):
            if "=" not in item:
                raise ConfigError(f"tokens: expected TOKEN=NAMESPACE, got {item!r}")
            tok, ns = item.split("=", 1)
            pairs.append((tok.strip(), ns.strip()))
    for tok, ns in pairs:
        if len(tok) < 8:
            raise ConfigError("tokens: a token must have at least 8 characters")
        try:
            check_namespace(ns)
        except ValueError as e:
            raise ConfigError(f"tokens: {e}") from None
    return dict(pairs)


def read_tokens_file(path: str) -> dict[str, str]:
    """TOKEN=NAMESPACE lines of a file only its owner may read; ConfigError otherwise."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"tokens_file {path}: not a regular file")
        if st.st_mode & 0o077:
            raise ConfigError(
                f"tokens_file {path}: its group or others have access (mode "
                f"{stat.S_IMODE(st.st_mode):o}); chmod 600 it"
            )
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ConfigError(f"tokens_file {path}: {e.strerror}") from None
    items = [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]
    return parse_tokens(",".join(items))
