"""Generate TECO-layout episode folders from real environments (Memory Maze, Crafter).

    python -m data.generate memory_maze --out datasets/memory_maze --episodes 24 --length 128
    python -m data.generate crafter --out datasets/crafter --episodes 100 --length 300 --workers 2

writes ``OUT/training/ep_000000.npz ...`` and ``OUT/validation/ep_0000NN.npz ...`` (about 10% of the
episodes, at least one whenever N >= 2) plus ``OUT/dataset.json`` describing how they were made.
Each npz holds ``video`` uint8 (T, H, W, 3), ``actions`` int64 (T,) (``actions[t]`` led to frame t;
``actions[0]`` = 0), ``pose`` float32 (T, 3) = (x, y, heading radians), ``revisits`` int64 (K, 2), the
(frame left, frame returned) pairs of the scripted policies' excursions (empty for `random` and `wander`),
``turns`` int64 (J, 2), the [start, stop) frame ranges of their full turns on the spot, and ``policy``, a
(1,) string array naming the policy that made the episode (for `mixed`: the one drawn; data/policies.py).

Episode i is a function of (seed, i) only — not of the worker count or of what ran before — so a
re-run skips complete episodes, regenerates missing or damaged ones bit-for-bit, and the same seed
gives the same bytes. Files are written atomically (temp file + rename).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .atomic import atomic_write
from .envs import ENV_NAMES, MAX_FRAMES, make_env
from .episodes import EpisodeError, read_header, write_episode
from .errors import DataError
from .policies import ENV_POLICIES, POLICIES, choose_policy, make_policy

MANIFEST = "dataset.json"
FORMAT = "arvdm-episodes/1"
SPLITS = ("training", "validation")
EXTRA_KEYS = ("revisits", "turns", "policy")  # what generated episodes hold beyond video, actions, pose
MAX_ATTEMPTS = 20  # crafter agents can die (lava, zombies); a dead episode is retried with a new sub-seed


class GenerateError(DataError):
    """Bad generator arguments, or an output folder that holds something else."""


@dataclass(frozen=True)
class GenerateSpec:
    """Everything that determines the episodes' bytes (workers does not)."""

    env: str
    episodes: int
    length: int
    size: int = 64
    seed: int = 0
    policy: str = "revisit"
    compress: bool = True  # deflate the npz members (~10-20x smaller; stored ones read faster)

    def validate(self) -> GenerateSpec:
        if self.env not in ENV_NAMES:
            raise GenerateError(f"unknown environment {self.env!r}; choose one of {', '.join(ENV_NAMES)}")
        if self.policy not in POLICIES:
            raise GenerateError(f"unknown policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        if self.policy not in ENV_POLICIES[self.env]:
            raise GenerateError(f"policy {self.policy!r} is not available for {self.env}; choose one of "
                                f"{', '.join(ENV_POLICIES[self.env])}")
        if self.episodes < 1:
            raise GenerateError(f"--episodes must be >= 1, got {self.episodes}")
        if self.length < 2:
            raise GenerateError(f"--length must be >= 2 frames, got {self.length}")
        if self.length > MAX_FRAMES[self.env]:
            raise GenerateError(f"--length {self.length} is too long: {self.env} episodes end after "
                                f"{MAX_FRAMES[self.env]} frames")
        if not 16 <= self.size <= 1024:
            raise GenerateError(f"--size must be in 16..1024 pixels, got {self.size}")
        if self.seed < 0:
            raise GenerateError(f"--seed must be >= 0, got {self.seed}")
        return self

    @property
    def n_validation(self) -> int:
        """About 10% of the episodes, at least one whenever there are two or more."""
        return 0 if self.episodes < 2 else max(1, round(0.1 * self.episodes))

    def episode_path(self, root: Path, index: int) -> Path:
        split = "training" if index < self.episodes - self.n_validation else "validation"
        return Path(root) / split / f"ep_{index:06d}.npz"


# ------------------------------------------------------------------------------------------------
# one episode
# ------------------------------------------------------------------------------------------------

def _episode_seeds(seed: int, index: int, attempt: int) -> tuple[int, np.random.Generator]:
    """Environment seed and policy RNG for attempt `attempt` of episode `index` (independent streams)."""
    ss = np.random.SeedSequence([seed, index, attempt])
    env_ss, policy_ss = ss.spawn(2)
    return int(env_ss.generate_state(1)[0] % (2**31 - 1)), np.random.default_rng(policy_ss)


def _mixture_rng(seed: int, index: int) -> np.random.Generator:
    """The stream that draws a `mixed` episode's policy: one per episode (not per attempt), and independent
    of the environment and policy streams, so `revisit` and `random` episodes are the same with it or not."""
    return np.random.default_rng(np.random.SeedSequence([seed, index, 0]).spawn(3)[2])


def generate_episode(env, spec: GenerateSpec, index: int) -> dict[str, np.ndarray]:
    """Run one episode of `spec.length` frames in `env`; returns video, actions, pose, revisits, turns and
    policy arrays.

    If the agent dies before the end (possible in Crafter), the episode is re-run with the next attempt's
    seed, so the result stays a deterministic function of (seed, index).
    """
    policy_name = choose_policy(spec.policy, env.name, _mixture_rng(spec.seed, index))
    for attempt in range(MAX_ATTEMPTS):
        env_seed, rng = _episode_seeds(spec.seed, index, attempt)
        frame, pose = env.reset(env_seed)
        policy = make_policy(policy_name, env, rng, spec.length)
        frames, poses, actions = [frame], [pose], [0]
        for _ in range(spec.length - 1):
            action = policy.act(pose)
            frame, pose, done = env.step(action)
            frames.append(frame)
            poses.append(pose)
            actions.append(action)
            if done:
                break
        if len(frames) == spec.length:
            return {"video": np.stack(frames), "actions": np.array(actions, dtype=np.int64),
                    "pose": np.stack(poses).astype(np.float32),
                    "revisits": np.array(policy.revisits, dtype=np.int64).reshape(-1, 2),  # (K, 2)
                    "turns": np.array(policy.turns, dtype=np.int64).reshape(-1, 2),  # (J, 2)
                    "policy": np.array([policy_name])}  # (1,) str
    raise RuntimeError(f"episode {index}: the environment ended early in all {MAX_ATTEMPTS} attempts "
                       f"(length {spec.length} too long for {spec.env}?)")


def _write(path: Path, arrays: dict[str, np.ndarray], compress: bool = True) -> None:
    # revisits, turns and policy ride along as extra npz members; loaders ignore keys they do not know.
    extra = {key: arrays[key] for key in EXTRA_KEYS}
    write_episode(path, arrays["video"], arrays["actions"], arrays["pose"], extra=extra, compress=compress)


def _is_complete(path: Path, spec: GenerateSpec) -> bool:
    """An episode file exists, passes the header check, and has the requested length, size and pose."""
    if not path.exists():
        return False
    try:
        h = read_header(path)
    except EpisodeError:
        return False
    return h.length == spec.length and h.height == h.width == spec.size and h.has_pose


# ------------------------------------------------------------------------------------------------
# workers
# ------------------------------------------------------------------------------------------------

def _worker_main(spec_dict: dict, root: str, tasks, results) -> None:
    """A worker process: one environment, reused for every episode index it takes from `tasks`."""
    spec = GenerateSpec(**spec_dict)
    env = None
    try:
        while True:
            index = tasks.get()
            if index is None:
                break
            try:
                if env is None:
                    env = make_env(spec.env, spec.size)
                _write(spec.episode_path(Path(root), index), generate_episode(env, spec, index), spec.compress)
                results.put(("done", index, ""))
            except BaseException:  # noqa: BLE001 -- report anything (incl. Ctrl-C) to the parent, then stop
                results.put(("error", index, traceback.format_exc()))
                break
    finally:
        if env is not None:
            env.close()  # or dm_control's renderer prints tracebacks at interpreter exit


def _run_serial(spec: GenerateSpec, root: Path, todo: list[int], bar) -> None:
    env = make_env(spec.env, spec.size)
    try:
        for index in todo:
            _write(spec.episode_path(root, index), generate_episode(env, spec, index), spec.compress)
            bar.update(1)
    finally:
        env.close()


def _run_parallel(spec: GenerateSpec, root: Path, todo: list[int], workers: int, bar) -> None:
    # spawn, not fork: MuJoCo/OpenGL state does not survive a fork safely.
    ctx = mp.get_context("spawn")
    tasks, results = ctx.Queue(), ctx.Queue()
    for index in todo:
        tasks.put(index)
    procs = [ctx.Process(target=_worker_main, args=(asdict(spec), str(root), tasks, results), daemon=True)
             for _ in range(workers)]
    for p in procs:
        tasks.put(None)
        p.start()
    try:
        done = 0
        while done < len(todo):
            try:
                status, index, tb = results.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a generator worker died (exit code {dead[0].exitcode}); "
                                       "re-run the same command to resume")
                continue
            if status == "error":
                raise RuntimeError(f"episode {index} failed in a worker:\n{tb}")
            done += 1
            bar.update(1)
        for p in procs:
            p.join()
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join()


# ------------------------------------------------------------------------------------------------
# folders
# ------------------------------------------------------------------------------------------------

def _read_manifest(root: Path) -> dict | None:
    path = root / MANIFEST
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise GenerateError(f"{path}: unreadable manifest ({e}); delete it to start over")


def _write_manifest(root: Path, spec: GenerateSpec, complete: bool) -> None:
    body = {"format": FORMAT, **asdict(spec), "splits": {"training": spec.episodes - spec.n_validation,
                                                          "validation": spec.n_validation},
            "complete": complete}
    atomic_write(root / MANIFEST, lambda tmp: tmp.write_text(json.dumps(body, indent=2) + "\n"))


def _has_foreign_episodes(root: Path) -> bool:
    for split in SPLITS + ("train", "test"):
        d = root / split
        if d.is_dir() and any(not n.startswith(".") and n.endswith((".npz", ".mp4")) for n in os.listdir(d)):
            return True
    return False


def _check_root(root: Path, spec: GenerateSpec) -> None:
    if root.exists() and not root.is_dir():
        raise GenerateError(f"--out {root} exists and is not a folder")
    manifest = _read_manifest(root) if root.exists() else None
    if manifest is None:
        if root.exists() and _has_foreign_episodes(root):
            raise GenerateError(f"{root} already holds episodes that this generator did not write "
                                f"(no {MANIFEST}); choose another --out")
        return
    # compress is only how the arrays are stored, not what they hold: a folder written either way (or by a
    # version that did not record it) is the same data set
    ours = {k: v for k, v in asdict(spec).items() if k != "compress"}
    diff = [f"{k}={manifest.get(k)!r} (asked {v!r})" for k, v in ours.items() if manifest.get(k) != v]
    if diff:
        raise GenerateError(f"{root} holds a different data set: {', '.join(diff)}; use another --out, "
                            "or delete the folder to regenerate")


def generate(root, env: str, episodes: int, length: int, *, size: int = 64, seed: int = 0,
             policy: str = "revisit", workers: int = 1, compress: bool = True, progress: bool = True) -> Path:
    """Generate (or finish) a data set in `root`; complete episodes are kept. Returns `root` as a Path."""
    spec = GenerateSpec(env, episodes, length, size, seed, policy, compress).validate()
    if workers < 1:
        raise GenerateError(f"--workers must be >= 1, got {workers}")
    root = Path(root)
    _check_root(root, spec)
    for split in SPLITS:
        (root / split).mkdir(parents=True, exist_ok=True)
        for name in os.listdir(root / split):  # temp files of an interrupted run
            if name.startswith(".ep_") and name.endswith(".tmp"):
                os.unlink(root / split / name)
    _write_manifest(root, spec, complete=False)

    todo = [i for i in range(spec.episodes) if not _is_complete(spec.episode_path(root, i), spec)]
    if todo:
        workers = min(workers, len(todo))
        with tqdm(total=len(todo), desc=f"{spec.env} episodes", unit="ep", disable=not progress) as bar:
            bar.set_postfix(kept=spec.episodes - len(todo), workers=workers)
            if workers == 1:
                _run_serial(spec, root, todo, bar)
            else:
                _run_parallel(spec, root, todo, workers, bar)
    _write_manifest(root, spec, complete=True)
    return root


def ensure_dataset(root, env: str, episodes: int, length: int, policy: str = "revisit", seed: int = 0,
                   size: int = 64, workers: int = 1, compress: bool = True) -> Path:
    """Make sure `root` holds a data set with training/ and validation/; returns `root` as a Path.

    A folder of real episodes (TECO layout, no dataset.json) is used as it is. Otherwise the generator
    creates the data set, or finishes an interrupted one; a complete one is only header-checked.
    """
    root = Path(root)
    if root.is_dir() and _read_manifest(root) is None and _has_foreign_episodes(root):
        return root
    return generate(root, env, episodes, length, size=size, seed=seed, policy=policy, workers=workers,
                    compress=compress)


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m data.generate",
        description="Generate TECO-layout episodes (training/ + validation/) from a real environment.")
    parser.add_argument("env", choices=ENV_NAMES, help="memory_maze (DMLab stand-in) or crafter (Minecraft stand-in)")
    parser.add_argument("--out", required=True, help="output folder (created; re-running resumes)")
    parser.add_argument("--episodes", type=int, default=24, help="number of episodes N (default 24)")
    parser.add_argument("--length", type=int, default=128, help="frames per episode T (default 128)")
    parser.add_argument("--size", type=int, default=64, help="frame height = width in pixels (default 64)")
    parser.add_argument("--seed", type=int, default=0, help="data set seed (default 0)")
    parser.add_argument("--policy", choices=POLICIES, default="revisit",
                        help="revisit: scripted out-and-back excursions with full turns (default); random: "
                             "sticky random; look_around: turn, out and back, turn (memory_maze); wander: "
                             "random exploring agent (memory_maze); mixed: one drawn per episode")
    parser.add_argument("--workers", type=int, default=1, help="parallel processes (default 1)")
    parser.add_argument("--no-compress", dest="compress", action="store_false",
                        help="store npz members uncompressed: ~10-20x larger files, fastest clip reads")
    args = parser.parse_args(argv)
    start = time.time()
    try:
        root = generate(args.out, args.env, args.episodes, args.length, size=args.size, seed=args.seed,
                        policy=args.policy, workers=args.workers, compress=args.compress)
    except (DataError, OSError) as e:  # the data package's user errors; OSError: e.g. --out not writable
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; complete episodes are kept — re-run the same command to resume", file=sys.stderr)
        return 130
    except RuntimeError as e:
        print(f"error: {e}".rstrip(), file=sys.stderr)
        return 1
    spec = GenerateSpec(args.env, args.episodes, args.length, args.size, args.seed, args.policy, args.compress)
    print(f"{root}: {spec.episodes - spec.n_validation} training + {spec.n_validation} validation episodes "
          f"of {spec.length} frames ({time.time() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
