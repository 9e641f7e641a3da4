"""arvdm/speculative/bandits.py: UCBSpec's bonus and behaviour (a greedy UCB fails), EXP3Spec's estimator and
regret, stopping-time regret; arvdm/speculative/cost.py: the cost model and the rows-per-cost reward, under which
the best arm depends on the acceptance profile."""

import math

import numpy as np
import pytest

from arvdm.speculative import bandits
from arvdm.speculative.bandits import (
    EXP3Spec,
    FixedArm,
    PerContext,
    UCBSpec,
    best_fixed_arm,
    hindsight_regret,
    stopping_time,
    stopping_time_regret,
    ucb_bonus,
)
from arvdm.speculative.cost import CostModel, CostModelError, hindsight_cost_regret, regret_over_time, reward_range

L = 4
PROBS = np.array([0.2, 0.45, 0.7, 0.55])  # Y = 1 + Binomial(L, p): means 1.8, 2.8, 3.8, 3.2; best arm 2


def test_ucb_bonus_value():
    # (4/2)·sqrt(3/4 · (1 + 2 log(4·25·√3 / 0.5))) = 6.1714
    assert ucb_bonus(n=2, t=5, n_arms=4, L=4, delta=0.5) == pytest.approx(6.1714, abs=5e-5)


def play(policy, rounds, seed=0):
    rng = np.random.default_rng(seed)
    arms, rewards = [], []
    for _ in range(rounds):
        arm = policy.select()
        y = 1 + rng.binomial(L, PROBS[arm])
        policy.update(arm, y)
        arms.append(arm)
        rewards.append(y)
    return np.array(arms), np.array(rewards)


def test_ucb_round_robin_then_settles_on_best_arm_with_log_regret():
    policy = UCBSpec(n_arms=4, L=L)
    arms, _ = play(policy, 200_000)
    assert arms[:4].tolist() == [0, 1, 2, 3]  # round robin first
    means = 1 + L * PROBS
    regret = np.cumsum(means.max() - means[arms])  # pseudo-regret after each round
    ratios = [regret[t - 1] / math.log(t) for t in (20_000, 200_000)]
    # regret / log(rounds) stays bounded: 10x the rounds add at most 25% to it (linear regret would add 900%)
    assert ratios[1] <= ratios[0] * 1.25
    assert (arms[-100_000:] == 2).mean() > 0.99  # settled on the best arm


def test_ucb_stopping_time_regret_small_against_best_fixed_arm():
    total = 15_000
    taus = {}
    for name, policy in {"ucb": UCBSpec(4, L), "best": FixedArm(4, 2), "worst": FixedArm(4, 0)}.items():
        _, rewards = play(policy, 10_000, seed=1)
        taus[name] = stopping_time(rewards, total)
    assert taus["best"] <= taus["ucb"] < taus["best"] * 1.1 < taus["worst"]


def test_exp3_probabilities_and_unbiased_loss():
    policy = EXP3Spec(n_arms=4, L=L, seed=0)
    play(policy, 50)
    p = policy.probabilities()
    assert p.sum() == pytest.approx(1.0) and (p > 0).all()
    # E_{I ~ p}[ℓ̂(I)] = the true loss vector (L+1−Y)/L, exactly
    y = np.array([1.0, 2.0, 4.0, 5.0])
    expected = sum(p[i] * policy.loss_estimate(i, y[i], p) for i in range(4))
    np.testing.assert_allclose(expected, (L + 1 - y) / L)
    assert policy.eta(5) == pytest.approx(math.sqrt(math.log(4) / 20))


def test_exp3_sublinear_regret_on_adversarial_sequence():
    """Rewards flip between two arms in blocks of growing length; regret / T falls with T."""
    T = 40_000
    t = np.arange(T)
    phase = (np.floor(np.sqrt(t / 50)) % 2).astype(int)  # blocks of growing length
    table = np.ones((T, 4))
    table[:, 0] = np.where(phase == 0, 5, 1)
    table[:, 1] = np.where(phase == 1, 5, 1.5)
    table[:, 2] = 2.5
    table[:, 3] = 1 + 4 * (t % 3 == 0)  # mean 2.33
    policy = EXP3Spec(n_arms=4, L=L, seed=0)
    got = np.zeros(T)
    for s in range(T):
        arm = policy.select()
        got[s] = table[s, arm]
        policy.update(arm, got[s])
    for n in (2500, 10_000, 40_000):  # within the O(L sqrt(n K log K)) bound at every horizon: sublinear
        regret = table[:n].sum(0).max() - got[:n].sum()  # against the best fixed arm in hindsight
        assert regret < L * math.sqrt(2 * n * 4 * math.log(4))
    assert regret / T < 0.02  # under 2% of a round's best reward per round by T
    total = got.sum() * 0.9
    assert stopping_time_regret(got, table, total) < 0.05 * stopping_time(got, total)


def test_per_context_learns_a_best_arm_per_context():
    """Context 0 favours arm 2, context 1 favours arm 0: one copy per context finds both."""
    policy = PerContext(lambda c: UCBSpec(4, L), 2)
    rng = np.random.default_rng(0)
    probs = {0: PROBS, 1: PROBS[::-1]}
    late = {0: [], 1: []}
    for t in range(40_000):
        c = t % 2
        policy.set_context(c)
        arm = policy.select()
        policy.update(arm, 1 + rng.binomial(L, probs[c][arm]))
        if t >= 30_000:
            late[c].append(arm)
    assert np.mean(np.array(late[0]) == 2) > 0.9 and np.mean(np.array(late[1]) == 1) > 0.9
    assert policy.policies[0].t == policy.policies[1].t == 20_000
    with pytest.raises(ValueError, match="context 2"):
        policy.set_context(2)


def test_stopping_time_helpers():
    assert stopping_time([1, 2, 3], 3) == 2 and stopping_time([1, 1], 5) is None
    table = np.array([[1, 2], [1, 2], [4, 1]])
    assert best_fixed_arm(table, 4) == (1, 2)
    assert stopping_time_regret([1, 1, 4], table, 4) == 1  # policy needs 3 rounds, arm 1 needs 2
    h = hindsight_regret([0, 1, 1, 0], [1, 3, 3, 1], n_arms=2)
    assert h["best_arm"] == 1 and h["regret"] == pytest.approx(4 - 8 / 3)


def test_bad_arguments():
    with pytest.raises(ValueError, match="arm 7"):
        UCBSpec(4, L).update(7, 1.0)
    with pytest.raises(ValueError, match="n >= 1"):
        ucb_bonus(0, 1, 4, L)


def _two_arm_late_choices(seed, rounds=3000):
    """Arm 0 (best, mean 3): 1 or 5 with probability 1/2 each; arm 1 (mean 2.2): 1 + Binomial(4, 0.3). With
    probability ~0.4 the best arm's first reward is 1 and the other's is >= 2: it looks worse. Returns the
    share of arm 0 over the last third of the rounds."""
    rng = np.random.default_rng(seed)
    policy = UCBSpec(n_arms=2, L=L)
    arms = np.empty(rounds, dtype=np.int64)
    for t in range(rounds):
        arm = policy.select()
        policy.update(arm, 1 + 4 * rng.binomial(1, 0.5) if arm == 0 else 1 + rng.binomial(L, 0.3))
        arms[t] = arm
    return float((arms[-rounds // 3:] == 0).mean())


def test_ucb_exploration_bonus_is_what_finds_the_best_arm(monkeypatch):
    """UCBSpec plays the best arm late in every one of 40 seeds; without its bonus (greedy) it stays on the
    worse arm for good in several. Fails if the bonus is removed from UCBSpec.index."""
    seeds = range(40)
    ucb = [_two_arm_late_choices(s) for s in seeds]
    assert min(ucb) > 0.9, sorted(ucb)[:5]
    monkeypatch.setattr(bandits, "ucb_bonus", lambda *args, **kwargs: 0.0)
    greedy = [_two_arm_late_choices(s) for s in seeds]
    stuck = sum(share < 0.1 for share in greedy)
    assert stuck >= 5, sorted(greedy)  # measured: 16 of 40 seeds never return to the best arm


ARMS = [(1, "none"), (2, "frozen"), (4, "frozen"), (8, "frozen")]


def _rows(rng, lookahead, acceptance):
    """Rows a round advances when every drafted row is accepted with probability ``acceptance`` independently:
    up to and including the first rejected row (its reflection), at most L."""
    return min(lookahead, int(rng.geometric(1 - acceptance)))


def test_cost_model_prices_rounds():
    cost = CostModel(batch_ratio=0.2, verify_costs={8: 1.73}, draft_costs={"small": 0.25})
    assert cost.round_cost(1, "small") == 1.0  # a plain row
    assert cost.round_cost(4, "frozen") == pytest.approx(1.6)  # 1 + 0.2·3, the frozen draft free
    assert cost.round_cost(4, "small") == pytest.approx(1.6 + 4 * 0.25)
    assert cost.round_cost(8, "frozen") == 1.73  # measured value overrides the linear model
    assert CostModel().round_cost(4, "frozen") == 4.0  # default: every window one target call
    low, high = reward_range(CostModel(batch_ratio=0.2), ARMS)
    assert low == pytest.approx(1 / 2.4) and high == pytest.approx(8 / 2.4)
    for bad in ({"batch_ratio": -0.1}, {"verify_costs": {2: 0.0}}, {"draft_costs": {"d": float("nan")}}):
        with pytest.raises(CostModelError, match="cost model"):
            CostModel(**bad)


@pytest.mark.parametrize("acceptance, best", [(0.9, 3), (0.5, 1), (0.1, 0)])
def test_cost_charged_reward_makes_the_best_arm_depend_on_acceptance(acceptance, best):
    """Rows per cost with batched verification at 0.2 per extra window: long lookahead pays at high acceptance,
    L = 2 at medium, no speculation at low. UCBSpec on the reward settles on that arm and gets >= 93% of the
    oracle arm's rows per cost; under the old reward (rows per round) the largest L would always win."""
    cost = CostModel(batch_ratio=0.2)
    rates = [(1 - acceptance ** L_) / (1 - acceptance) / cost.round_cost(L_, d) for L_, d in ARMS]  # E rows / cost
    assert int(np.argmax(rates)) == best
    low, high = reward_range(cost, ARMS)
    policy = UCBSpec(len(ARMS), high - low)
    rng = np.random.default_rng(0)
    arms, rows, costs = [], [], []
    for _ in range(20_000):
        arm = policy.select()
        r, c = _rows(rng, ARMS[arm][0], acceptance), cost.round_cost(*ARMS[arm])
        policy.update(arm, 1 + min(max(r / c, low), high) - low)
        arms.append(arm), rows.append(r), costs.append(c)
    assert np.mean(np.array(arms[-5000:]) == best) > 0.8
    assert sum(rows) / sum(costs) > 0.93 * max(rates)
    curve = regret_over_time(rows, costs, max(rates), points=4)
    assert [p["round"] for p in curve] == [5000, 10_000, 15_000, 20_000]
    relative = [p["relative_regret"] for p in curve]
    assert relative[-1] < relative[0] and relative[-1] < 0.07  # regret per round falls as UCB settles
    h = hindsight_cost_regret(arms, rows, costs, len(ARMS))
    assert h["best_arm"] == best and h["regret"] == pytest.approx(sum(costs) - sum(rows) / h["best_arm_rows_per_cost"])


def test_regret_over_time_hand_case():
    curve = regret_over_time([1, 3, 2, 2], [1, 2, 2, 1], best_rate=2.0, points=2)
    assert curve == [{"round": 2, "rows": 4.0, "cost": 3.0, "oracle_cost": 2.0, "regret": 1.0, "relative_regret": 0.5},
                     {"round": 4, "rows": 8.0, "cost": 6.0, "oracle_cost": 4.0, "regret": 2.0, "relative_regret": 0.5}]
    with pytest.raises(CostModelError, match="best_rate"):
        regret_over_time([1], [1], 0.0)
