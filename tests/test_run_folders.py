"""Run folders are portable: a run trained with a relative data path samples (and resumes) from any
directory, after the run folder moves, and after the whole project moves; when the data is gone the error
lists the paths tried and suggests --data."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_malformed_inputs import TINY, TINY_FLAGS, write_data

import sample
import train
from arvdm.config import apply_overrides, get_preset
from arvdm.model.checkpoint import CheckpointError, data_path_candidates, resolve_data_path

SAMPLE = ["--frames", "1", "--steps", "1", "--episodes", "1", "--device", "cpu"]


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    """tmp/project/{data, runs/tiny}: trained from tmp/project with the relative path `data`."""
    root = tmp_path / "project"
    write_data(root / "data")
    monkeypatch.chdir(root)
    assert train.main(["--preset", "tiny_time", "--data", "data", "--out", "runs/tiny", "--device", "cpu",
                       *TINY_FLAGS]) == 0  # time-based memory: the episodes have no poses
    return root


def saved_data_config(run: Path) -> dict:
    return json.loads((run / "checkpoints/step_0000001/config.json").read_text())["data"]


def samples_ok(run: Path, out: Path, *flags: str) -> None:
    assert sample.main(["--run", str(run), "--out", str(out), *SAMPLE, *flags]) == 0
    assert (out / "rollout.npz").is_file()


def test_config_stores_the_given_and_the_absolute_data_path(project):
    data = saved_data_config(project / "runs/tiny")
    assert data["path"] == "data" and data["abs_path"] == str((project / "data").resolve())


def test_sample_from_another_directory(project, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    samples_ok(project / "runs/tiny", tmp_path / "o")


def test_resume_from_another_directory(project, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert train.main(["--out", str(project / "runs/tiny"), "--resume", "--max-steps", "2", "--device", "cpu"]) == 0
    assert (project / "runs/tiny/checkpoints/step_0000002").is_dir()
    assert not (tmp_path / "datasets").exists() and not (tmp_path / "data").exists()  # nothing generated here


def test_sample_after_moving_the_run_folder(project, tmp_path, monkeypatch):
    moved = tmp_path / "elsewhere/tiny"
    shutil.move(project / "runs/tiny", moved)
    monkeypatch.chdir(tmp_path)
    samples_ok(moved, tmp_path / "o")  # found through data.abs_path


def test_sample_after_moving_the_whole_project(project, tmp_path, monkeypatch):
    moved = tmp_path / "copied_project"
    shutil.move(project, moved)  # the absolute path is stale now; data/ is still beside runs/
    monkeypatch.chdir(tmp_path)
    run = moved / "runs/tiny"
    assert resolve_data_path(apply_overrides(get_preset("tiny_time"), ["data.path=data"]), run) == moved / "data"
    samples_ok(run, tmp_path / "o")


def test_missing_data_lists_the_paths_tried_and_suggests_data_flag(project, tmp_path, monkeypatch, capsys):
    shutil.move(project / "data", tmp_path / "moved_data")
    monkeypatch.chdir(tmp_path)
    run = project / "runs/tiny"
    assert sample.main(["--run", str(run), "--out", str(tmp_path / "o"), *SAMPLE]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "pass --data DIR" in err and "data.path='data'" in err
    assert str(project / "data") in err and str(project / "runs/tiny/data") in err and str(tmp_path / "data") in err
    assert not (tmp_path / "o").exists()
    samples_ok(run, tmp_path / "o", "--data", str(tmp_path / "moved_data"))  # --data wins


def test_candidates_order_and_no_duplicates(tmp_path):
    cfg = apply_overrides(get_preset("tiny_time"), TINY + ["data.path=d", f"data.abs_path={tmp_path / 'abs'}"])
    run = tmp_path / "a/runs/r"
    found = data_path_candidates(cfg, run / "checkpoints/step_0000005")  # a checkpoint folder maps to its run
    assert found[:5] == [Path("d"), tmp_path / "abs", run / "d", tmp_path / "a/runs/d", tmp_path / "a/d"]
    assert len({str(p) for p in found}) == len(found)
    with pytest.raises(CheckpointError, match="--data nowhere: folder does not exist"):
        resolve_data_path(cfg, run, "nowhere")
