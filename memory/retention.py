"""Retention policies: which past frames are kept once `n` frames have been committed.

A policy is a pure function from "number of frames committed so far" to the absolute indices of the
frames that are kept. The same function drives the memory bank (raw frames) and every per-layer KV
cache, so the bank and the caches never disagree about what is remembered:

    all          every committed frame                       -> grows without bound
    last         the last m frames                           -> at most m
    sink_recent  the first s ("attention sink") + the last r  -> at most s + r (StreamingLLM-like)

All three are monotone: a frame that has been dropped never comes back. That is what lets the bank
and the caches evict incrementally after every commit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

POLICIES = ("all", "last", "sink_recent")


class RetentionError(ValueError):
    """A retention policy is unknown or its sizes are out of range."""


@dataclass(frozen=True)
class RetentionPolicy:
    """Which committed frames are remembered.

    Args:
        kind: `"all"`, `"last"` or `"sink_recent"`.
        length: m, the number of frames `"last"` keeps (ignored by the other kinds).
        sink: s, the first frames `"sink_recent"` keeps for ever.
        recent: r, the most recent frames `"sink_recent"` keeps.
    """

    kind: str = "all"
    length: int = 0
    sink: int = 0
    recent: int = 0

    def __post_init__(self) -> None:
        if self.kind not in POLICIES:
            raise RetentionError(f"retention policy {self.kind!r} is unknown; choose one of {POLICIES}")
        if self.kind == "last" and self.length < 0:
            raise RetentionError(f"retention 'last' needs length >= 0, got {self.length}")
        if self.kind == "sink_recent" and (self.sink < 0 or self.recent < 1):
            raise RetentionError(
                f"retention 'sink_recent' needs sink >= 0 and recent >= 1, got sink={self.sink}, "
                f"recent={self.recent}")

    @classmethod
    def from_config(cls, mem: Any) -> RetentionPolicy:
        """Build from anything with `retention`, `length`, `sink`, `recent` (e.g. `MemoryConfig`)."""
        return cls(kind=mem.retention, length=mem.length, sink=mem.sink, recent=mem.recent)

    @property
    def capacity(self) -> int | None:
        """The most frames this policy ever keeps (`None` = unbounded)."""
        if self.kind == "all":
            return None
        if self.kind == "last":
            return self.length
        return self.sink + self.recent

    @property
    def streaming(self) -> bool:
        """True when the policy keeps a bounded number of frames (its cache stops growing)."""
        return self.capacity is not None

    def kept_indices(self, n_committed: int) -> list[int]:
        """Absolute indices (ascending) of the frames kept after `n_committed` frames were committed."""
        n = int(n_committed)
        if n < 0:
            raise RetentionError(f"number of committed frames must be >= 0, got {n}")
        if self.kind == "all":
            return list(range(n))
        if self.kind == "last":
            return list(range(max(0, n - self.length), n))
        # sink_recent: the two ranges overlap while fewer than s + r frames exist; the max() merges them.
        sink = list(range(min(self.sink, n)))
        recent = list(range(max(self.sink, n - self.recent), n))
        return sink + recent


def kept_indices(policy: RetentionPolicy, n_committed: int) -> list[int]:
    """Functional form of `RetentionPolicy.kept_indices`."""
    return policy.kept_indices(n_committed)
