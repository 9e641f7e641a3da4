"""The denoiser's transformer layers: conditioning embeddings, RoPE, spatial / temporal / cross attention,
the AdaLN-Zero block and the output layer.

Tensor layout: tokens (B,T,N,D) (batch, frames, tokens per frame, channels); per-frame conditions (B,T,D).
Every layer mixes tokens only where its name says: spatial attention within a frame, temporal attention
across frames (block-causal, through `kernels.chunked_attention`), cross attention from the window to memory.

`TemporalAttention` has a small seam for tools that restrict or watch it without the layer knowing them
(arvdm.hybrid uses it): `retention` (which earlier key frames its queries read) and `lse_observers`
(callables that receive every kernel call, with its log-sum-exp, as an `AttentionCall`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

import kernels
from arvdm.config import FACTORIZED
from memory import RetentionPolicy
from memory.compress import sinusoidal

__all__ = ["AttentionCall", "Block", "CrossAttention", "FinalLayer", "LevelEmbedding", "PoseTags", "Rotary",
           "SpatialAttention", "TemporalAttention", "apply_rope", "modulate"]

LEVEL_EMBED_SCALE = 1000.0  # levels are rescaled to 0..1000 before the sinusoid, whatever K is (DiT's range)
ROPE_BASE = 10000.0


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """AdaLN: x (B,T,N,D) scaled/shifted per frame by shift, scale (B,T,D)."""
    return x * (1 + scale[:, :, None]) + shift[:, :, None]


class LevelEmbedding(nn.Module):
    """Noise level (B,T) int in 0..K -> (B,T,D): sinusoidal(level * 1000 / K) -> MLP (DiT's t-embedder).

    Rescaling to 0..1000 keeps the sinusoid frequencies meaningful whatever K is.
    """

    def __init__(self, dim: int, num_levels: int, freq_dim: int = 256):
        super().__init__()
        self.num_levels, self.freq_dim = num_levels, freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, levels: torch.Tensor) -> torch.Tensor:
        t = levels.float() * (LEVEL_EMBED_SCALE / self.num_levels)  # (B,T)
        return self.mlp(sinusoidal(t, self.freq_dim))  # (B,T,freq) -> (B,T,D)


class PoseTags(nn.Module):
    """Where and when a frame was seen, as one vector per frame added to all its tokens (pose-aware memory).

    rel (B,T,3) = the frame's pose in the window's frame (forward, left, heading change; `memory.relative_pose`)
    -> features (offsets, distance, sin/cos of 1-3x the heading change) -> MLP; plus, for memory frames,
    sinusoidal(age) -> MLP. Added to tokens (not only to the AdaLN condition) so that the temporal attention's
    query-key products can compare a window frame's tag with a memory frame's (cos(a - b) is a dot product
    of Fourier features). Both output layers start at zero: a new model behaves as one without poses.
    """

    HEADING_HARMONICS = 3
    FEATURES = 3 + 2 * HEADING_HARMONICS

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.pose = nn.Sequential(nn.Linear(self.FEATURES, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.age = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        for last in (self.pose[-1], self.age[-1]):
            nn.init.zeros_(last.weight)
            nn.init.zeros_(last.bias)

    def forward(self, rel: torch.Tensor, ages: torch.Tensor | None = None) -> torch.Tensor:
        fwd, left, dh = rel.float().unbind(-1)  # (B,T) each
        harmonics = torch.arange(1, self.HEADING_HARMONICS + 1, device=rel.device, dtype=torch.float32)
        angles = dh[..., None] * harmonics  # (B,T,H)
        feats = torch.cat([torch.stack([fwd, left, torch.hypot(fwd, left)], -1), angles.sin(), angles.cos()], -1)
        out = self.pose(feats)  # (B,T,D)
        if ages is not None:
            out = out + self.age(sinusoidal(ages.float(), self.dim))  # (B,T,D)
        return out


class Rotary(nn.Module):
    """Rotary position embedding over the absolute frame index (one angle set per frame).

    Keys are rotated once, when computed, so a cached key keeps its position and q.k depends only on
    the frame distance: a rollout longer than training slides without recomputing the cache.
    """

    def __init__(self, head_dim: int, base: float = ROPE_BASE):
        super().__init__()
        inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)  # (hd/2,)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ang = positions.float()[:, None] * self.inv_freq.to(positions.device)  # (L, hd/2)
        ang = torch.cat([ang, ang], dim=-1)  # (L, hd)
        return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B,T,N,H,hd) by the per-frame angles cos, sin (T,hd)."""
    x1, x2 = x.chunk(2, dim=-1)
    rot = torch.cat([-x2, x1], dim=-1)  # rotate_half
    cos, sin = cos[None, :, None, None].to(x.dtype), sin[None, :, None, None].to(x.dtype)  # (1,T,1,1,hd)
    return x * cos + rot * sin


class SpatialAttention(nn.Module):
    """Self-attention among the N tokens of each frame (frames never mix here)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, n, d = x.shape
        q, k, v = self.qkv(x).view(b * t, n, 3, self.heads, d // self.heads).unbind(2)  # (B*T,N,H,hd)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.proj(o.transpose(1, 2).reshape(b, t, n, d))  # (B*T,H,N,hd) -> (B,T,N,D)


@dataclass(frozen=True)
class AttentionCall:
    """One `kernels.chunked_attention` call of a `TemporalAttention` layer, as its `lse_observers` get it.

    The fields are the kernel's arguments (see kernels/mask.py for the rule); `recent_frames` is None when
    the layer reads every earlier key frame.
    """

    q: torch.Tensor  # (B',H,Lq,hd) rotated queries
    k: torch.Tensor  # (B',H,Lk,hd) rotated keys: cached past + prefix (+ window)
    lse: torch.Tensor  # (B',H,Lq) log-sum-exp of the call's attention scores
    tokens_per_frame: int
    frames_per_chunk: int
    q_frame_offset: int
    sink_frames: int
    recent_frames: int | None


def key_frame_rule(retention: RetentionPolicy | None) -> dict[str, int]:
    """The kernel's streaming arguments for a layer whose queries read the key frames `retention` keeps.

    None or "all": every earlier frame (no extra arguments); "sink_recent": the first `sink` frames and the
    `recent` frames before the query's chunk; "last": the `length` frames before it.
    """
    if retention is None or retention.capacity is None:
        return {}
    if retention.kind == "sink_recent":
        return {"sink_frames": retention.sink, "recent_frames": retention.recent}
    return {"sink_frames": 0, "recent_frames": retention.length}


class TemporalAttention(nn.Module):
    """Block-causal attention across frames through `kernels.chunked_attention`.

    The frames of `x` are `n_prefix` prefix frames (memory, latents or frames being committed) followed
    by window frames. Keys are `past` (a `KVCache` of earlier frames, already rotated) + the prefix + the window:
      - prefix queries see the past and the prefix (chunked by `prefix_chunk`), never the window;
      - window queries see everything before them and their own chunk (`frames_per_chunk`).
    Returns the output and this call's (K, V) in the kernel layout, for a caller that caches them.

    Seam (both default to plain full attention, no observers):
      retention: a `memory.RetentionPolicy` naming the earlier key frames the queries read (see
          `key_frame_rule`); a bounded one makes this a streaming layer. `streaming` reads it back as
          (sink, recent) frames, or None.
      lse_observers: callables `observer(call: AttentionCall)`, called after every kernel call; while there
          are any, the kernel also returns its log-sum-exp (the output is the same).
    """

    def __init__(self, dim: int, heads: int, form: str, frames_per_chunk: int):
        super().__init__()
        self.heads, self.form, self.frames_per_chunk = heads, form, frames_per_chunk
        self.factorized = form == FACTORIZED  # one token per frame and spatial position, else all tokens
        self.retention: RetentionPolicy | None = None
        self.lse_observers: list[Callable[[AttentionCall], None]] = []
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    @property
    def streaming(self) -> tuple[int, int] | None:
        """(sink, recent) key frames when `retention` restricts the keys, None for full attention."""
        rule = key_frame_rule(self.retention)
        return (rule["sink_frames"], rule["recent_frames"]) if rule else None

    def _to_seq(self, x: torch.Tensor) -> torch.Tensor:
        b, t, n, h, hd = x.shape
        if self.factorized:  # sequences of frames at each spatial position
            return x.permute(0, 2, 3, 1, 4).reshape(b * n, h, t, hd)  # (B*N,H,T,hd)
        return x.permute(0, 3, 1, 2, 4).reshape(b, h, t * n, hd)  # (B,H,T*N,hd), frame-major

    def _from_seq(self, o: torch.Tensor, b: int, t: int, n: int) -> torch.Tensor:
        h, hd = o.shape[1], o.shape[3]
        if self.factorized:
            o = o.view(b, n, h, t, hd).permute(0, 3, 1, 2, 4)  # (B*N,H,T,hd) -> (B,T,N,H,hd)
        else:
            o = o.view(b, h, t, n, hd).permute(0, 2, 3, 1, 4)  # (B,H,T*N,hd) -> (B,T,N,H,hd)
        return o.reshape(b, t, n, h * hd)  # (B,T,N,D)

    def _attend(self, q, k, v, *, tokens_per_frame: int, frames_per_chunk: int, q_frame_offset: int):
        """One kernel call (q (B',H,Lq,hd) against k, v (B',H,Lk,hd)); observers see it with its lse."""
        rule = dict(tokens_per_frame=tokens_per_frame, frames_per_chunk=frames_per_chunk,
                    q_frame_offset=q_frame_offset, **key_frame_rule(self.retention))
        if not self.lse_observers:
            return kernels.chunked_attention(q, k, v, **rule)
        o, lse = kernels.chunked_attention(q, k, v, return_lse=True, **rule)  # lse (B',H,Lq)
        call = AttentionCall(q, k, lse, tokens_per_frame, frames_per_chunk, q_frame_offset,
                             rule.get("sink_frames", 0), rule.get("recent_frames"))
        for observer in list(self.lse_observers):
            observer(call)
        return o

    def forward(self, x, cos, sin, *, past=None, n_prefix: int = 0, prefix_chunk: int = 1):
        b, t, n, d = x.shape
        q, k, v = self.qkv(x).view(b, t, n, 3, self.heads, d // self.heads).unbind(3)  # (B,T,N,H,hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = self._to_seq(q), self._to_seq(k), self._to_seq(v)  # (B',H,T*tpf,hd)
        tpf = 1 if self.factorized else n
        n_past = 0 if past is None else past.num_frames  # frames already in the cache
        keys, vals = k, v
        if n_past:
            pk, pv = past.keys_values()  # (B',H,P*tpf,hd) views
            if pk.dtype == k.dtype:  # past + window as views of the cache buffer: no copy of the past per call
                keys, vals = past.keys_values_with(k, v)  # (B',H,(P+T)*tpf,hd)
            else:  # a cache filled under another autocast dtype is cast to this call's dtype
                keys, vals = torch.cat([pk.to(k.dtype), k], dim=2), torch.cat([pv.to(v.dtype), v], dim=2)

        outs = []
        split = n_prefix * tpf
        if n_prefix > 0:  # prefix frames: the past + the prefix, never the window
            end = (n_past + n_prefix) * tpf
            outs.append(self._attend(q[:, :, :split], keys[:, :, :end], vals[:, :, :end], tokens_per_frame=tpf,
                                     frames_per_chunk=prefix_chunk, q_frame_offset=n_past))
        if n_prefix < t:  # window frames: everything earlier + their own chunk
            outs.append(self._attend(q[:, :, split:], keys, vals, tokens_per_frame=tpf,
                                     frames_per_chunk=self.frames_per_chunk, q_frame_offset=n_past + n_prefix))
        o = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]  # (B',H,T*tpf,hd)
        return self.proj(self._from_seq(o, b, t, n)), (k, v)


class CrossAttention(nn.Module):
    """Window tokens (all N of every frame) attend to all memory tokens (L frames x N tokens)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.kv_norm = nn.LayerNorm(dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)

    def memory_kv(self, mem: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Memory tokens (B, L*N, D) -> K, V (B,H,L*N,hd); computed once per commit in a rollout."""
        b, s, d = mem.shape
        k, v = self.kv(self.kv_norm(mem)).view(b, s, 2, self.heads, d // self.heads).unbind(2)  # (B,S,H,hd)
        return k.transpose(1, 2), v.transpose(1, 2)

    def forward(self, x: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        b, t, n, d = x.shape
        q = self.q(x).view(b, t * n, self.heads, d // self.heads).transpose(1, 2)  # (B,H,T*N,hd)
        o = F.scaled_dot_product_attention(q, kv[0], kv[1])  # (B,H,T*N,hd)
        return self.proj(o.transpose(1, 2).reshape(b, t, n, d))


class Block(nn.Module):
    """Spatial attention, temporal attention, [cross attention], MLP; each AdaLN-Zero modulated.

    The AdaLN projection gives (shift, scale, gate) per sublayer, in this order of chunks: spatial 0-2,
    temporal 3-5, MLP 6-8, cross attention 9-11.
    """

    def __init__(self, dim: int, heads: int, mlp_ratio: float, form: str, frames_per_chunk: int, cross: bool):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.spatial = SpatialAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False)
        self.temporal = TemporalAttention(dim, heads, form, frames_per_chunk)
        self.norm3 = nn.LayerNorm(dim, elementwise_affine=False)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, dim))
        self.cross = CrossAttention(dim, heads) if cross else None
        self.norm4 = nn.LayerNorm(dim, elementwise_affine=False) if cross else None
        sublayers = 4 if cross else 3
        self.n_mod = 3 * sublayers  # (shift, scale, gate) per sublayer
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(dim, self.n_mod * dim))
        nn.init.zeros_(self.ada[1].weight)  # AdaLN-Zero: every block starts as the identity
        nn.init.zeros_(self.ada[1].bias)

    def forward(self, h, cond, cos, sin, *, past=None, n_prefix=0, prefix_chunk=1, cross_kv=None):
        mods = self.ada(cond).chunk(self.n_mod, dim=-1)  # n_mod x (B,T,D)
        h = h + mods[2][:, :, None] * self.spatial(modulate(self.norm1(h), mods[0], mods[1]))
        a, kv = self.temporal(modulate(self.norm2(h), mods[3], mods[4]), cos, sin,
                              past=past, n_prefix=n_prefix, prefix_chunk=prefix_chunk)
        h = h + mods[5][:, :, None] * a
        if self.cross is not None and cross_kv is not None:
            h = h + mods[11][:, :, None] * self.cross(modulate(self.norm4(h), mods[9], mods[10]), cross_kv)
        h = h + mods[8][:, :, None] * self.mlp(modulate(self.norm3(h), mods[6], mods[7]))
        return h, kv


class FinalLayer(nn.Module):
    """AdaLN + linear from tokens to patch values (pixels, or the decoder's lowest feature map)."""

    def __init__(self, dim: int, patch_values: int, zero_init: bool = True):
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))
        self.linear = nn.Linear(dim, patch_values)
        # Zero-init when this layer writes pixels (v = 0 at the start); in front of a conv decoder the
        # decoder's last conv is the zero-init one and this layer must pass gradients from step one.
        for lin in (self.ada[1], self.linear) if zero_init else (self.ada[1],):
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)

    def forward(self, h: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        shift, scale = self.ada(cond).chunk(2, dim=-1)  # (B,T,D) each
        return self.linear(modulate(self.norm(h), shift, scale))  # (B,T,N,p*p*C)
