"""The denoiser's convolutional spatial path: a per-frame U-Net encoder / decoder around the token grid.

Frames are folded into the batch (x (B*T,C,H,W), cond (B*T,D)), so the convolutions never mix frames and
the temporal rules (chunked causality, cached == recomputed) hold unchanged. As in Diffusion Forcing's and
DDPM's U-Nets, the per-frame condition (noise level + action) enters every ResBlock through its group norm.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["ActionAdvection", "ConvDecoder", "ConvEncoder", "ResBlock"]

MAX_NORM_GROUPS = 8  # GroupNorm groups of the small U-Nets here (fewer when they do not divide the channels)
# Adam moves a parameter by about lr per step whatever its gradient, so a kernel's logits are stored divided by this:
# a kernel that starts uniform sharpens into a shift within a few hundred steps at the tiny preset's lr.
ADVECTION_LOGIT_SCALE = 20.0


def norm_groups(channels: int) -> int:
    """GroupNorm groups: 8 when they divide the channels, else the largest power of two below that does."""
    return next(g for g in (MAX_NORM_GROUPS, 4, 2, 1) if channels % g == 0)


class ResBlock(nn.Module):
    """Convolutional residual block with adaptive group norm (per-frame scale/shift from the cond).

    Works on frames folded into the batch: x (B*T,C,H,W), cond (B*T,D).
    """

    def __init__(self, c_in: int, c_out: int, cond_dim: int):
        super().__init__()
        self.norm1 = nn.GroupNorm(norm_groups(c_in), c_in)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.norm2 = nn.GroupNorm(norm_groups(c_out), c_out, affine=False)
        self.ada = nn.Linear(cond_dim, 2 * c_out)  # -> (scale, shift) of norm2
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1)
        self.skip = nn.Conv2d(c_in, c_out, 1) if c_in != c_out else nn.Identity()
        nn.init.zeros_(self.conv2.weight)  # every block starts as its skip path
        nn.init.zeros_(self.conv2.bias)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))  # (B*T,Co,H,W)
        scale, shift = self.ada(cond)[:, :, None, None].chunk(2, dim=1)  # (B*T,Co,1,1) each
        h = self.conv2(F.silu(self.norm2(h) * (1 + scale) + shift))
        return self.skip(x) + h


class ConvEncoder(nn.Module):
    """Per-frame convolutional path down to the token grid: one ResBlock per level, stride-2 between.

    Level i runs at image_size / 2**i with `channels[i]` channels; its output is kept as a skip for
    the decoder. The last level's feature map (image_size / 2**(L-1)) is what the patch embedding
    turns into tokens, so the transformer blocks (temporal attention, memory, KV caches) run at the
    lowest resolution, where a frame is a few dozen tokens.
    """

    def __init__(self, in_channels: int, channels: list[int], cond_dim: int):
        super().__init__()
        self.stem = nn.Conv2d(in_channels, channels[0], 3, padding=1)
        self.down = nn.ModuleList(nn.Conv2d(a, b, 3, stride=2, padding=1) for a, b in zip(channels, channels[1:]))
        self.blocks = nn.ModuleList(ResBlock(c, c, cond_dim) for c in channels)

    def forward(self, x: torch.Tensor, cond: torch.Tensor,
                extra: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`extra` (B*T,c0,H,W), if given, is added to the stem's output (the denoiser's last-frame input)."""
        h, skips = self.stem(x), []  # (B*T,c0,H,W)
        if extra is not None:
            h = h + extra
        for i, blk in enumerate(self.blocks):
            if i > 0:
                h = self.down[i - 1](h)  # (B*T,ci,H/2^i,W/2^i)
            h = blk(h, cond)
            skips.append(h)
        return h, skips


class ConvDecoder(nn.Module):
    """Mirror of `ConvEncoder`: per level, concat the skip, ResBlock, upsample; a zero-init conv to pixels."""

    def __init__(self, out_channels: int, channels: list[int], cond_dim: int):
        super().__init__()
        self.blocks = nn.ModuleList(ResBlock(2 * c, c, cond_dim) for c in channels)
        self.up = nn.ModuleList(nn.Conv2d(b, a, 3, padding=1) for a, b in zip(channels, channels[1:]))
        self.norm = nn.GroupNorm(norm_groups(channels[0]), channels[0])
        self.out = nn.Conv2d(channels[0], out_channels, 3, padding=1)
        nn.init.zeros_(self.out.weight)  # training starts from v = 0
        nn.init.zeros_(self.out.bias)

    def forward(self, h: torch.Tensor, skips: list[torch.Tensor], cond: torch.Tensor) -> torch.Tensor:
        for i in reversed(range(len(self.blocks))):
            h = self.blocks[i](torch.cat([h, skips[i]], dim=1), cond)  # (B*T,ci,.,.)
            if i > 0:
                h = self.up[i - 1](F.interpolate(h, scale_factor=2.0, mode="nearest"))  # (B*T,c_{i-1},2x,2x)
        return self.out(F.silu(self.norm(h)))  # (B*T,C,H,W)


class ActionAdvection(nn.Module):
    """The last past frame moved along the window's actions by one learned kernel per action (CDNA advection).

    Finn, Goodfellow & Levine 2016 ("Unsupervised learning for physical interaction through video prediction")
    predict the next frame as the previous one convolved with normalised kernels (their eq. 2: a softmax over the
    kernel's taps, so pixels are moved, never created); here the kernel is chosen by the frame's action, and window
    frame j gets the last frame advected by a_0, ..., a_j in turn: frame j lies j + 1 steps after it. A turn in
    Memory Maze shifts the 32 px image by about 7 px, a move the denoiser's global (AdaLN) action condition cannot
    express; the advected frame reaches the encoder like the last frame does (`stem`, zero-initialised).
    Borders are replicated: zeros would paint the revealed strip grey and make a shift worse than a copy.

        adv = advection(last, actions)       # (B,C,H,W), (B,T) -> (B,T,C,H,W)
        extra = advection.stem(adv.flatten(0, 1))

    Kernels start uniform (every shift equally likely); they are learned from the denoiser's loss and from the
    objective's reconstruction term |adv - x0|^2 (the CDNA objective), which trains them from the first step.
    Computed in float32 outside autocast: a bf16 kernel would not sum to 1.
    """

    def __init__(self, num_actions: int, radius: int, channels: int, out_channels: int):
        super().__init__()
        self.radius = radius
        # one row per action + the "no action" index; stored / ADVECTION_LOGIT_SCALE (see its comment)
        self.logits = nn.Parameter(torch.zeros(num_actions + 1, (2 * radius + 1) ** 2))
        self.stem = nn.Conv2d(channels, out_channels, 3, padding=1)
        nn.init.zeros_(self.stem.weight)  # a fresh model computes what it did without the advected frame
        nn.init.zeros_(self.stem.bias)

    def kernels(self) -> torch.Tensor:
        """(A+1, 2r+1, 2r+1) float32 kernels, each summing to 1."""
        k = 2 * self.radius + 1
        return torch.softmax(self.logits.float() * ADVECTION_LOGIT_SCALE, dim=-1).view(-1, k, k)

    def forward(self, last: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """last (B,C,H,W), actions (B,T) int64 -> (B,T,C,H,W) float32: frame j advected by actions[:, :j+1]."""
        b, c, h, w = last.shape
        r, k = self.radius, 2 * self.radius + 1
        with torch.autocast(device_type=last.device.type, enabled=False):
            kern = self.kernels()  # (A+1,k,k)
            f, out = last.float().reshape(1, b * c, h, w), []
            for j in range(actions.shape[1]):
                wj = kern[actions[:, j]][:, None].expand(b, c, k, k).reshape(b * c, 1, k, k)  # per sample and channel
                f = F.conv2d(_replicate_pad(f, r), wj, groups=b * c)  # (1,B*C,H,W)
                out.append(f.view(b, c, h, w))
        return torch.stack(out, dim=1)  # (B,T,C,H,W)


@torch.compiler.disable
def _replicate_pad(f: torch.Tensor, r: int) -> torch.Tensor:
    """(..., H, W) -> (..., H+2r, W+2r), borders replicated. Eager under torch.compile: inductor (torch 2.14) lowers
    the backward of this pad with channels-last strides that its own meta kernel then rejects (an AssertionError
    in `replication_pad2d_backward` at the first compiled training step; tests/test_training_perf.py)."""
    return F.pad(f, (r, r, r, r), mode="replicate")
