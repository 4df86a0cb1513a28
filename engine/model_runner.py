"""ModelRunner: owns device state (weights, paged KV caches, fp8 scales) and runs one step.

The forward goes layer by layer through `attend`, which is where the connector's per-layer
load wait and save happen, around the KV write and the paged attention of `kernels`. Which
kernel runs each op is decided once, when the runner is made (kernels/step_ops.py): the
environment (TRITON_INTERPRET, TIERKV_CPU_KERNEL) is read then and not during steps.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from tierkv.engine.blend_step import blend_prefill
from tierkv.engine.config import EngineConfig, ModelConfig
from tierkv.engine.context import Context, build_context
from tierkv.engine.decode_context import DecodeContexts
from tierkv.engine.decode_step import fits, fused_forward, fused_layers
from tierkv.engine.kv_connector import KVConnector
from tierkv.engine.layered import layered_forward
from tierkv.engine.model import LlamaForCausalLM
from tierkv.engine.scheduler import SchedulerOutput
from tierkv.kernels import FP8, LayerCache, cpu, fp8_scales
from tierkv.kernels.layer_ops import native_matmul
from tierkv.kernels.step_ops import select

FP8_HEADROOM = 2.0  # scales from the first batch's amax, doubled so later tokens rarely saturate


def retain_host_memory() -> bool:
    """glibc mallopt: no mmap for large blocks, no trimming (see
    EngineConfig.retain_host_memory)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False  # not glibc: leave the allocator alone
    m_trim_threshold, m_top_pad, m_mmap_max = -1, -2, -4
    return bool(
        libc.mallopt(m_mmap_max, 0)
        and libc.mallopt(m_trim_threshold, 1 << 40)
        and libc.mallopt(m_top_pad, 64 << 20)
    )


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    item = torch.empty(0, dtype=dtype).element_size()
    return cfg.num_hidden_layers * 2 * block_size * cfg.num_key_value_heads * cfg.head_dim * item


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        cfg: ModelConfig,
        config: EngineConfig,
        dtype: torch.dtype,
        connector: KVConnector,
        device: torch.device,
    ) -> None:
        self.model, self.cfg, self.config, self.device = model, cfg, config, device
        self.connector = connector
        if config.retain_host_memory and device.type == "cpu":
            retain_host_memory()
        self.kv_dtype = FP8 if config.kv_cache_dtype == "fp8" else dtype
        self.num_blocks = config.kv_cache_bytes // kv_bytes_per_block(
            cfg, config.block_size, self.kv_dtype
        )
        if self.num_blocks < 1:
            raise ValueError(
                f"kv_cache_bytes {config.kv_cache_bytes} is less than one block "
                f"({kv_bytes_per_block(cfg, config.block_size, self.kv_dtype)} bytes)"
            )
        shape = (2, self.num_blocks, config.block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.kv_dtype, device=device)
            for _ in range(cfg.num_hidden_layers)
        ]
        # fp8: per-layer, per-head scales [L, 2, Hkv], calibrated on the first forward.
        self.kv_scales = torch.ones(
            cfg.num_hidden_layers, 2, cfg.num_key_value_heads, device=device
        )
        self.calibrated = self.kv_dtype != FP8
        # Views: the kernels see the scales calibrated in place and the copies-on-write.
        self.layer_caches = [LayerCache.of(c, s) for c, s in zip(self.kv_caches, self.kv_scales)]
        self.ops = select(device, dtype, self.kv_dtype)
        # The C++ CPU decode kernel walks each sequence's own keys: decodes of any lengths go in
        # one call. The torch reference pads a decode batch to its longest sequence instead.
        q = torch.empty(1, cfg.num_attention_heads, cfg.head_dim, dtype=dtype, device=device)
        self.one_decode_group = self.ops.backend == "cpp" and cpu.decode_fits(
            q, self.layer_caches[0]
        )
        self.decodes = DecodeContexts(
            config.block_size,
            self.num_blocks,
            self.one_decode_group,
            self.ops.backend == "triton",
            device,
            config.cascade_attention,
        )
        self.scale = cfg.head_dim**-0.5
        self.ctx: Context | None = None
        self.saving = True  # store() hands each layer to the connector (off: layered prefill)
        # kv_scales is filled in place on the first forward, so the connector sees the final scales.
        connector.bind_model(model, cfg, dtype, self.kv_scales if self.kv_dtype == FP8 else None)
        connector.register_kv_caches(self.kv_caches)
        # After bind_model: the connector's model fingerprint covers the weights as loaded.
        if config.matmul_dtype == "float32" or (
            config.matmul_dtype == "auto" and not native_matmul(dtype, device)
        ):
            model.widen_matmuls(torch.float32)
        model.bind(self.ops)  # after the weights are final
        self.fused = fused_layers(model, self.ops, self.kv_dtype) if config.fused_decode else None

    def prepare(self, out: SchedulerOutput) -> Context:
        ctx = self.decodes.build(out)
        if ctx is None:
            ctx = build_context(
                out,
                self.config.block_size,
                self.num_blocks,
                self.one_decode_group,
                self.decodes.triton,
                self.device,
            )
        self.ctx = ctx
        return ctx

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the step's K/V of layer into the cache (after that layer's load landed) and hand
        it to the connector's saves."""
        ctx = self.ctx
        assert ctx is not None  # set by prepare() before the layers run
        n = ctx.num_tokens
        if not self.calibrated:
            self.kv_scales[layer, 0] = fp8_scales(k[:n]) * FP8_HEADROOM
            self.kv_scales[layer, 1] = fp8_scales(v[:n]) * FP8_HEADROOM
        self.connector.wait_for_layer_load(layer)
        self.ops.write_kv(k, v, self.layer_caches[layer], ctx.slot_mapping)
        if self.saving:
            self.connector.save_kv_layer(layer, self.kv_caches[layer], ctx)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx, cache = self.ctx, self.layer_caches[layer]
        assert ctx is not None  # set by prepare() before the layers run
        n = ctx.num_tokens
        self.store(layer, k, v)
        if ctx.decode is not None:  # decodes only: straight to the C++ kernel
            ids, seen, chunk = ctx.decode
            groups = ctx.all.meta.cascade
            if groups is None:
                o = cpu.paged_decode(q[:n], cache, ids, seen, self.scale, chunk)
            else:  # shared leading blocks read once per group (kernels/cascade.py)
                o = cpu.paged_decode_cascade(
                    q[:n], cache, ids, seen, self.scale, groups.tensors(ids.device), chunk
                )
            if n == q.shape[0]:
                return o
            out = torch.zeros_like(q)
            out[:n] = o
            return out
        out = torch.zeros_like(q)
        kernel = bool(ctx.fresh) and self.ops.backend == "cpp" and cpu.prefill_fits(q, k, v)
        for s, e in ctx.fresh:
            if kernel:
                out[s:e] = cpu.prefill_attention(
                    q[s:e], k[s:e], v[s:e], ctx.positions[s:e], self.scale
                )
                continue
            # 4-D: 3-D inputs fall back to SDPA's slow math path on CPU (7x)
            out[s:e] = F.scaled_dot_product_attention(
                q[None, s:e].transpose(1, 2),
                k[None, s:e].transpose(1, 2),
                v[None, s:e].transpose(1, 2),
                is_causal=True,
                scale=self.scale,
                enable_gqa=True,
            )[0].transpose(0, 1)
        for p in ctx.paged:
            qp = q[:n] if p.rows is None else q[p.rows]
            o = self.ops.attention(qp, cache, p.meta, self.scale)
            if p.rows is None:
                out[:n] = o
            else:
                out[p.rows] = o
        return out

    @torch.inference_mode()
    def forward(self, out: SchedulerOutput) -> torch.Tensor:
        """Run the step through every layer (KV written, hooks called); hidden states
        [N, hidden]."""
        for src, dst in out.copies:  # copy-on-write before anything writes into dst
            for cache in self.kv_caches:
                cache[:, dst] = cache[:, src]
        if out.layered:  # the sampling rows only (engine/layered.py)
            self.connector.start_load_kv(out.connector_meta)
            h = layered_forward(self, out)
            self.calibrated = True
            self.connector.wait_for_save()
            return h
        ctx = self.prepare(out)
        self.connector.start_load_kv(out.connector_meta)
        if out.blend is not None:
            h = blend_prefill(self, ctx, out.blend)
        elif self.fused is not None and fits(ctx):
            h = fused_forward(self, self.fused, ctx)
        else:
            h = self.model(ctx.input_ids, ctx.positions, self.attend)
        self.calibrated = True
        self.connector.wait_for_save()
        return h

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> torch.Tensor:
        """Forward the step; fp32 logits [S, vocab] of the sequences that sample, in order."""
        h = self.forward(out)
        if out.layered:
            return self.model.logits(h)
        assert self.ctx is not None  # set by forward()
        return self.model.logits(h[self.ctx.logits_indices])[: self.ctx.num_sampled]
