"""PyTorch reference backend: SDPA with the dense boolean mask of the rule.

Used on CPU (the model's default there) and as the oracle of the Triton kernel's tests. It builds the
(Lq, Lk) mask, so its memory is O(Lq * Lk) - fine for the CPU and for tests, not for long videos on a GPU.
Inputs are assumed validated by :func:`kernels.chunked_attention`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .mask import chunked_attention_mask

__all__ = ["reference_attention"]


def reference_attention(
    q: torch.Tensor,  # (B, H, Lq, D)
    k: torch.Tensor,  # (B, H, Lk, D)
    v: torch.Tensor,  # (B, H, Lk, D)
    *,
    tokens_per_frame: int,
    frames_per_chunk: int,
    q_frame_offset: int,
    sink_frames: int,
    recent_frames: int | None,
    scale: float,
    return_lse: bool,
):
    """Output (B, H, Lq, D) in q's dtype, and, if ``return_lse``, the fp32 log-sum-exp (B, H, Lq).

    The log-sum-exp is computed separately from the scaled, masked scores in fp32 (SDPA does not return
    it); both outputs are differentiable.
    """
    mask = chunked_attention_mask(
        q.shape[2], k.shape[2], tokens_per_frame=tokens_per_frame, frames_per_chunk=frames_per_chunk,
        q_frame_offset=q_frame_offset, sink_frames=sink_frames, recent_frames=recent_frames,
        device=q.device,
    )  # (Lq, Lk) bool, broadcast over B and H
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # (B, H, Lq, D)
    if not return_lse:
        return out
    # fp32 (float64 kept, for the tests' float64 oracle)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale  # (B, H, Lq, Lk)
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, H, Lq); finite: every query sees a key
    return out, lse
