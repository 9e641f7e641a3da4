"""Per-layer key/value cache of committed (clean) frames.

The denoiser's temporal attention stores, per layer, the keys and values of every frame that left the
window, so that a denoising step costs O(window + memory) instead of O(video length). The cache keeps
its tensors in the layout the attention kernel consumes, (B', H, F * tokens_per_frame, d), frame-major
along the sequence axis:

    factorized temporal attention: B' = B * N spatial positions, tokens_per_frame = 1
    full temporal attention:       B' = B,                        tokens_per_frame = N

Storage is a preallocated buffer (B', H, capacity, tokens_per_frame, d) that doubles when full, so an
append is amortised O(new frames); eviction by the layer's `RetentionPolicy` compacts it in place.
Each layer owns its cache and its policy, so some layers can stream (sink + recent) while others keep
everything (the hybrid-attention layout).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .retention import RetentionPolicy


class KVCache:
    """Keys and values of committed frames for one attention layer.

    Args:
        policy: which frames to keep (applied by `evict`).
        tokens_per_frame: tokens each frame contributes along the sequence axis.
        initial_capacity: frames the buffer holds before its first growth.
    """

    def __init__(self, policy: RetentionPolicy, tokens_per_frame: int = 1, initial_capacity: int = 16):
        if tokens_per_frame < 1:
            raise ValueError(f"KVCache: tokens_per_frame must be >= 1, got {tokens_per_frame}")
        self.policy = policy
        self.tokens_per_frame = tokens_per_frame
        self.initial_capacity = max(1, initial_capacity)
        self.reset()

    def reset(self) -> None:
        """Forget everything (the buffer is released too)."""
        self._k: torch.Tensor | None = None  # (B', H, capacity, tpf, d)
        self._v: torch.Tensor | None = None
        self._frames: list[int] = []  # absolute frame index of each stored frame, ascending

    # -- reading -----------------------------------------------------------------------------------
    @property
    def frame_ids(self) -> list[int]:
        """Absolute indices of the stored frames, in storage order."""
        return list(self._frames)

    @property
    def num_frames(self) -> int:
        return len(self._frames)

    def __len__(self) -> int:
        return len(self._frames)

    def keys_values(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(K, V), each (B', H, F * tokens_per_frame, d), views into the buffer; None when empty."""
        if not self._frames:
            return None
        f = len(self._frames)
        b, h, _, t, d = self._k.shape
        # (B', H, F, tpf, d) -> (B', H, F*tpf, d): frames are contiguous blocks of tpf tokens
        return self._k[:, :, :f].reshape(b, h, f * t, d), self._v[:, :, :f].reshape(b, h, f * t, d)

    def nbytes(self) -> int:
        """Bytes held by the stored frames' keys and values (what the policy keeps, not the slack)."""
        if not self._frames:
            return 0
        per_frame = self._k[:, :, :1].numel() * self._k.element_size()
        return 2 * per_frame * len(self._frames)

    def capacity_nbytes(self) -> int:
        """Bytes allocated by the buffer, slack included."""
        if self._k is None:
            return 0
        return 2 * self._k.numel() * self._k.element_size()

    # -- writing -----------------------------------------------------------------------------------
    def append(self, k: torch.Tensor, v: torch.Tensor, frame_ids: Sequence[int]) -> None:
        """Store keys/values (B', H, n * tokens_per_frame, d) of the frames with absolute `frame_ids`."""
        n = len(frame_ids)
        if k.shape != v.shape or k.dim() != 4:
            raise ValueError(f"KVCache.append: k and v must share a 4-D shape (B', H, L, d), got "
                             f"{tuple(k.shape)} and {tuple(v.shape)}")
        if k.shape[2] != n * self.tokens_per_frame:
            raise ValueError(f"KVCache.append: {k.shape[2]} tokens for {n} frames, expected "
                             f"{n * self.tokens_per_frame} (tokens_per_frame={self.tokens_per_frame})")
        if self._frames and min(frame_ids) <= self._frames[-1]:
            raise ValueError(f"KVCache.append: frame ids must increase; stored up to {self._frames[-1]}, "
                             f"got {list(frame_ids)}")
        if n == 0:
            return
        b, h, _, d = k.shape
        t = self.tokens_per_frame
        k5 = k.reshape(b, h, n, t, d)  # (B', H, n, tpf, d)
        v5 = v.reshape(b, h, n, t, d)
        f = len(self._frames)
        if self._k is None or self._k.shape[0] != b or self._k.shape[1] != h or self._k.shape[4] != d:
            if self._frames:
                raise ValueError(f"KVCache.append: got (B', H, d) = {(b, h, d)}, the cache holds "
                                 f"{(self._k.shape[0], self._k.shape[1], self._k.shape[4])}")
            self._alloc(b, h, t, d, max(self.initial_capacity, n), k.dtype, k.device)
        elif f + n > self._k.shape[2]:
            self._grow(max(2 * self._k.shape[2], f + n))
        self._k[:, :, f:f + n] = k5.to(self._k.dtype)
        self._v[:, :, f:f + n] = v5.to(self._v.dtype)
        self._frames.extend(int(i) for i in frame_ids)

    def evict(self, n_committed: int) -> None:
        """Drop the stored frames that the policy no longer keeps after `n_committed` commits."""
        keep = set(self.policy.kept_indices(n_committed))
        slots = [i for i, fid in enumerate(self._frames) if fid in keep]
        if len(slots) == len(self._frames):
            return
        idx = torch.tensor(slots, dtype=torch.long, device=self._k.device)
        # advanced indexing copies, so writing back into the same buffer cannot alias
        kept_k = self._k.index_select(2, idx)  # (B', H, kept, tpf, d)
        kept_v = self._v.index_select(2, idx)
        self._k[:, :, :len(slots)] = kept_k
        self._v[:, :, :len(slots)] = kept_v
        self._frames = [self._frames[i] for i in slots]

    # -- buffer management -------------------------------------------------------------------------
    def _alloc(self, b, h, t, d, cap, dtype, device) -> None:
        self._k = torch.empty(b, h, cap, t, d, dtype=dtype, device=device)  # (B', H, cap, tpf, d)
        self._v = torch.empty_like(self._k)

    def _grow(self, cap: int) -> None:
        f = len(self._frames)
        b, h, _, t, d = self._k.shape
        new_k = torch.empty(b, h, cap, t, d, dtype=self._k.dtype, device=self._k.device)
        new_v = torch.empty_like(new_k)
        new_k[:, :, :f] = self._k[:, :, :f]
        new_v[:, :, :f] = self._v[:, :, :f]
        self._k, self._v = new_k, new_v

    def __repr__(self) -> str:
        return (f"KVCache(policy={self.policy}, frames={self.num_frames}, "
                f"tokens_per_frame={self.tokens_per_frame}, nbytes={self.nbytes()})")
