"""Attention kernels: chunked temporal attention (a PyTorch reference; a Triton kernel, opt-in on CUDA).

Public API::

    chunked_attention(q, k, v, *, tokens_per_frame=1, frames_per_chunk=1, q_frame_offset=0,
                      sink_frames=0, recent_frames=None, scale=None, return_lse=False, backend="auto")
    chunked_attention_mask(Lq, Lk, ...)        # the dense bool mask of the rule (reference, tests)
    visible_key_frames(n_query_frames, n_key_frames, ...)  # visible key-frame ranges per query chunk
    flex_mask_mod(...)                         # the rule as a FlexAttention mask_mod
    kept_attention_mass(q, k, *, ..., sink_frames, recent_frames)  # streaming layer's kept softmax mass

``kernels`` imports nothing from the other packages; triton is imported lazily on first use.
"""

from .attention import BACKEND_ENV_VAR, chunked_attention, resolve_backend
from .kept_mass import kept_attention_mass
from .mask import ChunkVisibility, chunked_attention_mask, flex_mask_mod, visible_key_frames

__all__ = [
    "chunked_attention",
    "chunked_attention_mask",
    "kept_attention_mass",
    "visible_key_frames",
    "ChunkVisibility",
    "flex_mask_mod",
    "resolve_backend",
    "BACKEND_ENV_VAR",
]
