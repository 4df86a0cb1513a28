"""Chunk keys: chaining, salt binding, and determinism across separate interpreter processes."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from tierkv.storage_backends.keys import ChunkHasher, Salt, head_key

SALT = Salt(
    "llama-test:abc123:bf16",
    "layer-major:bf16:none:v1",
    tp_size=2,
    tp_rank=1,
    chunk_size=4,
    namespace="t1",
)


def test_chain_definition():
    toks = np.arange(10, dtype=np.int32)
    h = ChunkHasher(SALT)
    keys = h.prefix_keys(toks)
    assert h.chunks(toks) == [(0, 4), (4, 8)]
    assert h.chunks(toks, partial=True) == [(0, 4), (4, 8), (8, 10)]
    k0 = xxhash.xxh3_128_digest(SALT.digest() + toks[:4].astype("<i4").tobytes())
    k1 = xxhash.xxh3_128_digest(k0 + toks[4:8].astype("<i4").tobytes())
    assert keys == [k0, k1]
    assert (
        h.prefix_keys(toks, partial=True)[:2] == keys
        and len(h.prefix_keys(toks, partial=True)) == 3
    )
    assert h.segment_key(toks) == xxhash.xxh3_128_digest(
        SALT.digest() + b"segment" + toks.tobytes()
    )


@given(st.lists(st.integers(0, 2**31 - 1), min_size=0, max_size=40))
def test_inputs_agree_and_prefixes_share_keys(tokens):
    h = ChunkHasher(SALT)
    keys = h.prefix_keys(tokens)
    assert keys == h.prefix_keys(np.array(tokens, dtype=np.int64))
    assert keys == h.prefix_keys(torch.tensor(tokens, dtype=torch.long))
    assert len(keys) == len(tokens) // 4 and all(len(k) == 16 for k in keys)
    # a longer prompt with the same start shares the leading keys; a changed token changes all
    # after it
    assert h.prefix_keys(tokens + [1, 2, 3, 4])[: len(keys)] == keys
    if len(tokens) >= 4:
        changed = [tokens[0] ^ 1] + tokens[1:]
        assert not set(h.prefix_keys(changed)) & set(keys)


@given(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=40), st.booleans())
def test_a_chunk_key_rebuilds_from_its_parent_and_tokens(tokens, salted):
    """What a server tells of a chunk (its parent key and tokens) gives back its key, under the
    same hasher only."""
    h = ChunkHasher(SALT).salted("tenant" if salted else None)
    keys = h.prefix_keys(tokens, partial=True)
    spans = h.chunks(tokens, partial=True)
    for i, (a, b) in enumerate(spans):
        assert h.chunk_key(keys[i - 1] if i else None, tokens[a:b]) == keys[i]
    other = ChunkHasher(SALT).salted(None if salted else "tenant")
    assert other.chunk_key(None, tokens[: spans[0][1]]) != keys[0]


def test_every_salt_field_changes_keys():
    toks = list(range(8))
    base = ChunkHasher(SALT).prefix_keys(toks)
    variants = [
        Salt("other", SALT.kv_format, 2, 1, 4, "t1"),
        Salt(SALT.model_fingerprint, "fp8", 2, 1, 4, "t1"),
        Salt(SALT.model_fingerprint, SALT.kv_format, 4, 1, 4, "t1"),
        Salt(SALT.model_fingerprint, SALT.kv_format, 2, 0, 4, "t1"),
        Salt(SALT.model_fingerprint, SALT.kv_format, 2, 1, 4, "t2"),
    ]
    for s in variants:
        assert ChunkHasher(s).prefix_keys(toks)[0] != base[0]
    assert (
        Salt(SALT.model_fingerprint, SALT.kv_format, 2, 1, 4, "t2").fingerprint()
        == SALT.fingerprint()
    )
    assert ChunkHasher(SALT).segment_key(toks) != base[0]


@pytest.mark.parametrize(
    "bad",
    [
        dict(tp_rank=2),
        dict(chunk_size=0),
        dict(namespace="../x"),
        dict(namespace=""),
        dict(model_fingerprint=""),
    ],
)
def test_bad_salt(bad):
    args = dict(
        model_fingerprint="m", kv_format="f", tp_size=2, tp_rank=0, chunk_size=4, namespace="ok"
    )
    args.update(bad)
    with pytest.raises(ValueError):
        Salt(**args)


@pytest.mark.parametrize("bad", [[[1, 2]], [1.5, 2.0], [-1, 3], [2**31]])
def test_bad_tokens(bad):
    with pytest.raises(ValueError):
        ChunkHasher(SALT).prefix_keys(bad)


def test_same_keys_in_separate_processes():
    code = (
        "import numpy as np; from tierkv.storage_backends.keys import ChunkHasher, Salt;"
        "h = ChunkHasher("
        "Salt('llama-test:abc123:bf16', 'layer-major:bf16:none:v1', 2, 1, 4, 't1'));"
        "t = np.arange(1000, dtype=np.int32) * 7919 % 32000;"
        "print(b''.join(h.prefix_keys(t, partial=True)).hex(), h.segment_key(t).hex())"
    )
    outs = [
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
        ).stdout
        for seed in ("1", "2")
    ]
    assert outs[0] == outs[1]
    h = ChunkHasher(SALT)
    t = np.arange(1000, dtype=np.int32) * 7919 % 32000
    assert outs[0].split() == [
        b"".join(h.prefix_keys(t, partial=True)).hex(),
        h.segment_key(t).hex(),
    ]


def test_head_keys_bind_the_chunk_and_the_head() -> None:
    k = ChunkHasher(Salt("m", "f", chunk_size=4)).prefix_keys(np.arange(8))[1]
    parts = [head_key(k, h) for h in range(8)]
    assert parts[3] == xxhash.xxh3_128_digest(b"kv-head" + k + (3).to_bytes(4, "little"))
    assert len(set(parts)) == 8 and k not in parts
    assert head_key(bytes(16), 0) != head_key(bytes(15) + b"\x01", 0)
    with pytest.raises(ValueError, match="u32 head"):
        head_key(k[:8], 0)
    with pytest.raises(ValueError, match="u32 head"):
        head_key(k, -1)
