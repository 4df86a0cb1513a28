"""Prefill/decode disaggregation with the shared tier as the KV transport, in vLLM's
`kv_transfer_params` protocol as vllm-router's `--vllm-pd-disaggregation` drives it.

The router sends the prefill instance the request with `{"do_remote_decode": true}`; that
instance stores every chunk of the prompt (the partial last one too) and answers, through
`request_finished`, `{"do_remote_prefill": true, "do_remote_decode": false, "tierkv": {"tokens":
n, "chunks": k, "salt": <the salt's fingerprint, hex>}}`. The router hands that object to the
decode instance with the original request; the decode instance looks the prompt up under its
own keys, waits (at most `load_timeout_s`) for the claimed chunks, and loads them.

The parameters name an extent, never bytes or a namespace: the decode instance's keys come from
its own prompt, salt and credentials, so a claim can make it wait or look, never load KV that
its own lookup and verification would not. A claim that does not fit its prompt or salt is
refused (counted) and the request goes through the ordinary lookup.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from tierkv.connector.plan import Chunk

KEY = "tierkv"
RETRY_S = 0.02  # between lookups of a decode request still waiting for its chunks


def hands_off(params: Any) -> bool:
    """A prefill request whose decode runs elsewhere."""
    return isinstance(params, dict) and params.get("do_remote_decode") is True


def takes_over(params: Any) -> bool:
    """A decode request whose prompt another instance computed."""
    return isinstance(params, dict) and params.get("do_remote_prefill") is True


@dataclass(slots=True, frozen=True)
class Claim:
    """What a prefill instance says it stored: the prompt's first `chunks` chunks, `tokens`
    tokens, under keys salted as `salt` (a fingerprint, hex)."""

    tokens: int
    chunks: int
    salt: str

    def params(self) -> dict[str, Any]:
        body = {"tokens": self.tokens, "chunks": self.chunks, "salt": self.salt}
        return {"do_remote_prefill": True, "do_remote_decode": False, KEY: body}


def read_claim(params: Any, chunks: list[Chunk], salt: str) -> Claim | str:
    """The claim in a decode request's parameters, checked against its own prompt's chunks and
    salt; or why it is refused."""
    body = params.get(KEY) if isinstance(params, dict) else None
    if not isinstance(body, dict):
        return f"kv_transfer_params.{KEY} is missing or not an object"
    t, c, s = body.get("tokens"), body.get("chunks"), body.get("salt")
    if type(t) is not int or type(c) is not int or not isinstance(s, str):
        return f"kv_transfer_params.{KEY} needs integer 'tokens' and 'chunks' and a 'salt' string"
    if s != salt:
        return f"kv_transfer_params.{KEY}.salt is not this deployment's (another model or format)"
    if not 0 < c <= len(chunks) or chunks[c - 1].end != t:
        n = chunks[-1].end if chunks else 0
        return (
            f"kv_transfer_params.{KEY} claims {t} tokens in {c} chunks; this prompt has {n} "
            f"tokens in {len(chunks)} chunks"
        )
    return Claim(t, c, s)


@dataclass(slots=True)
class Waiting:
    """A decode request waiting for the chunks its prefill instance claims."""

    chunks: int
    until: float  # monotonic deadline: then whatever is present loads, the rest is recomputed
    next: float = 0.0  # no lookup before this

    def due(self) -> bool:
        return time.monotonic() >= self.next

    def settled(self, where: list[Any]) -> bool | None:
        """where: each chunk's tier at the lookup, None where absent. True: every claimed chunk
        is present; False: the deadline passed first; None: ask again later."""
        now = time.monotonic()
        present = next((i for i, w in enumerate(where) if w is None), len(where))
        if present >= self.chunks:
            return True
        if now >= self.until:
            return False
        self.next = now + RETRY_S
        return None


@dataclass(slots=True)
class Roles:
    """What vLLM's kv_role allows (KVTransferConfig.is_kv_producer / is_kv_consumer):
    `kv_producer` saves and never loads, `kv_consumer` loads and never saves, `kv_both` does
    both; and the P/D counters of the scheduler side."""

    produce: bool = True
    consume: bool = True
    salt: str = ""  # the salt's fingerprint, hex, as claims carry it
    wait_s: float = 10.0
    handoffs: int = 0  # prefill requests answered with a claim
    refused: int = 0  # claims refused (malformed, another salt, more than the prompt)
    timeouts: int = 0  # claims whose chunks were not all present by the deadline

    @classmethod
    def of(cls, ktc: Any, salt: str, wait_s: float) -> Roles:
        return cls(bool(ktc.is_kv_producer), bool(ktc.is_kv_consumer), salt, wait_s)

    def counters(self) -> dict[str, int]:
        return {
            "pd_handoffs": self.handoffs,
            "pd_refused": self.refused,
            "pd_timeouts": self.timeouts,
        }
