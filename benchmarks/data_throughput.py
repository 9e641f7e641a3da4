"""Data throughput: generation frames/s per worker for each environment, loader clips/s, index time.

    python benchmarks/data_throughput.py                 # ~3-4 minutes on a 2-core CPU
    python benchmarks/data_throughput.py --episodes 1 --length 64 --index-episodes 500   # quicker

Generation runs one worker in this process (a worker's rate; W workers scale it up to the core count)
and splits the time into environment build (once per worker), reset (once per episode), stepping and
writing. The loader part reads random 16-frame clips from 300-frame 64x64 episodes (DMLab's shape, made
of the rendered Memory Maze frames) through a DataLoader, for compressed and stored npz; the index part
times opening a folder of many episodes for the first time (every header read) and again (cached index).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.dataset import ClipDataset
from data.envs import make_env
from data.episodes import write_episode
from data.generate import GenerateSpec, generate_episode


class _Timed:
    """Wraps an environment and adds up the time spent in reset() and step()."""

    def __init__(self, env):
        self.env, self.reset_s, self.step_s, self.steps = env, 0.0, 0.0, 0

    def __getattr__(self, name):
        return getattr(self.env, name)

    def reset(self, seed):
        t = time.perf_counter()
        out = self.env.reset(seed)
        self.reset_s += time.perf_counter() - t
        return out

    def step(self, action):
        t = time.perf_counter()
        out = self.env.step(action)
        self.step_s += time.perf_counter() - t
        self.steps += 1
        return out


def bench_generation(env_name: str, episodes: int, length: int, out: Path) -> dict:
    t = time.perf_counter()
    env = _Timed(make_env(env_name, 64))
    spec = GenerateSpec(env_name, episodes + 1, length)
    generate_episode(env, spec, 0)  # warm-up: memory maze builds its environment on the first reset
    build_and_first = time.perf_counter() - t
    env.reset_s = env.step_s = env.steps = 0
    write_s, t0, videos = 0.0, time.perf_counter(), []
    for i in range(1, episodes + 1):
        arrays = generate_episode(env, spec, i)
        videos.append(arrays["video"])
        t = time.perf_counter()
        write_episode(out / env_name / f"ep_{i:06d}.npz", arrays["video"], arrays["actions"], arrays["pose"])
        write_s += time.perf_counter() - t
    total = time.perf_counter() - t0
    env.close()
    frames = episodes * length
    return {"env": env_name, "episodes": episodes, "length": length, "build+first_s": build_and_first,
            "reset_s": env.reset_s / episodes, "step_fps": env.steps / env.step_s,
            "write_ms": 1000 * write_s / episodes, "fps": frames / total, "videos": videos}


def bench_loader(root: Path, videos: list[np.ndarray], n_episodes: int, batches: int, workers_list) -> list[dict]:
    """Clips/s from 300-frame episodes made of rendered frames (so they compress like real data)."""
    frames = np.concatenate(videos)  # all generated frames, cycled into 300-frame episodes
    rng = np.random.default_rng(0)
    rows = []
    for compress in (True, False):
        split = root / ("compressed" if compress else "stored")
        for i in range(n_episodes):
            idx = (int(rng.integers(len(frames))) + np.arange(300)) % len(frames)
            write_episode(split / f"{i:04d}.npz", frames[idx], rng.integers(0, 6, 300), compress=compress)
        size_mb = sum(p.stat().st_size for p in split.glob("*.npz")) / n_episodes / 1e6
        ds = ClipDataset(split, n_frames=16, frame_skip=1, progress=False)
        for workers in workers_list:
            loader = torch.utils.data.DataLoader(ds, batch_size=8, shuffle=True, num_workers=workers,
                                                 generator=torch.Generator().manual_seed(0))
            it = iter(loader)
            next(it)  # worker start-up is not throughput
            t = time.perf_counter()
            for _ in range(batches):
                batch = next(it)
            dt = time.perf_counter() - t
            assert batch["video"].shape == (8, 16, 3, 64, 64)
            rows.append({"npz": "compressed" if compress else "stored", "mb": size_mb, "workers": workers,
                         "clips_s": batches * 8 / dt, "ms_per_batch": 1000 * dt / batches})
    return rows


def bench_index(root: Path, n: int) -> dict:
    """Open a folder of n episodes: first time (reads every header), second time (cached index)."""
    split = root / "many"
    video = np.zeros((300, 8, 8, 3), np.uint8)  # index cost does not depend on frame size
    for i in range(n):
        write_episode(split / f"{i:06d}.npz", video, np.zeros(300, np.int64))
    t = time.perf_counter()
    ClipDataset(split, n_frames=16, progress=False)
    first = time.perf_counter() - t
    t = time.perf_counter()
    ds = ClipDataset(split, n_frames=16, progress=False)
    again = time.perf_counter() - t
    t = time.perf_counter()
    for i in np.random.default_rng(0).integers(0, len(ds), 10_000):
        ds.locate(int(i))
    locate_us = 1e6 * (time.perf_counter() - t) / 10_000
    return {"episodes": n, "first_open_s": first, "cached_open_s": again, "locate_us": locate_us}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--episodes", type=int, default=3, help="episodes per environment (after a warm-up one)")
    ap.add_argument("--length", type=int, default=128, help="frames per episode")
    ap.add_argument("--loader-episodes", type=int, default=16)
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--index-episodes", type=int, default=2000)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        print(f"generation (one worker, {args.episodes} episodes x {args.length} frames, 64x64, policy revisit)")
        print(f"{'env':<12} {'build+ep0 s':>11} {'reset s/ep':>10} {'step fr/s':>9} {'write ms/ep':>11} "
              f"{'end-to-end fr/s':>15}")
        videos = {}
        for name in ("memory_maze", "crafter"):
            r = bench_generation(name, args.episodes, args.length, tmp / "gen")
            videos[name] = r["videos"]
            print(f"{r['env']:<12} {r['build+first_s']:>11.1f} {r['reset_s']:>10.2f} {r['step_fps']:>9.1f} "
                  f"{r['write_ms']:>11.1f} {r['fps']:>15.1f}")
        print(f"\nloader (DataLoader, batch 8 x 16 frames x 64x64, random starts, "
              f"{args.loader_episodes} episodes x 300 memory-maze frames)")
        print(f"{'npz':<11} {'MB/episode':>10} {'workers':>7} {'clips/s':>8} {'ms/batch':>9}")
        for r in bench_loader(tmp / "loader", videos["memory_maze"], args.loader_episodes, args.batches, (0, 2)):
            print(f"{r['npz']:<11} {r['mb']:>10.2f} {r['workers']:>7} {r['clips_s']:>8.1f} {r['ms_per_batch']:>9.1f}")
        r = bench_index(tmp / "index", args.index_episodes)
        print(f"\nindex: {r['episodes']} episodes: first open {r['first_open_s']:.2f} s, cached open "
              f"{r['cached_open_s']:.3f} s, locate(i) {r['locate_us']:.1f} us")


if __name__ == "__main__":
    main()
