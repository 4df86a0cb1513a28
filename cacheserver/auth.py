"""Bearer-token authentication: the caller's namespace comes from its token only.

Safety contract: a request body never names a namespace; without tokens configured
every caller shares one default namespace; with tokens, a call without a valid token is
aborted UNAUTHENTICATED before it touches the store. Tokens are compared in constant time.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from dataclasses import dataclass

import grpc

from tierkv.storage_backends.names import DEFAULT_NAMESPACE


@dataclass(slots=True)
class Auth:
    tokens: dict[str, str]  # token -> namespace; empty: auth off

    def namespace(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
        """The namespace of a call's metadata, or None when auth is on and no token matches."""
        if not self.tokens:
            return DEFAULT_NAMESPACE
        header = ""
        for k, v in metadata or ():
            if k == "authorization":
                header = v.decode() if isinstance(v, bytes) else v
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return None
        return self.of_token(token.strip())

    def of_token(self, token: str) -> str | None:
        """The namespace of a bare token (the data plane's HELLO), or None when auth is on and
        it matches none."""
        if not self.tokens:
            return DEFAULT_NAMESPACE
        found = None
        for known, ns in self.tokens.items():
            # Check every token so timing does not reveal which prefix matched.
            if hmac.compare_digest(known.encode(), token.encode()):
                found = ns
        return found

    async def require(self, context: grpc.aio.ServicerContext) -> str:
        ns = self.namespace(context.invocation_metadata())
        if ns is None:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid bearer token")
        return ns


def bearer(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying token (empty without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()
