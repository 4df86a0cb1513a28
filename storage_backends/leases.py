"""Leases: a reader holds a segment against eviction until it releases it or the lease's TTL
runs out, so a lost lease cannot leak."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol, Self


class Hold(Protocol):
    """What Tier.lease returns: it holds until released (by release() or the end of a `with`
    block) or until its TTL runs out."""

    def release(self) -> None: ...

    def __enter__(self) -> object: ...

    def __exit__(self, *exc: object) -> None: ...

    async def __aenter__(self) -> object: ...

    async def __aexit__(self, *exc: object) -> None: ...


class Releasing:
    """A Hold's `with` and `async with`, around its release()."""

    __slots__ = ()

    def release(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


@dataclass(slots=True)
class Lease(Releasing):
    """Holds (ns, key) against eviction until released or until `expires` (monotonic seconds)."""

    leases: Leases
    ident: tuple[str, bytes]
    expires: float
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.leases.drop(self)


@dataclass(slots=True)
class Leases:
    """The leases of one tier. A lease ends by itself after its TTL, so a lost one cannot leak."""

    active: dict[tuple[str, bytes], list[Lease]] = field(default_factory=dict)

    def take(self, ns: str, key: bytes, ttl: float) -> Lease:
        lease = Lease(self, (ns, key), time.monotonic() + ttl)
        self.active.setdefault(lease.ident, []).append(lease)
        return lease

    def drop(self, lease: Lease) -> None:
        held = self.active.get(lease.ident)
        if held and lease in held:
            held.remove(lease)
            if not held:
                del self.active[lease.ident]

    def held(self, ns: str, key: bytes) -> bool:
        held = self.active.get((ns, key))
        if not held:
            return False
        now = time.monotonic()
        held[:] = [x for x in held if x.expires > now]
        if not held:
            del self.active[(ns, key)]
        return bool(held)


@dataclass(slots=True)
class LeaseGroup(Releasing):
    """A lease on every tier of a store at once."""

    parts: list[Hold]

    def release(self) -> None:
        for p in self.parts:
            p.release()
