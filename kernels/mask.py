"""The chunked temporal attention mask rule, in one place.

Every backend (the PyTorch reference, the Triton kernel, the FlexAttention baseline in the benchmark)
implements the same rule, written here once in plain Python / torch:

* key token ``j`` belongs to key frame ``f_k = j // tokens_per_frame``;
* query token ``i`` belongs to frame ``f_q = q_frame_offset + i // tokens_per_frame`` (the queries are the
  current window; the keys hold memory prefix + cached past + the window, so the window starts at key
  frame ``q_frame_offset``);
* chunks count from the window: ``chunk(f) = floor((f - q_frame_offset) / frames_per_chunk)``, so every
  frame before the window (memory, cached past) is an earlier chunk;
* a query sees a key when ``chunk(f_k) <= chunk(f_q)`` and, for a streaming layer (``recent_frames`` set),
  also ``f_k < sink_frames`` or ``f_k >= chunk_start(f_q) - recent_frames`` where
  ``chunk_start(f_q) = q_frame_offset + chunk(f_q) * frames_per_chunk``.

Because ``chunk(f_k) <= chunk(f_q)`` is the same as ``f_k < chunk_end(f_q)`` (with
``chunk_end = chunk_start + frames_per_chunk``), the visible keys of one query chunk are at most two
contiguous key-frame ranges: the sinks ``[0, sink_frames)`` and the recent range
``[chunk_start - recent_frames, chunk_end)`` (just ``[0, chunk_end)`` when not streaming). The Triton
kernel uses exactly these ranges to skip key blocks; :func:`visible_key_frames` exposes them to callers.

A query always sees its own frame (``chunk_start <= f_q < chunk_end``), so as long as the window lies
inside the keys (``q_frame_offset + query frames <= key frames``, checked by :func:`check_rule`) no query
is ever left without a key.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable

import torch

__all__ = [
    "ChunkVisibility",
    "chunked_attention_mask",
    "visible_key_frames",
    "flex_mask_mod",
    "check_rule",
]


def _as_int(name: str, value, minimum: int | None = None) -> int:
    """``value`` as a Python int (rejecting floats/bools), with an error naming the argument."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool {value!r}")
    try:
        out = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None
    if minimum is not None and out < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {out}")
    return out


def check_rule(
    num_query_frames: int,
    num_key_frames: int,
    *,
    frames_per_chunk: int = 1,
    q_frame_offset: int = 0,
    sink_frames: int = 0,
    recent_frames: int | None = None,
) -> tuple[int, int, int, int, int, int | None]:
    """Validate a mask rule at frame level; return the normalised ints.

    Raises ``TypeError`` / ``ValueError`` naming the argument that is wrong. The check that the window
    lies inside the keys is also the (cheap, O(1)) check that every query sees at least one key: a query
    always sees its own frame, and only a window that runs past the keys can leave a query without one.
    """
    nq = _as_int("number of query frames", num_query_frames, 0)
    nk = _as_int("number of key frames", num_key_frames, 0)
    c = _as_int("frames_per_chunk", frames_per_chunk, 1)
    off = _as_int("q_frame_offset", q_frame_offset, 0)
    sink = _as_int("sink_frames", sink_frames, 0)
    if recent_frames is not None:
        # >= 1: a streaming window that keeps no frame before the query's chunk is almost always a
        # tokens->frames conversion that rounded to zero; None means "not streaming".
        recent = _as_int("recent_frames", recent_frames, 1)
    else:
        recent = None
    if off + nq > nk:
        raise ValueError(
            f"the query window (frames [{off}, {off + nq}) = q_frame_offset {off} + {nq} query frames) runs "
            f"past the {nk} key frames; the keys must hold memory + cached past + the whole window, "
            f"otherwise queries of frames >= {nk} would see no key (not even their own frame)"
        )
    return nq, nk, c, off, sink, recent


@dataclass(frozen=True)
class ChunkVisibility:
    """The key frames that the queries of one chunk of the window may attend to.

    ``query_frames`` and every entry of ``key_ranges`` are half-open ``(start, stop)`` frame indices
    counted among the key frames (so the window starts at ``q_frame_offset``). ``key_ranges`` holds one
    range (not streaming, or sinks touching the recent range) or two disjoint sorted ranges (sinks, then
    the recent range).
    """

    chunk: int
    query_frames: tuple[int, int]
    key_ranges: tuple[tuple[int, int], ...]

    @property
    def num_key_frames(self) -> int:
        """How many key frames the chunk's queries see."""
        return sum(b - a for a, b in self.key_ranges)

    def key_frame_mask(self, num_key_frames: int) -> torch.Tensor:
        """(num_key_frames,) bool, True where a key frame is visible to this chunk."""
        m = torch.zeros(num_key_frames, dtype=torch.bool)
        for a, b in self.key_ranges:
            m[a:b] = True
        return m


def _chunk_key_ranges(
    chunk: int, nk: int, c: int, off: int, sink: int, recent: int | None
) -> tuple[tuple[int, int], ...]:
    """Visible key-frame ranges for query chunk ``chunk`` (the rule of the module docstring)."""
    start = off + chunk * c  # first frame of the chunk
    end = min(nk, start + c)  # chunk(f_k) <= chunk  <=>  f_k < start + c
    if recent is None:
        return ((0, end),) if end > 0 else ()
    sink_end = min(sink, end)
    rec_start = max(0, start - recent)
    if rec_start <= sink_end:  # sinks and recent range touch: one range
        return ((0, end),) if end > 0 else ()
    ranges = []
    if sink_end > 0:
        ranges.append((0, sink_end))
    if end > rec_start:
        ranges.append((rec_start, end))
    return tuple(ranges)


def visible_key_frames(
    num_query_frames: int,
    num_key_frames: int,
    *,
    frames_per_chunk: int = 1,
    q_frame_offset: int = 0,
    sink_frames: int = 0,
    recent_frames: int | None = None,
) -> list[ChunkVisibility]:
    """Per query chunk of the window, the key frames its queries see (frames, not tokens).

    This is the rule the Triton kernel uses to skip key blocks, exposed for callers (e.g. a KV cache
    that wants to know which frames a streaming layer will ever read again: the union over chunks).

    Example: 2 memory frames, a window of 4 frames in chunks of 2::

        >>> [v.key_ranges for v in visible_key_frames(4, 6, frames_per_chunk=2, q_frame_offset=2)]
        [((0, 4),), ((0, 6),)]
    """
    nq, nk, c, off, sink, recent = check_rule(
        num_query_frames, num_key_frames, frames_per_chunk=frames_per_chunk,
        q_frame_offset=q_frame_offset, sink_frames=sink_frames, recent_frames=recent_frames,
    )
    out = []
    for chunk in range((nq + c - 1) // c):
        qs = off + chunk * c
        out.append(ChunkVisibility(chunk, (qs, min(off + nq, qs + c)),
                                   _chunk_key_ranges(chunk, nk, c, off, sink, recent)))
    return out


def chunked_attention_mask(
    Lq: int,
    Lk: int,
    *,
    tokens_per_frame: int = 1,
    frames_per_chunk: int = 1,
    q_frame_offset: int = 0,
    sink_frames: int = 0,
    recent_frames: int | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Dense boolean mask (Lq, Lk) of the rule, True where query token i may attend to key token j.

    This is what the reference backend hands to SDPA (True = attend, SDPA's convention). It costs
    O(Lq * Lk) memory, which is exactly what the Triton kernel avoids; use it for the reference, tests and
    small problems.

    Picture (tokens_per_frame=1, frames_per_chunk=2, q_frame_offset=2, 6 key frames, 4 query frames;
    rows = queries, columns = keys, ``#`` = visible)::

        keys:    m m | w w w w      (m = memory / cached past, w = window)
        q0 (f2)  # # | # # . .
        q1 (f3)  # # | # # . .
        q2 (f4)  # # | # # # #
        q3 (f5)  # # | # # # #
    """
    t = _as_int("tokens_per_frame", tokens_per_frame, 1)
    Lq = _as_int("Lq", Lq, 0)
    Lk = _as_int("Lk", Lk, 0)
    if Lq % t or Lk % t:
        raise ValueError(f"Lq={Lq} and Lk={Lk} must be multiples of tokens_per_frame={t}")
    nq, nk, c, off, sink, recent = check_rule(
        Lq // t, Lk // t, frames_per_chunk=frames_per_chunk, q_frame_offset=q_frame_offset,
        sink_frames=sink_frames, recent_frames=recent_frames,
    )
    fq = off + torch.arange(Lq, device=device) // t  # (Lq,) query frame
    fk = torch.arange(Lk, device=device) // t  # (Lk,) key frame
    cs = off + ((fq - off) // c) * c  # (Lq,) chunk start frame; fq >= off so the division is exact floor
    mask = fk[None, :] < (cs + c)[:, None]  # (Lq, Lk) chunk(f_k) <= chunk(f_q)
    if recent is not None:
        mask &= (fk[None, :] < sink) | (fk[None, :] >= (cs - recent)[:, None])
    return mask


def flex_mask_mod(
    *,
    tokens_per_frame: int = 1,
    frames_per_chunk: int = 1,
    q_frame_offset: int = 0,
    sink_frames: int = 0,
    recent_frames: int | None = None,
) -> Callable:
    """The rule as a FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor``.

    Feed it to ``torch.nn.attention.flex_attention.create_block_mask`` to get a block mask that skips
    the same blocks the Triton kernel skips (used by the benchmark's FlexAttention baseline).
    """
    t = _as_int("tokens_per_frame", tokens_per_frame, 1)
    c = _as_int("frames_per_chunk", frames_per_chunk, 1)
    off = _as_int("q_frame_offset", q_frame_offset, 0)
    sink = _as_int("sink_frames", sink_frames, 0)
    recent = None if recent_frames is None else _as_int("recent_frames", recent_frames, 1)

    def mask_mod(b, h, q_idx, kv_idx):
        fq = q_idx // t  # frame within the window (>= 0)
        fk = kv_idx // t
        cs = off + (fq // c) * c
        vis = fk < cs + c
        if recent is not None:
            vis = vis & ((fk < sink) | (fk >= cs - recent))
        return vis

    return mask_mod
