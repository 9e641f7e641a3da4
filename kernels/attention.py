"""``chunked_attention``: the one entry point, input checks and backend dispatch."""

from __future__ import annotations

import math
import os

import torch

from .mask import _as_int, check_rule
from .reference import reference_attention

__all__ = ["chunked_attention", "BACKEND_ENV_VAR", "resolve_backend"]

BACKEND_ENV_VAR = "ARVDM_ATTENTION_BACKEND"
# The compiled (non-interpreted) Triton kernel has not yet passed `TRITON_INTERPRET=0 pytest
# tests/test_kernels_triton.py` on a GPU: until it has, "auto" takes the PyTorch path (SDPA with the mask)
# on CUDA too and Triton is opt-in (backend="triton" or ARVDM_ATTENTION_BACKEND=triton). Set this to True
# in the commit that records the passing GPU run (benchmarks/gpu_check.sh).
TRITON_VERIFIED_ON_GPU = False
_BACKENDS = ("auto", "triton", "reference")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _triton_module():
    """Import the Triton backend lazily: importing `kernels` must stay cheap and work without triton."""
    from . import triton_attention  # lazy: importing kernels must not need triton

    return triton_attention


def resolve_backend(backend: str, q: torch.Tensor) -> str:
    """The backend that :func:`chunked_attention` will use for ``q``: "triton" or "reference".

    ``backend="auto"`` picks the reference (SDPA with the dense mask) on every device while
    ``TRITON_VERIFIED_ON_GPU`` is False (the compiled kernel has only run under the interpreter); once it
    is True, Triton for CUDA tensors (when triton is importable, not in interpreter mode, and the head dim
    is supported) and the reference otherwise. The environment variable
    ``ARVDM_ATTENTION_BACKEND`` (auto | triton | reference) overrides "auto". An explicit "triton" or
    "reference" argument always wins. Forcing Triton on CPU tensors needs ``TRITON_INTERPRET=1`` set
    before triton is imported.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    if backend == "auto":
        env = os.environ.get(BACKEND_ENV_VAR, "").strip().lower()
        if env and env not in _BACKENDS:
            raise ValueError(f"environment variable {BACKEND_ENV_VAR}={env!r}: expected one of {_BACKENDS}")
        backend = env or "auto"
    D = q.shape[-1]
    if backend == "auto":
        if not q.is_cuda or not TRITON_VERIFIED_ON_GPU:
            return "reference"
        ta = _triton_module()
        # Under the interpreter the "kernel" is numpy on the host: never pick it silently for speed.
        ok = ta.HAS_TRITON and not ta.INTERPRETED and D <= ta.MAX_HEAD_DIM
        return "triton" if ok else "reference"
    if backend == "triton":
        ta = _triton_module()
        if not ta.HAS_TRITON:
            raise RuntimeError("backend='triton' but the `triton` package is not importable; use 'reference'")
        if D > ta.MAX_HEAD_DIM:
            raise ValueError(f"head dim {D} is not supported by the Triton backend (at most "
                             f"{ta.MAX_HEAD_DIM}); use backend='reference' or split the heads")
        if not q.is_cuda:
            if not ta.INTERPRETED:
                raise RuntimeError(
                    f"backend='triton' with tensors on {q.device}: Triton runs on CUDA, or on the CPU only "
                    "through its interpreter, which needs TRITON_INTERPRET=1 in the environment before "
                    "triton is first imported; use backend='reference' on the CPU")
        if ta.INTERPRETED and q.dtype == torch.bfloat16:
            raise ValueError("dtype torch.bfloat16 is not supported by the Triton interpreter "
                             "(TRITON_INTERPRET=1); use float16/float32 or backend='reference'")
    return backend


def _check_inputs(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (B, H, L, D), got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; supported: float16, bfloat16, float32")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch, heads and head dim "
                         "(shapes are (B, H, L, D))")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.shape[3] < 1:
        raise ValueError("head dim (last dim of q, k, v) must be >= 1, got 0")


def chunked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    tokens_per_frame: int = 1,
    frames_per_chunk: int = 1,
    q_frame_offset: int = 0,
    sink_frames: int = 0,
    recent_frames: int | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    backend: str = "auto",
):
    """Block-causal (chunked) temporal attention, optionally streaming (sink + recent frames).

    Args:
        q: (B, H, Lq, D) queries of the current window, ``Lq = query frames * tokens_per_frame``.
        k, v: (B, H, Lk, D) keys / values of memory prefix + cached past + the window,
            ``Lk = key frames * tokens_per_frame``. q, k, v share dtype (float16, bfloat16, float32)
            and device.
        tokens_per_frame: tokens per frame (1 for factorized temporal attention, H'*W' for full).
        frames_per_chunk: frames that see each other; chunks count from the window's first frame.
        q_frame_offset: index of the window's first frame among the key frames; the window must fit:
            ``q_frame_offset + query frames <= key frames``.
        sink_frames: first key frames always visible to a streaming layer (ignored unless
            ``recent_frames`` is set).
        recent_frames: if set (>= 1), a streaming layer: besides the sinks a query sees only its own
            chunk and the ``recent_frames`` frames before it.
        scale: score scale; default ``1 / sqrt(D)``.
        return_lse: also return the natural-log log-sum-exp of the scaled, masked scores, (B, H, Lq)
            fp32 (differentiable).
        backend: "auto" (the reference until the Triton kernel is verified on a GPU, see
            :func:`resolve_backend`; env ``ARVDM_ATTENTION_BACKEND`` overrides), "triton" or "reference".

    Returns:
        out (B, H, Lq, D) in q's dtype, or ``(out, lse)`` when ``return_lse``.

    Rule: query token i (frame ``f_q = q_frame_offset + i // tokens_per_frame``) sees key token j
    (frame ``f_k = j // tokens_per_frame``) when ``chunk(f_k) <= chunk(f_q)`` with
    ``chunk(f) = floor((f - q_frame_offset) / frames_per_chunk)`` and, if streaming,
    ``f_k < sink_frames or f_k >= q_frame_offset + chunk(f_q) * frames_per_chunk - recent_frames``.
    See :mod:`kernels.mask`.
    """
    _check_inputs(q, k, v)
    t = _as_int("tokens_per_frame", tokens_per_frame, 1)
    Lq, Lk, D = q.shape[2], k.shape[2], q.shape[3]
    if Lq % t:
        raise ValueError(f"q length Lq={Lq} is not a multiple of tokens_per_frame={t}")
    if Lk % t:
        raise ValueError(f"k/v length Lk={Lk} is not a multiple of tokens_per_frame={t}")
    # also the O(1) "every query sees a key" check: see kernels.mask.check_rule
    _, _, c, off, sink, recent = check_rule(
        Lq // t, Lk // t, frames_per_chunk=frames_per_chunk, q_frame_offset=q_frame_offset,
        sink_frames=sink_frames, recent_frames=recent_frames)
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    else:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) \
                or scale == 0:
            raise ValueError(f"scale must be a finite nonzero number or None, got {scale!r}")
        scale = float(scale)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")

    which = resolve_backend(backend, q)
    kw = dict(tokens_per_frame=t, frames_per_chunk=c, q_frame_offset=off, sink_frames=sink,
              recent_frames=recent, scale=scale, return_lse=return_lse)
    if which == "reference" or q.numel() == 0 or k.numel() == 0:  # nothing to launch for empty inputs
        return reference_attention(q, k, v, **kw)
    return _triton_module().triton_chunked_attention(q, k, v, **kw)
