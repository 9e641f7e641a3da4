"""The teacher-forced paired memory test (arvdm/experiments/memory_probe_test.py) on a tiny random model and
synthetic episodes whose revisits are known: views seen at the start come back, one frame at a time, between
fresh views elsewhere, so every revisit is one probe and one event."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch

from arvdm.config import SamplingError, apply_overrides, get_preset
from arvdm.evaluation.metrics import psnr_per_frame, ssim_per_frame
from arvdm.evaluation.probes import paired_difference
from arvdm.experiments import memory_probe_test as mpt
from arvdm.model.denoiser import Denoiser
from arvdm.model.diffusion import PerFrameDiffusion
from arvdm.pipeline.rollout import rollout
from arvdm.schedules.presets import get_schedule
from data.episodes import write_episode

K = 10
RECENT = 3  # memory.length of the test model: probes need a match older than the last 3 frames
VIEWS = 6  # views seen during the first turn (60 degrees apart)
LENGTH = 30  # 6 views, then 12 x (a fresh view elsewhere, a revisit)
REVISITS = list(range(VIEWS + 1, LENGTH, 2))  # frames 7, 9, ..., 29


def _model(seed=0):
    cfg = apply_overrides(get_preset("tiny"), [
        "model.unet_channels=[8,16]", "model.dim=32", "model.depth=1", "model.image_size=16", "data.resize=16",
        f"diffusion.num_levels={K}", "diffusion.context_level=0", "train.context_noise_max=0",
        "diffusion.anchor_sigma=0", "diffusion.anchor_floor=0",
        f"memory.length={RECENT}", "memory.pose_frames=2", "train.window=2",
        "train.members=1"])  # one saved model: a tiny run's second member has no checkpoint here
    torch.manual_seed(seed)
    model = Denoiser(cfg).eval()
    with torch.no_grad():  # every parameter random: a fresh model's zero-initialised layers would ignore memory
        for p in model.parameters():
            p.normal_(0, 0.05)
        for blk in model.blocks:  # temporal attention's gate open: what memory holds reaches the frame clearly
            d = blk.ada[1].out_features // blk.n_mod
            blk.ada[1].bias[5 * d:6 * d] = 1.0
    return model, cfg


def _write_episodes(root, n=3, length=LENGTH, pose=True, seed=0):
    """A turn through VIEWS views at (0, 0), then alternately a fresh view far away and a revisit of view j (with a
    little pixel noise: ~40 dB, well above the 25 dB match threshold); turns [[0, 6], [18, length]]."""
    rng = np.random.default_rng(seed)
    for e in range(n):
        views = rng.integers(0, 256, (VIEWS, 16, 16, 3))
        frames = list(views)
        poses = [(0.0, 0.0, j * 2 * math.pi / VIEWS) for j in range(VIEWS)]
        for i in range((length - VIEWS) // 2):
            frames.append(rng.integers(0, 256, (16, 16, 3)))
            poses.append((5.0 + 2 * i, 3.0, 0.0))  # somewhere else, never again
            j = i % VIEWS
            frames.append(np.clip(views[j] + rng.integers(-4, 5, (16, 16, 3)), 0, 255))
            poses.append(poses[j])
        write_episode(root / f"ep{e:03d}.npz", np.stack(frames).astype(np.uint8), rng.integers(0, 6, length),
                      np.array(poses, dtype=np.float32) if pose else None,
                      extra={"turns": np.array([[0, VIEWS], [18, length]], dtype=np.int64)})
    return root


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = _write_episodes(tmp_path_factory.mktemp("episodes"))
    model, cfg = _model()
    eps = mpt.load_episodes(root, None, 16)
    diffusion = PerFrameDiffusion(cfg.diffusion)
    schedule = get_schedule("chunked", cfg.train.window, K, steps=2)
    return model, cfg, eps, diffusion, schedule, root


def test_probe_sets_are_the_known_revisits_and_stride_keeps_every_event(setup):
    _, _, eps, *_ = setup
    sets = mpt.find_probe_sets(eps, RECENT)
    for name in ("pixel", "pixel_at_pose", "pose"):
        assert [(p.e, p.t) for p in sets[name]] == [(e, t) for e in range(3) for t in REVISITS]
        assert len({p.event for p in sets[name]}) == 3 * len(REVISITS)  # isolated frames: one event each
    assert [p.t for p in sets["second_turn"] if p.e == 1] == list(range(18, LENGTH))
    assert len({p.event for p in sets["second_turn"]}) == 3
    strided = mpt.find_probe_sets(eps, RECENT, stride=5)
    assert [p.t for p in strided["second_turn"] if p.e == 2] == [18, 23, 28]
    assert strided["pixel"] == sets["pixel"]  # one-frame events keep their frame


def test_the_teacher_forced_window_is_a_rollout_from_the_ground_truth_past(setup):
    model, _, eps, diffusion, schedule, _ = setup
    frames = [(0, 9), (1, 19), (2, 12), (1, 20)]
    gen = mpt.generate_probe_frames(model, diffusion, schedule, eps, frames, ("pose", "time", "none"), batch=3,
                                    seed=5, progress=False)
    w = schedule.window
    for i, (e, t) in enumerate(frames):
        ep = eps[e]
        for mode in ("pose", "time", "none"):
            ref = rollout(model, diffusion, schedule, ep["video"][None, :t], ep["actions"][None, :t],
                          ep["actions"][None, t:t + w], w, poses=ep["pose"][None, :t + w], memory_select=mode,
                          generator=torch.Generator().manual_seed(mpt.probe_seed(5, e, t)), progress=False)
            torch.testing.assert_close(gen[mode][i], ref[0, 0], atol=1e-5, rtol=0)  # modes differ by ~1e-3
    assert (gen["pose"] - gen["time"]).abs().max() > 50 * 1e-5  # the tolerance is far below what memory changes


def test_last_generated_turns_the_observed_copy_gate_off(setup):
    """The test model has tiny's copy gate on observed frames. Counted as observed (the default) the gate acts: an open
    and a closed gate give other frames; counted as generated it is off: they give the same frames, bit for bit."""
    model, _, eps, diffusion, schedule, _ = setup
    frames = [(0, 9), (1, 19), (2, 12)]
    gates = []
    for logit in (60.0, -60.0):
        gated = copy.deepcopy(model)
        with torch.no_grad():
            gated.decoder.out.weight[-1].zero_()
            gated.decoder.out.bias[-1] = logit
        gates.append(gated)
    for observed in (True, False):
        opened, closed = (mpt.generate_probe_frames(g, diffusion, schedule, eps, frames, ("pose",), batch=3, seed=2,
                                                    progress=False, last_observed=observed)["pose"] for g in gates)
        assert torch.equal(opened, closed) != observed
    assert model.gate_on_embed is not None  # the preset's gate, not a plain model


def test_a_mode_against_itself_is_exactly_zero_and_memory_that_matters_separates_pose_from_other(setup):
    model, _, eps, diffusion, schedule, _ = setup
    frames = [(e, t) for e in range(3) for t in REVISITS[:4]]
    ids = list(range(len(frames)))

    def psnr(gen):
        real = torch.stack([eps[e]["video"][t] for e, t in frames])[:, None]
        return psnr_per_frame(gen[:, None], real)[:, 0].double().numpy()

    a = mpt.generate_probe_frames(model, diffusion, schedule, eps, frames, batch=5, seed=1, progress=False)
    b = mpt.generate_probe_frames(model, diffusion, schedule, eps, frames, ("pose",), batch=5, seed=1,
                                  progress=False)
    same = paired_difference(psnr(a["pose"]), psnr(b["pose"]), ids)
    assert (same["mean"], same["lo"], same["hi"]) == (0.0, 0.0, 0.0)
    other = paired_difference(psnr(a["pose"]), psnr(a["other"]), ids)
    assert other["mean"] != 0.0 and not torch.equal(a["pose"], a["other"])
    # the window cannot see memory (temporal-attention gates zero): every mode gives the same frames, bit for
    # bit, which only identical noise can do
    blind, _ = _model()
    with torch.no_grad():
        for blk in blind.blocks:
            d = blk.ada[1].out_features // blk.n_mod
            blk.ada[1].weight[5 * d:6 * d].zero_()
            blk.ada[1].bias[5 * d:6 * d].zero_()
    c = mpt.generate_probe_frames(blind, diffusion, schedule, eps, frames, batch=5, seed=1, progress=False)
    for mode in ("time", "other", "none"):
        assert torch.equal(c["pose"], c[mode])
    d = mpt.generate_probe_frames(blind, diffusion, schedule, eps, frames, ("pose",), batch=5, seed=2,
                                  progress=False)
    assert not torch.equal(c["pose"], d["pose"])  # another seed, other noise


def test_references_and_report_equal_a_direct_computation(setup):
    model, _, eps, diffusion, schedule, _ = setup
    res = mpt.run_memory_probe_test(model, diffusion, schedule, eps, batch=16, n_boot=200, progress=False)
    assert {p["t"] for p in res["probes"]} == set(REVISITS) | set(range(18, LENGTH))
    for p in res["probes"]:
        v = eps[p["episode"]]["video"]
        t = p["t"]
        copy = psnr_per_frame(v[None, t - 1:t], v[None, t:t + 1]).item()
        earlier = [psnr_per_frame(v[None, s:s + 1], v[None, t:t + 1]).item() for s in range(t - RECENT)]
        s_best = int(np.argmax(earlier))
        assert p["psnr"]["copy_last"] == pytest.approx(min(copy, 60.0), abs=1e-4)
        assert p["psnr"]["oracle"] == pytest.approx(min(max(earlier), 60.0), abs=1e-4)
        assert p["ssim"]["oracle"] == pytest.approx(ssim_per_frame(v[None, s_best:s_best + 1],
                                                                   v[None, t:t + 1]).item(), abs=1e-5)
        if t in REVISITS:
            assert p["psnr"]["oracle"] > 35.0 and "pixel" in p["sets"] and "pose" in p["sets"]
    pix = res["sets"]["pixel"]
    assert (pix["probes"], pix["events"], pix["too_few"]) == (36, 36, False)
    rows = [p for p in res["probes"] if "pixel" in p["sets"]]
    for k in ("pose", "time", "other", "none", "copy_last", "oracle"):
        assert pix["psnr"][k]["mean"] == pytest.approx(np.mean([p["psnr"][k] for p in rows]))
    diff = pix["paired_psnr"]["pose_minus_time"]
    assert diff["mean"] == pytest.approx(pix["psnr"]["pose"]["mean"] - pix["psnr"]["time"]["mean"])
    assert diff["lo"] <= diff["mean"] <= diff["hi"] and diff["n_events"] == 36
    assert res["sets"]["second_turn"]["too_few"] and "3 events" in res["sets"]["second_turn"]["message"]
    assert pix["message"].startswith(("memory helps", "memory does NOT help"))


def test_cli_writes_the_json_and_refuses_bad_input(setup, tmp_path, capsys):
    model, _, _, _, _, root = setup
    run = tmp_path / "run"
    model.save_pretrained(run)
    out = tmp_path / "out"
    assert mpt.main(["--run", str(run), "--data", str(root), "--out", str(out), "--steps", "2", "--stride", "3"]) == 0
    res = json.loads((out / "memory_probe_test.json").read_text())
    assert res["stride"] == 3 and res["sets"]["pixel"]["events"] == 36 and "verdict" in res
    assert res["last_observed"] is True and "pixel: PSNR pose" in capsys.readouterr().out
    assert mpt.main(["--run", str(run), "--data", str(root), "--out", str(out), "--steps", "2", "--stride", "3",
                     "--last-generated"]) == 0
    assert json.loads((out / "memory_probe_test.json").read_text())["last_observed"] is False
    assert "counted as generated" in capsys.readouterr().out

    def refused(data, run_dir=run):
        bad_out = tmp_path / "bad"
        rc = mpt.main(["--run", str(run_dir), "--data", str(data), "--out", str(bad_out), "--steps", "2"])
        assert rc == 2 and not (bad_out / "memory_probe_test.json").exists()
        return capsys.readouterr().err

    assert "has no poses" in refused(_write_episodes(tmp_path / "noposes", pose=False))
    assert "no such run" in refused(root, tmp_path / "missing")
    assert "fewer than 10 events" in refused(_write_episodes(tmp_path / "short", n=2, length=10))
    assert "no such folder" in refused(tmp_path / "nothing")
    with pytest.raises(SamplingError, match="--stride"):
        mpt.memory_probe_test(str(run), str(root), stride=0)
