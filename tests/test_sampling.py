"""sample.py end to end on a tiny run: files written, TECO arrays, metrics, eval.json, and bad input."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch

import sample
from arvdm.config import apply_overrides, get_preset
from arvdm.training.trainer import Trainer

TINY = ["model.image_size=16", "data.resize=0", "model.patch_size=4", "model.dim=32", "model.depth=2", "model.heads=2",
        "memory.length=4", "train.window=4", "train.batch_size=2", "train.max_steps=2", "train.ckpt_every=2",
        "train.val_every=1000", "train.sample_every=0", "train.warmup_steps=1", "diffusion.num_levels=100"]


def _write_episodes(root, split, n, length=40, size=16, seed=0):
    folder = root / split
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    for i in range(n):
        pose = np.zeros((length, 3), np.float32)
        pose[:, 0] = np.arange(length) % 10  # walks away and comes back: revisits at gap 10
        np.savez(folder / f"ep_{i:06d}.npz", video=rng.integers(0, 256, (length, size, size, 3), dtype=np.uint8),
                 actions=rng.integers(0, 6, length), pose=pose)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampling")
    data = root / "data"
    _write_episodes(data, "training", 2)
    _write_episodes(data, "validation", 2, seed=1)
    cfg = apply_overrides(get_preset("tiny_time"), TINY + [f"data.path={data}"]).validate()
    Trainer(cfg, root / "run").fit()
    return root / "run", data


def test_sample_writes_video_arrays_metrics_and_eval(run, tmp_path):
    run_dir, _ = run
    out = tmp_path / "out"
    rc = sample.main(["--run", str(run_dir), "--frames", "12", "--context", "4", "--episodes", "2",
                      "--steps", "3", "--eval", "--out", str(out)])
    assert rc == 0
    arrays = np.load(out / "rollout.npz")
    real, fake = arrays["real"], arrays["fake"]
    assert real.shape == fake.shape == (2, 16, 16, 16, 3) and real.dtype == np.uint8
    np.testing.assert_array_equal(fake[:, :4], real[:, :4])  # the context is the ground truth it was given
    assert not np.array_equal(fake[:, 4:], real[:, 4:])
    # the ground truth in the file is the validation episodes' first frames
    first = np.load(run_dir.parent / "data" / "validation" / "ep_000000.npz")["video"][:16]
    np.testing.assert_array_equal(real[0], first)
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["frame"]) for r in rows] == list(range(12))
    # metrics.csv agrees with a PSNR computed here from the uint8 arrays (up to uint8 rounding)
    g = fake[:, 4:].astype(np.float64) / 127.5 - 1
    t = real[:, 4:].astype(np.float64) / 127.5 - 1
    psnr = 10 * np.log10(4.0 / ((g - t) ** 2).mean(axis=(2, 3, 4))).mean(0)
    np.testing.assert_allclose([float(r["psnr"]) for r in rows], psnr, atol=0.05)
    ev = json.loads((out / "eval.json").read_text())
    for key in ("psnr_by_span", "ssim_by_span", "max_psnr_decay", "retrieval_by_span", "retrieval_threshold"):
        assert key in ev
    # no --eta given: the run's own diffusion.eta (1 in the presets) is used and recorded
    assert ev["settings"]["eta"] == ev["config"]["diffusion"]["eta"] == 1.0
    assert (out / "rollout.mp4").stat().st_size > 0
    import imageio.v2 as imageio
    strip = imageio.imread(out / "rollout.png")  # 2 episodes x (truth row, generated row), 12 frames, 2x
    # columns: the last context frame, 8 consecutive generated frames, 3 later ones
    assert strip.shape == (2 * (4 * 16 + 3 * 2), 2 * (12 * 16 + 11 * 2), 3)
    np.testing.assert_array_equal(strip[:32:2, :32:2], real[0, 3])  # top-left: the last context frame


def test_sample_splits_frames_17_on_by_the_views_the_context_shows(run, tmp_path, capsys):
    run_dir, _ = run
    out = tmp_path / "views"
    assert sample.main(["--run", str(run_dir), "--frames", "24", "--context", "4", "--episodes", "2", "--steps", "3",
                        "--eval", "--out", str(out)]) == 0
    views = json.loads((out / "eval.json").read_text())["hold_up"]["context_views"]
    # the episodes walk x = t mod 10 facing 0: the context shows x = 0..3; generated frames 17-24 are frames
    # 20..27 of the episode, x = 0..7, so half of them show a view the context shows
    assert (views["label"], views["share_seen"]) == ("17-24", 0.5)
    assert views["seen"]["n_probes"] == views["unseen"]["n_probes"] == 8
    assert views["all"]["n_probes"] == 16
    err = capsys.readouterr().err
    assert (f"frames 17-24: model minus context-mean {views['all']['mean']:+.2f} dB" in err
            and "; 50% show a view a context frame shows" in err)


def test_cache_and_no_cache_agree_with_full_retention(tmp_path):
    """With retention `all` the KV-cached rollout equals the recomputing one through the whole CLI path."""
    data = tmp_path / "data"
    _write_episodes(data, "training", 1)
    _write_episodes(data, "validation", 1, seed=1)
    cfg = apply_overrides(get_preset("tiny_time"), TINY + [f"data.path={data}", "memory.retention=all"]).validate()
    Trainer(cfg, tmp_path / "run").fit()
    outs = []
    for flag in ([], ["--no-cache"]):
        out = tmp_path / f"out{len(outs)}"
        args = ["--run", str(tmp_path / "run"), "--frames", "8", "--context", "4", "--episodes", "1",
                "--steps", "2", "--schedule", "fifo", "--out", str(out)]
        assert sample.main(args + flag) == 0
        outs.append(np.load(out / "rollout.npz")["fake"].astype(int))
    assert np.abs(outs[0] - outs[1]).max() <= 1  # equal up to uint8 rounding


def test_bad_input_exits_nonzero_with_a_clear_message(run, tmp_path, capsys):
    run_dir, data = run
    empty = tmp_path / "empty_run"
    empty.mkdir()
    assert sample.main(["--run", str(empty)]) == 2
    assert "checkpoint" in capsys.readouterr().err

    assert sample.main(["--run", str(run_dir), "--frames", "500", "--out", str(tmp_path / "o")]) == 2
    assert "hold only" in capsys.readouterr().err

    assert sample.main(["--run", str(run_dir), "--schedule", "nope", "--out", str(tmp_path / "o")]) == 2
    assert "unknown schedule" in capsys.readouterr().err

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"delta": 1, "num_levels": 100, "matrix": [[100, 100, 100, 100], [0, 0, 0, 0]]}))
    assert sample.main(["--run", str(run_dir), "--schedule", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "circularity" in capsys.readouterr().err.lower()

    other = tmp_path / "other"
    _write_episodes(other, "validation", 1, size=8)
    assert sample.main(["--run", str(run_dir), "--data", str(other), "--out", str(tmp_path / "o")]) == 2
    assert "resolution" in capsys.readouterr().err
    assert not (tmp_path / "o" / "rollout.npz").exists()


def test_split_training_rolls_out_the_training_episodes(run, tmp_path):
    """--split training rolls out another split of the folder (e.g. fresh episodes the run never saw)."""
    run_dir, data = run
    out = tmp_path / "train_split"
    assert sample.main(["--run", str(run_dir), "--frames", "4", "--context", "4", "--episodes", "1",
                        "--steps", "2", "--split", "training", "--out", str(out)]) == 0
    real = np.load(out / "rollout.npz")["real"]
    np.testing.assert_array_equal(real[0], np.load(data / "training" / "ep_000000.npz")["video"][:8])


def test_the_runs_own_context_level_is_the_default_and_recorded(run, tmp_path):
    """A run whose config says diffusion.context_level=7 samples as `--context-level 7` does (same frames), records
    7 in eval.json, and differs from `--context-level 0`: the default comes from the run, not from the schedule."""
    import shutil
    run_dir, _ = run
    own = tmp_path / "own"
    shutil.copytree(run_dir, own)
    for path in own.rglob("config.json"):
        cfg = json.loads(path.read_text())
        cfg["diffusion"]["context_level"] = 7
        path.write_text(json.dumps(cfg))
    flags = ["--frames", "8", "--context", "4", "--episodes", "2", "--steps", "3", "--eval"]

    def fake(run_path, out, *extra):
        assert sample.main(["--run", str(run_path), *flags, "--out", str(tmp_path / out), *extra]) == 0
        return np.load(tmp_path / out / "rollout.npz")["fake"]

    by_default = fake(own, "default")
    np.testing.assert_array_equal(by_default, fake(run_dir, "explicit", "--context-level", "7"))
    assert not np.array_equal(by_default, fake(own, "clean", "--context-level", "0"))
    assert json.loads((tmp_path / "default" / "eval.json").read_text())["settings"]["context_level"] == 7


def test_the_runs_own_anchor_is_the_default_and_recorded(run, tmp_path, capsys):
    """A run whose config says diffusion.anchor_sigma=1, anchor_floor=5 (as the tiny preset's 1 / 100) samples as
    `--anchor-sigma 1 --anchor-floor 5` does, records both in eval.json, and `--anchor-sigma 0` turns it off."""
    import shutil
    run_dir, _ = run
    own = tmp_path / "own"
    shutil.copytree(run_dir, own)
    for path in own.rglob("config.json"):
        cfg = json.loads(path.read_text())
        cfg["diffusion"].update(anchor_sigma=1.0, anchor_floor=5)
        path.write_text(json.dumps(cfg))
    flags = ["--frames", "8", "--context", "4", "--episodes", "2", "--steps", "3", "--eta", "1", "--eval"]

    def fake(run_path, out, *extra):
        assert sample.main(["--run", str(run_path), *flags, "--out", str(tmp_path / out), *extra]) == 0
        return np.load(tmp_path / out / "rollout.npz")["fake"]

    by_default = fake(own, "default")
    np.testing.assert_array_equal(by_default, fake(run_dir, "explicit", "--anchor-sigma", "1", "--anchor-floor", "5"))
    np.testing.assert_array_equal(fake(own, "off", "--anchor-sigma", "0"), fake(run_dir, "plain"))
    assert np.abs(by_default[:, 4:].astype(np.int16) - fake(run_dir, "plain")[:, 4:]).mean() > 1
    settings = json.loads((tmp_path / "default" / "eval.json").read_text())["settings"]
    assert (settings["anchor_sigma"], settings["anchor_floor"]) == (1.0, 5)
    assert sample.main(["--run", str(run_dir), *flags, "--anchor-floor", "5", "--out", str(tmp_path / "x")]) == 2
    assert "--anchor-floor 5 needs an anchor, but --anchor-sigma is 0" in capsys.readouterr().err


def test_an_episodes_rollout_does_not_depend_on_the_batch_size(run, tmp_path):
    """Each episode draws from its own generator (seeded by --seed and its index): --batch-size 1 and 2 give the
    same frames (uint8), and another --seed other ones."""
    run_dir, _ = run
    flags = ["--frames", "8", "--context", "4", "--episodes", "2", "--steps", "3", "--eta", "1"]

    def fake(out, *extra):
        assert sample.main(["--run", str(run_dir), *flags, "--out", str(tmp_path / out), *extra]) == 0
        return np.load(tmp_path / out / "rollout.npz")["fake"][:, 4:].astype(np.int16)

    together, one_by_one = fake("b2", "--batch-size", "2"), fake("b1", "--batch-size", "1")
    assert np.abs(together - one_by_one).max() <= 1  # the same noise; batched convs may round one step apart
    assert np.abs(together - fake("seed1", "--batch-size", "2", "--seed", "1")).mean() > 5


def test_candidates_reach_the_rollout_and_are_recorded(run, tmp_path):
    """--candidates 2 rolls out the medoid of two candidates per AR step: other frames than one sample from the same
    --seed, the first frames' medoid rule tested in test_candidates.py; the setting lands in eval.json."""
    run_dir, _ = run
    flags = ["--run", str(run_dir), "--frames", "8", "--context", "4", "--episodes", "2", "--steps", "3", "--eta", "1",
             "--eval"]
    assert sample.main([*flags, "--out", str(tmp_path / "one")]) == 0
    assert sample.main([*flags, "--candidates", "3", "--out", str(tmp_path / "three")]) == 0
    one, three = (np.load(tmp_path / d / "rollout.npz")["fake"][:, 4:].astype(np.int16) for d in ("one", "three"))
    assert np.abs(one - three).mean() > 1
    assert json.loads((tmp_path / "three" / "eval.json").read_text())["settings"]["candidates"] == 3


def test_anchor_sigma_reaches_the_rollout_and_is_recorded(run, tmp_path, capsys):
    """--anchor-sigma 1 holds the frames' low frequencies to their level-K predictions (the rule is tested in
    test_anchor.py): other frames than the plain sampler's from the same --seed; the setting lands in eval.json."""
    run_dir, _ = run
    flags = ["--run", str(run_dir), "--frames", "8", "--context", "4", "--episodes", "2", "--steps", "3", "--eval"]
    assert sample.main([*flags, "--out", str(tmp_path / "plain")]) == 0
    assert sample.main([*flags, "--anchor-sigma", "1", "--out", str(tmp_path / "anchored")]) == 0
    plain, anchored = (np.load(tmp_path / d / "rollout.npz")["fake"][:, 4:].astype(np.int16)
                       for d in ("plain", "anchored"))
    assert np.abs(plain - anchored).mean() > 1
    assert json.loads((tmp_path / "anchored" / "eval.json").read_text())["settings"]["anchor_sigma"] == 1.0
    assert sample.main([*flags, "--anchor-sigma", "1", "--anchor-floor", "100000", "--out", str(tmp_path / "x")]) == 2
    assert "--anchor-floor must be an integer noise level in 0..K-1" in capsys.readouterr().err


def test_anchor_runs_reach_the_rollout_and_are_recorded(run, tmp_path, capsys):
    """--anchor-runs: the run with itself samples as alone (uint8, bit for bit); a run with other weights of the same
    config moves the frames and lands in eval.json; another config, or a folder without a checkpoint, exits 2
    naming the flag (the averaging rule is tested in test_anchor_ensemble.py)."""
    import shutil

    from safetensors.torch import load_file, save_file
    run_dir, _ = run
    other, odd, empty = tmp_path / "other", tmp_path / "odd", tmp_path / "empty"
    shutil.copytree(run_dir, other)
    for path in other.rglob("ema.safetensors"):  # another "training seed": the same config, other weights
        g = torch.Generator().manual_seed(0)
        save_file({k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in load_file(path).items()}, path)
    shutil.copytree(run_dir, odd)
    for path in odd.rglob("config.json"):
        cfg = json.loads(path.read_text())
        cfg["memory"]["length"] += 1
        path.write_text(json.dumps(cfg))
    empty.mkdir()
    flags = ["--run", str(run_dir), "--frames", "8", "--context", "4", "--episodes", "2", "--steps", "3",
             "--anchor-sigma", "1", "--eval"]

    def fake(out, *extra):
        assert sample.main([*flags, "--out", str(tmp_path / out), *extra]) == 0
        return np.load(tmp_path / out / "rollout.npz")["fake"][:, 4:].astype(np.int16)

    alone = fake("alone")
    np.testing.assert_array_equal(fake("itself", "--anchor-runs", str(run_dir)), alone)
    assert np.abs(fake("pair", "--anchor-runs", str(other)) - alone).mean() > 1
    assert json.loads((tmp_path / "pair" / "eval.json").read_text())["settings"]["anchor_runs"] == [str(other)]
    assert sample.main([*flags, "--anchor-runs", f"{other},{odd}", "--out", str(tmp_path / "x")]) == 2
    assert f"--anchor-runs {odd}: memory.length is" in capsys.readouterr().err
    assert sample.main([*flags, "--anchor-runs", str(empty), "--out", str(tmp_path / "y")]) == 2
    assert f"--anchor-runs {empty}: " in capsys.readouterr().err
    assert sample.main([*flags, "--anchor-runs", str(other), "--anchor-sigma", "0", "--out", str(tmp_path / "z")]) == 2
    assert "needs an anchor" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
