"""The denoiser's memory path: how past frames (a `MemoryFrames`) reach the network, per memory.structure.

    mem = memory_tokens(model, memory, batch)      # raw frame tokens or compressed latents, or None
    cond = prefix_cond(model, mem)                 # prepend: the AdaLN condition of the prefix frames
    vec = concat_vector(model, mem, batch)         # channel_concat: (B,N,D) added to every window token
    kv = cross_kv(model, mem)                      # cross_attention: per-layer memory (K, V)

Functions of a `Denoiser` (arvdm/model/denoiser.py), which owns the parameters they use (the encoder, the
level / action embeddings, the compressor, memory_proj, memory_age, the blocks' cross attention). Both the
uncached forward (memory given per call) and the cached rollout's commit / refresh go through them, so the
two paths build the same memory.

A memory frame's noise level (`MemoryFrames.levels`, None = clean) is part of its condition, as every frame's
level is: it modulates the conv encoder's adaptive norms (every structure) and, for prepend, the prefix
frame's AdaLN in every block. (A plain patch DiT, model.unet_channels=[], has no encoder: there only prepend
sees a memory frame's level.) Compressed latents sit at level 0: the compressor read the frames' tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from arvdm.checks import value_checks_enabled
from arvdm.errors import ArvdmError
from memory import MemoryFrames
from memory.compress import sinusoidal

__all__ = ["DenoiserError", "MemoryTokens", "concat_vector", "cross_kv", "memory_levels", "memory_tokens",
           "prefix_cond"]


class DenoiserError(ArvdmError):
    """An input to the denoiser has the wrong shape/range, or a schedule it cannot serve.

    Defined here, beside the memory path that raises it too; `arvdm.model.denoiser` exports it.
    """


@dataclass
class MemoryTokens:
    """Memory as the network sees it: L frames of tokens (raw frames or compressed latents)."""

    tokens: torch.Tensor  # (B,L,N,D)
    actions: torch.Tensor  # (B,L) (the "no action" index for latents)
    positions: torch.Tensor  # (L,) absolute frame index used by RoPE
    ages: torch.Tensor  # (L,) frames between each memory frame and the window (>= 1)
    latent: bool
    levels: torch.Tensor  # (B,L) int64 noise level of each memory frame (0 = clean; latents: 0)


def memory_tokens(model, mem: MemoryFrames | None, batch: int) -> MemoryTokens | None:
    """MemoryFrames -> what the network sees (raw frame tokens or compressed latents); None for no memory.

    Raises `DenoiserError` naming the field that does not fit.
    """
    if mem is None or len(mem) == 0:
        return None
    model._check_frames(mem.frames, "memory.frames")
    m = mem.frames.shape[1]
    if mem.frames.shape[0] != batch:
        raise DenoiserError(f"memory.frames has batch {mem.frames.shape[0]}, the window has {batch}")
    model._check_actions(mem.actions, (batch, m), "memory.actions")
    pos = mem.frame_positions().to(mem.frames.device)  # (m,)
    if pos.shape != (m,):
        raise DenoiserError(f"memory.positions must be ({m},), got {tuple(pos.shape)}")
    start = mem.window_start
    if model.memory_concat and model.compressor is None and m > model.memory_slots:
        raise DenoiserError(f"channel_concat has {model.memory_slots} memory slots (memory.length), got "
                    f"{m} memory frames")
    levels = memory_levels(model, mem, batch)  # (B,m)
    tokens, _ = model._embed_frames(mem.frames, model._cond(levels, mem.actions))  # (B,m,N,D)
    ages = start - pos  # (m,)
    if model.pose_aware:
        if mem.poses is None or mem.target_poses is None:
            raise DenoiserError("a pose-aware model (memory.select=pose) needs memory.poses and "
                        "memory.target_poses (the poses of the frames to generate)")
        per_sample_ages = mem.ages if mem.ages is not None else ages.expand(batch, m)  # (B,m)
        tokens = tokens + model._tags(mem.poses, mem.target_poses, per_sample_ages)[:, :, None]  # (B,m,N,D)
    if model.compressor is None:
        return MemoryTokens(tokens, mem.actions, pos, ages, latent=False, levels=levels)
    lat = model.compressor(tokens, mem.actions, ages)  # (B,L,N,D)
    n_lat = lat.shape[1]
    lat_pos = start - n_lat + torch.arange(n_lat, device=lat.device)  # latents sit just before the window
    null = torch.full((batch, n_lat), model.null_action, dtype=torch.long, device=lat.device)
    return MemoryTokens(lat, null, lat_pos, start - lat_pos, latent=True, levels=torch.zeros_like(null))


def memory_levels(model, mem: MemoryFrames, batch: int) -> torch.Tensor:
    """The memory frames' noise levels (B,m) int64: `mem.levels`, checked, or zeros (clean) when None."""
    m = mem.frames.shape[1]
    if mem.levels is None:
        return torch.zeros_like(mem.actions)  # (B,m) clean
    lv = mem.levels
    if tuple(lv.shape) != (batch, m) or lv.is_floating_point() or lv.dtype == torch.bool:
        raise DenoiserError(f"memory.levels must be integer (B, m) = {(batch, m)}, got {tuple(lv.shape)} {lv.dtype}")
    # a memory frame at level K would be pure noise: the context level is 0..K-1 (value check: CPU / debug only)
    if lv.numel() and value_checks_enabled(lv) and (int(lv.min()) < 0 or int(lv.max()) >= model.num_levels):
        raise DenoiserError(f"memory.levels must be in 0..{model.num_levels - 1} (below diffusion.num_levels="
                            f"{model.num_levels}), got {int(lv.min())}..{int(lv.max())}")
    return lv.to(device=mem.actions.device, dtype=torch.long)


def prefix_cond(model, mem: MemoryTokens) -> torch.Tensor:
    """AdaLN condition of prefix frames: their noise level (0 = clean) + their action. (B,L,D)"""
    return model._cond(mem.levels, mem.actions)


def concat_vector(model, mem: MemoryTokens | None, batch: int) -> torch.Tensor:
    """channel_concat: memory (B,L',N,D) -> (B,N,D) added to every window token."""
    d, n, slots = model.pos_embed.shape[-1], model.num_tokens, model.memory_slots
    if mem is None:  # an empty bank: every slot is empty (zeros)
        tok = model.pos_embed.new_zeros(batch, slots, n, d)
    else:
        tok = mem.tokens if mem.latent else mem.tokens + model.action_embed(mem.actions)[:, :, None]
        # fewer frames than slots (a bank still filling up): empty slots are the oldest ones
        tok = F.pad(tok, (0, 0, 0, 0, slots - tok.shape[1], 0))  # (B,L,N,D)
    tok = tok.permute(0, 2, 1, 3).reshape(batch, n, slots * d)  # (B,N,L*D): frames along channels
    return model.memory_proj(tok)  # (B,N,D)


def cross_kv(model, mem: MemoryTokens) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """cross_attention: per layer (K, V) of the memory tokens (B,H,L*N,hd)."""
    tok = mem.tokens
    if not mem.latent:  # raw frames carry their action and how long ago they were seen
        age = model.memory_age(sinusoidal(mem.ages, tok.shape[-1]))  # (L,D)
        tok = tok + model.action_embed(mem.actions)[:, :, None] + age[None, :, None]  # (B,L,N,D)
    tok = tok.reshape(tok.shape[0], -1, tok.shape[-1])  # (B,L*N,D)
    return [blk.cross.memory_kv(tok) for blk in model.blocks]

