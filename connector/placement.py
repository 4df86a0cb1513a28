"""Where a tier's KV events say its entries are, in vLLM's event fields, as vllm-router's
`kv_aware` policy reads them: it admits media GPU, DEVICE, CPU, HOST, HOST_PINNED, DISK,
STORAGE or none, takes an `ownership` only with locality REMOTE, and credits an owned block as
external, CPU/HOST as host and DISK/STORAGE as disk. So an engine's own tiers are their medium
with locality LOCAL and no ownership, and the shared tier is no medium, locality REMOTE and
the shared store's kind as ownership (`SERVER`: a tierkv-server; `REDIS`)."""

from __future__ import annotations

from typing import Any

SHARED = {"remote": "SERVER", "redis": "REDIS"}  # tier name -> ownership


def placement(tier: str) -> dict[str, Any]:
    """medium, locality and ownership of the events of tier (a TieredStore tier's name)."""
    shared = SHARED.get(tier)
    if shared:
        return {"medium": None, "locality": "REMOTE", "ownership": shared}
    return {"medium": tier.upper(), "locality": "LOCAL", "ownership": None}
