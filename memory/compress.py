"""Memory compressors: m past frames (as token grids) -> a budget of B latent frames.

Both compressors take the memory frames already embedded as the denoiser's frame tokens
(B, m, N, D) and return B latent "frames" of the same token-grid shape (B, B_lat, N, D), so that a
latent can stand wherever a frame's tokens stand (temporal prefix, channel concat, cross-attention).

    joint:      [frame tokens ; action embedding] (channel concat) -> feed-forward -> trunk -> pool
    modulated:  frame tokens FiLM-modulated by the action embedding  -> feed-forward -> trunk -> pool
    trunk:      one spatial self-attention (within each frame, over N tokens) and one temporal
                self-attention (over the m frames at each spatial position, bidirectional: all of it
                is the past), pre-norm residual, with a sinusoidal embedding of each frame's age
    pool:       B learned query grids (B, N, D) cross-attend over the m frames at each spatial
                position -> (B, N, D) per sample. Learned queries (rather than adaptive pooling) let
                each latent choose what to summarise and accept any m, so the same compressor serves a
                bank that is still filling up. Only the queries depend on B: B * N * D parameters.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

COMPRESSORS = ("none", "joint", "modulated")


def sinusoidal(x: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding of a float tensor (...,) -> (..., dim) (as for diffusion timesteps)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=x.device, dtype=torch.float32) / half)
    args = x.float()[..., None] * freqs  # (..., half)
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)  # (..., 2*half)
    if dim % 2:
        emb = F.pad(emb, (0, 1))
    return emb


class _SelfAttention(nn.Module):
    """Pre-norm residual multi-head self-attention over the second-to-last axis of (B', L, D)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, self.heads, d // self.heads).unbind(2)  # (B', L, H, dh)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # (B', H, L, dh)
        return x + self.proj(o.transpose(1, 2).reshape(b, n, d))  # (B', L, D)


class MemoryCompressor(nn.Module):
    """Compress m memory frames into `budget` latent frames.

    Args:
        kind: `"joint"` or `"modulated"`.
        dim: token width D (the denoiser's).
        heads: attention heads.
        num_tokens: N tokens per frame (the denoiser's patch grid).
        budget: B, latent frames produced.
        num_actions: size of the action vocabulary.

    Shapes:
        tokens (B, m, N, D), actions (B, m) int64, ages (m,) or (B, m) ints >= 1 (frames between a memory
        frame and the window) -> (B, budget, N, D).
    """

    def __init__(self, kind: str, dim: int, heads: int, num_tokens: int, budget: int, num_actions: int):
        super().__init__()
        if kind not in ("joint", "modulated"):
            raise ValueError(f"MemoryCompressor: kind must be 'joint' or 'modulated', got {kind!r}")
        if budget < 1:
            raise ValueError(f"MemoryCompressor: budget must be >= 1, got {budget}")
        self.kind, self.dim, self.heads, self.budget, self.num_tokens = kind, dim, heads, budget, num_tokens
        self.action_embed = nn.Embedding(num_actions, dim)
        self.age_mlp = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        if kind == "joint":
            # frames and actions meet by channel concatenation, then a feed-forward mixes them
            self.ff = nn.Sequential(nn.Linear(2 * dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        else:
            # FiLM: the action sets a per-channel scale and shift of every token of its frame
            self.film = nn.Linear(dim, 2 * dim)
            self.ff = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.spatial = _SelfAttention(dim, heads)
        self.temporal = _SelfAttention(dim, heads)
        self.queries = nn.Parameter(torch.randn(budget, num_tokens, dim) * 0.02)  # (B_lat, N, D)
        self.pool_norm = nn.LayerNorm(dim)
        self.pool_q = nn.Linear(dim, dim)
        self.pool_kv = nn.Linear(dim, 2 * dim)
        self.pool_proj = nn.Linear(dim, dim)
        self.out_norm = nn.LayerNorm(dim)

    def forward(self, tokens: torch.Tensor, actions: torch.Tensor, ages: torch.Tensor) -> torch.Tensor:
        b, m, n, d = tokens.shape
        if n != self.num_tokens or d != self.dim:
            raise ValueError(f"MemoryCompressor: tokens must be (B, m, {self.num_tokens}, {self.dim}), "
                             f"got {tuple(tokens.shape)}")
        if m == 0:
            raise ValueError("MemoryCompressor: needs at least one memory frame")
        a = self.action_embed(actions)[:, :, None, :]  # (B, m, 1, D)
        if self.kind == "joint":
            x = self.ff(torch.cat([tokens, a.expand(b, m, n, d)], dim=-1))  # (B, m, N, 2D) -> (B, m, N, D)
        else:
            scale, shift = self.film(a).chunk(2, dim=-1)  # (B, m, 1, D) each
            x = self.ff(tokens * (1 + scale) + shift)  # (B, m, N, D)
        ages = ages.expand(b, m) if ages.dim() == 2 else ages[None].expand(b, m)  # (B, m)
        x = x + self.age_mlp(sinusoidal(ages, d))[:, :, None, :]  # (B, m, N, D)
        x = self.spatial(x.reshape(b * m, n, d)).view(b, m, n, d)  # attention within each frame
        x = x.permute(0, 2, 1, 3).reshape(b * n, m, d)  # (B*N, m, D): the frames at each position
        x = self.temporal(x)  # (B*N, m, D)
        # pool m -> budget with learned queries, per spatial position
        hd = d // self.heads
        grid = self.queries.permute(1, 0, 2)[None].expand(b, n, self.budget, d).reshape(b * n, self.budget, d)
        q = self.pool_q(grid).view(b * n, self.budget, self.heads, hd).transpose(1, 2)  # (B*N, H, B_lat, hd)
        k, v = self.pool_kv(self.pool_norm(x)).view(b * n, m, 2, self.heads, hd).unbind(2)  # (B*N, m, H, hd)
        o = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2))  # (B*N, H, B_lat, hd)
        # residual on the queries so every latent keeps its own identity even when the frames agree
        o = grid + self.pool_proj(o.transpose(1, 2).reshape(b * n, self.budget, d))  # (B*N, B_lat, D)
        o = self.out_norm(o).view(b, n, self.budget, d).permute(0, 2, 1, 3)  # (B, B_lat, N, D)
        return o.contiguous()


def build_compressor(kind: str, *, dim: int, heads: int, num_tokens: int, budget: int,
                     num_actions: int) -> MemoryCompressor | None:
    """`None` for `kind="none"` (raw frames), else a `MemoryCompressor`."""
    if kind not in COMPRESSORS:
        raise ValueError(f"memory.compressor={kind!r} is unknown; choose one of {COMPRESSORS}")
    if kind == "none":
        return None
    return MemoryCompressor(kind, dim, heads, num_tokens, budget, num_actions)
