"""Rotary position embeddings with Hugging Face Llama semantics (rotate_half, cos/sin =
cat(freqs, freqs)), Llama-3 frequency scaling, and re-rotation of cached K by a delta."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from tierkv.kernels import cpu
from tierkv.kernels.dispatch import use_triton


def llama_inv_freq(head_dim: int, rope_theta: float, rope_scaling: dict | None) -> torch.Tensor:
    """inv_freq [head_dim/2] float32, computed exactly as transformers' rope init functions."""
    inv = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    scaling = rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type") if scaling else "default")
    if kind in (None, "default"):
        return inv
    if kind != "llama3":
        raise ValueError(f"rope_type {kind!r} not supported (default, llama3)")
    try:
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
    except KeyError as e:
        raise ValueError(f"llama3 rope_scaling needs {e.args[0]!r}") from None
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D] rotated by cos/sin [N, D/2] (fp32), in x's dtype: x*cos + rotate_half(x)*sin.
    On a CPU the C++ op does it in one pass, bit for bit the same (see cpu_ops.cpp)."""
    if cpu.rope_usable(x):
        return torch.ops.tierkv.rope(x, cos.contiguous(), sin.contiguous())
    return rotate_ref(x, cos, sin)


def rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rotate() as torch ops: the reference the C++ op is checked against."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


@dataclass(slots=True)
class RotaryEmbedding:
    """Llama RoPE. cos/sin are tabulated up to max_position (grown on demand) in fp32."""

    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position: int = 8192
    inv_freq: torch.Tensor = field(init=False)
    _cos: torch.Tensor = field(init=False)
    _sin: torch.Tensor = field(init=False)
    # (positions, cos, sin) of the last lookup: every layer of a step rotates at the same
    # positions tensor, so the lookup (a min/max sync and two gathers) runs once per step.
    # Held by identity: the reference keeps the tensor alive, so its id is not reused.
    _last: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = field(init=False, default=None)
    # The rotation kernel an engine bound once (kernels/step_ops.py), x [N, H, D] by contiguous
    # cos/sin [N, D/2]; None dispatches at each call.
    rotate: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"head_dim must be even and positive, got {self.head_dim}")
        self.inv_freq = llama_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling)
        self._build(self.max_position, torch.device("cpu"))

    def _build(self, n: int, device: torch.device) -> None:
        # Same op order as HF (position.float() * inv_freq, then cos/sin) so fp32 matches bit-wise.
        self.max_position, self._last = n, None
        self.inv_freq = self.inv_freq.to(device)
        freqs = torch.arange(n, device=device).float()[:, None] * self.inv_freq
        self._cos, self._sin = freqs.cos(), freqs.sin()

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [N, D/2] float32 for int positions [N] (>= 0). The same positions tensor
        again (not changed in place meanwhile, as the engine's never are) reuses the last lookup."""
        last = self._last
        if last is not None and last[0] is positions:
            return last[1], last[2]
        if positions.numel() and int(positions.min()) < 0:
            raise ValueError("positions must be >= 0")
        top = int(positions.max()) + 1 if positions.numel() else 0
        if top > self.max_position or self._cos.device != positions.device:
            self._build(max(top, self.max_position), positions.device)
        idx = positions.long()
        cos, sin = self._cos[idx], self._sin[idx]
        self._last = (positions, cos, sin)
        return cos, sin

    def apply(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [N, Hq, D] and k [N, Hkv, D] at positions [N]; returns new tensors."""
        if (
            q.dim() != 3
            or k.dim() != 3
            or q.shape[-1] != self.head_dim
            or k.shape[-1] != self.head_dim
            or q.shape[0] != k.shape[0]
            or positions.shape != (q.shape[0],)
        ):
            raise ValueError(
                f"q [N, Hq, {self.head_dim}], k [N, Hkv, {self.head_dim}], positions [N] expected; "
                f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(positions.shape)}"
            )
        cos, sin = self.cos_sin(positions)
        if self.rotate is not None:
            return self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        if use_triton(q):
            from tierkv.kernels.triton_rope import rope_triton

            return rope_triton(q, cos, sin), rope_triton(k, cos, sin)
        return rotate(q, cos, sin), rotate(k, cos, sin)


def rerotate_k(k: torch.Tensor, delta: int | torch.Tensor, rope: RotaryEmbedding) -> torch.Tensor:
    """K [N, Hkv, D] rotated at positions p.. becomes K at p+delta.. (R(p+d) = R(d) R(p)).
    delta: an int or a per-token int tensor [N]; negative allowed. Returns a new tensor."""
    if k.dim() != 3 or k.shape[-1] != rope.head_dim:
        raise ValueError(f"k must be [N, Hkv, {rope.head_dim}], got {tuple(k.shape)}")
    d = torch.as_tensor(delta, device=k.device)
    if d.is_floating_point():
        raise ValueError("delta must be an integer")
    d = d.expand(k.shape[0]) if d.dim() == 0 else d
    if d.shape != (k.shape[0],):
        raise ValueError(f"delta must be an int or a tensor of shape [{k.shape[0]}]")
    angle = d.float()[:, None] * rope.inv_freq.to(k.device)
    if use_triton(k):
        from tierkv.kernels.triton_rope import rope_triton

        return rope_triton(k, angle.cos(), angle.sin())
    return rotate(k, angle.cos(), angle.sin())
