"""The P/D parameters without an engine: what a prefill instance claims, and how a decode
instance reads a claim against its own prompt and salt (tierkv.vllm.pd)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tierkv.connector.requests import prefix_chunks
from tierkv.storage_backends.keys import ChunkHasher, Salt
from tierkv.vllm.pd import Claim, Waiting, hands_off, read_claim, takes_over

SALT = Salt(model_fingerprint="m", kv_format="f", chunk_size=64, namespace="ns")
CHUNKS = prefix_chunks(ChunkHasher(SALT), np.arange(300, dtype=np.int32), True)
FP = SALT.fingerprint().hex()


def test_claim_round_trip() -> None:
    params = Claim(300, 5, FP).params()
    assert params == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "tierkv": {"tokens": 300, "chunks": 5, "salt": FP},
    }
    assert takes_over(params) and not hands_off(params)
    assert read_claim(params, CHUNKS, FP) == Claim(300, 5, FP)
    assert read_claim(Claim(256, 4, FP).params(), CHUNKS, FP) == Claim(256, 4, FP)


@pytest.mark.parametrize(
    "body,why",
    [
        (None, "missing or not an object"),
        ([1, 2], "missing or not an object"),
        ({"tokens": "300", "chunks": 5, "salt": FP}, "integer 'tokens'"),
        ({"tokens": 300, "chunks": True, "salt": FP}, "integer 'tokens'"),
        ({"tokens": 300, "chunks": 5, "salt": "00" * 16}, "not this deployment's"),
        ({"tokens": 300, "chunks": 6, "salt": FP}, "this prompt has 300 tokens in 5 chunks"),
        ({"tokens": 290, "chunks": 5, "salt": FP}, "claims 290 tokens in 5 chunks"),
        ({"tokens": 0, "chunks": 0, "salt": FP}, "claims 0 tokens"),
    ],
)
def test_claims_refused(body: object, why: str) -> None:
    got = read_claim({"do_remote_prefill": True, "tierkv": body}, CHUNKS, FP)
    assert isinstance(got, str) and why in got


def test_flags_are_booleans() -> None:
    assert not hands_off({"do_remote_decode": "true"}) and not takes_over({"do_remote_prefill": 1})
    assert not hands_off(None) and not takes_over("do_remote_prefill")


def test_waiting() -> None:
    w = Waiting(3, time.monotonic() + 60)
    assert w.settled(["server", "server", None]) is None and not w.due()
    assert w.settled(["server"] * 3 + [None]) is True
    late = Waiting(3, time.monotonic() - 1)
    assert late.settled(["server", None, "server"]) is False
