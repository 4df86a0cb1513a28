"""What the connector keys a request by: its chunks (prefix, segment or ingest), the model
fingerprint every key is salted with, and the lookup of where the store holds them."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
import xxhash

from tierkv.connector.loop import LoopThread
from tierkv.connector.plan import Chunk, RequestState
from tierkv.engine.kv_connector import ConnectorRequest
from tierkv.storage_backends.keys import ChunkHasher
from tierkv.storage_backends.segment import dtype_name
from tierkv.storage_backends.store import TieredStore

log = logging.getLogger("tierkv.connector")

# The model config fields that shape a model's KV; the rest (EOS ids, the dtype a file
# names, the context length it declares) differ between file formats of the same weights.
KV_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "tie_word_embeddings",
    "attention_bias",
)


def model_fingerprint(model: torch.nn.Module, cfg: Any, dtype: torch.dtype) -> str:
    """Architecture, shape and a digest of every weight: KV of two models shares keys only
    when all of these are equal, whatever file the weights came from."""
    h = xxhash.xxh3_128(repr([(f, getattr(cfg, f, None)) for f in KV_FIELDS]).encode())
    for name, p in model.state_dict().items():
        h.update(name.encode())
        h.update(memoryview(p.detach().cpu().contiguous().view(torch.uint8).numpy().reshape(-1)))
    return f"llama:{dtype_name(dtype) or str(dtype)}:{h.hexdigest()}"


def request_state(request: ConnectorRequest, hasher: ChunkHasher, partial: bool) -> RequestState:
    """The chunks of a request's prompt: chained prefix chunks for a plain prompt; for a prompt
    in parts, those of its declared shared prefix P (if any, the last one partial) then one
    position-free chunk per reusable segment, keyed and parented under P's key (an ingest
    request has one, the segment to store). Without P, segments encoded after a preamble are
    keyed under the preamble's prefix key (the preamble itself is never stored)."""
    tokens = np.asarray(request.token_ids[: request.num_prompt_tokens], dtype=np.int32)
    parts = request.blend
    if parts is None:
        chunks = prefix_chunks(hasher, tokens, partial)
        return RequestState(chunks, tokens, prefix_chunks=len(chunks))
    p = parts.prefix_len
    pre = prefix_chunks(hasher, tokens[:p], True) if p else []
    after = pre[-1].key if pre else None
    if not p and parts.preamble:
        after = hasher.prefix_key(np.asarray(parts.preamble, dtype=np.int32))
    spans = [(a, b) for a, b, reusable in parts.segments if reusable]
    segs = [
        Chunk(len(pre) + i, hasher.segment_key(tokens[a:b], after), after or bytes(16), a, b)
        for i, (a, b) in enumerate(spans)
    ]
    return RequestState(pre + segs, tokens, prefix_chunks=len(pre))


def prefix_chunks(hasher: ChunkHasher, tokens: np.ndarray, partial: bool) -> list[Chunk]:
    keys = hasher.prefix_keys(tokens, partial=partial)
    return [
        Chunk(i, k, keys[i - 1] if i else bytes(16), a, b)
        for i, (k, (a, b)) in enumerate(zip(keys, hasher.chunks(tokens, partial=partial)))
    ]


def segment_keys(
    hasher: ChunkHasher, segments: list[list[int]], prefix: list[int] | None
) -> list[bytes]:
    """Each segment's key, computed standalone or, given prefix, right after that prefix."""
    after = hasher.prefix_key(np.asarray(prefix, dtype=np.int32)) if prefix else None
    return [hasher.segment_key(np.asarray(t, dtype=np.int32), after) for t in segments]


def located(
    loop: LoopThread, store: TieredStore, keys: list[bytes], ns: str, timeout: float
) -> list[int | None]:
    """The index of the fastest tier holding each key, else None, from one lookup on the
    connector's loop; a store that fails or takes over timeout seconds is a miss (logged)."""
    try:
        return loop.run(store.locate(keys, ns), timeout)
    except Exception as e:
        log.warning("tierkv lookup failed (%r): miss", e)
        return [None] * len(keys)


def record_lookup(st: RequestState, tiers: list[str | None], num_computed: int, blend: bool) -> int:
    """Note in st where the store holds each chunk (tiers: a name, or None for absent); returns
    the tokens the request can load after num_computed: the leading run of prefix chunks (all
    but its last token), and for a blend request every segment present, wherever it lies."""
    st.tiers, k = [t or "" for t in tiers], st.prefix_chunks
    st.present = n = next((i for i, t in enumerate(tiers[:k]) if t is None), k)
    end = min(st.chunks[n - 1].end, len(st.tokens) - 1) if n else 0
    new = max(0, end - num_computed)
    if blend:  # the declared prefix loads exactly, right after the local hit
        st.exact = (num_computed, num_computed + new)
        st.hits = [False] * k + [t is not None for t in tiers[k:]]
        new += sum(c.end - c.start for c, hit in zip(st.chunks, st.hits) if hit)
    return new
