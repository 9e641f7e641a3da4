"""Experiment grids: expansion and names, validation errors, resumability, the report, one real micro grid.

Everything but the last test uses fake train / sample functions (a checkpoint folder with config.json,
an eval.json with chosen numbers); the end-to-end test trains two tiny runs for a few steps and
evaluates them through arvdm.sampling (about 20 s on a 2-core CPU).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml

from arvdm.experiments.cli import main
from arvdm.experiments.grid import GridError, expand_grid, load_grid
from arvdm.experiments.report import write_report
from arvdm.experiments.results import collect_results
from arvdm.experiments.runner import run_grid, run_status
from arvdm.model.checkpoint import checkpoint_dir, latest_checkpoint

# -- helpers -----------------------------------------------------------------------------------------------


def spec(tmp_path: Path, **parts) -> dict:
    """A grid spec on the tiny preset whose data path does not exist (so episode lengths come from
    data.generate_length)."""
    base = {"preset": "tiny_time", "set": {"data.path": str(tmp_path / "no-data"), "train.max_steps": 5,
                                      "data.generate_length": 160}}
    return {"name": "t", "base": base, "sample": {"steps": 4}, **parts}


def fake_eval(decay: float, rates: dict[str, float | None], psnr0: float = 20.0) -> dict:
    """An eval.json body with the fields the report reads (and the ones read_eval_json requires)."""
    bins = [{"bin": b, "n": 0 if r is None else 10, "hits": 0, "rate": r} for b, r in rates.items()]
    known = [r for r in rates.values() if r is not None]
    spans = [{"label": "0-16", "mean": psnr0, "n": 16}, {"label": "16-32", "mean": psnr0 - decay, "n": 16}]
    return {"psnr_by_span": spans, "ssim_by_span": spans, "max_psnr_decay": decay, "retrieval_by_span": bins,
            "retrieval_mean": sum(known) / len(known) if known else None, "retrieval_threshold": 0.5,
            "n_frames": 64, "n_probes": 30, "psnr_mean": psnr0 - decay / 2, "ssim_mean": 0.5,
            "psnr_curve": [psnr0 - decay * i / 31 for i in range(32)]}


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def write_fake_cell(out: Path, name: str, decay: float, rates: dict[str, float | None]) -> None:
    cell = out / "cells" / name
    cell.mkdir(parents=True, exist_ok=True)
    (cell / "eval.json").write_text(json.dumps(fake_eval(decay, rates)))
    with open(cell / "metrics.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["frame", "psnr", "ssim", "n"])
        w.writerows([i, 20.0 - decay * i / 31, 0.5, 4] for i in range(32))


class FakeTrainer:
    """Records calls; 'trains' by writing a checkpoint folder at max_steps with the run's config.json."""

    def __init__(self):
        self.calls: list[tuple[str, bool]] = []

    def __call__(self, cfg, run_dir, resume, device):
        self.calls.append((Path(run_dir).name, resume))
        ckpt = checkpoint_dir(run_dir, cfg.train.max_steps)
        ckpt.mkdir(parents=True)
        (ckpt / "config.json").write_text(cfg.to_json())


class FakeSampler:
    """Records calls; writes eval.json + metrics.csv whose numbers depend on the cell's memory length."""

    def __init__(self, fail: set[str] = frozenset()):
        self.calls: list[str] = []
        self.fail = fail

    def __call__(self, run_dir, out_dir, settings):
        name = Path(out_dir).name
        self.calls.append(name)
        assert settings.evaluate and not settings.progress  # the runner always evaluates, quietly
        if name in self.fail:
            raise RuntimeError("rollout exploded")
        m = json.loads((Path(out_dir) / "cell.json").read_text())["values"]["memory.length"]
        write_fake_cell(Path(out_dir).parents[1], name, decay=m / 4, rates={"0-16": 0.5, "16-48": m / 48})


# -- expansion -------------------------------------------------------------------------------------------


def test_product_exclusions_explicit_cells_and_shared_runs(tmp_path):
    grid = expand_grid(spec(tmp_path,
                            axes={"memory.structure": ["prepend", "channel_concat"], "memory.length": [8, 24],
                                  "schedule": ["chunked", "fifo"]},
                            exclude=[{"memory.structure": "channel_concat", "schedule": "fifo"}],
                            cells=[{"memory.length": 24, "memory.budget": 8}]))
    assert [c.name for c in grid.cells] == [
        "prepend-m8-none-chunked", "prepend-m8-none-fifo", "prepend-m24-none-chunked", "prepend-m24-none-fifo",
        "channel_concat-m8-none-chunked", "channel_concat-m24-none-chunked", "prepend-m24-joint8-chunked"]
    # Cells that differ only in the schedule share one training run.
    assert grid.runs["prepend-m8-none"].cells == ["prepend-m8-none-chunked", "prepend-m8-none-fifo"]
    assert len(grid.runs) == 5
    budget = grid.cell("prepend-m24-joint8-chunked")
    assert "memory.compressor=joint" in budget.overrides  # a budget without a compressor gets the paper's
    assert budget.config.memory.budget == 8 and budget.config.memory.compressor == "joint"
    fifo = grid.cell("prepend-m8-none-fifo")
    assert fifo.sample["schedule"] == "fifo" and fifo.sample["steps"] == 4
    assert f"data.path={tmp_path / 'no-data'}" in fifo.overrides and "memory.length=8" in fifo.overrides
    # One context for every cell (the longest memory), so all curves cover the same frames.
    assert {c.sample["context"] for c in grid.cells} == {24}


def test_budget_axis_couples_with_compressor_and_extra_axes_join_names(tmp_path):
    grid = expand_grid(spec(tmp_path, axes={"memory.length": [16], "memory.compressor": ["joint", "modulated"],
                                            "memory.budget": [0, 8], "train.lr": [1e-4, 3e-4],
                                            "sample.steps": [2, 4]}))
    names = [c.name for c in grid.cells]
    # budget 0 = uncompressed: one cell, not one per compressor; lr is a training key, steps a sampling key
    assert names == [f"prepend-m16-{comp}-lr{lr}-chunked-steps{s}" for comp in ("none", "joint8", "modulated8")
                     for lr in ("0.0001", "0.0003") for s in (2, 4)]
    assert len(grid.runs) == 6 and all(len(r.cells) == 2 for r in grid.runs.values())
    assert grid.columns == ["train.lr", "sample.steps"]
    assert grid.cell("prepend-m16-none-lr0.0001-chunked-steps2").config.memory.compressor == "none"


def test_invalid_cells_are_listed_together_before_anything_runs(tmp_path):
    s = spec(tmp_path, axes={"memory.length": [8, 4], "schedule": ["chunked", "zigzag"]},
             cells=[{"memory.length": 4, "memory.budget": 16}])
    s["sample"]["frames"] = 155
    with pytest.raises(GridError) as e:
        expand_grid(s)
    msg = str(e.value)
    assert "invalid cell" in msg
    assert "cell prepend-m8-none-zigzag: schedule 'zigzag'" in msg
    assert "memory.budget=16" in msg and "memory.length=4" in msg  # the Config's own complaint
    # 8 context + 155 frames > 160-frame episodes: caught now, not after training
    assert "sample.frames=155" in msg and "hold 160" in msg
    # An excluded combination may be invalid; an exclusion that matches nothing is a mistake.
    ok = spec(tmp_path, axes={"memory.length": [4, 8], "memory.budget": [0, 8]},
              exclude=[{"memory.length": 4, "memory.budget": 8}])
    assert [c.name for c in expand_grid(ok).cells] == ["prepend-m4-none-chunked", "prepend-m8-none-chunked",
                                                       "prepend-m8-joint8-chunked"]
    ok["exclude"].append({"memory.structure": "channel-concat"})
    with pytest.raises(GridError, match=r"exclude\[1\].*channel-concat.*matches no cell"):
        expand_grid(ok)


@pytest.mark.parametrize("change, words", [
    ({"colour": 1}, ["unknown key", "colour"]),
    ({"axes": {"memory.length": 8}}, ["axes.memory.length", "non-empty list"]),
    ({"axes": {"memory.lenght": [8]}}, ["axes.memory.lenght", "unknown config key"]),
    ({"axes": {"sample.colour": [1]}}, ["axes.sample.colour", "unknown sampling key"]),
    ({"axes": {"memory.length": [[8]]}}, ["axes.memory.length[0]", "number, string or boolean"]),
    ({"sample": {"evaluate": False}}, ["sample.evaluate", "experiment runner"]),
    ({"sample": {"stepz": 3}}, ["sample.stepz", "unknown sampling setting"]),
    ({"base": {"preset": "huge"}}, ["base.preset", "huge"]),
    ({"base": {"set": {"train.max_stepz": 3}}}, ["base.set", "train.max_stepz"]),
    ({"exclude": [{}]}, ["exclude[0]", "empty"]),
    ({"cells": "prepend"}, ["cells", "list"]),
    ({"report": {"pareto": True}}, ["report", "pareto"]),
])
def test_malformed_grid_errors_name_the_key(tmp_path, change, words):
    s = {**spec(tmp_path), **change}
    with pytest.raises(GridError) as e:
        expand_grid(s)
    for word in words:
        assert word in str(e.value)


def test_grid_files_by_path_and_by_name(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in spec(tmp_path).items() if k != "name"}))
    assert load_grid(path).name == "mine"  # the file's stem when the grid has no name
    assert [c.name for c in load_grid(path).cells] == ["prepend-m4-none-chunked"]  # no axes: the base cell (tiny: m=4)
    with pytest.raises(GridError, match=r"no grid 'nope'.*tiny"):
        load_grid("nope")
    (tmp_path / "bad.yaml").write_text("axes: [1, 2\n")
    with pytest.raises(GridError, match="bad.yaml: cannot read it as YAML"):
        load_grid(tmp_path / "bad.yaml")


def test_shipped_grids_expand_and_fit_their_episodes():
    tiny = load_grid("tiny")
    assert [c.name for c in tiny.cells] == [
        "prepend-m8-none-chunked", "prepend-m24-none-chunked", "channel_concat-m24-none-chunked",
        "cross_attention-m24-none-chunked", "prepend-m24-joint8-chunked", "prepend-m24-none-fifo"]
    assert len(tiny.runs) == 5 and tiny.runs["prepend-m24-none"].cells[1] == "prepend-m24-none-fifo"
    for c in tiny.cells:
        cfg = c.config
        assert cfg.data.generate_policy == "revisit" and cfg.data.generate_length >= 128
        assert c.sample["context"] + c.sample["frames"] <= cfg.data.generate_length
    paper = load_grid("paper")
    assert {"prepend-m16-none-chunked", "prepend-m112-none-chunked", "channel_concat-m112-none-chunked",
            "cross_attention-m112-none-chunked", "prepend-m48-joint8-chunked",
            "prepend-m48-joint48-chunked"} <= {c.name for c in paper.cells}
    assert all(c.config.model.image_size == 64 and c.config.preset == "paper" for c in paper.cells)
    assert paper.paper_reference and not tiny.paper_reference


# -- running: resumability with fake train / sample functions ---------------------------------------------


def test_finished_cells_and_runs_are_skipped_interrupted_runs_resume(tmp_path):
    grid = expand_grid(spec(tmp_path, axes={"memory.length": [8, 24]},
                            cells=[{"memory.length": 24, "schedule": "fifo"}]))
    out, trainer, sampler = tmp_path / "out", FakeTrainer(), FakeSampler()
    result = run_grid(grid, out, train_fn=trainer, sample_fn=sampler, progress=False, log=lambda s: None)
    assert trainer.calls == [("prepend-m8-none", False), ("prepend-m24-none", False)]  # fifo shares m24's run
    assert sampler.calls == ["prepend-m8-none-chunked", "prepend-m24-none-chunked", "prepend-m24-none-fifo"]
    assert result["evaluated"] == sampler.calls and not result["failed"]
    assert (out / "plan.json").is_file() and (out / "results.csv").is_file()

    # Everything finished: nothing trains or samples again.
    trainer.calls.clear(), sampler.calls.clear()
    result = run_grid(grid, out, train_fn=trainer, sample_fn=sampler, progress=False, log=lambda s: None)
    assert trainer.calls == [] and sampler.calls == [] and len(result["skipped"]) == 3

    # A lost eval.json: that cell alone is evaluated again, its finished run is not retrained.
    (out / "cells/prepend-m24-none-fifo/eval.json").unlink()
    run_grid(grid, out, train_fn=trainer, sample_fn=sampler, progress=False, log=lambda s: None)
    assert trainer.calls == [] and sampler.calls == ["prepend-m24-none-fifo"]

    # An interrupted run (newest checkpoint before max_steps) resumes; --only limits the work.
    sampler.calls.clear()
    run_dir = out / "runs/prepend-m8-none"
    (run_dir / "checkpoints/step_0000005").rename(run_dir / "checkpoints/step_0000003")
    assert run_status(run_dir, grid.runs["prepend-m8-none"].config) == ("resume", 3)
    (out / "cells/prepend-m8-none-chunked/eval.json").unlink()
    trainer_resume = FakeTrainer()
    run_grid(grid, out, only=["prepend-m8-*"], train_fn=trainer_resume, sample_fn=sampler, progress=False,
             log=lambda s: None)
    assert trainer_resume.calls == [("prepend-m8-none", True)] and sampler.calls == ["prepend-m8-none-chunked"]


def test_failures_are_recorded_and_the_grid_carries_on(tmp_path):
    grid = expand_grid(spec(tmp_path, axes={"memory.length": [8, 24]}))
    out = tmp_path / "out"
    result = run_grid(grid, out, train_fn=FakeTrainer(), sample_fn=FakeSampler(fail={"prepend-m8-none-chunked"}),
                      progress=False, log=lambda s: None)
    assert list(result["failed"]) == ["prepend-m8-none-chunked"]
    assert "rollout exploded" in (out / "cells/prepend-m8-none-chunked/error.txt").read_text()
    assert result["evaluated"] == ["prepend-m24-none-chunked"]
    rows = {r["name"]: r for r in collect_results(out, grid)}
    assert rows["prepend-m8-none-chunked"]["status"] == "failed"
    assert rows["prepend-m24-none-chunked"]["status"] == "done"
    # The retry succeeds and clears the error.
    run_grid(grid, out, train_fn=FakeTrainer(), sample_fn=FakeSampler(), progress=False, log=lambda s: None)
    assert not (out / "cells/prepend-m8-none-chunked/error.txt").exists()
    with pytest.raises(RuntimeError, match="exploded"):
        (out / "cells/prepend-m8-none-chunked/eval.json").unlink()
        run_grid(grid, out, train_fn=FakeTrainer(), sample_fn=FakeSampler(fail={"prepend-m8-none-chunked"}),
                 progress=False, log=lambda s: None, fail_fast=True)


def test_a_run_folder_with_another_config_is_refused_before_anything_runs(tmp_path):
    grid = expand_grid(spec(tmp_path, axes={"memory.length": [8, 24]}))
    other = expand_grid(spec(tmp_path, axes={"memory.length": [8]}))
    out = tmp_path / "out"
    FakeTrainer()(other.cells[0].config, out / "runs/prepend-m24-none", False, None)  # m=8 weights, m=24 name
    trainer, sampler = FakeTrainer(), FakeSampler()
    with pytest.raises(GridError, match=r"prepend-m24-none holds a run with another configuration.*memory.length"):
        run_grid(grid, out, train_fn=trainer, sample_fn=sampler, progress=False, log=lambda s: None)
    assert trainer.calls == [] and sampler.calls == []


def test_dry_run_and_unknown_only_names(tmp_path, capsys):
    path = tmp_path / "g.yaml"
    path.write_text(yaml.safe_dump(spec(tmp_path, axes={"memory.length": [8, 24]})))
    assert main(["pareto", "--grid", str(path), "--out", str(tmp_path / "out"), "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "run  prepend-m8-none: train 5 steps" in printed and "cell prepend-m24-none-chunked: evaluate" in printed
    assert not (tmp_path / "out").exists()  # a dry run writes nothing
    assert main(["pareto", "--grid", str(path), "--out", str(tmp_path / "out"), "--only", "cross*"]) == 2
    assert "matches no cell" in capsys.readouterr().err


# -- the report ------------------------------------------------------------------------------------------


def test_report_tables_plots_and_frontier_from_cell_folders(tmp_path):
    grid = expand_grid(spec(tmp_path, axes={"memory.structure": ["prepend", "channel_concat", "cross_attention"],
                                            "memory.length": [8, 24]}))
    out = tmp_path / "out"
    # (decay, mean retrieval): prepend-m8 (1, .3) and prepend-m24 (3, .6) are the frontier; channel concat
    # m24 (3, .2) is dominated; cross-attention m8 has no probes at all; m24 cells of the rest are pending.
    write_fake_cell(out, "prepend-m8-none-chunked", 1.0, {"0-16": 0.6, "16-48": 0.0})
    write_fake_cell(out, "prepend-m24-none-chunked", 3.0, {"0-16": 0.8, "16-48": 0.4})
    write_fake_cell(out, "channel_concat-m24-none-chunked", 3.0, {"0-16": 0.3, "16-48": 0.1})
    write_fake_cell(out, "cross_attention-m8-none-chunked", 0.5, {"0-16": None, "16-48": None})
    run = out / "runs/prepend-m24-none"
    FakeTrainer()(grid.runs["prepend-m24-none"].config, run, False, None)
    (run / "log.csv").write_text("step,loss,val_loss,val_loss_ema\n5,0.9,0.8,0.7\n10,0.5,,\n")

    paths = write_report(out, grid, quiet=True)
    for name in ("error_accumulation.png", "retrieval_by_span.png", "pareto.png"):
        assert (out / name).stat().st_size > 1000
    assert set(paths) >= {"csv", "md", "pareto", "pareto_csv", "error_accumulation", "retrieval_by_span"}

    rows = {r["name"]: r for r in read_csv(out / "results.csv")}
    assert list(rows) == [c.name for c in grid.cells]  # one row per cell, in grid order
    front = {n for n, r in rows.items() if r["on_frontier"] == "1"}
    assert front == {"prepend-m8-none-chunked", "prepend-m24-none-chunked"}
    r = rows["prepend-m24-none-chunked"]
    assert (r["structure"], r["length"], r["budget"], r["compressor"], r["schedule"]) == \
        ("prepend", "24", "0", "none", "chunked")
    assert float(r["max_psnr_decay"]) == 3.0 and float(r["retrieval_mean"]) == pytest.approx(0.6)
    assert float(r["retrieval_16-48"]) == 0.4 and float(r["psnr_16-32"]) == 17.0
    assert (r["train_steps"], r["val_loss"], r["val_loss_ema"]) == ("5", "0.8", "0.7")
    assert rows["cross_attention-m8-none-chunked"]["retrieval_mean"] == ""  # no probes: not on any frontier
    assert rows["cross_attention-m8-none-chunked"]["on_frontier"] == "0"
    assert rows["prepend-m24-none-chunked"]["status"] == "done"
    assert rows["channel_concat-m8-none-chunked"]["status"] == "pending"
    assert rows["channel_concat-m8-none-chunked"]["max_psnr_decay"] == ""

    pareto = {r["name"]: r for r in read_csv(out / "pareto.csv")}
    assert len(pareto) == 4 and pareto["channel_concat-m24-none-chunked"]["on_frontier"] == "0"
    md = (out / "results.md").read_text()
    assert "4 of 6 cells evaluated, 2 pending" in md and "| prepend-m8-none-chunked |" in md
    assert "![Pareto frontier, max decay vs mean retrieval (old criterion)](pareto.png)" in md
    assert "pareto_gain.png" not in md  # no rollout.npz: no revisit gain, no trade-off plot

    # `report` regenerates from the folder alone (plan.json, else the cells' cell.json), runs nothing.
    (out / "pareto.png").unlink()
    assert main(["report", "--out", str(out)]) == 2  # no plan.json, no cell.json yet: says so
    (out / "plan.json").write_text(json.dumps(grid.to_dict()))
    assert main(["report", "--out", str(out), "--paper-reference"]) == 0
    assert (out / "pareto.png").stat().st_size > 1000
    assert "(paper)" not in (out / "pareto.csv").read_text()  # paper points are drawn, not frontier members


# -- end to end ------------------------------------------------------------------------------------------


def test_micro_grid_end_to_end(tmp_path):
    """Two cells on 16-px random episodes with poses: real training (a few steps) and real evaluation."""
    import numpy as np

    from data.episodes import write_episode

    rng = np.random.default_rng(0)
    data = tmp_path / "data"
    for split, n in (("training", 3), ("validation", 2)):
        (data / split).mkdir(parents=True)
        for e in range(n):
            t = 40
            # A there-and-back walk: frames 20..39 retrace 19..0, so late frames revisit early poses.
            xs = np.concatenate([np.arange(20), np.arange(19, -1, -1)]).astype(np.float32)
            pose = np.stack([xs, np.zeros(t, np.float32), np.zeros(t, np.float32)], 1)
            write_episode(data / split / f"ep{e:04d}.npz", rng.integers(0, 256, (t, 16, 16, 3), dtype=np.uint8),
                          rng.integers(0, 6, t).astype(np.int64), pose)
    s = {"name": "micro",
         "base": {"preset": "tiny_time", "set": {
             "data.path": str(data), "model.image_size": 16, "data.resize": 0, "model.patch_size": 4, "model.dim": 32,
             "model.depth": 1, "model.heads": 2, "model.num_actions": 6, "train.window": 4,
             "train.batch_size": 2, "train.max_steps": 3, "train.warmup_steps": 1, "train.val_every": 3,
             "train.val_batches": 1, "train.sample_every": 0, "train.ckpt_every": 3, "diffusion.num_levels": 50}},
         "sample": {"steps": 2, "frames": 32, "episodes": 2, "batch_size": 2, "device": "cpu"},
         "axes": {"memory.length": [2, 4]}}
    grid = expand_grid(s)
    out = tmp_path / "out"
    result = run_grid(grid, out, device="cpu", progress=False, log=lambda s: None)
    assert not result["failed"], result["failed"]
    assert result["trained"] == ["prepend-m2-none", "prepend-m4-none"]
    for cell in grid.cells:
        ev = json.loads((out / "cells" / cell.name / "eval.json").read_text())
        assert ev["n_probes"] > 0 and ev["max_psnr_decay"] is not None
        assert latest_checkpoint(out / "runs" / cell.train_run).name == "step_0000003"
    rows = read_csv(out / "results.csv")
    assert [r["status"] for r in rows] == ["done", "done"] and all(int(r["params"]) > 0 for r in rows)
    assert all(r["psnr_16-32"] for r in rows) and {r["on_frontier"] for r in rows} <= {"0", "1"}
    assert (out / "pareto.png").stat().st_size > 1000
    # A second call finds everything finished.
    again = run_grid(grid, out, device="cpu", progress=False, log=lambda s: None)
    assert again["trained"] == [] and again["evaluated"] == [] and len(again["skipped"]) == 2
