"""Bearer tokens from a file only its owner may read (--tokens-file, TIERKV_TOKENS_FILE), and
the warning for tokens on a command line."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.test_server_auth import segment
from tierkv.cacheserver import config as cfg
from tierkv.cacheserver.cli import build_parser
from tierkv.cacheserver.client import RemoteTier
from tierkv.cacheserver.launch import ServerProcess

LINES = "# team tokens\ntoken-team-a-0001=team-a\n\n  token-team-b-0002 = team-b  \n"


def tokens_file(tmp_path: Path, text: str = LINES, mode: int = 0o600) -> Path:
    p = tmp_path / "tokens"
    p.write_text(text)
    p.chmod(mode)
    return p


def test_tokens_from_a_private_file(tmp_path: Path) -> None:
    p = tokens_file(tmp_path)
    c = cfg.load(build_parser().parse_args(["--tokens-file", str(p)]), env={})
    assert c.tokens == {"token-team-a-0001": "team-a", "token-team-b-0002": "team-b"}
    c = cfg.load(build_parser().parse_args([]), env={"TIERKV_TOKENS_FILE": str(p)})
    assert c.auth and c.tokens["token-team-b-0002"] == "team-b"


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_a_file_others_can_touch_is_refused(tmp_path: Path, mode: int) -> None:
    p = tokens_file(tmp_path, mode=mode)
    with pytest.raises(cfg.ConfigError, match="chmod 600"):
        cfg.load(build_parser().parse_args(["--tokens-file", str(p)]), env={})


@pytest.mark.parametrize(
    ("text", "words"),
    [("token-team-a-0001\n", "TOKEN=NAMESPACE"), ("short=team-a\n", "8 characters")],
)
def test_a_malformed_file_is_refused(tmp_path: Path, text: str, words: str) -> None:
    p = tokens_file(tmp_path, text)
    with pytest.raises(cfg.ConfigError, match=words):
        cfg.load(build_parser().parse_args(["--tokens-file", str(p)]), env={})


def test_a_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(cfg.ConfigError, match="tokens_file"):
        cfg.load(build_parser().parse_args(["--tokens-file", str(tmp_path / "no")]), env={})


def test_tokens_on_the_command_line_warn(tmp_path: Path, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="tierkv.server"):
        c = cfg.load(build_parser().parse_args(["--tokens", "token-team-c-0003=team-c"]), env={})
    assert c.tokens == {"token-team-c-0003": "team-c"}
    assert "--tokens-file" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tierkv.server"):
        cfg.load(None, env={"TIERKV_TOKENS": "token-team-c-0003=team-c"})
    assert not caplog.text  # the environment is not on a command line


async def test_a_server_with_a_tokens_file_maps_tokens_to_namespaces(tmp_path: Path) -> None:
    p = tokens_file(tmp_path)
    s = ServerProcess(args=["--tokens-file", str(p)]).start()
    try:
        a = RemoteTier(target=s.target, token="token-team-a-0001", retries=0, timeout_s=10)
        b = RemoteTier(target=s.target, token="token-team-b-0002", retries=0, timeout_s=10)
        x = RemoteTier(target=s.target, token="wrong-token-0000", retries=0, timeout_s=10)
        seg = segment(7)
        assert await a.put(seg.key, seg)
        got = await a.get(seg.key)
        assert got is not None and list(got.tokens) == list(seg.tokens)
        assert await b.contains([seg.key]) == [False]  # another namespace
        assert await x.get(seg.key) is None and x.stats().errors >= 1
        for t in (a, b, x):
            await t.close()
    finally:
        s.stop(kill=True)
    bad = tokens_file(tmp_path, mode=0o644)
    with pytest.raises(RuntimeError, match="chmod 600"):
        ServerProcess(args=["--tokens-file", str(bad)]).start(timeout=20)
