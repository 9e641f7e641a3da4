"""`train.cpu_ranks`: `python train.py` on a CPU launches data-parallel ranks of one thread each under torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_training import TINY, write_episodes

import arvdm.training.loader as loader
from arvdm.config import ConfigError, apply_overrides, get_preset

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import train  # noqa: E402


def test_presets_and_validation():
    assert get_preset("tiny").train.cpu_ranks == 2  # the main job: 2 ranks x batch 8
    assert get_preset("tiny_time").train.cpu_ranks == 1  # the time-based baseline as it was measured
    with pytest.raises(ConfigError, match="train.cpu_ranks"):
        apply_overrides(get_preset("tiny"), ["train.cpu_ranks=0"]).validate()


@pytest.mark.parametrize("device,ranks,in_torchrun,expected", [
    ("cpu", 2, False, True), ("cpu", 1, False, False), ("cpu", 2, True, False), ("cuda", 2, False, False),
    ("cuda:1", 4, False, False)])
def test_launches_only_on_the_cpu_outside_torchrun(monkeypatch, device, ranks, in_torchrun, expected):
    cfg = apply_overrides(get_preset("tiny"), [f"train.cpu_ranks={ranks}"]).validate()
    if in_torchrun:
        monkeypatch.setenv("RANK", "0")
    else:
        monkeypatch.delenv("RANK", raising=False)
    assert train.launches_cpu_ranks(cfg, torch.device(device)) is expected


@pytest.mark.parametrize("with_data", [False, True])
def test_main_runs_torchrun_with_the_same_flags(monkeypatch, tmp_path, with_data):
    """The launch: torchrun --standalone --nproc_per_node=N on this train.py with the caller's flags, one
    thread per rank, the data set generated first (only for the default folder), the exit status passed on."""
    monkeypatch.delenv("RANK", raising=False)
    calls, prepared = [], []
    monkeypatch.setattr(subprocess, "run", lambda cmd, env: calls.append((cmd, env)) or
                        subprocess.CompletedProcess(cmd, 3))
    monkeypatch.setattr(loader, "prepare_data", lambda cfg: prepared.append(cfg.data.path))
    data = tmp_path / "data"
    data.mkdir()
    argv = ["--out", str(tmp_path / "run"), "--device", "cpu", "--set", "train.cpu_ranks=3", "--max-steps", "5"]
    argv += ["--data", str(data)] if with_data else []
    assert train.main(argv) == 3
    (cmd, env), = calls
    assert cmd[:5] == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3"]
    assert Path(cmd[5]) == REPO / "train.py" and cmd[6:] == argv
    assert env["OMP_NUM_THREADS"] == "1"
    assert prepared == ([] if with_data else ["datasets/memory_maze_32_mixed"])
    assert not (tmp_path / "run").exists()  # nothing written by the launching process


@pytest.mark.slow  # two ranks importing torch and training: ~25 s on a 2-core CPU
def test_python_train_py_trains_as_two_ranks(monkeypatch, tmp_path):
    """End to end: the ranks really train together (world size 2, batch_size per rank in the saved state)."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv("PYTHONPATH", f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    data = write_episodes(tmp_path / "data", n_train=6, poses=False)
    sets = [a for o in TINY + ["train.cpu_ranks=2", "train.ckpt_every=2", "train.val_every=0", "train.sample_every=0"]
            for a in ("--set", o)]
    rc = train.main(["--preset", "tiny_time", "--data", str(data), "--out", str(tmp_path / "run"), "--device", "cpu",
                     "--max-steps", "2", *sets])
    assert rc == 0
    state = torch.load(tmp_path / "run/checkpoints/step_0000002/state.pt", weights_only=True)
    assert state["data"]["world_size"] == 2 and len(state["rng"]) == 2
    assert state["data"]["position"] == 2 * 2 * state["data"]["batch_size"]


def test_in_process_training_says_it_is_one_process(tmp_path):
    """`arvdm.training.train` (the experiment grids call it) trains in the calling process: with cpu_ranks > 1
    it warns instead of silently training another global batch than `python train.py` would."""
    from arvdm.training import train as train_in_process

    data = write_episodes(tmp_path / "data", n_train=4, poses=False)
    cfg = apply_overrides(get_preset("tiny_time"), TINY + [f"data.path={data}", "train.max_steps=1",
                                                           "train.cpu_ranks=2"]).validate()
    with pytest.warns(UserWarning, match="cpu_ranks=2 is launched by train.py"):
        train_in_process(cfg, tmp_path / "run", device="cpu")
    assert (tmp_path / "run/checkpoints/step_0000001").is_dir()


def test_each_member_gets_its_own_launch(monkeypatch, tmp_path):
    """train.members=2 on CPU ranks: one torchrun launch per member, in order, each told its member by
    ARVDM_TRAIN_MEMBER (the ranks train that member alone) with the caller's flags unchanged; a failed launch
    stops the run with its exit status."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv(train.MEMBER_ENV, raising=False)
    data = tmp_path / "data"
    data.mkdir()
    argv = ["--out", str(tmp_path / "run"), "--device", "cpu", "--data", str(data), "--set", "train.cpu_ranks=2",
            "--set", "train.members=2", "--max-steps", "5"]
    for status, launched in ((0, ["0", "1"]), (4, ["0"])):
        calls = []
        monkeypatch.setattr(subprocess, "run", lambda cmd, env, calls=calls, status=status:
                            calls.append((cmd, env)) or subprocess.CompletedProcess(cmd, status))
        assert train.main(argv) == status
        assert [env[train.MEMBER_ENV] for _, env in calls] == launched
        assert all(cmd[6:] == argv for cmd, _ in calls)
