"""Workflow hints (KVFlow) through vLLM's own per-request envelope: `kv_hints`, a
`vllm.v1.kv_hints.KvHintsEnvelope` given to `LLMEngine.add_request` or `AsyncLLM.generate`.

tierkv reads the actions of type ACTION_TYPE at version ACTION_VERSION; the payload is
tierkv's hint object, as in a `tierkv-engine serve` request body (docs/workflows.md):

    KvHintAction(action_id="a1", action_type="tierkv.workflow", action_version="1",
                 payload={"workflow": "w", "agent": "coder", "next_use": {"reviewer": 2}})

The request's chunk keys (every head's part) are tagged with the hint's agent on the cache
server. Other action types are left to whatever else reads them. vLLM has accepted the request
before a connector sees it, so a malformed tierkv action cannot be refused: it is logged once
per request, counted, and ignored (a hint is advice; nothing else changes).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from tierkv.connector.workflow import Workflows
from tierkv.storage_backends.hints import HintError, KVHint, parse_hint

log = logging.getLogger("tierkv.vllm")

ACTION_TYPE = "tierkv.workflow"
ACTION_VERSION = "1"


def hint_of(request: Any) -> KVHint | HintError | None:
    """The workflow hint of a vLLM request's envelope: None when it carries no tierkv action,
    a HintError naming the field when its tierkv action is malformed (or there are two)."""
    env = getattr(request, "kv_hints", None)
    if env is None:
        return None
    found: KVHint | None = None
    for i, action in enumerate(getattr(env, "actions", None) or []):
        if getattr(action, "action_type", None) != ACTION_TYPE:
            continue
        where = f"kv_hints.actions[{i}]"
        if found is not None:
            return HintError(where, f"a second {ACTION_TYPE} action")
        version = getattr(action, "action_version", None)
        if version != ACTION_VERSION:
            return HintError(f"{where}.action_version", f"must be {ACTION_VERSION!r}")
        payload = getattr(action, "payload", None)
        if not isinstance(payload, Mapping):
            return HintError(f"{where}.payload", "must be an object")
        try:
            found = parse_hint(payload, f"{where}.payload")
        except HintError as e:
            return e
    return found


def advise(workflows: Workflows, request: Any, keys: list[bytes]) -> bool:
    """Tag keys (a request's chunk parts) with its envelope's hint, in the background; False
    (logged, nothing tagged) when the envelope's tierkv action is malformed."""
    hint = hint_of(request)
    if isinstance(hint, HintError):
        log.warning("tierkv: request %s: %s: hint ignored", request.request_id, hint)
        return False
    if hint is not None and keys:
        workflows.advise(keys, hint)
    return True
