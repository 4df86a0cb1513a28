"""Prefill/decode disaggregation over the connector's shared tier, in vLLM's `kv_transfer_params`
protocol as vllm-router's `--vllm-pd-disaggregation` drives it.

A prefill request (`do_remote_decode: true`) computes and stores every chunk of its prompt, the
partial last one included, waits (at most `pd_flush_timeout_s`) until its chunks are on the
shared tier, and answers with parameters naming what the decode side needs: the salt's
fingerprint, the model, the extent (tokens, chunks, how many are durable) and the chained key of
the last chunk. Never bytes. A decode request (`do_remote_prefill: true`) loads through the
connector's ordinary lookup: its keys come from its own salt, namespace and cache salt, never
from the parameters, so parameters of another model, namespace or engine can load nothing of
theirs; they are only checked, and a mismatch is counted as a refused handoff (a recompute).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from tierkv.engine.serve.fields import APIError

log = logging.getLogger("tierkv.engine.serve")
VERSION = 1
FIELD = "kv_transfer_params"


@dataclass(slots=True)
class Transfer:
    """What a request's kv_transfer_params ask for."""

    prefill: bool  # do_remote_decode: compute the prompt and hand its KV over
    decode: bool  # do_remote_prefill: the prompt's KV was handed over by a prefill instance
    handed: dict[str, Any] | None  # the prefill's tierkv section (None: another engine's)


def _bool(params: dict[str, Any], name: str) -> bool:
    v = params.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise APIError(400, f"'{FIELD}.{name}' must be a boolean", f"{FIELD}.{name}")
    return v


def _bad(name: str, what: str) -> APIError:
    return APIError(400, f"'{FIELD}.tierkv.{name}' must be {what}", f"{FIELD}.tierkv.{name}")


def _hex(section: dict[str, Any], name: str) -> None:
    v = section.get(name)
    if not isinstance(v, str) or len(v) != 32 or any(c not in "0123456789abcdef" for c in v):
        raise _bad(name, "32 lowercase hex digits")


def _count(section: dict[str, Any], name: str) -> None:
    v = section.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise _bad(name, "an integer >= 0")


def parse_transfer(body: dict[str, Any]) -> Transfer | None:
    """The request's kv_transfer_params, checked field by field (400 naming the field)."""
    params = body.get(FIELD)
    if params is None:
        return None
    if not isinstance(params, dict):
        raise APIError(400, f"'{FIELD}' must be an object", FIELD)
    prefill, decode = _bool(params, "do_remote_decode"), _bool(params, "do_remote_prefill")
    if prefill and decode:
        raise APIError(
            400, f"'{FIELD}' cannot ask for both do_remote_decode and do_remote_prefill", FIELD
        )
    section = params.get("tierkv")
    if section is None:
        return Transfer(prefill, decode, None)
    if not isinstance(section, dict):
        raise APIError(400, f"'{FIELD}.tierkv' must be an object", f"{FIELD}.tierkv")
    if section.get("version") != VERSION:
        raise _bad("version", str(VERSION))
    _hex(section, "fingerprint")
    _hex(section, "key")
    for name in ("tokens", "chunks", "durable"):
        _count(section, name)
    if not isinstance(section.get("model"), str):
        raise _bad("model", "a string")
    return Transfer(prefill, decode, section)


class Handoff:
    """The P/D side of one serve process: its connector's keys, fingerprint and shared tier."""

    def __init__(self, connector: Any, model: str, flush_timeout_s: float) -> None:
        self.conn, self.model, self.flush_timeout_s = connector, model, flush_timeout_s
        shared = connector is not None and connector.config.remote is not None
        self.shared = connector.store.tiers[-1] if shared else None

    def check(self, t: Transfer, prompts: list[Any]) -> None:
        """Refuse (400) what this process cannot do: a handoff needs a shared tier and one plain
        prompt (not documents in parts)."""
        if not (t.prefill or t.decode):
            return
        if self.shared is None:
            raise APIError(
                400,
                f"'{FIELD}' needs a shared tier: start serve with --cache-server or --remote",
                FIELD,
            )
        if len(prompts) != 1:
            raise APIError(400, f"'{FIELD}' applies to one prompt, got {len(prompts)}", FIELD)
        if not all(isinstance(x, int) for x in prompts[0]):
            raise APIError(400, f"'{FIELD}' cannot be combined with 'documents'", FIELD)

    def keys(self, tokens: list[int], cache_salt: str | None) -> list[bytes]:
        """The chained chunk keys of a prompt, as the connector saves them."""
        hasher = self.conn.hasher.salted(cache_salt)
        return list(hasher.prefix_keys(tokens, partial=self.conn.config.save_partial_chunks))

    def fingerprint(self) -> str:
        return bytes(self.conn.hasher.salt.fingerprint()).hex()

    def hand_over(self, request_id: str, tokens: list[int], cache_salt: str | None) -> dict:
        """After a prefill: wait until its saves are on the shared tier (at most
        flush_timeout_s), then the parameters for the decode side. Runs off the event loop."""
        assert self.shared is not None  # check() refused a prefill without one
        keys = self.keys(tokens, cache_salt)
        deadline = time.monotonic() + self.flush_timeout_s
        w = self.conn.worker
        with w.lock:  # this request's puts into the store (its first tier at once)
            w.saved.wait_for(lambda: not w.outstanding[request_id], self.flush_timeout_s)
        durable = 0
        try:  # the write-behind queue to the shared tier, then ask the shared tier itself
            loop, ns = self.conn.loop, self.conn.ns
            loop.run(self.conn.store.drain(), max(0.01, deadline - time.monotonic()))
            held = loop.run(self.shared.contains(keys, ns), max(0.01, deadline - time.monotonic()))
            durable = next((i for i, h in enumerate(held) if not h), len(held))
        except Exception as e:  # a slow or failing shared tier: the decode side recomputes
            log.warning("prefill %s: its KV is not durable on the shared tier (%r)", request_id, e)
        section = {
            "version": VERSION,
            "fingerprint": self.fingerprint(),
            "model": self.model,
            "tokens": len(tokens),
            "chunks": len(keys),
            "durable": durable,
            "key": keys[-1].hex(),
        }
        # vLLM's own fields, so a router or a vLLM decode instance reads the usual shape
        return {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
            "tierkv": section,
        }

    def accepts(self, t: Transfer, tokens: list[int], cache_salt: str | None) -> str | None:
        """None if the handed-over KV is this process's own (same model, salt, namespace, cache
        salt and prompt), else why not. Either way the decode loads only its own keys."""
        s = t.handed
        if s is None:
            return "the parameters are not tierkv's (another engine: its KV is salted as its own)"
        if s["fingerprint"] != self.fingerprint() or s["model"] != self.model:
            return "the parameters name another model's KV"
        keys = self.keys(tokens, cache_salt)
        if s["tokens"] != len(tokens) or s["chunks"] != len(keys) or s["key"] != keys[-1].hex():
            return "the parameters name another prompt, namespace or cache salt"
        return None
