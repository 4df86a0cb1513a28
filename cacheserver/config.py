"""Server configuration: flags over TIERKV_* environment variables over a YAML file.

Every knob is a field of ServerConfig with its meaning beside it; the tier knobs (cpu_bytes,
disk_bytes, redis_*) are those of its embedded storage_backends.build.TiersConfig, under their
flat names here too. Sizes accept human units (`512MiB`, `8GiB`, `1.5GB`, plain bytes;
storage_backends' parse_size); tokens map bearer tokens to namespaces.
"""

from __future__ import annotations

import argparse
import logging
import os
import stat
from collections.abc import Mapping
from dataclasses import Field, dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from tierkv.storage_backends.build import (
    ConfigError,
    TiersConfig,
    flat_fields,
    nest,
    parse_quota_knob,
)
from tierkv.storage_backends.knobs import default_of, field_docs, format_default
from tierkv.storage_backends.names import check_namespace
from tierkv.storage_backends.sizes import MiB, parse_size

__all__ = ["ConfigError", "ServerConfig", "add_arguments", "knobs", "load", "parse_tokens"]

log = logging.getLogger("tierkv.server")

# Tier knobs a server does not take: it has no gpu tier, and its disk tier is in cache_dir.
NOT_SERVER_KNOBS = ("gpu_bytes", "disk_dir")


def _size(value: str | int, knob: str) -> int:
    try:
        return parse_size(value)
    except ValueError as e:
        raise ConfigError(f"{knob}: {e}") from None


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


@dataclass(slots=True)
class ServerConfig:
    host: str = "127.0.0.1"  # bind address; 0.0.0.0 only when asked
    port: int = 50051  # gRPC port (0: pick a free one, printed at start)
    cache_dir: str = "~/.cache/tierkv"  # the server's directory; the disk tier is its disk/
    # The tiers (each knob is documented in TiersConfig): a size of 0 leaves that tier out;
    # the disk tier lives in cache_dir/disk unless tiers.disk_dir says otherwise.
    tiers: TiersConfig = field(default_factory=TiersConfig)
    # Bearer tokens: TOKEN=NAMESPACE[,TOKEN=NAMESPACE...] (each token 8+ characters); none:
    # no auth, one namespace. On a command line every local user reads them in `ps`: prefer
    # tokens_file.
    tokens: dict[str, str] = field(default_factory=dict)
    # A file of TOKEN=NAMESPACE lines (# comments) read at start and merged under tokens;
    # refused when its group or others have any permission on it (chmod 600).
    tokens_file: str = ""
    tls_cert: str = ""  # PEM certificate; with tls_key turns TLS on
    tls_key: str = ""  # PEM private key
    metrics_port: int = 0  # Prometheus HTTP port (0: off)
    max_segment_bytes: int = 256 * MiB  # largest encoded segment a Put may carry
    max_frame_bytes: int = MiB  # largest payload frame
    max_frames: int = 4096  # most payload frames in one Put
    max_streams: int = 64  # concurrent Put/Get/GetMany streams, server-wide
    max_keys: int = 4096  # most keys in one Lookup/GetMany/Delete/Hint
    max_pin_s: float = 600.0  # longest soft pin a Hint may ask for (its pin_ttl_s), seconds
    # Bytes held by Puts still being received, server-wide: receive buffers grow as bytes
    # arrive (never from a declared size); past this a Put fails with RESOURCE_EXHAUSTED.
    max_inflight_bytes: int = 1 << 30
    grace_s: float = 10.0  # SIGTERM: time in-flight RPCs get to finish
    # The same-host data plane (loads over shared memory, docs/server.md): its Unix socket,
    # "auto" for <cache_dir>/data-<port>.sock, "" to turn it off.
    data_socket: str = "auto"
    # The data plane's TCP port, for clients on other hosts (payload inline on a socket,
    # authenticated by the bearer token; TLS with the gRPC port's certificate when TLS is on):
    # 0 picks a free one (announced over gRPC), -1 turns it off.
    data_port: int = 0
    shm_region_bytes: int = 256 * MiB  # each data plane session's shared-memory region
    max_sessions: int = 64  # data plane sessions at once, server-wide
    max_watchers: int = 64  # open Watch streams (eviction events), server-wide
    watch_queue: int = 4096  # events queued per Watch stream; beyond it they drop, counted

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        if not 0 <= self.port < 65536 or not 0 <= self.metrics_port < 65536:
            raise ConfigError("port and metrics_port must be in 0..65535")
        if not -1 <= self.data_port < 65536:
            raise ConfigError("data_port must be in -1..65535 (-1: off, 0: any free port)")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("tls_cert and tls_key go together")
        if not 0 < self.max_frame_bytes <= 4 * MiB:
            raise ConfigError("max_frame_bytes must be in 1..4MiB")
        for name in (
            "max_frames",
            "max_streams",
            "max_keys",
            "max_segment_bytes",
            "max_inflight_bytes",
            "shm_region_bytes",
            "max_sessions",
            "max_watchers",
            "watch_queue",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0")
        if self.grace_s < 0:
            raise ConfigError("grace_s must be >= 0")
        if not 0 < self.max_pin_s <= 86400:
            raise ConfigError("max_pin_s must be in (0, 86400]")

    @property
    def cache_path(self) -> Path:
        return Path(self.cache_dir).expanduser()

    def data_socket_path(self, port: int) -> Path | None:
        """The data plane's Unix socket for a server bound to port; None when it is off."""
        if not self.data_socket:
            return None
        if self.data_socket == "auto":
            return self.cache_path / f"data-{port}.sock"
        return Path(self.data_socket).expanduser()

    def tier_config(self) -> TiersConfig:
        """The tiers to build (storage_backends.build.build_tiers), the disk tier in place."""
        return replace(self.tiers, disk_dir=self.tiers.disk_dir or self.cache_path / "disk")

    @property
    def auth(self) -> bool:
        return bool(self.tokens)


_SIZES = {  # the tier sizes are TiersConfig's to convert
    "max_segment_bytes",
    "max_frame_bytes",
    "max_inflight_bytes",
    "shm_region_bytes",
}


def knobs() -> list[Field]:
    """The server's knobs, flat: the names of YAML keys, TIERKV_* variables and flags."""
    return flat_fields(ServerConfig, NOT_SERVER_KNOBS)


def _coerce(knob: Field, raw: Any) -> Any:
    name, kind = knob.name, knob.type
    try:
        if name in _SIZES:
            return _size(raw, name)
        if name == "tokens":
            return parse_tokens(raw)
        if name == "quotas":
            return parse_quota_knob(raw)
        if kind == "bool":
            if isinstance(raw, bool):
                return raw
            if str(raw).lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                raise ConfigError(f"{name}: expected true/false, got {raw!r}")
            return str(raw).lower() in ("1", "true", "yes", "on")
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
        return str(raw)
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{name}: bad value {raw!r}") from e


def knobs_markdown() -> str:
    """docs/server.md's table of knobs, made from the same documentation as --help."""
    docs = {**field_docs(TiersConfig), **field_docs(ServerConfig)}
    rows = ["| knob (flag, `TIERKV_` variable) | default | meaning |", "|---|---|---|"]
    for f in knobs():
        text = docs[f.name].replace("|", "\\|")
        rows.append(f"| `{f.name}` | {format_default(f.name, default_of(f))} | {text} |")
    return "\n".join(rows)


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


def add_arguments(p: argparse.ArgumentParser) -> None:
    """One --flag per knob, its help from the knob's documentation (default None, so unset
    flags fall back to env and YAML; the help shows the knob's own default)."""
    p.add_argument(
        "--config", help="YAML file with any of the knobs below (default: $TIERKV_CONFIG, none)"
    )
    docs = {**field_docs(TiersConfig), **field_docs(ServerConfig)}
    for f in knobs():
        flag = "--" + f.name.replace("_", "-")
        shown = format_default(f.name, default_of(f))
        text = f"{docs[f.name]} (default: {shown}; env TIERKV_{f.name.upper()})"
        text = text.replace("%", "%%")
        if f.type == "bool":
            p.add_argument(flag, action="store_const", const=True, default=None, help=text)
        else:
            p.add_argument(flag, help=text)


def load(
    args: argparse.Namespace | None = None, env: Mapping[str, str] | None = None
) -> ServerConfig:
    """YAML (--config or TIERKV_CONFIG), then TIERKV_* env, then flags; later wins."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    path = getattr(args, "config", None) or env.get("TIERKV_CONFIG")
    if path:
        doc = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(doc, dict):
            raise ConfigError(f"{path}: expected a mapping of knobs")
        values.update(doc)
    known = {f.name: f for f in knobs()}
    for name in known:
        if f"TIERKV_{name.upper()}" in env:
            values[name] = env[f"TIERKV_{name.upper()}"]
        if args is not None and getattr(args, name, None) is not None:
            values[name] = getattr(args, name)
    unknown = set(values) - set(known)
    if unknown:
        raise ConfigError(f"unknown config keys: {sorted(unknown)}")
    if args is not None and getattr(args, "tokens", None) is not None:
        log.warning("--tokens: every local user reads a command line; use --tokens-file")
    if values.get("tokens_file"):
        from_file = read_tokens_file(str(values["tokens_file"]))
        values["tokens"] = {**from_file, **parse_tokens(values.get("tokens") or {})}
    return ServerConfig(**nest({k: _coerce(known[k], v) for k, v in values.items()}))
