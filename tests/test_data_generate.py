"""Generators driven for real: Memory Maze (MuJoCo, software rendering) and Crafter.

One small generation per environment is shared by the module (environment start-up costs seconds).
"""

import importlib.util
import json
import os

import numpy as np
import pytest
import torch

pytest.importorskip("crafter")
# find_spec, not importorskip: importing memory_maze here would load OSMesa before Triton (see data/envs.py)
if importlib.util.find_spec("memory_maze") is None:
    pytest.skip("memory_maze is not installed", allow_module_level=True)

from data.dataset import ClipDataset
from data.episodes import load_episode
from data.generate import GenerateError, ensure_dataset, generate
from data.mirror import MEMORY_MAZE_MIRROR, mirror_clip, mirror_permutation

MM_LEN, CR_LEN = 56, 40


@pytest.fixture(scope="module")
def mm_root(tmp_path_factory):
    return generate(tmp_path_factory.mktemp("mm"), "memory_maze", episodes=2, length=MM_LEN, seed=0,
                    policy="revisit", progress=False)


@pytest.fixture(scope="module")
def cr_root(tmp_path_factory):
    return generate(tmp_path_factory.mktemp("cr"), "crafter", episodes=3, length=CR_LEN, seed=0,
                    policy="revisit", progress=False)


def _episodes(root):
    return sorted(root.glob("*/ep_*.npz"))


@pytest.mark.parametrize("env,num_actions,length", [("memory_maze", 6, MM_LEN), ("crafter", 17, CR_LEN)])
def test_generated_files_have_the_right_shapes_dtypes_ranges(env, num_actions, length, mm_root, cr_root):
    root = mm_root if env == "memory_maze" else cr_root
    n_train = 1 if env == "memory_maze" else 2  # validation gets one episode whenever N >= 2
    names = [f"training/ep_{i:06d}.npz" for i in range(n_train)] + [f"validation/ep_{n_train:06d}.npz"]
    assert [p.relative_to(root).as_posix() for p in _episodes(root)] == names
    manifest = json.loads((root / "dataset.json").read_text())
    assert manifest["complete"] and manifest["env"] == env
    assert manifest["splits"] == {"training": n_train, "validation": 1}
    for path in _episodes(root):
        ep = load_episode(path)
        assert ep.video.shape == (length, 64, 64, 3) and ep.video.dtype == np.uint8
        assert ep.video.std() > 10  # real rendered pictures, not blank frames
        assert ep.actions.shape == (length,) and ep.actions.dtype == np.int64 and ep.actions[0] == 0
        assert 0 <= ep.actions.min() and ep.actions.max() < num_actions
        assert ep.pose.shape == (length, 3) and ep.pose.dtype == np.float32
        assert np.all(np.abs(ep.pose[:, 2]) <= np.pi + 1e-6)
        assert np.abs(np.diff(ep.pose[:, :2], axis=0)).max() <= 1.0  # at most one cell per step
        assert np.abs(np.diff(ep.pose[:, :2], axis=0)).sum() > 1.0  # and the agent does move
    ds = ClipDataset(root / "training", n_frames=8, frame_skip=2)
    item = ds[len(ds) // 2]
    assert item["video"].shape == (8, 3, 64, 64) and item["pose"].shape == (8, 3)
    assert ds.num_actions <= num_actions


@pytest.mark.parametrize("env", ["memory_maze", "crafter"])
def test_revisit_episodes_really_revisit(env, mm_root, cr_root):
    """At each recorded return the pose matches the departure, and the frame looks like the departure frame
    far more than random frame pairs do."""
    root = mm_root if env == "memory_maze" else cr_root
    returns, randoms = [], []
    rng = np.random.default_rng(0)
    for path in _episodes(root):
        ep = load_episode(path)
        with np.load(path) as z:
            revisits = z["revisits"]
        video = ep.video.astype(np.float32)
        for left, back in revisits:
            if back - left < 16:
                continue
            dist = np.hypot(*(ep.pose[back, :2] - ep.pose[left, :2]))
            dh = abs((ep.pose[back, 2] - ep.pose[left, 2] + np.pi) % (2 * np.pi) - np.pi)
            if env == "memory_maze":
                assert dist < 0.2 and dh < 0.35, (path.name, left, back, dist, dh)  # cells, radians
            else:
                assert dist == 0, (path.name, left, back, dist)
            # the path in between really went away (not standing still)
            assert np.hypot(*(ep.pose[left:back, :2] - ep.pose[left, :2]).T).max() > 1.0
            returns.append(((video[back] - video[left]) ** 2).mean())
        for _ in range(20):
            i, j = rng.integers(0, len(ep), size=2)
            if abs(i - j) >= 16:
                randoms.append(((video[i] - video[j]) ** 2).mean())
    assert len(returns) >= 2, "expected excursions with gaps of 16+ frames"
    assert np.median(returns) < 0.35 * np.median(randoms), (returns, np.median(randoms))


def test_rerun_skips_complete_episodes_and_rebuilds_missing_ones_bit_for_bit(cr_root):
    files = _episodes(cr_root)
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in files}
    deleted, damaged, kept = files[0], files[2], files[1]
    deleted.unlink()
    damaged.write_bytes(before[damaged][0][:1000])  # truncated, e.g. by a crash during a copy
    (deleted.parent / ".ep_000000.npz.abc.tmp").write_bytes(b"half")  # an interrupted write's temp file
    generate(cr_root, "crafter", episodes=3, length=CR_LEN, seed=0, policy="revisit", progress=False)
    assert kept.stat().st_mtime_ns == before[kept][1]  # not regenerated
    assert deleted.read_bytes() == before[deleted][0]  # same seed, same bytes
    assert damaged.read_bytes() == before[damaged][0]
    assert not list(cr_root.glob("*/.*.tmp"))
    # a complete data set is left alone by ensure_dataset
    stamps = {p: p.stat().st_mtime_ns for p in _episodes(cr_root)}
    assert ensure_dataset(cr_root, "crafter", 3, CR_LEN, policy="revisit", seed=0) == cr_root
    assert {p: p.stat().st_mtime_ns for p in _episodes(cr_root)} == stamps
    with pytest.raises(GenerateError, match="different data set: length=40 \\(asked 41\\)"):
        generate(cr_root, "crafter", episodes=3, length=CR_LEN + 1, seed=0, progress=False)


def test_memory_maze_episode_depends_on_seed_and_index_only(mm_root, tmp_path):
    """Episode 1 regenerated alone in a fresh environment equals the one made after episode 0."""
    target = mm_root / "validation" / "ep_000001.npz"
    original = target.read_bytes()
    target.unlink()
    generate(mm_root, "memory_maze", episodes=2, length=MM_LEN, seed=0, policy="revisit", progress=False)
    assert target.read_bytes() == original


def test_seed_changes_episodes_and_random_policy_runs(cr_root, tmp_path):
    other = generate(tmp_path / "s1", "crafter", episodes=1, length=12, seed=1, policy="random", progress=False)
    ep = load_episode(other / "training" / "ep_000000.npz")
    assert len(np.unique(ep.actions)) >= 3  # sticky-random over 17 actions
    assert not np.array_equal(ep.video, load_episode(cr_root / "training" / "ep_000000.npz").video[:12])


def test_ensure_dataset_uses_real_data_as_is(tmp_path):
    real = tmp_path / "dmlab"
    (real / "train").mkdir(parents=True)
    np.savez(real / "train" / "0.npz", video=np.zeros((5, 8, 8, 3), np.uint8), actions=np.zeros(5, np.int32))
    assert ensure_dataset(real, "memory_maze", 4, 16) == real
    assert sorted(os.listdir(real)) == ["train"]  # nothing generated, no manifest written


@pytest.mark.slow
def test_worker_processes_give_the_same_bytes(cr_root, tmp_path):
    """Two spawn workers produce byte-identical episodes to the serial run (episode = f(seed, index))."""
    par = generate(tmp_path / "par", "crafter", episodes=3, length=CR_LEN, seed=0, policy="revisit",
                   workers=2, progress=False)
    for a, b in zip(_episodes(cr_root), _episodes(par)):
        assert a.read_bytes() == b.read_bytes(), a.name


def test_model_kernels_load_after_memory_maze_rendered_in_the_same_process():
    """Regression: libOSMesa and Triton both carry LLVM; Triton loaded after OSMesa segfaulted the process."""
    import subprocess
    import sys

    code = ("import data.envs as e; env = e.make_env('memory_maze', 16); env.close() if hasattr(env, 'close') "
            "else None; import triton._C.libtriton, kernels; print('ok')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "MUJOCO_GL": "osmesa", "PYOPENGL_PLATFORM": "osmesa"})
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]


def _turns(video: np.ndarray, actions: np.ndarray, poses: np.ndarray, r: int = 20) -> dict[str, tuple[float, float]]:
    """Per turn direction (left: turn left, forward+left; right: the others), the mean horizontal shift of the image
    (pixels, content moving right > 0; the best-matching shift of the grey frames) and heading change per step."""
    grey = video.astype(np.float64).mean(-1)  # (T, H, W)
    width, out = grey.shape[-1], {}
    for name, acts in (("left", (2, 4)), ("right", (3, 5))):
        shifts, turns = [], []
        for t in np.flatnonzero(np.isin(actions, acts)):
            if t == 0:
                continue
            errs = [((grey[t - 1][:, r:width - r] - grey[t][:, r + s:width - r + s]) ** 2).mean()
                    for s in range(-r, r + 1)]
            shifts.append(int(np.argmin(errs)) - r)
            turns.append(np.angle(np.exp(1j * (poses[t, 2] - poses[t - 1, 2]))))
        out[name] = (float(np.mean(shifts)), float(np.mean(turns)))
    return out


def test_the_memory_maze_mirror_turns_the_other_way_on_the_real_renderer(mm_root):
    """data.mirror on rendered Memory Maze episodes: in the mirror image (frames flipped, MEMORY_MAZE_MIRROR's
    actions, reflected poses) a left turn still moves the view right and the heading up, as in the episodes
    themselves; with the actions left as they are (no permutation) it would turn the other way."""
    for path in _episodes(mm_root):
        ep = load_episode(path)
        video, actions, poses = np.array(ep.video), np.array(ep.actions), np.array(ep.pose)  # writable copies
        seen = _turns(video, actions, poses)
        assert seen["left"][0] > 2 and seen["left"][1] > 0.1 and seen["right"][0] < -2 and seen["right"][1] < -0.1
        m_video, m_actions, m_poses = mirror_clip(torch.as_tensor(video).permute(0, 3, 1, 2),
                                                  torch.as_tensor(actions), torch.as_tensor(poses),
                                                  mirror_permutation(MEMORY_MAZE_MIRROR, 6))
        mirrored = _turns(m_video.permute(0, 2, 3, 1).numpy(), m_actions.numpy(), m_poses.numpy())
        for side in ("left", "right"):
            assert np.sign(mirrored[side]).tolist() == np.sign(seen[side]).tolist()
