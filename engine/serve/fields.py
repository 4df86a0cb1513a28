"""Request-body fields checked one by one: a bad field is an APIError, answered as the OpenAI
API does (a 400 naming it)."""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "") -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind or {401: "authentication_error", 404: "not_found_error"}.get(
            status, "invalid_request_error"
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}
        }


def typed(body: dict[str, Any], name: str, kinds: type | tuple[type, ...], default: Any) -> Any:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise APIError(400, f"'{name}' must be {names(kinds)}, got a boolean", name)
    if not isinstance(v, kinds):
        raise APIError(400, f"'{name}' must be {names(kinds)}, got {type(v).__name__}", name)
    return v


def names(kinds: type | tuple[type, ...]) -> str:
    ks = kinds if isinstance(kinds, tuple) else (kinds,)
    return " or ".join(
        {
            "int": "an integer",
            "float": "a number",
            "str": "a string",
            "bool": "a boolean",
            "list": "an array",
        }.get(k.__name__, k.__name__)
        for k in ks
    )


def check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise APIError(400, message, param)
