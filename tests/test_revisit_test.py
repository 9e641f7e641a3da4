"""The look-around revisit test (arvdm/experiments/revisit_test.py) on a tiny random model and the synthetic
look-around episodes of the teacher-forced test: a turn through 6 views, then fresh views alternating with
revisits; the second turn (frames 18..29) is what the test generates from the 18 frames before it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_memory_probe_test import LENGTH, _model, _write_episodes

from arvdm.config import SamplingError, apply_overrides
from arvdm.evaluation.metrics import psnr_per_frame
from arvdm.experiments import revisit_test as rt
from arvdm.model.denoiser import Denoiser
from data.episodes import write_episode

SECOND_TURN = 18  # the episodes' turns: [[0, 6], [18, LENGTH]]


def _blind(model):
    """The same model with every temporal-attention gate shut: memory cannot reach the window."""
    with torch.no_grad():
        for blk in model.blocks:
            d = blk.ada[1].out_features // blk.n_mod
            blk.ada[1].weight[5 * d:6 * d].zero_()
            blk.ada[1].bias[5 * d:6 * d].zero_()
    return model


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("look")
    data = _write_episodes(root / "episodes", n=3)
    out = {"data": data}
    for name, make in (("seeing", lambda m: m), ("blind", _blind)):
        model, cfg = _model()
        assert cfg.memory.select == "pose"  # the test needs a pose-aware run
        make(model).save_pretrained(root / name)
        out[name] = str(root / name)
    return out


def _video(path):
    return torch.from_numpy(np.load(path)["video"]).permute(0, 3, 1, 2).float() / 127.5 - 1  # (T, C, H, W)


def test_references_are_the_direct_computation_and_pairs_use_the_first_two_episodes(runs):
    res = rt.look_around_test(runs["seeing"], str(runs["data"]), episodes=3, steps=2, n_boot=200)
    n = LENGTH - SECOND_TURN
    assert res["episodes"] == 2 and res["frames"] == 2 * n  # 3 episodes: the odd one out is left
    for e, path in enumerate(sorted(runs["data"].glob("*.npz"))[:2]):
        v = _video(path)
        real = v[None, SECOND_TURN:]
        copy = psnr_per_frame(v[None, SECOND_TURN - 1:SECOND_TURN].expand_as(real), real).clamp(max=60)
        assert res["per_episode"]["copy_last"][e] == pytest.approx(copy.mean().item(), abs=1e-4)
        best = torch.stack([psnr_per_frame(v[None, s:s + 1].expand_as(real), real)[0] for s in range(6)]).amax(0)
        assert res["per_episode"]["oracle"][e] == pytest.approx(best.clamp(max=60).mean().item(), abs=1e-4)
    m = res["psnr"]
    assert res["pose_closes_oracle_gap"] == pytest.approx((m["pose"] - m["copy_last"]) / (m["oracle"] - m["copy_last"]))
    for k in ("time", "other", "none", "copy_last"):
        d = res["paired"][f"pose_minus_{k}"]
        assert d["mean"] == pytest.approx(m["pose"] - m[k]) and d["lo"] <= d["mean"] <= d["hi"]
    # every revisit frame of the second turn is a noisy copy of a first-turn view: the oracle sees it (~40 dB)
    assert m["oracle"] > m["copy_last"] + 10


def test_modes_share_their_noise_so_memory_alone_separates_them(runs):
    seeing = rt.look_around_test(runs["seeing"], str(runs["data"]), episodes=2, steps=2, n_boot=200)
    assert seeing["per_episode"]["pose"] != seeing["per_episode"]["other"]  # memory reaches the window
    blind = rt.look_around_test(runs["blind"], str(runs["data"]), episodes=2, steps=2, n_boot=200)
    for k in ("time", "other", "none"):  # memory cannot matter: only identical noise gives equal frames
        assert blind["per_episode"][k] == blind["per_episode"]["pose"]
        d = blind["paired"][f"pose_minus_{k}"]
        assert (d["mean"], d["lo"], d["hi"]) == (0.0, 0.0, 0.0)
    again = rt.look_around_test(runs["blind"], str(runs["data"]), episodes=2, steps=2, n_boot=200, seed=1)
    assert again["per_episode"]["pose"] != blind["per_episode"]["pose"]  # another seed, other noise
    anchored = rt.look_around_test(runs["seeing"], str(runs["data"]), episodes=2, steps=2, n_boot=200,
                                   anchor_sigma=1.0)  # the anchor reaches every mode's rollout
    assert anchored["anchor_sigma"] == 1.0 and seeing["anchor_sigma"] == 0.0
    for k in ("pose", "time", "other", "none"):
        assert anchored["per_episode"][k] != seeing["per_episode"][k]
    # --anchor-runs reaches them too: the run with itself is the run alone, with other weights other frames
    itself = rt.look_around_test(runs["seeing"], str(runs["data"]), episodes=2, steps=2, n_boot=200,
                                 anchor_sigma=1.0, anchor_runs=(runs["seeing"],))
    assert itself["per_episode"] == anchored["per_episode"] and itself["anchor_runs"] == [runs["seeing"]]
    paired = rt.look_around_test(runs["seeing"], str(runs["data"]), episodes=2, steps=2, n_boot=200,
                                 anchor_sigma=1.0, anchor_runs=(runs["blind"],))
    assert all(paired["per_episode"][k] != anchored["per_episode"][k] for k in ("pose", "time", "other", "none"))
    with pytest.raises(SamplingError, match="--anchor-runs .* needs an anchor"):  # the run's own anchor is off
        rt.look_around_test(runs["seeing"], str(runs["data"]), episodes=2, steps=2, anchor_runs=(runs["blind"],))


def test_cli_writes_the_json_and_refuses_bad_input(runs, tmp_path, capsys):
    out = tmp_path / "out"
    assert rt.main(["--run", runs["blind"], "--data", str(runs["data"]), "--episodes", "2", "--steps", "2",
                    "--out", str(out)]) == 0
    res = json.loads((out / "revisit_test.json").read_text())
    assert res["episodes"] == 2 and set(res["psnr"]) == {*rt.MODES, "copy_last", "oracle"}
    assert "pose_minus_time: +0.00 dB" in capsys.readouterr().out

    def refused(data, run=runs["blind"]):
        bad = tmp_path / "bad"
        assert rt.main(["--run", str(run), "--data", str(data), "--steps", "2", "--out", str(bad)]) == 2
        assert not (bad / "revisit_test.json").exists()
        return capsys.readouterr().err

    plain = tmp_path / "plain"
    plain.mkdir()
    for e in range(2):  # episodes without a 'turns' array: not look-around episodes
        write_episode(plain / f"ep{e}.npz", np.zeros((20, 16, 16, 3), np.uint8), np.zeros(20, np.int64),
                      np.zeros((20, 3), np.float32))
    assert "not a look-around episode" in refused(plain)
    assert "has no poses" in refused(_write_episodes(tmp_path / "noposes", n=2, pose=False))
    assert "needs at least 2 look-around episodes" in refused(_write_episodes(tmp_path / "one", n=1))
    _, cfg = _model()
    Denoiser(apply_overrides(cfg, ["memory.select=time", "memory.pose_frames=0"])).save_pretrained(tmp_path / "timerun")
    assert "memory.select=time" in refused(runs["data"], tmp_path / "timerun")
    assert "no such run" in refused(runs["data"], tmp_path / "missing")
