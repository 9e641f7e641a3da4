"""Post-hoc EMA (EDM2; arvdm.training.power_ema and posthoc_ema): the power profile's known values, the discrete
update against its closed-form weights, reconstruction against a power EMA run alongside, the trainer's snapshots
and exact resume, and the CLI's refusals."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_training import assert_same, tiny_cfg, write_episodes

from arvdm.config import ConfigError, apply_overrides, get_preset
from arvdm.errors import ArvdmError
from arvdm.model.checkpoint import CheckpointError, load_config, load_weights, resolve_checkpoint
from arvdm.model.denoiser import Denoiser
from arvdm.training.posthoc_ema import list_snapshots, main, reconstruct, solve_coefficients
from arvdm.training.power_ema import PostHocEMA, PowerEMA, gamma_of, sigma_rel_of, snapshot_path
from arvdm.training.trainer import Trainer

POSTHOC = ["train.ema_posthoc=[0.05,0.1]", "train.ema_posthoc_every=1"]


def test_sigma_rel_and_gamma_known_values():
    """EDM2's pairs: σ_rel 0.05 ↔ γ 16.97, 0.10 ↔ γ 6.94; the flat profile (γ 0) has σ_rel 1/√12; out of range
    refused."""
    assert gamma_of(0.05) == pytest.approx(16.97, abs=0.01)
    assert gamma_of(0.10) == pytest.approx(6.94, abs=0.01)
    assert sigma_rel_of(0.0) == pytest.approx(1 / math.sqrt(12))
    for s in (0.03, 0.11, 0.2):
        assert sigma_rel_of(gamma_of(s)) == pytest.approx(s, rel=1e-9)
    for bad in (0.0, -0.1, 0.29, float("nan")):
        with pytest.raises(ArvdmError, match="sigma_rel"):
            gamma_of(bad)


def test_power_ema_weights_step_t_by_the_telescoped_power_profile():
    """After T updates with β(t) = (1 − 1/t)^(γ+1), the EMA is Σ_t w_t θ_t with w_t = (t^(γ+1) − (t−1)^(γ+1)) /
    T^(γ+1) (the products of β telescope): checked on a scalar trajectory θ_t = sin(t) (the EMA is fp32)."""
    model = torch.nn.Linear(1, 1, bias=False)
    ema = PowerEMA(model, 0.1)
    g, T = ema.gamma, 40
    for t in range(1, T + 1):
        with torch.no_grad():
            model.weight.fill_(math.sin(t))
        ema.update(model, t)
    w = np.array([(t ** (g + 1) - (t - 1) ** (g + 1)) / T ** (g + 1) for t in range(1, T + 1)])
    assert w.sum() == pytest.approx(1.0)
    expected = float((w * np.sin(np.arange(1, T + 1))).sum())
    assert ema.model.weight.item() == pytest.approx(expected, abs=1e-6)
    assert abs(expected - float(np.sin(np.arange(1, T + 1)).mean())) > 0.01  # not the flat average


def test_coefficients_pick_a_stored_profile_and_fit_others_closely():
    """The target equal to a stored snapshot gets that snapshot alone (residual 0); a length between the stored two
    is fitted with a small residual; one far outside them with a larger one."""
    steps = np.arange(10, 201, 10)
    s, g = np.concatenate([steps, steps]), np.concatenate([np.full(20, gamma_of(0.05)), np.full(20, gamma_of(0.1))])
    x, res = solve_coefficients(s, g, 200, gamma_of(0.1))
    assert res < 1e-6 and x[-1] == pytest.approx(1.0, abs=1e-6) and np.abs(x[:-1]).max() < 1e-6
    _, mid = solve_coefficients(s, g, 200, gamma_of(0.07))
    _, far = solve_coefficients(s, g, 200, gamma_of(0.25))
    assert mid < 0.01 < far


def test_reconstruction_matches_a_power_ema_run_alongside(tmp_path):
    """A parameter trajectory (a drifting noisy walk) averaged by snapshot EMAs of σ_rel 0.05 / 0.1 every 5 steps
    and, alongside, by a power EMA of 0.07: the reconstruction of 0.07 from the snapshots is close to it (much
    closer than either stored EMA is)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    posthoc = PostHocEMA(model, [0.05, 0.1], every=5)
    truth = PowerEMA(model, 0.07)
    for t in range(1, 201):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 + 0.05 * torch.randn_like(p))
        posthoc.update(model, t)
        truth.update(model, t)
        if posthoc.due(t, last=t == 200):
            posthoc.save(tmp_path, t, is_main=True)
    assert len(list_snapshots(tmp_path)) == 80
    # the last step is written even off the interval; a run without lengths writes nothing
    assert posthoc.due(7, last=True) and not posthoc.due(7, last=False) and posthoc.due(10, last=False)
    assert not PostHocEMA(model, [], every=5).due(10, last=True)
    weights, info = reconstruct(tmp_path, 0.07)
    assert info["step"] == 200 and info["relative_residual"] < 0.01
    want = truth.model.state_dict()

    def dist(a):
        return sum((a[k].float() - want[k]).norm() ** 2 for k in want).sqrt().item()

    stored = [load_file(str(snapshot_path(tmp_path, s, 200))) for s in (0.05, 0.1)]
    assert dist(weights) < 0.05 * min(dist(s) for s in stored)


def test_config_refuses_lengths_and_intervals_it_cannot_use():
    """An interval that does not divide ckpt_every (tiny's 525), a length out of (0, 0.28], a string, a bare number:
    each a ConfigError naming the key."""
    with pytest.raises(ConfigError, match=r"train\.ema_posthoc_every"):
        apply_overrides(get_preset("tiny"), ["train.ema_posthoc=[0.05]", "train.ema_posthoc_every=50"]).validate()
    for bad in ("[0.05,0.3]", '["0.05"]', "0.05"):
        with pytest.raises(ConfigError, match=r"train\.ema_posthoc"):
            apply_overrides(get_preset("tiny"), [f"train.ema_posthoc={bad}"]).validate()
    apply_overrides(get_preset("tiny"), ["train.ema_posthoc=[0.05,0.1]", "train.ema_posthoc_every=35"]).validate()


def test_trainer_snapshots_resume_exactly_and_build_a_checkpoint(tmp_path, capsys, monkeypatch):
    """The trainer writes both power EMAs every step; a run killed at step 3 and resumed writes the same step-6
    snapshots bit for bit (their state comes back from the step-3 snapshots); the CLI's checkpoint folder loads
    into a Denoiser, its EMA is the reconstruction, and sampling finds it as a run."""
    torch.use_deterministic_algorithms(True)
    try:
        data = write_episodes(tmp_path / "data")
        Trainer(tiny_cfg(data, *POSTHOC), tmp_path / "unbroken", device="cpu").fit()
        Trainer(tiny_cfg(data, *POSTHOC), tmp_path / "killed", device="cpu").fit(stop_at=3)
        Trainer(tiny_cfg(data, *POSTHOC), tmp_path / "killed", resume=True, device="cpu").fit()
    finally:
        torch.use_deterministic_algorithms(False)
    snaps = list_snapshots(tmp_path / "unbroken")
    assert sorted({s.step for s in snaps}) == [1, 2, 3, 4, 5, 6]
    for s in (0.05, 0.1):
        a = load_file(str(snapshot_path(tmp_path / "unbroken", s, 6)))
        assert_same(a, load_file(str(snapshot_path(tmp_path / "killed", s, 6))))
        mid = load_file(str(snapshot_path(tmp_path / "unbroken", s, 3)))
        assert any(not torch.equal(a[k], v) for k, v in mid.items())  # the weights moved: the equality says something

    out = tmp_path / "ema007"
    assert main([str(tmp_path / "unbroken"), "--sigma-rel", "0.07", "--out", str(out)]) == 0
    ckpt = resolve_checkpoint(out)
    model = Denoiser(load_config(ckpt))
    load_weights(model, ckpt / "ema.safetensors")
    info = json.loads((out / "posthoc.json").read_text())
    assert info["step"] == 6 and info["sigma_rel"] == 0.07
    assert_same(load_file(str(out / "ema.safetensors")), reconstruct(tmp_path / "unbroken", 0.07)[0])
    assert_same(load_file(str(out / "model.safetensors")),
                load_file(str(tmp_path / "unbroken/checkpoints/step_0000006/model.safetensors")))

    # refusals: an existing --out, a run without snapshots, a step without a checkpoint, a corrupt snapshot
    assert main([str(tmp_path / "unbroken"), "--sigma-rel", "0.07", "--out", str(out)]) == 2
    assert main([str(data), "--sigma-rel", "0.07", "--out", str(tmp_path / "x")]) == 2
    assert main([str(tmp_path / "unbroken"), "--sigma-rel", "0.07", "--step", "5", "--out", str(tmp_path / "y")]) == 2
    assert main([str(tmp_path / "unbroken"), "--sigma-rel", "0.5", "--out", str(tmp_path / "z")]) == 2
    snapshot_path(tmp_path / "killed", 0.1, 4).write_bytes(b"not a safetensors file")
    assert main([str(tmp_path / "killed"), "--sigma-rel", "0.07", "--out", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert "exists" in err and "no power-EMA snapshots" in err and "no checkpoint at step 5" in err
    assert "sigma_rel 0.5" in err and "step_0000004.safetensors: not a readable power-EMA snapshot" in err
    assert not any((tmp_path / n).exists() for n in "xyzw")

    # a sweep: one folder per length from one call, each the reconstruction of its own length
    sweep = str(tmp_path / "sweep{sigma_rel}")
    assert main([str(tmp_path / "unbroken"), "--sigma-rel", "0.05", "0.2", "--out", sweep]) == 0
    for s in (0.05, 0.2):
        assert_same(load_file(str(tmp_path / f"sweep{s}/ema.safetensors")), reconstruct(tmp_path / "unbroken", s)[0])
    # refused before anything is written: no pattern, a length twice, one length out of range, a folder that exists
    run, pattern = str(tmp_path / "unbroken"), str(tmp_path / "v{sigma_rel}")
    assert main([run, "--sigma-rel", "0.05", "0.07", "--out", str(tmp_path / "v")]) == 2
    assert main([run, "--sigma-rel", "0.07", "0.07", "--out", pattern]) == 2
    assert main([run, "--sigma-rel", "0.07", "0.5", "--out", pattern]) == 2
    assert main([run, "--sigma-rel", "0.07", "0.2", "--out", sweep]) == 2
    err = capsys.readouterr().err
    assert "need a {sigma_rel} in --out" in err and "a length is given twice" in err and "sigma_rel 0.5" in err
    assert f"--out {tmp_path / 'sweep0.2'} exists" in err
    assert not list(tmp_path.glob("v*")) and not (tmp_path / "sweep0.07").exists()
    # a step without a checkpoint is named before the snapshots are read and combined
    import arvdm.training.posthoc_ema as posthoc_module
    monkeypatch.setattr(posthoc_module, "reconstruct", lambda *a, **k: pytest.fail("reconstructed before the check"))
    assert main([run, "--sigma-rel", "0.07", "--step", "5", "--out", str(tmp_path / "y")]) == 2


def test_resume_without_the_snapshot_at_the_checkpoint_step_is_refused(tmp_path):
    data = write_episodes(tmp_path / "data")
    Trainer(tiny_cfg(data, *POSTHOC), tmp_path / "run", device="cpu").fit(stop_at=3)
    snapshot_path(tmp_path / "run", 0.1, 3).unlink()
    with pytest.raises(CheckpointError, match=r"sigma_rel_0\.1000/step_0000003\.safetensors is missing"):
        Trainer(tiny_cfg(data, *POSTHOC), tmp_path / "run", resume=True, device="cpu")
