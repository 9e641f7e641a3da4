"""A sweep of malformed inputs: every one gets exit code 2, a one-line message naming the thing, no traceback.

Episodes (data.preview and training), schedules, configs, checkpoints (including a training state whose
pickle carries code) and the numeric / path flags of train.py, sample.py, data.generate and data.preview.
The CLIs' main(argv) run in-process (fast); one case runs the real script in a subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import sample
import train
from arvdm.config import apply_overrides, get_preset
from arvdm.training.trainer import Trainer
from data import generate as generate_cli
from data import preview as preview_cli
from data.episodes import write_episode

REPO = Path(__file__).resolve().parents[1]
TINY = ["model.image_size=16", "data.resize=0", "model.patch_size=4", "model.dim=32", "model.depth=1",
        "model.heads=2", "model.num_actions=6", "memory.length=2", "train.window=4", "train.batch_size=2",
        "train.max_steps=1", "train.ckpt_every=1", "train.val_every=0", "train.sample_every=0",
        "train.warmup_steps=1", "diffusion.num_levels=100"]
TINY_FLAGS = [a for o in TINY for a in ("--set", o)]


def write_data(root: Path, length: int = 12, n: int = 2) -> Path:
    rng = np.random.default_rng(0)
    for split in ("training", "validation"):
        (root / split).mkdir(parents=True, exist_ok=True)
        for e in range(n):
            write_episode(root / split / f"ep{e:04d}.npz", rng.integers(0, 256, (length, 16, 16, 3), dtype=np.uint8),
                          rng.integers(0, 6, length).astype(np.int64))
    return root


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A one-step tiny run (checkpoint step_0000001) with its data beside it."""
    root = tmp_path_factory.mktemp("malformed")
    data = write_data(root / "data")
    cfg = apply_overrides(get_preset("tiny_time"), TINY + [f"data.path={data}"]).validate()
    Trainer(cfg, root / "run", device="cpu").fit()
    return root / "run"


@pytest.fixture
def data(tmp_path) -> Path:
    return write_data(tmp_path / "data")


def fails(capsys, main, argv: list[str], *needles: str) -> str:
    """main(argv) returns 2 (argparse's SystemExit(2) counts) and prints one error naming every needle."""
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:  # argparse rejects a malformed value itself, with exit code 2
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err, err
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"
    return err


def sample_fails(capsys, run: Path, tmp_path: Path, flags: list, *needles: str) -> None:
    """sample.py refuses before any work: no output folder, no progress bar."""
    out = tmp_path / "samples"
    err = fails(capsys, sample.main, ["--run", run, "--out", out, "--device", "cpu", *flags], *needles)
    assert not out.exists(), "sample.py wrote output before refusing"
    assert "rollout" not in err  # the progress bar never started


def train_fails(capsys, argv: list, *needles: str, out: Path | None = None) -> None:
    fails(capsys, train.main, ["--preset", "tiny_time", *argv, "--device", "cpu", *TINY_FLAGS], *needles)  # no poses
    if out is not None:
        assert not (out / "checkpoints").exists() and not (out / "log.csv").exists(), "train.py wrote into --out"


# -- episodes -------------------------------------------------------------------------------------------
def test_preview_of_a_zero_length_episode_names_the_file(tmp_path, capsys):
    (tmp_path / "d").mkdir()
    write_episode(tmp_path / "d/empty.npz", np.zeros((0, 16, 16, 3), np.uint8), np.zeros(0, np.int64))
    fails(capsys, preview_cli.main, [tmp_path / "d", "--out", tmp_path / "o"], "empty.npz", "empty (0 frames)")
    assert not (tmp_path / "o/preview.png").exists()


def test_training_on_a_folder_with_an_empty_episode_names_the_file(tmp_path, data, capsys):
    write_episode(data / "training/zz_empty.npz", np.zeros((0, 16, 16, 3), np.uint8), np.zeros(0, np.int64))
    train_fails(capsys, ["--data", data, "--out", tmp_path / "run"], "zz_empty.npz", "empty (0 frames)",
                out=tmp_path / "run")


@pytest.mark.parametrize("content, needle", [
    (b"", "file is empty (0 bytes)"),
    (b"this is not a zip file at all", "not an npz file"),
])
def test_training_on_a_broken_episode_file_names_it(tmp_path, data, capsys, content, needle):
    (data / "training/zz_bad.npz").write_bytes(content)
    train_fails(capsys, ["--data", data, "--out", tmp_path / "run"], "zz_bad.npz", needle)


@pytest.mark.parametrize("arrays, needle", [
    ({"video": np.zeros((4, 16, 16, 3), np.float32), "actions": np.zeros(4, np.int64)}, "expected uint8"),
    ({"video": np.zeros((4, 16, 16, 3), np.uint8), "actions": np.zeros(3, np.int64)}, "length mismatch"),
    ({"video": np.zeros((4, 16, 16, 3), np.uint8), "actions": -np.ones(4, np.int64)}, "negative values"),
    ({"video": np.zeros((4, 16, 16, 3), np.uint8)}, "missing key 'actions'"),
    ({"video": np.zeros((4, 16, 16, 3), np.uint8), "actions": np.array([None] * 4, dtype=object)},
     "refusing to unpickle"),
])
def test_preview_of_a_malformed_episode_names_file_and_problem(tmp_path, capsys, arrays, needle):
    (tmp_path / "d").mkdir()
    np.savez(tmp_path / "d/bad.npz", **arrays)
    fails(capsys, preview_cli.main, [tmp_path / "d", "--out", tmp_path / "o"], "bad.npz", needle)


# -- data.preview and data.generate flags -----------------------------------------------------------------
@pytest.mark.parametrize("flags, needle", [
    (["--episodes", "0"], "--episodes must be >= 1, got 0"),
    (["--frames", "-3"], "--frames must be >= 1, got -3"),
    (["--gif-frames", "0"], "--gif-frames must be >= 1"),
    (["--frames", "abc"], "invalid int value"),
])
def test_preview_numeric_flags(data, capsys, tmp_path, flags, needle):
    fails(capsys, preview_cli.main, [data, "--out", tmp_path / "o", *flags], needle)
    assert not (tmp_path / "o").exists()


def test_preview_paths(tmp_path, data, capsys):
    fails(capsys, preview_cli.main, [tmp_path / "nowhere"], "nowhere: folder does not exist")
    (tmp_path / "file").write_text("x")
    fails(capsys, preview_cli.main, [data, "--out", tmp_path / "file"], "--out", "not a folder")


@pytest.mark.parametrize("flags, needle", [
    (["--episodes", "0"], "--episodes must be >= 1"),
    (["--length", "1"], "--length must be >= 2"),
    (["--size", "8"], "--size must be in 16..1024"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--workers", "0"], "--workers must be >= 1"),
])
def test_generate_flags_refused_before_any_episode(tmp_path, capsys, flags, needle):
    out = tmp_path / "gen"
    fails(capsys, generate_cli.main, ["crafter", "--out", out, *flags], needle)
    assert not out.exists()


def test_generate_out_that_is_a_file(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    fails(capsys, generate_cli.main, ["crafter", "--out", tmp_path / "file", "--episodes", "2"], "not a folder")


# -- configs (train.py --set / --preset) -----------------------------------------------------------------
@pytest.mark.parametrize("flags, needle", [
    (["--set", "model.bogus=1"], "unknown config key 'model.bogus'"),
    (["--set", "memory.length=abc"], "config key 'memory.length' expects int"),
    (["--set", "memory.compressor=joint", "--set", "memory.budget=9"], "memory.budget=9 must be in 1..memory.length"),
    (["--set", "train.dist_timeout_s=0"], "train.dist_timeout_s=0.0 must be > 0"),
    (["--set", "memory.length"], "is not of the form key=value"),
    (["--preset", "huge"], "unknown preset 'huge'"),
])
def test_bad_configs(tmp_path, data, capsys, flags, needle):
    train_fails(capsys, ["--data", data, "--out", tmp_path / "run", *flags], needle, out=tmp_path / "run")


# -- train.py flags ---------------------------------------------------------------------------------------
def test_train_numeric_and_path_flags(tmp_path, data, capsys):
    out = tmp_path / "run"
    train_fails(capsys, ["--data", data, "--out", out, "--max-steps", "0"], "--max-steps must be >= 1, got 0", out=out)
    train_fails(capsys, ["--data", tmp_path / "nowhere", "--out", out], "--data", "nowhere: folder does not exist",
                out=out)
    (tmp_path / "file").write_text("x")
    train_fails(capsys, ["--data", data, "--out", tmp_path / "file"], "--out", "not a folder")
    fails(capsys, train.main, ["--data", data, "--out", out, "--device", "tpu9"], "--device 'tpu9'")
    train_fails(capsys, ["--data", data, "--out", out, "--resume"], "--resume", "no complete checkpoint", out=out)
    assert not out.exists()


def test_train_refuses_to_overwrite_a_run(run, capsys):
    train_fails(capsys, ["--out", run], "already holds checkpoints", "--resume")


# -- checkpoints ------------------------------------------------------------------------------------------
def copy_run(run: Path, tmp_path: Path) -> tuple[Path, Path]:
    dst = tmp_path / "run"
    shutil.copytree(run, dst)
    return dst, dst / "checkpoints/step_0000001"


def test_training_state_whose_pickle_carries_code_is_refused_and_never_runs(run, tmp_path, capsys):
    class Payload:
        def __reduce__(self):  # unpickling this would create the marker file
            return (open, (str(tmp_path / "PWNED"), "w"))

    dst, ckpt = copy_run(run, tmp_path)
    torch.save({"step": 1, "payload": Payload()}, ckpt / "state.pt")
    assert not (tmp_path / "PWNED").exists()
    train_fails(capsys, ["--out", dst, "--resume"], "state.pt", "cannot load training state")
    assert not (tmp_path / "PWNED").exists(), "the pickle's code ran"


def test_resume_without_training_state(run, tmp_path, capsys):
    dst, ckpt = copy_run(run, tmp_path)
    (ckpt / "state.pt").unlink()
    train_fails(capsys, ["--out", dst, "--resume"], "state.pt is missing")


@pytest.mark.parametrize("damage, needle", [
    (lambda c: (c / "config.json").write_text("{not json"), "not a valid run config"),
    (lambda c: (c / "config.json").write_text(json.dumps({"model": {"dim": "wide"}})), "expects int"),
    (lambda c: (c / "config.json").unlink(), "config.json is missing"),
    (lambda c: (c / "ema.safetensors").write_bytes(b"\x00" * 10), "cannot read"),
    (lambda c: (c / "config.json").write_text(
        json.loads((c / "config.json").read_text()) and
        (c / "config.json").read_text().replace('"dim": 32', '"dim": 64')), "do not match config.json"),
])
def test_sampling_from_a_damaged_checkpoint(run, tmp_path, capsys, damage, needle):
    dst, ckpt = copy_run(run, tmp_path)
    damage(ckpt)
    sample_fails(capsys, dst, tmp_path, ["--frames", "2"], needle)


def test_sampling_from_no_run(tmp_path, capsys):
    sample_fails(capsys, tmp_path / "nowhere", tmp_path, [], "no such run or checkpoint folder")
    (tmp_path / "empty_run").mkdir()
    sample_fails(capsys, tmp_path / "empty_run", tmp_path, [], "no complete checkpoint")


# -- sample.py flags ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("flags, needle", [
    (["--episodes", "0"], "--episodes must be an integer >= 1, got 0"),
    (["--frames", "-3"], "--frames must be an integer >= 1, got -3"),
    (["--frames", "0"], "--frames must be an integer >= 1, got 0"),
    (["--eta", "5"], "--eta must be in [0, 1]"),
    (["--eta", "nan"], "--eta must be in [0, 1]"),
    (["--steps", "0"], "--steps must be an integer >= 1"),
    (["--context", "-1"], "--context must be an integer >= 0"),
    (["--batch-size", "0"], "--batch-size must be an integer >= 1"),
    (["--seed", "-5"], "--seed must be an integer >= 0"),
    (["--device", "gpu7"], "--device 'gpu7' is not a device name"),
    (["--frames", "1000"], "hold only 12"),
    (["--steps", "x"], "invalid int value"),
])
def test_sample_numeric_flags(run, tmp_path, capsys, flags, needle):
    sample_fails(capsys, run, tmp_path, flags, needle)


def test_sample_path_flags(run, tmp_path, capsys):
    sample_fails(capsys, run, tmp_path, ["--data", tmp_path / "nowhere"], "--data", "folder does not exist")
    sample_fails(capsys, run, tmp_path, ["--schedule", tmp_path / "s.json"], "--schedule", "no such file")
    (tmp_path / "file").write_text("x")
    fails(capsys, sample.main, ["--run", run, "--out", tmp_path / "file", "--device", "cpu"], "--out", "not a folder")


@pytest.mark.parametrize("body, needle", [
    ("{broken", "s.json"),
    (json.dumps({"delta": 1, "num_levels": 100, "matrix": [[100, 100, 100, 100], [0, 50, 20, 100]]}),
     "monotonicity"),
    (json.dumps({"delta": 1, "num_levels": 100, "matrix": [[25, 50, 75, 100], [0, 25, 50, 75]], "extra": 1}),
     "unknown keys"),
    (json.dumps({"delta": 2, "num_levels": 100, "matrix": [[100, 100], [0, 0]]}), "2-frame window"),
    (json.dumps({"delta": 1, "num_levels": 50, "matrix": [[10, 20, 30, 50], [0, 10, 20, 30]]}), "K=50 levels"),
])
def test_sample_with_a_malformed_schedule_file(run, tmp_path, capsys, body, needle):
    (tmp_path / "s.json").write_text(body)
    sample_fails(capsys, run, tmp_path, ["--schedule", tmp_path / "s.json"], needle)


def test_sample_cli_in_a_subprocess_refuses_eta_before_any_work(run, tmp_path):
    """The real script: exit 2, one line on stderr, no traceback and no progress bar."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(REPO / "sample.py"), "--run", str(run), "--eta", "5",
                           "--out", str(tmp_path / "o")], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == ["sample.py: error: --eta must be in [0, 1] (0 = DDIM, 1 = DDPM-like), "
                                                "got 5.0"]
    assert not (tmp_path / "o").exists()
