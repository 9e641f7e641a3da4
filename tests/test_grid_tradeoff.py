"""The memory grid's report: revisit gain at one common recent, labels, seeds pooled, frontiers, grid_cost.py.

The fake grid folders hold synthetic rollouts whose revisit gain is known by construction: every episode
returns to one view A at generated frames 8, 16, 24, ... (A was seen at context frame 1), every other frame is
random noise, the last context frame is A + 40 grey levels (copy-last: 20 log10(255 / 40) dB on the returns)
and the model draws A + d there (20 log10(255 / d) dB), so the gain is 20 log10(40 / d) dB on every probe.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from arvdm.config import apply_overrides, get_preset
from arvdm.evaluation.pareto import plot_tradeoff
from arvdm.evaluation.revisit_score import revisit_score
from arvdm.experiments.cells import GridError
from arvdm.experiments.cli import main as experiments_main
from arvdm.experiments.grid import load_grid
from arvdm.experiments.labels import cell_labels, pool_seeds
from arvdm.experiments.paired import paired_rows
from arvdm.experiments.report import write_report
from arvdm.experiments.results import collect_results
from arvdm.experiments.tradeoff import eval_poses, read_rollout
from arvdm.model.checkpoint import checkpoint_dir, save_pretrained
from arvdm.model.denoiser import Denoiser
from benchmarks import grid_cost
from data.episodes import write_episode

CONTEXT, GENERATED, EPISODES, SIZE = 4, 40, 3, 8
RETURNS = range(8, CONTEXT + GENERATED, 8)  # frames showing view A again (one event each: 5 per episode)


def gain_db(d: int) -> float:
    """The revisit gain of a model that draws A + d on the returns (copy-last is A + 40)."""
    return 20 * math.log10(40 / d)


def synthetic_rollout(d: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(real, fake) uint8 (B, T, H, W, 3), context included, with the known gain gain_db(d)."""
    rng = np.random.default_rng(seed)
    t = CONTEXT + GENERATED
    real = rng.integers(0, 256, (EPISODES, t, SIZE, SIZE, 3), dtype=np.uint8)
    view = rng.integers(50, 200, (EPISODES, SIZE, SIZE, 3)).astype(np.uint8)  # A, per episode
    real[:, 1] = view
    real[:, CONTEXT - 1] = view + 40
    for r in RETURNS:
        real[:, r] = view
    fake = real.copy()
    fake[:, CONTEXT:] = rng.integers(0, 256, (EPISODES, GENERATED, SIZE, SIZE, 3), dtype=np.uint8)
    for r in RETURNS:
        fake[:, r] = view + d
    return real, fake


def write_eval_data(root: Path) -> Path:
    """An evaluation data set whose poses the report reads (its frames do not matter here)."""
    split = root / "validation"
    split.mkdir(parents=True)
    rng = np.random.default_rng(1)
    for e in range(EPISODES):
        t = CONTEXT + GENERATED + 4
        pose = np.stack([np.arange(t, dtype=np.float32), np.zeros(t, np.float32), np.zeros(t, np.float32)], 1)
        write_episode(split / f"ep{e:03d}.npz", rng.integers(0, 256, (t, SIZE, SIZE, 3), dtype=np.uint8),
                      np.zeros(t, np.int64), pose)
    return root


def hold_up(psnr_minus_ctx: float, grad: float) -> dict:
    spans = [{"start": s, "end": s + 16, "label": f"{s}-{s + 16}", "mean": psnr_minus_ctx, "lo": 0.0, "hi": 0.0,
              "n_episodes": EPISODES, "n_frames": 16 * EPISODES} for s in range(0, 128, 16)]
    spans[0]["mean"] = 99.0  # frames 1-16 are not part of the 17-64 column
    grads = [{"start": s, "end": s + 16, "label": f"{s}-{s + 16}", "mean": 0.1 if s < 64 else grad, "n": 16}
             for s in range(0, 128, 16)]
    return {"hold_up_horizon": {"label": "32-48", "start": 32, "end": 48}, "gradient_ratio_by_span": grads,
            "psnr_minus": {"context_mean": spans, "copy_last": spans}}


def write_cell(out: Path, name: str, values: dict, *, d: int, decay: float, data: Path | None,
               run: str | None = None) -> None:
    """cell.json, eval.json (with the cell's own revisits and hold_up) and rollout.npz of one finished cell
    (trained as run ``run``, default its own name)."""
    cell = out / "cells" / name
    cell.mkdir(parents=True)
    (cell / "cell.json").write_text(json.dumps({"name": name, "train_run": run or name, "values": values,
                                                "sample": {"context": CONTEXT}}))
    spans = [{"label": "0-16", "mean": 20.0, "n": 16}, {"label": "16-32", "mean": 20.0 - decay, "n": 16}]
    ev = {"psnr_by_span": spans, "ssim_by_span": spans, "max_psnr_decay": decay, "retrieval_by_span": [],
          "retrieval_threshold": 0.5, "n_frames": GENERATED * EPISODES, "n_generated": GENERATED, "n_probes": 0,
          "context": CONTEXT,
          "settings": {"context": CONTEXT, "data": None if data is None else str(data), "split": "validation",
                       "episodes": EPISODES},
          "config": {"data": {"path": "nowhere", "frame_skip": 1}},
          "revisits": {"probes": 7, "events": 3, "recent": values["memory.length"],
                       "model_minus_copy_last": {"mean": -1.5, "lo": -2.0, "hi": -1.0}},
          "hold_up": hold_up(0.25 * d, 0.9)}
    (cell / "eval.json").write_text(json.dumps(ev))
    real, fake = synthetic_rollout(d)
    np.savez(cell / "rollout.npz", real=real, fake=fake)


def memory_values(select: str, length: int, k: int, seed: int, **more) -> dict:
    return {"memory.structure": "prepend", "memory.length": length, "memory.budget": 0, "memory.compressor": "none",
            "schedule": "chunked", "memory.select": select, "memory.pose_frames": k, "train.seed": seed,
            "sample.memory_select": None, "train.context_noise_max": 0, "sample.context_level": None, **more}


def fake_grid(tmp_path: Path, with_data: bool = True) -> Path:
    """Three finished cells: (decay, gain) = (1, 12.04), (2, 6.02) dominated, (0.5, 6.02); and one pending."""
    out = tmp_path / "grid"
    data = write_eval_data(tmp_path / "fresh") if with_data else None
    write_cell(out, "pose6-s0", memory_values("pose", 6, 4, 0), d=10, decay=1.0, data=data)
    write_cell(out, "time6-s0", memory_values("time", 6, 0, 0), d=20, decay=2.0, data=data)
    write_cell(out, "time3-s0", memory_values("time", 3, 0, 0), d=20, decay=0.5, data=data)
    pending = out / "cells" / "pose6-s1"
    pending.mkdir(parents=True)
    (pending / "cell.json").write_text(json.dumps({"name": "pose6-s1", "train_run": "pose6-s1",
                                                   "values": memory_values("pose", 6, 4, 1)}))
    return out


def test_common_recent_gain_equals_a_direct_revisit_score_and_the_known_value(tmp_path):
    out = fake_grid(tmp_path)
    rows = {r["name"]: r for r in collect_results(out)}
    pose = rows["pose6-s0"]
    assert {r["revisit_recent"] for r in rows.values() if r["status"] == "done"} == {3}  # the smallest memory.length
    # the same call sample.py makes, at recent 3, on the rollout and poses the report reads
    real, fake = read_rollout(out / "cells" / "pose6-s0")
    ev = json.loads((out / "cells" / "pose6-s0" / "eval.json").read_text())
    poses = eval_poses(ev, out, EPISODES, CONTEXT + GENERATED)
    assert poses is not None and poses.shape == (EPISODES, CONTEXT + GENERATED, 3)
    assert torch.equal(poses[0, :, 0], torch.arange(CONTEXT + GENERATED, dtype=torch.float32))
    direct = revisit_score(fake[:, CONTEXT:], real, CONTEXT, recent=3, poses=poses)
    assert pose["revisit_gain"] == direct["model_minus_copy_last"]["mean"]
    assert (pose["revisit_gain_lo"], pose["revisit_gain_hi"]) == (direct["model_minus_copy_last"]["lo"],
                                                                  direct["model_minus_copy_last"]["hi"])
    assert (pose["revisit_probes"], pose["revisit_events"]) == (direct["probes"], direct["events"])
    assert pose["revisit_probes"] == len(RETURNS) * EPISODES and pose["revisit_events"] == len(RETURNS) * EPISODES
    assert pose["revisit_gain"] == pytest.approx(gain_db(10), abs=1e-6)
    assert rows["time6-s0"]["revisit_gain"] == pytest.approx(gain_db(20), abs=1e-6)
    assert pose["revisit_poses"] == 1 and pose["revisit_oracle"] == 60.0  # identical view: the PSNR cap
    # the cell's own score is kept as eval.json has it, beside the common one
    assert (pose["own_gain"], pose["own_recent"], pose["own_events"]) == (-1.5, 6, 3)
    # error accumulation from hold_up: frames 17-64 (spans 16-32, 32-48, 48-64), gradient over 65-120
    assert pose["psnr17_64_minus_ctx"] == pytest.approx(2.5) and pose["grad_ratio_65_120"] == pytest.approx(0.9)
    assert pose["hold_up_horizon"] == "32-48" and rows["pose6-s1"]["status"] == "pending"
    # a second call reads the cache and gives the same numbers; a different recent recomputes
    assert collect_results(out)[0]["revisit_gain"] == pose["revisit_gain"]
    at6 = {r["name"]: r for r in collect_results(out, recent=6)}
    assert at6["pose6-s0"]["revisit_recent"] == 6 and at6["pose6-s0"]["revisit_gain"] == pytest.approx(gain_db(10))


def test_frontiers_and_a_report_without_cost_csv(tmp_path):
    out = fake_grid(tmp_path, with_data=False)  # no evaluation data: scored without poses, same gain
    paths = write_report(out, quiet=True)
    rows = {r["name"]: r for r in csv.DictReader(open(out / "results.csv", newline=""))}
    assert rows["pose6-s0"]["revisit_poses"] == "0"
    assert float(rows["pose6-s0"]["revisit_gain"]) == pytest.approx(gain_db(10))
    # (decay, gain): pose6 (1, 12.0) and time3 (0.5, 6.0) are the frontier; time6 (2, 6.0) is dominated
    assert {n for n, r in rows.items() if r["on_frontier_gain"] == "1"} == {"pose6-s0", "time3-s0"}
    assert all(r["ms_per_frame"] == "" and r["on_frontier_cost"] in ("0", "") for r in rows.values())
    assert "pareto_gain" in paths and "pareto_cost" not in paths and not (out / "pareto_cost.png").exists()
    assert (out / "pareto_gain.png").stat().st_size > 1000
    md = (out / "results.md").read_text()
    assert "## The memory trade-off" in md and "recent = 3" in md and "![Revisit gain vs error accumulation]" in md
    assert experiments_main(["report", "--out", str(out), "--recent", "0"]) == 2  # a bad --recent is refused

    # with cost.csv: the cheapest point joins the cost frontier, and the cost plot appears
    with open(out / "cost.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["cell", "ms_per_frame", "ms_min", "ms_max", "ratio"])
        w.writerows([["pose6-s0", 9.0, 8.5, 9.5, 1.0], ["time6-s0", 3.0, 2.9, 3.2, 0.33],
                     ["time3-s0", 4.0, 3.8, 4.4, 0.44]])
    paths = write_report(out, quiet=True)
    rows = {r["name"]: r for r in collect_results(out)}
    assert rows["time6-s0"]["ms_per_frame"] == 3.0 and rows["time6-s0"]["cost_ratio"] == 0.33
    # (ms, gain): time6 (3, 6.0) and pose6 (9, 12.0) are the frontier; time3 (4, 6.0) is dominated
    assert {n for n, r in rows.items() if r.get("on_frontier_cost") == 1} == {"time6-s0", "pose6-s0"}
    assert (out / "pareto_cost.png").stat().st_size > 1000 and "pareto_cost" in paths

    (out / "cost.csv").write_text("cell,seconds\nx,1\n")
    with pytest.raises(ValueError, match="cost.csv: not a table written by benchmarks/grid_cost.py"):
        collect_results(out)


def test_cells_are_paired_probe_by_probe(tmp_path):
    """Cells sharing a run are paired automatically (the run's first cell as a), others with --pair; a - b on each
    probe is the known 20 log10(20 / 10) dB when a draws the view 10 levels off and b 20 levels off."""
    out = fake_grid(tmp_path)
    write_cell(out, "pose6-s0-time", memory_values("pose", 6, 4, 0, **{"sample.memory_select": "time"}), d=20,
               decay=1.0, data=tmp_path / "fresh", run="pose6-s0")
    write_report(out, quiet=True, pairs=[("time6-s0", "time3-s0")])
    labels = {r["name"]: r["label"] for r in collect_results(out)}
    rows = list(csv.DictReader(open(out / "paired.csv", newline="")))
    assert [(r["a"], r["b"]) for r in rows] == [(labels["pose6-s0"], labels["pose6-s0-time"]),
                                                (labels["time6-s0"], labels["time3-s0"])]
    same, named = rows
    assert float(same["difference"]) == pytest.approx(gain_db(10) - gain_db(20), abs=1e-6)
    assert float(same["lo"]) == pytest.approx(float(same["hi"]), abs=1e-9)  # every probe differs by the same
    assert (same["probes"], same["events"], same["verdict"]) == (str(len(RETURNS) * EPISODES),
                                                                 str(len(RETURNS) * EPISODES), "a > b")
    assert float(named["difference"]) == 0.0 and named["verdict"] == "no difference shown"
    # the spans from the rollouts: the same random frames on both sides except the returns (view + d)
    assert float(same["first4_diff"]) == 0.0  # generated frames 1-4 hold no return
    returns_in_17_64 = sum(16 <= r - CONTEXT < min(64, GENERATED) for r in RETURNS)  # 3 of the span's 24 frames
    assert float(same["f17_64_diff"]) == pytest.approx(
        returns_in_17_64 * (gain_db(10) - gain_db(20)) / (min(64, GENERATED) - 16), abs=1e-4)
    md = (out / "results.md").read_text()
    assert "## Paired on the same probes (a - b)" in md and "1 of 1" in md  # the pooled row: above 0 in 1 seed of 1
    with pytest.raises(GridError, match="--pair 'nope': no such cell"):
        write_report(out, quiet=True, pairs=[("nope", "time3-s0")])
    assert experiments_main(["report", "--out", str(out), "--pair", "nope", "time3-s0"]) == 2
    # cells scored on other probes cannot be paired
    a = {r["name"]: r for r in collect_results(out)}
    moved = dict(a["time3-s0"], _revisit_probes=dict(a["time3-s0"]["_revisit_probes"], t=[0] * 15))
    with pytest.raises(GridError, match="not scored on the same probes"):
        paired_rows([(a["time6-s0"], moved)])


def test_labels_from_config_keys_and_seeds_pooled():
    cells = [{"name": "a", "values": memory_values("pose", 6, 4, 0)},
             {"name": "b", "values": memory_values("pose", 6, 4, 1)},
             {"name": "c", "values": memory_values("time", 6, 0, 0)},
             {"name": "d", "values": memory_values("pose", 6, 4, 0, **{"sample.memory_select": "time"})},
             {"name": "e", "values": memory_values("pose", 3, 1, 1, **{"train.context_noise_max": 100,
                                                                        "sample.context_level": 20})},
             {"name": "f", "values": memory_values("pose", 6, 4, 0, **{"memory.structure": "cross_attention"})}]
    labels = cell_labels(cells)
    assert [labels[c["name"]].label for c in cells] == [
        "pose k4 prepend s0", "pose k4 prepend s1", "time m6 prepend s0", "pose->time k4 prepend s0",
        "pose k1 prepend +noise100 ctx20 s1", "pose k4 xattn s0"]
    assert labels["a"].config == labels["b"].config == "pose k4 prepend" and labels["b"].seed == "s1"
    # only varying keys appear: without other structures the structure is not spelled out
    assert cell_labels(cells[:3])["a"].label == "pose k4 s0"
    # unknown keys read like the cell names; cells that would read alike are numbered
    other = cell_labels([{"name": "x", "values": {"train.lr": 0.001}}, {"name": "y", "values": {"train.lr": 0.003}}])
    assert (other["x"].label, other["y"].label) == ("lr0.001", "lr0.003")
    anchored = cell_labels([{"name": "p", "values": {"sample.anchor_sigma": 0.0, "sample.anchor_floor": 0}},
                            {"name": "q", "values": {"sample.anchor_sigma": 1.0, "sample.anchor_floor": 300}}])
    assert (anchored["p"].label, anchored["q"].label) == ("anchor0 floor0", "anchor1 floor300")
    # None is the run's own setting (tiny: anchor on, k_ctx 20); an explicit 0 turns it off and must not read alike
    run_or_off = cell_labels([{"name": f"c{i}", "values": {"sample.anchor_sigma": a, "sample.context_level": c}}
                              for i, (a, c) in enumerate([(None, None), (0.0, None), (None, 0)])])
    assert [run_or_off[f"c{i}"].label for i in range(3)] == ["base", "anchor0", "ctx0"]
    runs_anchor = cell_labels([{"name": "p", "values": {"diffusion.anchor_sigma": 0.0, "diffusion.anchor_floor": 0}},
                               {"name": "q", "values": {"diffusion.anchor_sigma": 1.0, "diffusion.anchor_floor": 100}}])
    assert (runs_anchor["p"].label, runs_anchor["q"].label) == ("-anchor", "base")  # tiny has it on
    twins = cell_labels([{"name": "x", "values": {"train.memory_dropout": 0.0}},
                         {"name": "y", "values": {"train.memory_dropout": None}}])
    assert (twins["x"].label, twins["y"].label) == ("base", "base #2")

    rows = [{"config": "pose k4", "seed": "s1", "revisit_gain": 1.0}, {"config": "pose k4", "seed": "s0",
                                                                         "revisit_gain": 3.0},
            {"config": "time m6", "seed": "s0", "revisit_gain": None}]
    pooled = pool_seeds(rows, ["revisit_gain"])
    assert pooled[0] == {"config": "pose k4", "seeds": "s0 s1", "revisit_gain": 2.0, "revisit_gain_by_seed": "3 / 1"}
    assert pooled[1]["revisit_gain"] is None and pooled[1]["revisit_gain_by_seed"] == ""


def test_memory_grid_labels_are_short_and_unique():
    grid = load_grid("memory")
    labels = cell_labels([c.to_dict() for c in grid.cells])
    assert len(set(lab.label for lab in labels.values())) == len(grid.cells)
    assert max(len(lab.label) for lab in labels.values()) <= 45  # the cell names run to ~150 characters
    first = [labels[c.name].label for c in grid.cells[:3]]
    assert first == ["pose k4 prepend s0", "pose->time k4 prepend s0", "time m6 prepend s0"]
    # every seed-1 configuration repeats a seed-0 one
    configs = {lab.config for lab in labels.values() if lab.seed == "s1"}
    assert configs <= {lab.config for lab in labels.values() if lab.seed == "s0"}
    # a switch the main job has on reads only when a cell turns it off
    off = [lab.label for lab in labels.values() if "-lastframe" in lab.label or "-advect" in lab.label
           or "-gate" in lab.label]
    assert off == ["pose k4 prepend -lastframe -advect -gate s0", "time m6 prepend -lastframe -advect -gate s0",
                   "pose k4 prepend -advect s0", "pose k4 prepend -gate s0"]


def test_grid_cost_writes_a_well_formed_cost_csv(tmp_path):
    """A tiny run with random weights, three cells: two share a timing, one guides (two network calls per row)."""
    cfg = apply_overrides(get_preset("tiny_time"), [
        "model.image_size=16", "data.resize=0", "model.patch_size=4", "model.dim=32", "model.depth=1",
        "model.heads=2", "model.num_actions=6", "train.window=4", "diffusion.num_levels=50",
        f"data.path={tmp_path / 'fresh'}"])
    out = tmp_path / "grid"
    save_pretrained(Denoiser(cfg), checkpoint_dir(out / "runs" / "run", 3), cfg)
    split = tmp_path / "fresh" / "validation"
    split.mkdir(parents=True)
    pose = np.zeros((24, 3), np.float32)
    write_episode(split / "ep000.npz", np.random.default_rng(0).integers(0, 256, (24, 16, 16, 3), dtype=np.uint8),
                  np.zeros(24, np.int64), pose)
    sample = {"schedule": "chunked", "steps": 2, "eta": 1.0, "split": "validation"}
    cells = [{"name": "plain", "train_run": "run", "sample": sample, "values": {"sample.seed": 0}},
             {"name": "plain-seed1", "train_run": "run", "sample": {**sample, "seed": 1},
              "values": {"sample.seed": 1}},
             {"name": "guided", "train_run": "run", "sample": {**sample, "history_guidance": 1.0},
              "values": {"sample.seed": 0, "sample.history_guidance": 1.0}},
             {"name": "untrained", "train_run": "nothing", "sample": sample, "values": {"sample.seed": 2}}]
    (out / "plan.json").write_text(json.dumps({"cells": cells}))
    assert grid_cost.main(["--grid-out", str(out), "--context", "4", "--frames", "4", "--repeats", "2",
                           "--warmup", "0"]) == 0
    rows = list(csv.DictReader(open(out / "cost.csv", newline="")))
    assert [r["cell"] for r in rows] == ["plain", "plain-seed1", "guided"]  # the untrained run is skipped
    assert list(rows[0]) == list(grid_cost.COLUMNS)
    assert rows[1]["timed_as"] == "plain" and rows[1]["ms_per_frame"] == rows[0]["ms_per_frame"]
    assert rows[2]["timed_as"] == "guided" and float(rows[0]["ratio"]) == 1.0 and rows[0]["reference"] == "1"
    for r in rows:
        assert float(r["ms_min"]) <= float(r["ms_per_frame"]) <= float(r["ms_max"]) and float(r["ms_min"]) > 0
        assert (r["threads"], r["frames"], r["context"], r["repeats"]) == ("1", "4", "4", "2")
    assert grid_cost.main(["--grid-out", str(tmp_path / "none")]) == 2
    assert grid_cost.main(["--grid-out", str(out), "--cells", "nope*"]) == 2


def test_plot_tradeoff_frontier_and_intervals_that_miss_the_mean(tmp_path):
    points = [{"name": "a", "x": 1.0, "y": 2.0, "lo": 1.0, "hi": 3.0, "group": "s0"},
              {"name": "b", "x": 2.0, "y": 1.0, "lo": 1.5, "hi": 2.5, "group": "s1"},  # interval above its mean
              {"name": "c", "x": 0.5, "y": 0.5, "group": "s0"},
              {"name": "d", "x": None, "y": 9.0}]  # no x: neither drawn nor on the frontier
    assert plot_tradeoff(points, tmp_path / "t.png", xlabel="x", ylabel="y", title="t", zero_line="0") == [2, 0]
    assert (tmp_path / "t.png").stat().st_size > 1000
