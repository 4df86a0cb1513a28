"""The selective recompute at intermediate ratios against an independent reference built from
Hugging Face transformers' own modules (fp32): each document run alone at its offset in the
prompt (RoPE is relative, so this is its standalone KV re-rotated), then CacheBlend written out
densely: layers before the check layer in full, the check layer's fresh K ranks the loaded
rows, and from there on only the kept rows run, over cached K/V for the others."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from tests.test_blend import DOCS, QUESTION, ckpt, conn, engine, first_logits, prompt  # noqa: F401
from tierkv.connector import ConnectorConfig, TierKVConnector
from tierkv.engine import LLM, SamplingParams, blend
from tierkv.storage_backends.build import TiersConfig


class Dense:
    """One HF Llama, run layer by layer on explicit rows and keys (no cache object, no mask
    helpers): q/k/v [heads, rows, head_dim]."""

    def __init__(self, hf) -> None:
        self.hf, c = hf, hf.config
        self.hq, self.hkv = c.num_attention_heads, c.num_key_value_heads
        self.d = c.hidden_size // c.num_attention_heads

    def qkv(self, i: int, h: torch.Tensor, pos: torch.Tensor):
        layer, n = self.hf.model.layers[i], h.shape[0]
        x = layer.input_layernorm(h)
        a = layer.self_attn
        q = a.q_proj(x).view(n, self.hq, self.d).transpose(0, 1)
        k = a.k_proj(x).view(n, self.hkv, self.d).transpose(0, 1)
        v = a.v_proj(x).view(n, self.hkv, self.d).transpose(0, 1)
        cos, sin = self.hf.model.rotary_emb(v[None], pos[None])
        q, k = apply_rotary_pos_emb(q[None], k[None], cos, sin)
        return q[0], k[0], v

    def attend(self, q, qpos, k, v, kpos) -> torch.Tensor:
        rep = self.hq // self.hkv
        s = q @ k.repeat_interleave(rep, 0).transpose(1, 2) * self.d**-0.5
        s = s.masked_fill(kpos[None, None, :] > qpos[None, :, None], float("-inf"))
        return s.softmax(-1) @ v.repeat_interleave(rep, 0)

    def finish(self, i: int, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        layer = self.hf.model.layers[i]
        h = h + layer.self_attn.o_proj(o.transpose(0, 1).reshape(h.shape[0], -1))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def prefill(self, tokens: list[int], start: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (K, V) of tokens alone at positions start.. (a standalone segment's KV)."""
        pos = torch.arange(start, start + len(tokens))
        h, kv = self.hf.model.embed_tokens(torch.tensor(tokens)), []
        for i in range(len(self.hf.model.layers)):
            q, k, v = self.qkv(i, h, pos)
            kv.append((k, v))
            h = self.finish(i, h, self.attend(q, pos, k, v, pos))
        return kv

    def blend(
        self, order: list[int], ratio: float, check: int, gradual: int = 0
    ) -> tuple[torch.Tensor, int]:
        """Next-token logits of the blended prompt, and how many loaded rows were recomputed.
        gradual: the check layer keeps 2x ratio, then each of the next `gradual` layers keeps
        the kept loaded rows farthest from their cached K there, narrowing linearly to ratio."""
        tokens, cached, off = [], [], 0
        for j in order:
            cached.append(self.prefill(DOCS[j], off))
            tokens += DOCS[j]
            off += len(DOCS[j])
        loaded, tokens = off, tokens + QUESTION
        kc = [torch.cat([c[i][0] for c in cached], 1) for i in range(len(self.hf.model.layers))]
        vc = [torch.cat([c[i][1] for c in cached], 1) for i in range(len(self.hf.model.layers))]
        pos = torch.arange(len(tokens))
        h = self.hf.model.embed_tokens(torch.tensor(tokens))
        for i in range(check):
            q, k, v = self.qkv(i, h, pos)
            h = self.finish(i, h, self.attend(q, pos, k, v, pos))
        q, k, v = self.qkv(check, h, pos)
        dev = (k[:, :loaded] - kc[check]).pow(2).sum(dim=(0, 2))

        def share(step: int) -> float:
            return ratio if not gradual else min(1.0, ratio * (2 - min(step, gradual) / gradual))

        m = math.ceil(share(0) * loaded - 1e-9)
        keep = torch.cat(
            [torch.topk(dev, m).indices.sort().values, torch.arange(loaded, len(tokens))]
        )
        h = self.finish(check, h[keep], self.attend(q[:, keep], pos[keep], k, v, pos))
        for i in range(check + 1, len(self.hf.model.layers)):
            q, k, v = self.qkv(i, h, pos[keep])
            K = torch.cat([kc[i], k[:, -len(QUESTION) :]], 1)
            V = torch.cat([vc[i], v[:, -len(QUESTION) :]], 1)
            sub = torch.arange(len(keep))
            if i - check <= gradual:  # re-rank the kept loaded rows by their K deviation here
                ctx = keep < loaded
                dev = (k[:, ctx] - kc[i][:, keep[ctx]]).pow(2).sum(dim=(0, 2))
                m = min(int(ctx.sum()), math.ceil(share(i - check) * loaded - 1e-9))
                top = torch.topk(dev, m).indices.sort().values
                sub = torch.cat([torch.nonzero(ctx).flatten()[top], torch.nonzero(~ctx).flatten()])
            K[:, keep], V[:, keep] = k, v
            h, q, keep = h[sub], q[:, sub], keep[sub]
            h = self.finish(i, h, self.attend(q, pos[keep], K, V, pos))
        return self.hf.lm_head(self.hf.model.norm(h[-1])), m


@pytest.mark.parametrize(
    "ratio,check,gradual",
    [
        pytest.param(0.3, 1, 0, marks=pytest.mark.triton_path),
        (0.15, 2, 0),
        (0.6, 1, 0),
        (0.2, 1, 2),
    ],
)
def test_blend_matches_dense_reference(ckpt, conn, ratio: float, check: int, gradual: int) -> None:
    path, hf = ckpt
    order = [2, 0, 1]
    with torch.no_grad():
        ref, m = Dense(hf).blend(order, ratio, check, gradual)
    llm = engine(path, conn)
    llm.config.blend_gradual = gradual
    got, _, metrics = first_logits(
        llm,
        prompt(order),
        SamplingParams(
            max_tokens=1,
            temperature=0.0,
            ignore_eos=True,
            blend_ratio=ratio,
            blend_check_layer=check,
        ),
    )
    assert metrics.blend == {
        "loaded": sum(map(len, DOCS)),
        "recomputed": m,
        "computed": len(QUESTION),
        "full_layers": check,
    }
    torch.testing.assert_close(got, ref.float(), rtol=1e-4, atol=1e-4)


def test_fp8_cache_blend(ckpt, conn, monkeypatch) -> None:
    """With an fp8 KV cache the check layer compares fresh K to the dequantized cached K: it
    picks mostly the rows the fp32 cache picks; ratio 1.0 gives the same engine's full-prefill
    logits, 0.15 recomputes its share and deviates less than 0.0."""
    path, _ = ckpt
    picked: list[set[int]] = []
    inner = blend.select

    def select(fresh, cached, ratio):  # observes the ranking, changes nothing
        idx = inner(fresh, cached, ratio)
        picked.append(set(idx.tolist()))
        return idx

    monkeypatch.setattr(blend, "select", select)
    order, loaded = [1, 0, 2], sum(map(len, DOCS))
    p15 = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, blend_ratio=0.15)
    first_logits(engine(path, conn), prompt(order), p15)
    fp8_conn = TierKVConnector(ConnectorConfig(chunk_size=64, tiers=TiersConfig(cpu_bytes="32MiB")))
    try:
        llm = LLM(
            str(path),
            dtype="float32",
            kv_cache_bytes=16 << 20,
            enable_prefix_caching=False,
            kv_cache_dtype="fp8",
            kv_connector=fp8_conn,
            blend_calibration="off",
        )
        ref, _, _ = first_logits(
            llm,
            sum((DOCS[i] for i in order), []) + QUESTION,
            SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
        )
        kl = {}
        for r in (0.15, 1.0, 0.0):
            got, _, m = first_logits(
                llm,
                prompt(order),
                SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, blend_ratio=r),
            )
            assert m.blend["loaded"] == loaded and m.blend["recomputed"] == math.ceil(
                r * loaded - 1e-9
            )
            kl[r] = float(
                torch.nn.functional.kl_div(
                    got.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="sum"
                )
            )
    finally:
        fp8_conn.close()
    assert len(picked[1] & picked[0]) >= 0.8 * len(picked[0]), (
        len(picked[1] & picked[0]),
        len(picked[0]),
    )
    assert kl[1.0] < 1e-6 and kl[0.15] < kl[0.0], kl
