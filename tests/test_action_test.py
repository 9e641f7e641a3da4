"""The action test (arvdm/experiments/action_test.py): its summary against hand-computed PSNRs, and its three
rollouts on a tiny random model (same noise for own and other actions, other noise for the noise rollout)."""

from __future__ import annotations

import math

import pytest
import torch

from arvdm.config import SamplingError, apply_overrides, get_preset
from arvdm.experiments import action_test as at
from arvdm.model.denoiser import Denoiser
from arvdm.pipeline.anchor import use_anchor


def _psnr(offset: float) -> float:
    return 10 * math.log10(4 / offset ** 2)  # frames in [-1, 1]: data range 2


def _videos(n=5, t=20, own=0.1, other=0.2, noise=0.05):
    """Truth 0; every rollout a constant offset from it, so each PSNR is known by hand."""
    real = torch.zeros(n, t, 3, 8, 8)
    return {"real": real, "last": real[:, :1] + 0.5, "own": real + own, "other": real + other,
            "noise": real + own + noise}


def test_the_summary_matches_hand_computed_psnrs():
    res = at.summarise(_videos(), n_boot=200)
    assert [s["span"] for s in res["spans"]] == ["1-4", "5-16", "17-20"]  # cut at the 20 generated frames
    for s in res["spans"]:
        assert s["own"] == pytest.approx(_psnr(0.1), abs=1e-3)
        assert s["other"] == pytest.approx(_psnr(0.2), abs=1e-3)
        assert s["copy_last"] == pytest.approx(_psnr(0.5), abs=1e-3)
        assert s["own_minus_other"]["mean"] == pytest.approx(_psnr(0.1) - _psnr(0.2), abs=1e-3)
        assert s["agree_noise"] == pytest.approx(_psnr(0.05), abs=1e-3)
        assert s["agree_actions"] == pytest.approx(_psnr(0.1), abs=1e-3)  # own - other = 0.1
        assert s["self_agreement_gap"] == pytest.approx(_psnr(0.05) - _psnr(0.1), abs=1e-3)
        assert not s["actions_move_less_than_noise"]


def test_the_direction_check_reports_own_minus_swapped_by_hand():
    v = _videos()
    assert "own_minus_swapped" not in at.summarise(v, n_boot=200)["spans"][0]  # only with a swapped rollout
    v["swapped"] = v["real"] + 0.4
    for s in at.summarise(v, n_boot=200)["spans"]:
        assert s["swapped"] == pytest.approx(_psnr(0.4), abs=1e-3)
        assert s["own_minus_swapped"]["mean"] == pytest.approx(_psnr(0.1) - _psnr(0.4), abs=1e-3)
    line = at.describe({"episodes": 5, "generated_frames": 20, "context": 4, "swap": "2:3",
                        **at.summarise(v, n_boot=200)})
    assert f"swapped (2:3) {_psnr(0.4):.2f}: the true direction buys {_psnr(0.1) - _psnr(0.4):+.2f}" in line


def test_actions_that_move_the_rollout_less_than_the_noise_are_flagged():
    res = at.summarise(_videos(own=0.1, other=0.12, noise=0.3), n_boot=200)
    s = res["spans"][0]
    assert s["agree_actions"] > s["agree_noise"] and s["actions_move_less_than_noise"]
    assert s["self_agreement_gap"] < 0  # samples further apart than from the truth: over-dispersed


def test_the_bootstrap_interval_brackets_a_varying_difference():
    v = _videos(n=8)
    v["other"] = v["other"] * torch.linspace(0.5, 2.0, 8)[:, None, None, None, None]  # episodes differ
    d = at.summarise(v, n_boot=500)["spans"][0]["own_minus_other"]
    assert d["lo"] < d["mean"] < d["hi"]


def test_per_episode_span_means_are_kept_for_pairing_runs():
    v = _videos(n=4)
    v["own"] = v["own"] * torch.tensor([0.5, 1.0, 2.0, 4.0])[:, None, None, None, None]
    s = at.summarise(v, n_boot=100)["spans"][0]
    assert set(s["per_episode"]) == {"own", "other", "copy_last"}
    assert s["per_episode"]["own"] == pytest.approx([_psnr(0.1 * f) for f in (0.5, 1.0, 2.0, 4.0)], abs=1e-3)
    assert sum(s["per_episode"]["own"]) / 4 == pytest.approx(s["own"])


def _model():
    cfg = apply_overrides(get_preset("tiny"), [
        "model.unet_channels=[8,16]", "model.dim=32", "model.depth=1", "model.image_size=16", "data.resize=16",
        "diffusion.num_levels=10", "diffusion.context_level=0", "train.context_noise_max=0",
        "diffusion.anchor_sigma=0", "diffusion.anchor_floor=0",
        "memory.select=time", "memory.pose_frames=0", "memory.length=2", "train.window=2"])
    torch.manual_seed(0)
    model = Denoiser(cfg).eval()
    with torch.no_grad():  # random weights everywhere: a fresh model's zero-initialised layers ignore the actions
        for p in model.parameters():
            p.normal_(0, 0.05)
    return model, cfg


def _episodes(n=3, t=8, same_actions=False):
    g = torch.Generator().manual_seed(1)
    real = torch.rand(n, t, 3, 16, 16, generator=g) * 2 - 1
    actions = torch.randint(0, 6, (1 if same_actions else n, t), generator=g).expand(n, t).clone()
    return real, actions


def test_the_other_rollout_differs_from_own_only_by_its_actions():
    model, cfg = _model()
    real, actions = _episodes(same_actions=True)  # every episode lends the same actions: other == own, exactly
    out = at.run_action_test(model, cfg, real, actions, context=4, steps=3, batch_size=2, progress=False)
    assert out["own"].shape == (3, 4, 3, 16, 16)
    assert torch.equal(out["own"], out["other"])
    assert not torch.allclose(out["own"], out["noise"])  # another noise seed: another sample
    assert torch.equal(out["real"], real[:, 4:])


def test_an_episodes_rollouts_do_not_depend_on_the_batch_size():
    """One generator per episode and kind: batches of 2 + 1 and one batch of 3 give the same rollouts."""
    model, cfg = _model()
    real, actions = _episodes()
    twos = at.run_action_test(model, cfg, real, actions, context=4, steps=3, batch_size=2, progress=False)
    three = at.run_action_test(model, cfg, real, actions, context=4, steps=3, batch_size=3, progress=False)
    for kind in ("own", "noise", "other"):
        torch.testing.assert_close(twos[kind], three[kind], rtol=0, atol=1e-5)


def test_other_actions_change_the_rollout():
    model, cfg = _model()
    real, actions = _episodes()
    assert not torch.equal(actions, actions.roll(1, 0))
    out = at.run_action_test(model, cfg, real, actions, context=4, steps=3, progress=False)
    assert not torch.allclose(out["own"], out["other"])


def test_the_rollouts_take_the_anchor_set_on_the_runs_config():
    """`use_anchor(cfg, ...)` (the CLI's --anchor-sigma / --anchor-floor) reaches all three rollouts: equal to the
    plain ones with σ = 0, other frames with σ = 1."""
    model, cfg = _model()
    real, actions = _episodes()
    plain = at.run_action_test(model, cfg, real, actions, context=4, steps=3, progress=False)
    assert use_anchor(cfg, 1.0, 5) == {"anchor_sigma": 1.0, "anchor_floor": 5}
    anchored = at.run_action_test(model, cfg, real, actions, context=4, steps=3, progress=False)
    for kind in ("own", "noise", "other"):
        assert (anchored[kind] - plain[kind]).abs().max() > 1e-3
    use_anchor(cfg, 0.0, None)
    again = at.run_action_test(model, cfg, real, actions, context=4, steps=3, progress=False)
    assert all(torch.equal(again[k], plain[k]) for k in ("own", "noise", "other"))


def test_the_swapped_rollout_exchanges_only_the_named_actions_after_the_context():
    model, cfg = _model()
    real, actions = _episodes()
    unused = next(a for a in range(6) if not (actions[:, 4:] == a).any())
    absent = {unused: 6, 6: unused}  # exchanges an action that never occurs: the own rollout, bit for bit
    out = at.run_action_test(model, cfg, real, actions, context=4, steps=3, progress=False, swap=absent)
    assert torch.equal(out["own"], out["swapped"])
    a, b = int(actions[0, 4]), int(actions[0, 5])
    b = b if b != a else (a + 1) % 6
    out = at.run_action_test(model, cfg, real, actions, context=4, steps=3, progress=False, swap={a: b, b: a})
    assert not torch.allclose(out["own"][0], out["swapped"][0])  # episode 0's first generated action swapped


def test_swap_pairs_are_parsed_and_bad_ones_refused():
    assert at.parse_swap("2:3,4:5", 6) == {2: 3, 3: 2, 4: 5, 5: 4}
    for bad in ("2-3", "2:3,3:4", "2:2", "2:6", "x:1", "2:3:4"):
        with pytest.raises(SamplingError, match="--swap"):
            at.parse_swap(bad, 6)


@pytest.mark.parametrize("n, context", [(1, 4), (3, 0), (3, 8)])
def test_bad_inputs_are_refused_with_a_message(n, context):
    model, cfg = _model()
    real, actions = _episodes(n=n)
    with pytest.raises(SamplingError, match="episodes|--context"):
        at.run_action_test(model, cfg, real, actions, context=context, steps=2, progress=False)


def test_the_cli_exits_2_naming_a_bad_flag_or_a_missing_run(tmp_path, capsys):
    assert at.main(["--run", str(tmp_path / "none"), "--data", str(tmp_path), "--frames", "0"]) == 2
    assert "--frames" in capsys.readouterr().err
    assert at.main(["--run", str(tmp_path / "none"), "--data", str(tmp_path)]) == 2
    assert "action_test: error:" in capsys.readouterr().err


def test_action_guidance_reaches_every_rollout_and_zero_is_the_plain_test():
    model, cfg = _model()
    real, actions = _episodes()
    plain = at.run_action_test(model, cfg, real, actions, context=4, steps=3, progress=False)
    zero = at.run_action_test(model, cfg, real, actions, context=4, steps=3, progress=False, action_guidance=0.0)
    guided = at.run_action_test(model, cfg, real, actions, context=4, steps=3, progress=False, action_guidance=2.0)
    for kind in ("own", "noise", "other"):
        assert torch.equal(zero[kind], plain[kind])
        assert (guided[kind] - plain[kind]).abs().max() > 1e-3
