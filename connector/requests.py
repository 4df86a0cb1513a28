"""What the connector keys a request by: its chunks (prefix, segment or ingest), and the
model fingerprint every key is salted with."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
import xxhash

from connector.plan import Chunk, RequestState
from kernels import FP8
from storage_backends.keys import ChunkHasher

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
               FP8: "float8_e4m3fn"}


def model_fingerprint(model: torch.nn.Module, cfg: Any, dtype: torch.dtype) -> str:
    """Architecture, shape and a digest of every weight: KV of two models shares keys only
    when all of these are equal."""
    h = xxhash.xxh3_128(repr(sorted((k, repr(v)) for k, v in vars(cfg).items())
                             if hasattr(cfg, "__dict__") else repr(cfg)).encode())
    for name, p in model.state_dict().items():
        h.update(name.encode())
        h.update(memoryview(p.detach().cpu().contiguous().view(torch.uint8).numpy().reshape(-1)))
    return f"llama:{DTYPE_NAMES.get(dtype, str(dtype))}:{h.hexdigest()}"


def request_state(request: Any, hasher: ChunkHasher, partial: bool) -> RequestState:
    """The chunks of a request's prompt: chained prefix chunks for a plain prompt, one
    position-free chunk per reusable segment for a blend prompt, the whole prompt for ingest."""
    tokens = np.asarray(request.token_ids[:request.num_prompt_tokens], dtype=np.int32)
    if getattr(request, "blend", None) is not None:
        spans = [(a, b) for a, b, reusable in request.segments if reusable]
        chunks = [Chunk(i, hasher.segment_key(tokens[a:b]), bytes(16), a, b) for i, (a, b) in enumerate(spans)]
    elif getattr(request, "ingest", False):
        chunks = [Chunk(0, hasher.segment_key(tokens), bytes(16), 0, len(tokens))]
    else:
        keys = hasher.prefix_keys(tokens, partial=partial)
        chunks = [Chunk(i, k, keys[i - 1] if i else bytes(16), a, b)
                  for i, (k, (a, b)) in enumerate(zip(keys, hasher.chunks(tokens, partial=partial)))]
    return RequestState(chunks, tokens)
