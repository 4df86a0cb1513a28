"""Namespaces and keys: what every tier checks before it touches anything."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tierkv.storage_backends.segment import KVSegment

DEFAULT_NAMESPACE = "default"
KEY_NBYTES = 16  # a key is an xxh3_128 digest
_NS = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")


def check_namespace(ns: str) -> str:
    """A namespace is 1-64 of [A-Za-z0-9_.-], not starting with '.' or '-' (it names files
    and keys)."""
    if not isinstance(ns, str) or not _NS.fullmatch(ns):
        raise ValueError(
            f"bad namespace {ns!r}: use 1-64 characters of [A-Za-z0-9_.-], "
            "starting with a letter, digit or '_'"
        )
    return ns


def check_key(key: bytes) -> bytes:
    if not isinstance(key, bytes) or len(key) != KEY_NBYTES:
        n = len(key) if hasattr(key, "__len__") else "?"
        raise ValueError(f"a key is {KEY_NBYTES} bytes, got {type(key).__name__} of length {n}")
    return key


def check_put(key: bytes, segment: KVSegment, ns: str) -> None:
    """The arguments of a put: a namespace, a 16-byte key, and a segment made for that key."""
    check_namespace(ns)
    if getattr(segment, "key", None) != check_key(key):
        raise ValueError("segment.key does not match key")
