"""benchmarks/soak.py's watcher on a short rollout: KV-cache frames stay at sink + recent, every frame is
finite, and retention `all` (the contrast) holds every committed frame. RSS is reported by the script, not
asserted here (it depends on the machine)."""

from __future__ import annotations

import argparse

from benchmarks.soak import build_model, soak


def args(retention: str) -> argparse.Namespace:
    return argparse.Namespace(run=None, frames=24, every=8, sink=1, recent=3, steps=1, context=8, image=16, seed=0,
                              retention=retention)


def test_sink_recent_keeps_the_cache_bounded_and_all_keeps_everything():
    bounded = soak(build_model(args("sink_recent")), args("sink_recent"))
    assert [r["frames"] for r in bounded[:-1]] == [8, 16, 24]  # a sample every 8 committed frames
    assert all(r["finite"] for r in bounded)
    assert max(r["cache_frames"] for r in bounded) == 4 and max(r["bank_frames"] for r in bounded) == 4
    everything = soak(build_model(args("all")), args("all"))
    assert [r["cache_frames"] for r in everything[:-1]] == [8, 16, 24]
