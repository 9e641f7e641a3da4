"""Per-layer key/value cache of committed (clean) frames.

The denoiser's temporal attention stores, per layer, the keys and values of every frame that left the
window, so that a denoising step costs O(window + memory) instead of O(video length). The cache keeps
its tensors in the layout the attention kernel consumes, (B', H, F * tokens_per_frame, d), frame-major
along the sequence axis:

    factorized temporal attention: B' = B * N spatial positions, tokens_per_frame = 1
    full temporal attention:       B' = B,                        tokens_per_frame = N

Storage is a preallocated buffer (B', H, capacity, tokens_per_frame, d) holding the stored frames in the
slots [start, start + F). Appends write after them; evicting the oldest frames (a sliding window, `last`)
only moves `start`, and the frames are moved back to slot 0 once the slack at the end is used up, with
slack kept at >= F/2 frames, so a sliding window costs O(new frames) per commit amortised instead of a
copy of the whole cache. Evictions that are not a prefix (`sink_recent` dropping the frame after the
sinks) compact with one gather. `keys_values_with(k, v)` writes a window's K/V into the slack and returns
past + window as views, so attention over the cache needs no concatenation copy of the past.
Each layer owns its cache and its policy, so some layers can stream (sink + recent) while others keep
everything (the hybrid-attention layout); `shrink_to_fit` releases the long buffer of a cache whose policy
became bounded.
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
        self._start = 0  # slot of the first stored frame; stored frames are slots [start, start + F)
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
        return self._view(len(self._frames))

    def _view(self, f: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots [start, start + f) as (B', H, f * tpf, d) views."""
        b, h, _, t, d = self._k.shape
        s = self._start
        # (B', H, f, tpf, d) -> (B', H, f*tpf, d): frames are contiguous blocks of tpf tokens (a view)
        return self._k[:, :, s:s + f].reshape(b, h, f * t, d), self._v[:, :, s:s + f].reshape(b, h, f * t, d)

    def keys_values_with(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(stored + `k`, stored + `v`), each (B', H, (F + n) * tokens_per_frame, d), without copying the past.

        `k`, `v` (B', H, n * tokens_per_frame, d) are the current window's keys/values: they are written into
        the buffer's slack after the stored frames (not committed: the next `append` overwrites them) and
        the result is a view. Equal to ``torch.cat([keys_values()[0], k], dim=2)``, minus the copy of the
        stored frames that the concatenation makes at every denoising call. The views are valid until the
        next call that writes the cache.
        """
        b, h, L, d = self._check_kv(k, v)
        n = L // self.tokens_per_frame
        if self._k is None or not self._frames:
            return k, v
        self._reserve(n, b, h, d)
        f, s = len(self._frames), self._start
        self._k[:, :, s + f:s + f + n] = k.reshape(b, h, n, self.tokens_per_frame, d)  # (B', H, n, tpf, d)
        self._v[:, :, s + f:s + f + n] = v.reshape(b, h, n, self.tokens_per_frame, d)
        return self._view(f + n)

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
    def _check_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int]:
        if k.shape != v.shape or k.dim() != 4:
            raise ValueError(f"KVCache: k and v must share a 4-D shape (B', H, L, d), got "
                             f"{tuple(k.shape)} and {tuple(v.shape)}")
        if k.shape[2] % self.tokens_per_frame:
            raise ValueError(f"KVCache: {k.shape[2]} tokens is not a whole number of frames of "
                             f"tokens_per_frame={self.tokens_per_frame}")
        b, h, L, d = k.shape
        if self._k is not None and self._frames and (self._k.shape[0], self._k.shape[1], self._k.shape[4]) != (b, h, d):
            raise ValueError(f"KVCache.append: got (B', H, d) = {(b, h, d)}, the cache holds "
                             f"{(self._k.shape[0], self._k.shape[1], self._k.shape[4])}")
        return b, h, L, d

    def append(self, k: torch.Tensor, v: torch.Tensor, frame_ids: Sequence[int]) -> None:
        """Store keys/values (B', H, n * tokens_per_frame, d) of the frames with absolute `frame_ids`."""
        n = len(frame_ids)
        b, h, L, d = self._check_kv(k, v)
        if L != n * self.tokens_per_frame:
            raise ValueError(f"KVCache.append: {L} tokens for {n} frames, expected "
                             f"{n * self.tokens_per_frame} (tokens_per_frame={self.tokens_per_frame})")
        if self._frames and min(frame_ids) <= self._frames[-1]:
            raise ValueError(f"KVCache.append: frame ids must increase; stored up to {self._frames[-1]}, "
                             f"got {list(frame_ids)}")
        if n == 0:
            return
        if self._k is None or not self._frames and (self._k.shape[0], self._k.shape[1], self._k.shape[4]) != (b, h, d):
            self._alloc(b, h, self.tokens_per_frame, d, max(self.initial_capacity, n), k.dtype, k.device)
        self._reserve(n, b, h, d)
        f, s = len(self._frames), self._start
        t = self.tokens_per_frame
        self._k[:, :, s + f:s + f + n] = k.reshape(b, h, n, t, d).to(self._k.dtype)  # (B', H, n, tpf, d)
        self._v[:, :, s + f:s + f + n] = v.reshape(b, h, n, t, d).to(self._v.dtype)
        self._frames.extend(int(i) for i in frame_ids)

    def evict(self, n_committed: int) -> None:
        """Drop the stored frames that the policy no longer keeps after `n_committed` commits."""
        keep = set(self.policy.kept_indices(n_committed))
        slots = [i for i, fid in enumerate(self._frames) if fid in keep]
        if len(slots) == len(self._frames):
            return
        dropped = len(self._frames) - len(slots)
        if slots == list(range(dropped, len(self._frames))):  # the oldest frames go: just move the start
            self._start += dropped
            self._frames = self._frames[dropped:]
            if not self._frames:
                self._start = 0
            return
        idx = torch.tensor(slots, dtype=torch.long, device=self._k.device) + self._start
        # advanced indexing copies, so writing back into the same buffer cannot alias
        kept_k = self._k.index_select(2, idx)  # (B', H, kept, tpf, d)
        kept_v = self._v.index_select(2, idx)
        self._k[:, :, :len(slots)] = kept_k
        self._v[:, :, :len(slots)] = kept_v
        self._start = 0
        self._frames = [self._frames[i] for i in slots]

    def shrink_to_fit(self) -> None:
        """Reallocate the buffer to exactly the stored frames, releasing the rest (the old buffer is freed).

        For a cache whose policy just became bounded (a layer converted to streaming): its buffer was sized
        for the long memory it held before; afterwards the next append regrows it to the bounded working
        size (stored + appended frames + slack, see `_reserve`), never to the old size.
        """
        if self._k is None:
            return
        f, s = len(self._frames), self._start
        if f == 0:
            self._k = self._v = None
            self._start = 0
            return
        if self._k.shape[2] == f:
            return
        self._k = self._k[:, :, s:s + f].clone()  # a new (B', H, F, tpf, d) buffer; the old one is released
        self._v = self._v[:, :, s:s + f].clone()
        self._start = 0

    # -- buffer management -------------------------------------------------------------------------
    def _alloc(self, b, h, t, d, cap, dtype, device) -> None:
        self._k = torch.empty(b, h, cap, t, d, dtype=dtype, device=device)  # (B', H, cap, tpf, d)
        self._v = torch.empty_like(self._k)
        self._start = 0

    def _reserve(self, n: int, b: int, h: int, d: int) -> None:
        """Make room for `n` frames after the stored ones: move them to slot 0, or reallocate."""
        f, cap = len(self._frames), self._k.shape[2]
        if self._start + f + n <= cap:
            return
        # After a move the slack is cap - f - n; keeping it >= f/2 makes the moves O(1) per appended frame.
        want = f + n + max(n, f // 2)
        new_cap = cap if cap >= want else max(want, 2 * cap if self._start == 0 else want)
        s = self._start
        if new_cap == cap:  # move the stored frames to the front of the same buffer
            self._k[:, :, :f] = self._k[:, :, s:s + f].clone()  # the ranges may overlap: copy first
            self._v[:, :, :f] = self._v[:, :, s:s + f].clone()
        else:
            _, _, _, t, _ = self._k.shape
            new_k = torch.empty(b, h, new_cap, t, d, dtype=self._k.dtype, device=self._k.device)
            new_v = torch.empty_like(new_k)
            new_k[:, :, :f] = self._k[:, :, s:s + f]
            new_v[:, :, :f] = self._v[:, :, s:s + f]
            self._k, self._v = new_k, new_v
        self._start = 0

    def __repr__(self) -> str:
        return (f"KVCache(policy={self.policy}, frames={self.num_frames}, "
                f"tokens_per_frame={self.tokens_per_frame}, nbytes={self.nbytes()})")
