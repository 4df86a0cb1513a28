"""ModelRunner: owns device state (weights, paged KV caches, fp8 scales) and runs one step.

The forward goes layer by layer through `attend`, which is where the connector's per-layer
load wait and save happen, around the KV write and the paged attention of `kernels`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import EngineConfig, ModelConfig
from engine.kv_connector import KVConnector
from engine.model import LlamaForCausalLM
from engine.scheduler import SchedulerOutput
from kernels import fp8_scales, paged_attention, write_kv

FP8 = torch.float8_e4m3fn
FP8_HEADROOM = 2.0  # scales from the first batch's amax, doubled so later tokens rarely saturate


@dataclass(slots=True)
class Context:
    """Attention metadata of one step (flattened tokens of all scheduled sequences)."""
    input_ids: torch.Tensor  # int64 [N]
    positions: torch.Tensor  # int64 [N] absolute positions
    q_positions: torch.Tensor  # int32 [N], the same for the kernels
    slot_mapping: torch.Tensor  # int64 [N] cache slot of each new token
    block_tables: torch.Tensor  # int32 [B, max_blocks], -1 padded
    seq_lens: torch.Tensor  # int32 [B] keys in cache after this step's write
    cu_seqlens_q: torch.Tensor  # int32 [B+1]
    logits_indices: torch.Tensor  # int64 [S] rows whose logits are sampled
    seq_ids: list[int]  # seq_id of each of the B sequences
    block_ids: list[list[int]]  # block table of each sequence (valid during this step only)
    max_seqlen_q: int
    max_seqlen_k: int


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    item = torch.empty(0, dtype=dtype).element_size()
    return cfg.num_hidden_layers * 2 * block_size * cfg.num_key_value_heads * cfg.head_dim * item


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, cfg: ModelConfig, config: EngineConfig, dtype: torch.dtype,
                 connector: KVConnector, device: torch.device) -> None:
        self.model, self.cfg, self.config, self.device = model, cfg, config, device
        self.connector = connector
        self.kv_dtype = FP8 if config.kv_cache_dtype == "fp8" else dtype
        self.num_blocks = config.kv_cache_bytes // kv_bytes_per_block(cfg, config.block_size, self.kv_dtype)
        if self.num_blocks < 1:
            raise ValueError(f"kv_cache_bytes {config.kv_cache_bytes} is less than one block "
                             f"({kv_bytes_per_block(cfg, config.block_size, self.kv_dtype)} bytes)")
        shape = (2, self.num_blocks, config.block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=self.kv_dtype, device=device) for _ in range(cfg.num_hidden_layers)]
        # fp8: per-layer, per-head scales [L, 2, Hkv], calibrated on the first forward.
        self.kv_scales = torch.ones(cfg.num_hidden_layers, 2, cfg.num_key_value_heads, device=device)
        self.calibrated = self.kv_dtype != FP8
        self.scale = cfg.head_dim ** -0.5
        self.ctx: Context | None = None
        connector.register_kv_caches(self.kv_caches)

    def prepare(self, out: SchedulerOutput) -> Context:
        bs, ids, pos, counts, starts = self.config.block_size, [], [], [], []
        for seq, n in zip(out.seqs, out.num_new_tokens):
            start = seq.num_computed_tokens
            ids += seq.token_ids[start:start + n]
            counts.append(n)
            starts.append(start)
        dev = self.device
        b = len(out.seqs)
        width = max(len(s.block_table) for s in out.seqs)
        tables = torch.full((b, width), -1, dtype=torch.int32)
        for i, s in enumerate(out.seqs):
            tables[i, :len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int32)
        count_t = torch.tensor(counts, dtype=torch.int64)
        start_t = torch.tensor(starts, dtype=torch.int64)
        cu = torch.zeros(b + 1, dtype=torch.int64)
        cu[1:] = count_t.cumsum(0)
        row = torch.repeat_interleave(torch.arange(b), count_t)
        positions = start_t[row] + torch.arange(int(cu[-1])) - cu[:-1][row]
        slots = tables[row, positions // bs].long() * bs + positions % bs
        sampled = torch.tensor(out.samples(), dtype=torch.bool)
        self.ctx = Context(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev), positions=positions.to(dev),
            q_positions=positions.to(torch.int32).to(dev),
            slot_mapping=slots.to(dev), block_tables=tables.to(dev),
            seq_lens=(start_t + count_t).to(torch.int32).to(dev), cu_seqlens_q=cu.to(torch.int32).to(dev),
            logits_indices=(cu[1:] - 1)[sampled].to(dev),
            seq_ids=[s.seq_id for s in out.seqs], block_ids=[list(s.block_table) for s in out.seqs],
            max_seqlen_q=max(counts), max_seqlen_k=max(a + c for a, c in zip(starts, counts)))
        return self.ctx

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx, cache = self.ctx, self.kv_caches[layer]
        if not self.calibrated:
            self.kv_scales[layer, 0] = fp8_scales(k) * FP8_HEADROOM
            self.kv_scales[layer, 1] = fp8_scales(v) * FP8_HEADROOM
        ks, vs = (self.kv_scales[layer, 0], self.kv_scales[layer, 1]) if self.kv_dtype == FP8 else (None, None)
        self.connector.wait_for_layer_load(layer)
        write_kv(k, v, cache[0], cache[1], ctx.slot_mapping, ks, vs)
        self.connector.save_kv_layer(layer, cache, ctx)
        return paged_attention(q, cache[0], cache[1], ctx.block_tables, ctx.seq_lens, ctx.cu_seqlens_q,
                               ctx.q_positions, self.scale, ks, vs,
                               max_seqlen_q=ctx.max_seqlen_q, max_seqlen_k=ctx.max_seqlen_k)

    @torch.inference_mode()
    def forward(self, out: SchedulerOutput) -> torch.Tensor:
        """Run the step through every layer (KV written, hooks called); hidden states [N, hidden]."""
        for src, dst in out.copies:  # copy-on-write before anything writes into dst
            for cache in self.kv_caches:
                cache[:, dst] = cache[:, src]
        ctx = self.prepare(out)
        self.connector.start_load_kv(out.connector_meta)
        h = self.model(ctx.input_ids, ctx.positions, self.attend)
        self.calibrated = True
        self.connector.wait_for_save()
        return h

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> torch.Tensor:
        """Forward the step; fp32 logits [S, vocab] of the sequences that sample, in order."""
        h = self.forward(out)
        return self.model.logits(h[self.ctx.logits_indices])
