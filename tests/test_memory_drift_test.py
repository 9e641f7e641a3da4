"""Memory after drift (arvdm/experiments/memory_drift_test.py) on the teacher-forced test's tiny random model and
synthetic revisit episodes: each frame is a rollout from the ground truth k frames back, the probe set is the same
for every k, and the report equals a direct computation."""

from __future__ import annotations

import json

import numpy as np
import pytest
import test_memory_probe_test
import torch
from test_memory_probe_test import RECENT, REVISITS, VIEWS

from arvdm.config import SamplingError
from arvdm.evaluation.metrics import psnr_per_frame
from arvdm.experiments import memory_drift_test as mdt
from arvdm.experiments import memory_probe_test as mpt
from arvdm.pipeline.rollout import rollout

setup = test_memory_probe_test.setup  # the teacher-forced test's fixture: model, cfg, episodes, diffusion, ...


def test_probes_keep_a_true_remembered_view_at_every_drift(setup):
    _, _, eps, *_ = setup
    every = mdt.drift_probes(eps, RECENT, 0)
    assert {p.t for p in every if p.e == 0} >= set(REVISITS)  # the known revisits, matched to their view j < 6
    for max_free in (0, 4, 10):
        kept = mdt.drift_probes(eps, RECENT, max_free)
        assert kept and all(p.s < p.t - max_free and p.t - max_free >= 1 for p in kept)
        assert {(p.e, p.t) for p in kept} == {(p.e, p.t) for p in every if p.s < p.t - max_free}
    # a revisit of view j at frame t is kept for k < t - j only: frame 7 revisits view 0, frame 17 view 5
    assert (0, 7) in {(p.e, p.t) for p in mdt.drift_probes(eps, RECENT, 6)}
    assert (0, 17) not in {(p.e, p.t) for p in mdt.drift_probes(eps, RECENT, 12)}
    strided = mdt.drift_probes(eps, RECENT, 0, stride=2)
    assert {p.event for p in strided} == {p.event for p in every}  # every event keeps its first probe


def test_each_frame_is_a_rollout_from_the_truth_k_frames_back(setup):
    model, _, eps, diffusion, schedule, _ = setup
    probes = [p for p in mdt.drift_probes(eps, RECENT, 4) if p.t in (9, 19)][:3]
    gen = mdt.generate_after_drift(model, diffusion, schedule, eps, probes, (0, 4), ("pose", "time"), seed=3,
                                   progress=False)
    for i, p in enumerate(probes):
        ep = eps[p.e]
        for k in (0, 4):
            c = p.t - k
            for mode in ("pose", "time"):  # a long rollout from c, as sample.py would run it: frame t is its k-th
                ref = rollout(model, diffusion, schedule, ep["video"][None, :c], ep["actions"][None, :c],
                              ep["actions"][None, c:], ep["video"].shape[0] - c, poses=ep["pose"][None],
                              memory_select=mode, progress=False,
                              generator=torch.Generator().manual_seed(mpt.probe_seed(3, p.e, p.t)))
                assert torch.equal(gen[k][mode][i], ref[0, k])
    # k = 0 is the teacher-forced window's first frame: the same noise, the same frame
    tf = mpt.generate_probe_frames(model, diffusion, schedule, eps, [(p.e, p.t) for p in probes], ("pose",), seed=3,
                                   progress=False)
    torch.testing.assert_close(gen[0]["pose"], tf["pose"], atol=1e-5, rtol=0)
    assert not torch.equal(gen[0]["pose"], gen[4]["pose"])  # four frames of its own change the revisit frame


def test_report_equals_a_direct_computation(setup):
    model, _, eps, diffusion, schedule, _ = setup
    res = mdt.run_memory_drift_test(model, diffusion, schedule, eps, (0, 2), n_boot=200, progress=False)
    assert res["free"] == [0, 2] and res["probes"] == len(res["per_probe"]) and res["events"] >= 3
    for row in res["rows"]:
        k = str(row["free"])
        for mode in mdt.MODES:
            assert row["psnr"][mode]["mean"] == pytest.approx(np.mean([p["psnr"][k][mode] for p in res["per_probe"]]))
        d = row["paired"]["pose_minus_time"]
        assert d["mean"] == pytest.approx(row["psnr"]["pose"]["mean"] - row["psnr"]["time"]["mean"])
    assert res["rows"][0]["paired"]["pose_minus_pose_at_0"]["mean"] == 0.0  # k = 0 against itself
    p = res["per_probe"][0]
    v = eps[p["episode"]]["video"]
    assert p["copy_last"] == pytest.approx(min(psnr_per_frame(v[None, p["t"] - 1:p["t"]],
                                                              v[None, p["t"]:p["t"] + 1]).item(), 60.0), abs=1e-4)
    assert p["oracle"] == pytest.approx(min(psnr_per_frame(v[None, p["s"]:p["s"] + 1],
                                                           v[None, p["t"]:p["t"] + 1]).item(), 60.0), abs=1e-4)
    assert res["verdict"].startswith("memory by pose")


def test_parse_free_and_the_cli(setup, tmp_path, capsys):
    model, _, _, _, _, root = setup
    assert mdt.parse_free("8, 0,24,8") == (0, 8, 24)
    for bad in ("", "-1", "a,b", "4,-2"):
        with pytest.raises(SamplingError, match="--free"):
            mdt.parse_free(bad)
    run = tmp_path / "run"
    model.save_pretrained(run)
    out = tmp_path / "out"
    assert mdt.main(["--run", str(run), "--data", str(root), "--out", str(out), "--steps", "2", "--free", "0,2",
                     "--stride", "2"]) == 0
    res = json.loads((out / "memory_drift_test.json").read_text())
    assert res["free"] == [0, 2] and res["stride"] == 2 and (out / "memory_drift_test.png").stat().st_size > 1000
    assert (res["anchor_sigma"], res["anchor_floor"]) == (0.0, 0)  # the run's own: none
    assert "pose - time" in capsys.readouterr().out
    # the rollouts with sample.py's anchor flags: recorded, other frames; a floor without an anchor refused
    assert mdt.main(["--run", str(run), "--data", str(root), "--out", str(tmp_path / "anch"), "--steps", "2",
                     "--free", "0,2", "--stride", "2", "--anchor-sigma", "1", "--anchor-floor", "3"]) == 0
    anch = json.loads((tmp_path / "anch" / "memory_drift_test.json").read_text())
    assert (anch["anchor_sigma"], anch["anchor_floor"]) == (1.0, 3) and anch["per_probe"] != res["per_probe"]
    capsys.readouterr()
    assert mdt.main(["--run", str(run), "--data", str(root), "--steps", "2", "--anchor-floor", "3"]) == 2
    assert "--anchor-floor 3 needs an anchor" in capsys.readouterr().err
    # a drift no remembered view survives: too few events, refused before any rollout
    assert mdt.main(["--run", str(run), "--data", str(root), "--out", str(out), "--steps", "2",
                     "--free", str(VIEWS * 10)]) == 2
    assert "fewer than" in capsys.readouterr().err
    assert mdt.main(["--run", str(run), "--data", str(root), "--free", "x"]) == 2
    assert mdt.main(["--run", str(tmp_path / "missing"), "--data", str(root)]) == 2
