"""An independent dense reference of every blend rule, built from Hugging Face transformers'
own Llama modules in fp32: each document run alone at its offset in the prompt (RoPE is
relative, so this is its standalone KV re-rotated), then the rule written out densely over
explicit rows and keys (no paged cache, no engine code). `Variant.wrong` runs a deliberately
wrong rule, which the engine must NOT match (tests/test_blend_rules.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from tests.test_blend import DOCS, QUESTION

RANKS = ("cacheblend", "query_early", "query_late")


@dataclass
class Variant:
    rule: str = "cacheblend"
    ratio: float = 0.15
    check: int = 1
    gradual: int = 0
    sinks: int = 16
    query_layer: int | None = None
    smooth: int = 2
    temperature: float = 0.9
    scale: float = 0.9
    # "sinks+1": one more sink token per segment; "ape-rest": APE's temperature and scale on the
    # recomputed block instead of the cached one; "least": the query rules keep the least attended
    wrong: str = ""


class Dense:
    """One HF Llama, run layer by layer on explicit rows and keys (no cache object, no mask
    helpers): q/k/v [heads, rows, head_dim]."""

    def __init__(self, hf) -> None:
        self.hf, c = hf, hf.config
        self.hq, self.hkv = c.num_attention_heads, c.num_key_value_heads
        self.d = c.hidden_size // c.num_attention_heads
        self.layers = c.num_hidden_layers

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

    def logits(self, q, qpos, k, kpos) -> torch.Tensor:
        rep = self.hq // self.hkv
        s = q @ k.repeat_interleave(rep, 0).transpose(1, 2) * self.d**-0.5
        return s.masked_fill(kpos[None, None, :] > qpos[None, :, None], float("-inf"))

    def attend(self, q, qpos, k, v, kpos, ctx=None, v_: Variant | None = None) -> torch.Tensor:
        """Causal attention; with ctx (a key mask) and v_, APE: the ctx block's logits become
        s/T + (T*S - 1) * LSE(s_ctx/T), so one softmax gives the block log-mass T*S*LSE(s/T)
        and softmax(s/T) inside it."""
        s = self.logits(q, qpos, k, kpos)
        if ctx is not None and v_ is not None and bool(ctx.any()):
            block = ~ctx if v_.wrong == "ape-rest" else ctx
            t, ts = v_.temperature, v_.temperature * v_.scale
            sb = (s / t).masked_fill(~block[None, None, :], float("-inf"))
            lse = torch.logsumexp(sb, -1, keepdim=True)
            s = torch.where(block[None, None, :], s / t + (ts - 1.0) * lse, s)
            s = s.masked_fill(kpos[None, None, :] > qpos[None, :, None], float("-inf"))
        return s.softmax(-1) @ v.repeat_interleave(self.hq // self.hkv, 0)

    def finish(self, i: int, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        layer = self.hf.model.layers[i]
        h = h + layer.self_attn.o_proj(o.transpose(0, 1).reshape(h.shape[0], -1))
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def prefill(self, tokens: list[int], start: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (K, V) of tokens alone at positions start.. (a standalone segment's KV)."""
        pos = torch.arange(start, start + len(tokens))
        h, kv = self.hf.model.embed_tokens(torch.tensor(tokens)), []
        for i in range(self.layers):
            q, k, v = self.qkv(i, h, pos)
            kv.append((k, v))
            h = self.finish(i, h, self.attend(q, pos, k, v, pos))
        return kv

    def mass(self, q, qpos, k, kpos, loaded: int, v_: Variant) -> torch.Tensor:
        """Per loaded row: the question's attention (all heads, all its queries), summed with
        the `smooth` loaded rows on each side."""
        raw = self.logits(q, qpos, k, kpos).softmax(-1).sum(dim=(0, 1))[:loaded]
        w = v_.smooth
        out = torch.stack([raw[max(0, i - w) : i + w + 1].sum() for i in range(loaded)])
        return -out if v_.wrong == "least" else out

    def blend(self, order: list[int], v_: Variant) -> tuple[torch.Tensor, int]:
        """Next-token logits of the prompt [docs in order..., QUESTION] under the rule, and how
        many loaded rows reach the last layer."""
        names = set(v_.rule.split("+"))
        rank = next((r for r in RANKS if r in names), None)
        tokens, cached, starts, off = [], [], [], 0
        for j in order:
            cached.append(self.prefill(DOCS[j], off))
            starts.append((off, len(DOCS[j])))
            tokens += DOCS[j]
            off += len(DOCS[j])
        loaded, tokens = off, tokens + QUESTION
        n, nl = len(tokens), self.layers
        pos = torch.arange(n)
        kc = [torch.cat([c[i][0] for c in cached], 1) for i in range(nl)]
        vc = [torch.cat([c[i][1] for c in cached], 1) for i in range(nl)]
        question = torch.arange(loaded, n)
        emb = self.hf.model.embed_tokens(torch.tensor(tokens))
        if v_.ratio == 1.0 and rank is None:  # every row recomputed: a full prefill
            rank, v_ = "cacheblend", Variant(v_.rule, 1.0, nl - 1)
        fixed = torch.zeros(n, dtype=torch.bool)
        fixed[loaded:] = True
        if "legolink" in names and v_.ratio < 1.0:
            k = v_.sinks + (v_.wrong == "sinks+1")
            for a, length in starts:
                fixed[a : a + min(k, length)] = True

        def share(step: int) -> float:
            g = v_.gradual if rank == "cacheblend" else 0
            return v_.ratio if not g else min(1.0, v_.ratio * (2 - min(step, g) / g))

        late = None
        if rank == "query_late" and v_.ratio > 0:  # the question alone over the cached KV
            ql = min(nl - 1, round(0.75 * nl) if v_.query_layer is None else v_.query_layer)
            h = emb[loaded:]
            for i in range(ql + 1):
                q, k, v = self.qkv(i, h, question)
                kk, vv = torch.cat([kc[i], k], 1), torch.cat([vc[i], v], 1)
                if i < ql:
                    h = self.finish(i, h, self.attend(q, question, kk, vv, pos))
            late = self.mass(q, question, kk, pos, loaded, v_)
        if rank is None or v_.ratio == 0.0:
            keep, h, first = torch.nonzero(fixed).flatten(), emb[fixed], 0
        else:
            h, c = emb, min(v_.check, nl - 1)
            for i in range(c):
                q, k, v = self.qkv(i, h, pos)
                h = self.finish(i, h, self.attend(q, pos, k, v, pos))
            q, k, v = self.qkv(c, h, pos)
            m = math.ceil(share(0) * loaded - 1e-9)
            if rank == "cacheblend":
                score = (k[:, :loaded] - kc[c]).pow(2).sum(dim=(0, 2))
            elif rank == "query_early":
                score = self.mass(q[:, loaded:], question, k, pos, loaded, v_)
            else:
                score = late
            picked = fixed.clone()
            picked[torch.topk(score, m).indices] = True
            keep = torch.nonzero(picked).flatten()
            h = self.finish(c, h[keep], self.attend(q[:, keep], pos[keep], k, v, pos))
            first = c + 1
        for i in range(first, nl):
            q, k, v = self.qkv(i, h, pos[keep])
            K = torch.cat([kc[i], torch.zeros(self.hkv, n - loaded, self.d)], 1)
            V = torch.cat([vc[i], torch.zeros(self.hkv, n - loaded, self.d)], 1)
            K[:, keep], V[:, keep] = k, v
            sub = torch.arange(len(keep))
            if rank == "cacheblend" and 0 < i - first + 1 <= v_.gradual:  # re-rank the kept
                ctx = keep < loaded
                dev = (k[:, ctx] - kc[i][:, keep[ctx]]).pow(2).sum(dim=(0, 2))
                m = min(int(ctx.sum()), math.ceil(share(i - first + 1) * loaded - 1e-9))
                top = torch.nonzero(ctx).flatten()[torch.topk(dev, m).indices]
                stay = fixed[keep].clone()
                stay[top] = True
                sub = torch.nonzero(stay).flatten()
            stale = torch.ones(n, dtype=torch.bool)
            stale[keep] = False
            stale[loaded:] = False
            h, q, keep = h[sub], q[:, sub], keep[sub]
            ape = stale if "ape" in names else None
            h = self.finish(i, h, self.attend(q, pos[keep], K, V, pos, ape, v_))
        return self.hf.lm_head(self.hf.model.norm(h[-1])), int((keep < loaded).sum())
