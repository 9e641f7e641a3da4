"""Speculative rows in pipeline.rollout: exact output law, bit-for-bit with an exact draft, tiled KV state."""

import math

import numpy as np
import pytest
import torch
from scipy import stats

from arvdm.config import Config, DiffusionConfig, apply_overrides, get_preset
from arvdm.model.denoiser import Denoiser
from arvdm.model.diffusion import PerFrameDiffusion
from arvdm.pipeline.rollout import rollout
from arvdm.schedules.presets import chunked
from arvdm.speculative.bandits import FixedArm, UCBSpec
from arvdm.speculative.cost import CostModel
from arvdm.speculative.rows import FROZEN, Speculation, SpeculativeRows, make_speculation, tile_state

ALPHA = 1e-3
K = 100
DIFF = PerFrameDiffusion(DiffusionConfig(num_levels=K))


# -- a linear-Gaussian chain: closed-form final law --------------------------------------------------------

class LinearModel:
    """v = a·x + c elementwise: every transition mean is affine in x, so the chain's law is Gaussian."""

    frames_per_chunk = 1

    def __init__(self, a, c):
        self.a, self.c, self.cfg = a, c, Config()

    def check_schedule(self, delta, window):
        pass

    def init_state(self, batch_size):
        return {"ones": torch.ones(batch_size)}

    def commit(self, state, frames, actions):
        pass

    def __call__(self, x, levels, actions, memory=None, state=None):
        assert state is not None and state["ones"].shape[0] == x.shape[0]  # the state is tiled with the batch
        return self.a * x + self.c


def closed_form(model, schedule, eta):
    """Mean and variance of the output frame: x_0 ~ N(0, 1); x_{m+1} = A_m x_m + c_m + σ_m ξ."""
    mu, var = 0.0, 1.0
    rows = torch.tensor(schedule.matrix)
    for m in range(rows.shape[0] - 1):
        lf, lt = rows[m].view(1, 1), rows[m + 1].view(1, 1)
        x = torch.tensor([0.0, 1.0], dtype=torch.float64).view(2, 1, 1, 1, 1)
        mean, sigma = DIFF.transition(x, model(x, lf.repeat(2, 1), None, state={"ones": torch.ones(2)}),
                                      lf.repeat(2, 1), lt.repeat(2, 1), eta)
        c, a = float(mean[0]), float(mean[1] - mean[0])
        mu, var = a * mu + c, a * a * var + float(sigma[0]) ** 2
    return mu, var


@pytest.mark.parametrize("draft_a, lookahead", [(0.9, 3), (0.5003, 4)])  # far draft (many reflections); near
def test_linear_gaussian_chain_has_closed_form_law(draft_a, lookahead):
    target, draft = LinearModel(0.5, 0.2), LinearModel(draft_a, 0.2)
    sched = chunked(1, K, 8)
    b = 4000
    ctx, ctx_act, act = torch.zeros(b, 0, 1, 2, 2, dtype=torch.float64), torch.zeros(b, 0, dtype=torch.long), \
        torch.zeros(b, 1, dtype=torch.long)
    spec = Speculation(arms=[(lookahead, "d")], policy=FixedArm(1, 0), drafts={"d": draft})
    out = rollout(target, DIFF, sched, ctx, ctx_act, act, 1, eta=1.0, generator=torch.Generator().manual_seed(0),
                  progress=False, rows=SpeculativeRows(spec))  # (B, 1, 1, 2, 2)
    mu, var = closed_form(target, sched, 1.0)
    standardized = ((out.flatten() - mu) / math.sqrt(var)).numpy()  # 4 independent pixels per sample
    assert stats.kstest(standardized, "norm").pvalue > ALPHA
    s = spec.summary()
    assert s["rows"] == 8
    if draft_a == 0.9:  # some sample reflects in every round: the coupling path is what is being tested
        assert 0.05 < s["acceptance"] < 0.95
    else:  # multi-row rounds: drafted states, their levels and the batched target call line up
        assert s["rows_per_round"] > 1.5


def test_level_binned_bandit_uses_one_policy_per_noise_level_bin():
    target, draft = LinearModel(0.5, 0.2), LinearModel(0.5003, 0.2)
    spec = make_speculation("ucb", (1, 2, 4), {"d": draft}, level_bins=4)
    b = 64
    out = rollout(target, DIFF, chunked(1, K, 40), torch.zeros(b, 0, 1, 2, 2), torch.zeros(b, 0, dtype=torch.long),
                  torch.zeros(b, 1, dtype=torch.long), 1, eta=1.0, generator=torch.Generator().manual_seed(0),
                  progress=False, rows=SpeculativeRows(spec))
    assert torch.isfinite(out).all()
    rounds = [p.t for p in spec.policy.policies]  # rounds each level bin's bandit played
    assert sum(rounds) == len(spec.rounds) and all(r > 0 for r in rounds)
    starts = [r.row for r in spec.rounds]  # rows 0..39 go from level 100 down: bins 3, 2, 1, 0 in turn
    assert starts == sorted(starts)


def test_eta_zero_refused_with_reason():
    target = LinearModel(0.5, 0.2)
    spec = Speculation(arms=[(2, FROZEN)], policy=FixedArm(1, 0))
    with pytest.raises(ValueError, match="needs eta > 0"):
        rollout(target, DIFF, chunked(1, K, 4), torch.zeros(1, 0, 1, 2, 2), torch.zeros(1, 0, dtype=torch.long),
                torch.zeros(1, 1, dtype=torch.long), 1, eta=0.0, progress=False, rows=SpeculativeRows(spec))


def test_speculation_checks_its_arms():
    with pytest.raises(ValueError, match="'small' is neither"):
        Speculation(arms=[(2, "small")], policy=FixedArm(1, 0))
    with pytest.raises(ValueError, match="policy has 2 arms"):
        Speculation(arms=[(2, FROZEN)], policy=UCBSpec(2, 1))


# -- the tiny Denoiser -------------------------------------------------------------------------------------

def tiny(seed=0, scale=0.1):
    cfg = apply_overrides(get_preset("tiny_time"), [
        "model.image_size=16", "model.patch_size=4", "model.dim=32", "model.depth=2", "model.heads=2",
        "model.num_actions=4", f"diffusion.num_levels={K}", "memory.length=4"])
    torch.manual_seed(0)
    model = Denoiser(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # lift the zero-inits so every path is live
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


def tiny_inputs(b, seed=0):
    g = torch.Generator().manual_seed(seed)
    ctx = torch.rand(1, 2, 3, 16, 16, generator=g).expand(b, -1, -1, -1, -1) * 2 - 1
    return ctx, torch.zeros(b, 2, dtype=torch.long), torch.randint(0, 4, (1, 6), generator=g).expand(b, -1)


def tiny_rollout(model, b, seed, spec=None, n_frames=4, steps=4, use_cache=True):
    ctx, ctx_act, act = tiny_inputs(b)
    return rollout(model, PerFrameDiffusion(model.cfg.diffusion), chunked(2, K, steps), ctx, ctx_act, act,
                   n_frames, eta=1.0, generator=torch.Generator().manual_seed(seed), progress=False,
                   rows=None if spec is None else SpeculativeRows(spec), use_cache=use_cache)


def test_draft_equal_to_target_reproduces_plain_sampling():
    """Bit for bit where a batched call rounds as single calls do; on CPUs whose kernels round by batch size (an
    AMX machine, 2026-12-06) the rows that land frames on level 0 (σ = 0: accepted only when the means are equal
    bit for bit) are rejected and their exact reflection is the target's own mean: the frames agree to rounding."""
    model = tiny()
    plain = tiny_rollout(model, 2, seed=3)
    spec = Speculation(arms=[(1, FROZEN), (3, "self")], policy=UCBSpec(2, 2), drafts={"self": model})
    fast = tiny_rollout(model, 2, seed=3, spec=spec)
    torch.testing.assert_close(fast, plain, atol=1e-5, rtol=0)
    s = spec.summary()
    # 2 AR steps x 4 rows; every drafted row that stays noisy accepted, the speculating arm was played
    noisy = [c for c in spec.checks if c.row < 3]  # chunked, 4 steps: row 3 lands the window on level 0
    assert s["rows"] == 8 and noisy and all(c.accepted == c.checked for c in noisy) and s["arm_counts"][1] > 0
    if all(c.accepted == c.checked for c in spec.checks):  # the batched call rounded as the single ones
        assert torch.equal(fast, plain)
    # the no-speculation arm alone is exactly a plain rollout too
    assert torch.equal(tiny_rollout(model, 2, seed=3, spec=Speculation([(1, FROZEN)], FixedArm(1, 0))), plain)
    # and without the KV cache (memory frames tiled for the batched call)
    plain = tiny_rollout(model, 2, seed=4, use_cache=False)
    spec = Speculation(arms=[(3, "self")], policy=FixedArm(1, 0), drafts={"self": model})
    assert torch.equal(tiny_rollout(model, 2, seed=4, spec=spec, use_cache=False), plain)
    assert spec.summary()["acceptance"] == 1.0


def test_tiled_kv_state_equals_separate_calls():
    model = tiny()
    ctx, ctx_act, act = tiny_inputs(2)
    state = model.init_state(2)
    model.commit(state, ctx, ctx_act)
    g = torch.Generator().manual_seed(1)
    xs = torch.randn(3, 2, 2, 3, 16, 16, generator=g)  # three windows per sample
    lv = torch.tensor([[60, 70], [30, 40], [10, 20]]).repeat_interleave(2, 0)  # (3·B, w)
    tiled = tile_state(state, 3)
    assert tiled.batch_size == 6 and state.batch_size == 2
    v = model(xs.flatten(0, 1), lv, act[:, :2].repeat(3, 1), state=tiled).view(3, 2, 2, 3, 16, 16)
    for i in range(3):
        ref = model(xs[i], lv[2 * i:2 * i + 2], act[:, :2], state=state)
        torch.testing.assert_close(v[i], ref, atol=1e-5, rtol=1e-5)


def test_tiny_model_speculative_pixels_have_plain_law():
    """Draft = a perturbed copy of the target (a different Denoiser) and the frozen draft, eta = 1:
    the generated pixels have plain sampling's distribution (two-sample KS over many seeds)."""
    target, other = tiny(0), tiny(0)
    with torch.no_grad():
        g = torch.Generator().manual_seed(9)
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.001)
    b = 96
    plain = torch.cat([tiny_rollout(target, b, seed=s, n_frames=2) for s in range(2)])  # (2b, 2, 3, 16, 16)
    spec = Speculation(arms=[(3, "copy"), (2, FROZEN)], policy=UCBSpec(2, 2), drafts={"copy": other})
    fast = torch.cat([tiny_rollout(target, b, seed=100 + s, spec=spec, n_frames=2) for s in range(2)])
    s = spec.summary()
    assert s["sample_rows_per_round"] > 1.2 and 0.3 < s["acceptance"] < 0.97, s  # drafted rows kept, rows reflected
    stats_of = [lambda v: v[:, -1].mean((1, 2, 3)), lambda v: v[:, 0, 0, 5, 7], lambda v: v[:, 1, 2, 12, 3],
                lambda v: v[:, -1, 1].std((1, 2))]
    for f in stats_of:
        assert stats.ks_2samp(f(plain).numpy(), f(fast).numpy()).pvalue > ALPHA / len(stats_of)
    assert np.isfinite(fast.numpy()).all()


def test_round_reward_charges_cost_and_counts_what_the_batch_advances():
    """The policy's reward is the rows the batch advanced (its slowest sample's row moved) per modelled cost: a
    batch's rounds add up to its rows, the next round starts that many rows further, the reward is rows / cost
    shifted into the policy's range."""
    target, other = tiny(0), tiny(0)
    with torch.no_grad():
        g = torch.Generator().manual_seed(9)
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.001)
    cost = CostModel(batch_ratio=0.5, draft_costs={"copy": 0.25})
    spec = Speculation(arms=[(1, FROZEN), (3, "copy")], policy=UCBSpec(2, 2), drafts={"copy": other}, cost=cost)
    tiny_rollout(target, 8, seed=5, spec=spec, n_frames=2, steps=12)
    s, rounds = spec.summary(), spec.rounds
    assert sum(r.rows for r in rounds) == s["rows"] == 12  # one AR step of 12 rows, all samples through
    assert [r.rows for r in rounds[:-1]] == [b.row - a.row for a, b in zip(rounds, rounds[1:])]
    assert any(r.rows != r.sample_rows for r in rounds)  # samples move at their own pace
    for r in rounds:
        size = 1 if r.lookahead == 1 else min(3, 12 - r.row)
        assert r.cost == pytest.approx(cost.round_cost(size, "copy"))
        assert r.reward == pytest.approx(1 + r.rows / r.cost - spec.reward_low)
    assert spec.reward_low == pytest.approx(1 / (2 + 0.75)) and spec.reward_high == pytest.approx(3 / 2.75)
    assert s["cost"] == pytest.approx(sum(r.cost for r in rounds))
    assert s["rows_per_cost"] == pytest.approx(12 / s["cost"])


# -- batched verification == sequential verification -------------------------------------------------------

def _rounds_of(spec):
    return [(r.row, r.lookahead, r.rows, r.accepted, r.sample_rows) for r in spec.rounds]


@pytest.mark.parametrize("draft", ["d", FROZEN])
def test_batched_verification_equals_sequential_bit_for_bit(draft):
    """A model whose arithmetic does not depend on the batch (elementwise): one target call on L·B stacked
    windows gives exactly what L calls of B windows give: same frames, rounds and accept decisions."""
    target, other = LinearModel(0.5, 0.2), LinearModel(0.52, 0.2)
    b = 16
    outs, specs = [], []
    for verify in ("batched", "sequential"):
        spec = Speculation(arms=[(3, draft)], policy=FixedArm(1, 0), drafts={"d": other} if draft == "d" else {})
        outs.append(rollout(target, DIFF, chunked(1, K, 12), torch.zeros(b, 0, 1, 2, 2),
                            torch.zeros(b, 0, dtype=torch.long), torch.zeros(b, 1, dtype=torch.long), 1, eta=1.0,
                            generator=torch.Generator().manual_seed(2), progress=False,
                            rows=SpeculativeRows(spec, verify=verify)))
        specs.append(spec)
    assert torch.equal(outs[0], outs[1])
    assert _rounds_of(specs[0]) == _rounds_of(specs[1])
    assert [(c.accepted, c.checked) for c in specs[0].checks] == [(c.accepted, c.checked) for c in specs[1].checks]
    assert 0.05 < specs[0].summary()["acceptance"] < 0.95  # both accepted and reflected rows were compared
    rounds = specs[0].rounds
    assert all(r.target_states == 3 * b for r in rounds if r.row + 3 <= 12)  # one call on 3·B windows per round


def test_batched_verification_matches_sequential_on_the_tiny_denoiser():
    """The real model (levels per window, KV state tiled L-major, per-sample rows): the batched call's v equals
    the separate calls' up to float rounding, so the same rows are accepted and the frames agree."""
    target, other = tiny(0), tiny(0)
    with torch.no_grad():
        g = torch.Generator().manual_seed(9)
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.001)
    outs, specs = [], []
    for verify in ("batched", "sequential"):
        spec = Speculation(arms=[(3, "copy"), (4, FROZEN)], policy=UCBSpec(2, 3), drafts={"copy": other})
        ctx, ctx_act, act = tiny_inputs(3)
        act = torch.randint(0, 4, (3, 6), generator=torch.Generator().manual_seed(4))  # a different window per sample
        outs.append(rollout(target, PerFrameDiffusion(target.cfg.diffusion), chunked(2, K, 10), ctx, ctx_act, act, 4,
                            eta=1.0, generator=torch.Generator().manual_seed(6), progress=False,
                            rows=SpeculativeRows(spec, verify=verify)))
        specs.append(spec)
    assert _rounds_of(specs[0]) == _rounds_of(specs[1])
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)
    s = specs[0].summary()
    assert 0.05 < s["acceptance"] < 0.95 and min(s["arm_counts"]) > 0, s  # both arms, accepts and reflections


def test_speculative_rows_refuses_an_unknown_verify_mode():
    with pytest.raises(ValueError, match="verify must be one of"):
        SpeculativeRows(Speculation(arms=[(2, FROZEN)], policy=FixedArm(1, 0)), verify="parallel")
