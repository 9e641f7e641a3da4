"""BanditSpec: choose a speculation configuration online (Hou et al., arXiv 2505.15141).

Generic: arms are integers 0..K−1 (what an arm means — lookahead, draft model — is the caller's business),
a round's reward Y lies in [1, L+1] (the paper: tokens produced in one round, at least 1, at most the
lookahead + 1; here rows of a denoising chain advanced in one round, at most the largest lookahead).

    policy = UCBSpec(n_arms=4, L=4)
    arm = policy.select()           # which configuration to run this round
    policy.update(arm, reward)      # what it produced

Policies: :class:`UCBSpec` (paper Alg. 4), :class:`EXP3Spec` (Alg. 5) and :class:`FixedArm`. The figure
of merit is the stopping-time regret (paper Eq. 1): the rounds a policy needs to produce a given total,
minus the rounds the best fixed arm needs (:func:`stopping_time`, :func:`best_fixed_arm`,
:func:`stopping_time_regret`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from arvdm.speculative.cost import hindsight_cost_regret

__all__ = ["ArmPolicy", "UCBSpec", "EXP3Spec", "FixedArm", "PerContext", "ucb_bonus", "stopping_time", "best_fixed_arm",
           "stopping_time_regret", "hindsight_regret"]


class ArmPolicy:
    """Interface: ``select() -> arm`` then ``update(arm, reward)`` once per round."""

    n_arms: int

    def select(self) -> int:
        raise NotImplementedError

    def update(self, arm: int, reward: float) -> None:
        raise NotImplementedError

    def _check(self, arm: int) -> int:
        if not 0 <= int(arm) < self.n_arms:
            raise ValueError(f"arm {arm} out of range 0..{self.n_arms - 1}")
        return int(arm)


def ucb_bonus(n: int, t: int, n_arms: int, L: float, delta: float = 0.5) -> float:
    """UCBSpec's exploration bonus (paper Alg. 4):
    (L/2)·sqrt((1+n)/n² · (1 + 2 log(K t² √(1+n) / δ))) for an arm pulled n times at round t."""
    if n < 1 or t < 1:
        raise ValueError(f"ucb_bonus needs n >= 1 and t >= 1, got n={n}, t={t}")
    return (L / 2) * math.sqrt((1 + n) / n**2 * (1 + 2 * math.log(n_arms * t**2 * math.sqrt(1 + n) / delta)))


class UCBSpec(ArmPolicy):
    """Upper confidence bounds with the self-normalised bonus of BanditSpec Alg. 4.

    Rounds 1..K play every arm once (round robin); then round t plays argmax_i μ̂_i + ucb_bonus(n_i, t).

    Args:
        n_arms: K.
        L: reward range: rewards lie in [1, L+1] (sub-Gaussian with scale L/2).
        delta: confidence parameter δ (paper: 1/2).
    """

    def __init__(self, n_arms: int, L: float, delta: float = 0.5):
        if n_arms < 1 or L <= 0 or not 0 < delta < 1:
            raise ValueError(f"UCBSpec needs n_arms >= 1, L > 0, 0 < delta < 1; got {n_arms}, {L}, {delta}")
        self.n_arms, self.L, self.delta = int(n_arms), float(L), float(delta)
        self.counts = np.zeros(self.n_arms, dtype=np.int64)
        self.sums = np.zeros(self.n_arms, dtype=np.float64)
        self.t = 0  # rounds completed

    def index(self) -> np.ndarray:
        """(K,) UCB index of every arm at the next round (inf for arms never pulled)."""
        t = self.t + 1
        out = np.full(self.n_arms, np.inf)
        for i in np.nonzero(self.counts)[0]:
            n = int(self.counts[i])
            out[i] = self.sums[i] / n + ucb_bonus(n, t, self.n_arms, self.L, self.delta)
        return out

    def select(self) -> int:
        if self.t < self.n_arms:
            return self.t  # round robin first
        return int(np.argmax(self.index()))

    def update(self, arm: int, reward: float) -> None:
        arm = self._check(arm)
        self.counts[arm] += 1
        self.sums[arm] += float(reward)
        self.t += 1


class EXP3Spec(ArmPolicy):
    """Exponential weights on importance-weighted losses (BanditSpec Alg. 5), for adversarial rewards.

    Round t plays arm i with p_t,i ∝ exp(−η_t Σ_s ℓ̂_s,i), η_t = sqrt(log K / (t K)); the played arm's loss
    estimate is ℓ̂ = (L+1−Y)/(L·p_t,i) (unbiased for the loss (L+1−Y)/L ∈ [0, 1]), the others' 0.

    Args:
        n_arms: K.
        L: rewards lie in [1, L+1].
        seed: the policy's own random stream (numpy), so a run is reproducible.
    """

    def __init__(self, n_arms: int, L: float, seed: int = 0):
        if n_arms < 1 or L <= 0:
            raise ValueError(f"EXP3Spec needs n_arms >= 1 and L > 0; got {n_arms}, {L}")
        self.n_arms, self.L = int(n_arms), float(L)
        self.cum_loss = np.zeros(self.n_arms, dtype=np.float64)  # Σ_s ℓ̂_s,i
        self.t = 0  # rounds completed
        self.rng = np.random.default_rng(seed)
        self._last_p: np.ndarray | None = None

    def eta(self, t: int) -> float:
        """Learning rate η_t = sqrt(log K / (t K)) of round t (1-based); log K = 0 for one arm."""
        return math.sqrt(math.log(self.n_arms) / (t * self.n_arms))

    def probabilities(self) -> np.ndarray:
        """(K,) the distribution the next round samples its arm from."""
        logits = -self.eta(self.t + 1) * self.cum_loss
        w = np.exp(logits - logits.max())  # stable softmax
        return w / w.sum()

    def loss_estimate(self, arm: int, reward: float, p: np.ndarray) -> np.ndarray:
        """(K,) ℓ̂ for one round: (L+1−Y)/(L·p_arm) on the played arm, 0 elsewhere."""
        out = np.zeros(self.n_arms)
        out[arm] = (self.L + 1 - float(reward)) / (self.L * p[arm])
        return out

    def select(self) -> int:
        self._last_p = self.probabilities()
        return int(self.rng.choice(self.n_arms, p=self._last_p))

    def update(self, arm: int, reward: float) -> None:
        arm = self._check(arm)
        p = self._last_p if self._last_p is not None else self.probabilities()
        self.cum_loss += self.loss_estimate(arm, reward, p)
        self._last_p = None
        self.t += 1


class FixedArm(ArmPolicy):
    """Always the same arm (a baseline, and the comparator of the regret)."""

    def __init__(self, n_arms: int, arm: int):
        self.n_arms = int(n_arms)
        self.arm = self._check(arm)

    def select(self) -> int:
        return self.arm

    def update(self, arm: int, reward: float) -> None:
        self._check(arm)


class PerContext(ArmPolicy):
    """One independent copy of a policy per discrete context (e.g. a noise-level bin): ``set_context(c)``
    before ``select``/``update``. For when the best arm depends on an observable state, which a single
    context-free bandit (and a single fixed arm) can only average over.

    Args:
        make_policy: builds a fresh policy; called once per context (``make_policy(c)``).
        n_contexts: contexts 0..n_contexts−1.
    """

    def __init__(self, make_policy, n_contexts: int):
        if n_contexts < 1:
            raise ValueError(f"PerContext needs n_contexts >= 1, got {n_contexts}")
        self.policies = [make_policy(c) for c in range(n_contexts)]
        self.n_arms = self.policies[0].n_arms
        self.context = 0

    def set_context(self, context: int) -> None:
        if not 0 <= int(context) < len(self.policies):
            raise ValueError(f"context {context} out of range 0..{len(self.policies) - 1}")
        self.context = int(context)

    def select(self) -> int:
        return self.policies[self.context].select()

    def update(self, arm: int, reward: float) -> None:
        self.policies[self.context].update(arm, reward)


# -- stopping-time regret (paper Eq. 1) ------------------------------------------------------------------

def stopping_time(rewards: Sequence[float] | np.ndarray, total: float) -> int | None:
    """τ = the first round (1-based) by which the rewards add up to ``total``; None if they never do."""
    csum = np.cumsum(np.asarray(rewards, dtype=np.float64))
    hit = np.nonzero(csum >= total)[0]
    return int(hit[0]) + 1 if hit.size else None


def best_fixed_arm(reward_table: np.ndarray, total: float) -> tuple[int, int | None]:
    """The fixed arm with the smallest stopping time in hindsight.

    Args:
        reward_table: (T, K) the reward each arm would have produced at round t.
        total: the amount to produce.

    Returns:
        ``(arm, τ_arm)``; τ is None when no arm reaches ``total`` within T rounds.
    """
    taus = [stopping_time(reward_table[:, i], total) for i in range(reward_table.shape[1])]
    finite = [(tau, i) for i, tau in enumerate(taus) if tau is not None]
    if not finite:
        return int(np.argmax(reward_table.sum(0))), None
    tau, arm = min(finite)
    return arm, tau


def stopping_time_regret(played_rewards: Sequence[float], reward_table: np.ndarray, total: float) -> int:
    """Eq. 1: τ(policy) − τ(best fixed arm in hindsight) on the same reward sequence."""
    tau = stopping_time(played_rewards, total)
    _, tau_best = best_fixed_arm(reward_table, total)
    if tau is None or tau_best is None:
        raise ValueError(f"the rewards do not add up to total={total} within the rounds given")
    return tau - tau_best


def hindsight_regret(arms: Sequence[int], rewards: Sequence[float], n_arms: int) -> dict[str, float]:
    """Regret estimate when only the played rewards are known (a real rollout, no counterfactuals).

    The best fixed arm is the one with the highest mean observed reward μ̂*; it would have needed about
    Σ Y / μ̂* rounds for what the policy produced in len(rewards) rounds. This is
    ``hindsight_cost_regret`` with every round costing 1.
    """
    r = hindsight_cost_regret(arms, rewards, np.ones(len(rewards)), n_arms)
    return {"best_arm": r["best_arm"], "best_arm_mean": r["best_arm_rows_per_cost"], "rounds": r["rounds"],
            "rounds_best_arm_estimate": r["cost_best_arm_estimate"], "regret": r["regret"]}
