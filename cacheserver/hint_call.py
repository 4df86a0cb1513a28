"""The Hint call's request, checked: the keys, the workflow hint and the pin, or a refusal.

Safety contract: everything is checked before anything changes; a refusal is
INVALID_ARGUMENT whose message starts with the offending field (`hint_json.next_use.coder`,
`keys[3]`, `pin_ttl_s`); the namespace is the caller's token's, so a hint reaches only the
caller's own entries.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from tierkv.cacheserver.frames import check_known, invalid
from tierkv.proto import tierkv_pb2 as pb
from tierkv.storage_backends.hints import HintError, KVHint, parse_hint
from tierkv.storage_backends.names import KEY_NBYTES

MAX_HINT_JSON = 64 * 1024  # bytes of hint_json; a graph of MAX_STEPS short steps fits


@dataclass(slots=True, frozen=True)
class HintCall:
    keys: list[bytes]
    hint: KVHint | None
    pin_ttl_s: float
    prefetch: bool


def check_hint(request: pb.HintRequest, max_keys: int, max_pin_s: float) -> HintCall:
    """The request's parts, or BadRequest (INVALID_ARGUMENT) naming the field."""
    check_known(request)
    if len(request.keys) > max_keys:
        raise invalid(f"keys: {len(request.keys)} keys; at most {max_keys}")
    for i, k in enumerate(request.keys):
        if len(k) != KEY_NBYTES:
            raise invalid(f"keys[{i}]: a key is {KEY_NBYTES} bytes, got {len(k)}")
    ttl = request.pin_ttl_s
    if not math.isfinite(ttl) or not 0 <= ttl <= max_pin_s:
        raise invalid(f"pin_ttl_s: must be in 0..{max_pin_s:g} seconds, got {ttl}")
    hint = None
    if request.hint_json:
        if len(request.hint_json) > MAX_HINT_JSON:
            raise invalid(f"hint_json: longer than {MAX_HINT_JSON} bytes")
        try:
            hint = parse_hint(json.loads(request.hint_json), "hint_json")
        except HintError as e:
            raise invalid(str(e)) from None
        except (ValueError, RecursionError):
            raise invalid("hint_json: not valid JSON") from None
    return HintCall(list(request.keys), hint, ttl, request.prefetch)
