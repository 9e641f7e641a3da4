"""Data throughput: generation frames/s per worker, loader clips/s per episode format, index time.

    python benchmarks/data_throughput.py                 # ~4-6 minutes on a 2-core CPU
    python benchmarks/data_throughput.py --loader-only   # the loader part only, synthetic frames (~1-2 min)

Generation runs one worker in this process (a worker's rate; W workers scale it up to the core count)
and splits the time into environment build (once per worker), reset (once per episode), stepping and
writing. The loader part reads random clips of the paper preset's shape (memory.length + train.window =
48 + 16 = 64 frames of 64x64, batch 32) from 300-frame episodes (DMLab's length; the rendered Memory Maze
frames, or with --loader-only blocky synthetic frames that compress about as well) through a DataLoader
with 0 and 2 workers, for three formats: compressed npz (the default), stored npz read through the zip
(`ClipDataset(mmap=False)`), stored npz through a memory map (the default for stored files), and the
same as uint8 clips (`video_dtype="uint8"`, what the Trainer loads: the float conversion moves to the
device, where it is free). It then
prints what a GPU consumes: batch x steps/s clips/s, for the steps/s that `benchmarks/gpu_check.sh`
measures (pass it as --gpu-steps-per-s). The index part times opening a folder of many episodes.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

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


def synthetic_frames(n: int, size: int = 64, seed: int = 0) -> np.ndarray:
    """(n, size, size, 3) uint8 frames of 8x8-pixel blocks that scroll, with 40% of the pixels jittered: they
    deflate ~3x like rendered Memory Maze frames, so compressed-npz reads cost about the same."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (size // 8 + n // 8 + 2, size // 8, 3), dtype=np.uint8)
    out = np.stack([np.repeat(np.repeat(base[i // 8:i // 8 + size // 8], 8, 0), 8, 1) for i in range(n)])
    jitter = rng.random(out.shape[:3]) < 0.4  # (n, size, size): which pixels get a grey-level offset
    out = out.astype(np.int16)
    out[jitter] += rng.integers(-6, 7, (int(jitter.sum()), 1), dtype=np.int16)
    return np.clip(out, 0, 255).astype(np.uint8)


LOADER_FORMATS = (("compressed npz", True, True, "float32"), ("stored npz, zip", False, False, "float32"),
                  ("stored npz, mmap", False, True, "float32"), ("stored, mmap, uint8", False, True, "uint8"))
# (name, compress, ClipDataset(mmap=...), ClipDataset(video_dtype=...)); uint8 is what the Trainer loads


def bench_loader(root: Path, frames: np.ndarray, n_episodes: int, batches: int, workers_list, clip_frames: int,
                 batch_size: int) -> list[dict]:
    """Clips/s of random `clip_frames`-frame clips from 300-frame episodes cut from `frames`."""
    rng = np.random.default_rng(0)
    rows = []
    for compress in (True, False):
        split = root / ("compressed" if compress else "stored")
        for i in range(n_episodes):
            idx = (int(rng.integers(len(frames))) + np.arange(300)) % len(frames)
            write_episode(split / f"{i:04d}.npz", frames[idx], rng.integers(0, 6, 300), compress=compress)
    for name, compress, mmap, video_dtype in LOADER_FORMATS:
        split = root / ("compressed" if compress else "stored")
        size_mb = sum(p.stat().st_size for p in split.glob("*.npz")) / n_episodes / 1e6
        ds = ClipDataset(split, n_frames=clip_frames, frame_skip=1, progress=False, mmap=mmap,
                         video_dtype=video_dtype)
        for workers in workers_list:
            loader = torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=True, num_workers=workers,
                                                 persistent_workers=workers > 0,
                                                 generator=torch.Generator().manual_seed(0))
            it = iter(loader)
            next(it)  # worker start-up is not throughput
            t = time.perf_counter()
            for _ in tqdm(range(batches), desc=f"{name}, {workers} workers", leave=False):
                batch = next(it)
            dt = time.perf_counter() - t
            assert batch["video"].shape[:2] == (batch_size, clip_frames)
            rows.append({"format": name, "mb": size_mb, "workers": workers,
                         "clips_s": batches * batch_size / dt, "ms_per_batch": 1000 * dt / batches})
            del it, loader
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
    ap.add_argument("--loader-only", action="store_true", help="only the loader part, on synthetic frames")
    ap.add_argument("--loader-episodes", type=int, default=16)
    ap.add_argument("--batches", type=int, default=8, help="timed batches per (format, workers)")
    ap.add_argument("--clip-frames", type=int, default=64, help="memory + window frames (paper: 48 + 16)")
    ap.add_argument("--batch-size", type=int, default=32, help="clips per batch (paper preset: 32)")
    ap.add_argument("--gpu-steps-per-s", type=float, nargs="*", default=[1.0, 2.0, 4.0],
                    help="training steps/s of the GPU to feed (benchmarks/gpu_check.sh measures it)")
    ap.add_argument("--index-episodes", type=int, default=2000)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        frames = None
        if not args.loader_only:
            print(f"generation (one worker, {args.episodes} episodes x {args.length} frames, 64x64, policy revisit)")
            print(f"{'env':<12} {'build+ep0 s':>11} {'reset s/ep':>10} {'step fr/s':>9} {'write ms/ep':>11} "
                  f"{'end-to-end fr/s':>15}")
            for name in ("memory_maze", "crafter"):
                r = bench_generation(name, args.episodes, args.length, tmp / "gen")
                if name == "memory_maze":
                    frames = np.concatenate(r["videos"])  # rendered frames, cycled into 300-frame episodes
                print(f"{r['env']:<12} {r['build+first_s']:>11.1f} {r['reset_s']:>10.2f} {r['step_fps']:>9.1f} "
                      f"{r['write_ms']:>11.1f} {r['fps']:>15.1f}")
        source = "synthetic 64x64 frames" if frames is None else "rendered memory-maze frames"
        if frames is None:
            frames = synthetic_frames(600)
        print(f"\nloader (DataLoader, batch {args.batch_size} x {args.clip_frames} frames x 64x64, random starts, "
              f"{args.loader_episodes} episodes x 300 {source})")
        print(f"{'format':<19} {'MB/episode':>10} {'workers':>7} {'clips/s':>8} {'ms/batch':>9}")
        rows = bench_loader(tmp / "loader", frames, args.loader_episodes, args.batches, (0, 2), args.clip_frames,
                            args.batch_size)
        for r in rows:
            print(f"{r['format']:<19} {r['mb']:>10.2f} {r['workers']:>7} {r['clips_s']:>8.1f} "
                  f"{r['ms_per_batch']:>9.1f}")
        base = {r["workers"]: r["clips_s"] for r in rows if r["format"] == "compressed npz"}
        best = max(rows, key=lambda r: r["clips_s"])
        print(f"best: {best['format']} with {best['workers']} workers, "
              f"{best['clips_s'] / base[best['workers']]:.1f}x compressed npz at the same workers")
        print(f"\nwhat a GPU consumes at batch {args.batch_size}: " + ", ".join(
            f"{s:g} steps/s -> {s * args.batch_size:.0f} clips/s" for s in args.gpu_steps_per_s))
        print("(loader clips/s scale about linearly with workers on free cores; a GPU node has 8+ per GPU)")
        if not args.loader_only:
            r = bench_index(tmp / "index", args.index_episodes)
            print(f"\nindex: {r['episodes']} episodes: first open {r['first_open_s']:.2f} s, cached open "
                  f"{r['cached_open_s']:.3f} s, locate(i) {r['locate_us']:.1f} us")


if __name__ == "__main__":
    main()
