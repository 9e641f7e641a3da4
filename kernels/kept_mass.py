"""Kept attention mass: how much of a query's softmax attention a streaming (sink + recent) layer keeps.

LightTransfer (arXiv 2410.13846, Eq. 1) calls a layer "lazy" when its queries put almost all their
attention on the first (sink) keys and the most recent ones. For one query the kept mass is

    kept(q) = sum_{k visible to the streaming rule} softmax(q.k)  =  exp(lse_streaming(q) - lse_full(q))

where both log-sum-exps run over the scaled scores under the chunked mask rule of :mod:`kernels.mask`
(the streaming one additionally drops the frames that are neither sinks nor recent). The ratio is exact:
the two sums share every term that the streaming rule keeps, so no softmax is ever materialised.
"""

from __future__ import annotations

import math

import torch

from .attention import _check_inputs, chunked_attention, resolve_backend
from .mask import _as_int, check_rule, chunked_attention_mask

__all__ = ["kept_attention_mass"]


def _reference_lses(q, k, *, scale, lse_full, **rule):
    """(lse_full, lse_streaming), each (B, H, Lq) fp32, from one fp32 score matrix and two dense masks."""
    streaming = chunked_attention_mask(q.shape[2], k.shape[2], device=q.device, **rule)  # (Lq, Lk)
    full_rule = dict(rule, sink_frames=0, recent_frames=None)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # (B, H, Lq, Lk)
    lse_s = torch.logsumexp(scores.masked_fill(~streaming, float("-inf")), dim=-1)  # (B, H, Lq)
    if lse_full is None:
        full = chunked_attention_mask(q.shape[2], k.shape[2], device=q.device, **full_rule)
        lse_full = torch.logsumexp(scores.masked_fill(~full, float("-inf")), dim=-1)
    return lse_full, lse_s


@torch.no_grad()
def kept_attention_mass(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    tokens_per_frame: int = 1,
    frames_per_chunk: int = 1,
    q_frame_offset: int = 0,
    sink_frames: int = 0,
    recent_frames: int,
    scale: float | None = None,
    backend: str = "auto",
    lse_full: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per query, the fraction of its attention that a streaming layer (sink + recent frames) keeps.

    Args:
        q: (B, H, Lq, D) queries; k: (B, H, Lk, D) keys, laid out as for :func:`kernels.chunked_attention`
            (the same ``tokens_per_frame`` / ``frames_per_chunk`` / ``q_frame_offset`` rule).
        sink_frames, recent_frames: the streaming rule whose kept keys are counted (``recent_frames >= 1``).
        scale: score scale; default ``1 / sqrt(D)``.
        backend: "auto", "triton" or "reference" (as :func:`kernels.chunked_attention`).
        lse_full: optional (B, H, Lq) log-sum-exp of the full (non-streaming) attention under the same
            rule and scale, e.g. the one a model's attention call just returned; then only the streaming
            log-sum-exp is computed (the "one extra lse per layer" of an online measurement).

    Returns:
        (B, H, Lq) float32 in (0, 1]: ``exp(lse_streaming - lse_full)`` (LightTransfer, Eq. 1 per query).
        It is 1 where the streaming rule keeps every key the query sees.
    """
    if recent_frames is None:
        raise ValueError("kept_attention_mass: recent_frames must be an int >= 1 (the streaming window "
                         "whose kept mass is measured), got None")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    rule = dict(tokens_per_frame=tokens_per_frame, frames_per_chunk=frames_per_chunk,
                q_frame_offset=q_frame_offset, sink_frames=sink_frames, recent_frames=recent_frames)
    if lse_full is not None and tuple(lse_full.shape) != tuple(q.shape[:3]):
        raise ValueError(f"kept_attention_mass: lse_full must be (B, H, Lq) = {tuple(q.shape[:3])}, got "
                         f"{tuple(lse_full.shape)}")
    _check_inputs(q, k, k)  # shapes, dtypes, devices, with errors naming the argument
    t = _as_int("tokens_per_frame", tokens_per_frame, 1)
    if q.shape[2] % t or k.shape[2] % t:
        raise ValueError(f"q length {q.shape[2]} and k length {k.shape[2]} must be multiples of "
                         f"tokens_per_frame={t}")
    check_rule(q.shape[2] // t, k.shape[2] // t, frames_per_chunk=frames_per_chunk,
               q_frame_offset=q_frame_offset, sink_frames=sink_frames, recent_frames=recent_frames)
    # v = k below: only the log-sum-exps are used
    if resolve_backend(backend, q) == "reference":
        lse_full, lse_s = _reference_lses(q, k, scale=scale, lse_full=lse_full, **rule)
    else:
        _, lse_s = chunked_attention(q, k, k, scale=scale, return_lse=True, backend=backend, **rule)
        if lse_full is None:
            _, lse_full = chunked_attention(q, k, k, scale=scale, return_lse=True, backend=backend,
                                            **dict(rule, sink_frames=0, recent_frames=None))
    # the streaming keys are a subset of the full keys, so lse_s <= lse_full; clamp fp rounding above 1
    return torch.exp(lse_s.float() - lse_full.float()).clamp_(max=1.0)  # (B, H, Lq)
