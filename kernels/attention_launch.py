"""Launch policy of the Triton attention kernel (kernels/triton_attention.py): tile shapes,
warps and when to split the keys (flash-decoding). Plain Python: no Triton needed to read it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionLaunch:
    """Tile shapes and split-K policy of the Triton attention kernel (GPU tuning knobs)."""

    # Query rows per program when a token's GQA group fits (tl.dot needs >= 16).
    decode_block_m: int = 16
    prefill_block_m: int = 128  # query rows per program for prefill on a GPU (64 interpreted)
    tile_n: int = 64  # keys per inner step
    decode_warps: int = 4
    prefill_warps: int = 8
    programs_per_sm: int = 4  # split-K adds splits until the grid has this many programs per SM
    min_tiles_per_split: int = 4  # ... while every split keeps at least this many key tiles
    max_splits: int = 128  # a power of 2


LAUNCH = AttentionLaunch()


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_seqlen_q: int,
    max_seqlen_k: int,
    sm_count: int,
    cfg: AttentionLaunch = LAUNCH,
) -> int:
    """Split-K only pays when the grid cannot fill the device: decode-sized queries, fewer
    (sequence, KV head) programs than programs_per_sm per SM, and enough key tiles per split."""
    if max_seqlen_q > 1:
        return 1
    programs = num_seqs * num_kv_heads
    splits = 1
    while (
        splits < cfg.max_splits
        and programs * splits < cfg.programs_per_sm * sm_count
        and max_seqlen_k >= splits * 2 * cfg.min_tiles_per_split * cfg.tile_n
    ):
        splits *= 2
    return splits


def launch_config(
    max_seqlen_q: int, g_pad: int, cuda: bool, cfg: AttentionLaunch = LAUNCH
) -> tuple[int, int, int]:
    """(BLOCK_M query rows, TILE_N keys, num_warps) for this batch."""
    if max_seqlen_q * g_pad <= cfg.decode_block_m:
        return cfg.decode_block_m, cfg.tile_n, cfg.decode_warps
    return (cfg.prefill_block_m if cuda else 64), cfg.tile_n, cfg.prefill_warps
