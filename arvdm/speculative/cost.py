"""What a speculative round costs, and the bandits' reward: rows advanced per unit of cost actually spent.

    cost = CostModel(batch_ratio=0.2, draft_costs={"small": 0.3})
    cost.round_cost(4, "small")       # verify(4) + 4 * 0.3 = 1.6 + 1.2 target-equivalent calls

Generic (no dependency on the denoiser). The unit is the **target-equivalent call**: one plain denoising row of
the whole batch (one target call on B windows) costs 1. A round with lookahead L > 1 costs

    verify(L) + L · draft_cost(draft)

where ``verify(L)`` is one batched target call on the L drafted states (L·B windows): a measured value from
``verify_costs`` if given, else the linear model ``1 + batch_ratio · (L − 1)``. ``batch_ratio`` is the cost of
one more window in the batched call relative to the first: 1 where L windows cost L calls (a saturated device,
compute-bound; the default, and about what this project's 2-core CPU gives with its per-round overheads), 0
where a batch of L costs one call (a GPU that is not saturated; a model, not a measurement). A draft call costs
``draft_costs[name]`` target calls (the frozen draft reuses the target's v: 0 unless given). L = 1 (a plain
row) costs 1.

The reward of a round is rows advanced / cost, so the best arm depends on the acceptance profile: with
a free draft and batch_ratio = 0 it is the largest L, with batch_ratio = 1 it is L = 1 (a round of L rows
advances at most L), in between it depends on how many drafted rows are accepted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from arvdm.errors import ArvdmError

__all__ = ["CostModel", "CostModelError", "reward_range", "regret_over_time", "hindsight_cost_regret"]


class CostModelError(ArvdmError):
    """A cost model that cannot price a round (negative or non-finite costs)."""


@dataclass(frozen=True)
class CostModel:
    """Cost of a speculative round in target-equivalent calls (module docstring).

    Args:
        batch_ratio: >= 0, extra cost of each window after the first in the batched verification call.
        verify_costs: {L: cost of the batched target call on L windows} (measured); overrides the linear model
            for those L.
        draft_costs: {draft name: cost of one draft call} in target calls; missing names cost 0.
    """

    batch_ratio: float = 1.0
    verify_costs: dict[int, float] = field(default_factory=dict)
    draft_costs: dict[str, float] = field(default_factory=dict)

    def __post_init__(self):
        values = [("batch_ratio", self.batch_ratio)] + [(f"verify_costs[{k}]", v) for k, v in self.verify_costs.items()]
        values += [(f"draft_costs[{k!r}]", v) for k, v in self.draft_costs.items()]
        for name, value in values:
            if not (np.isfinite(value) and value >= 0):
                raise CostModelError(f"cost model: {name} must be a finite number >= 0, got {value}")
        for lookahead, value in self.verify_costs.items():
            if int(lookahead) < 1 or value <= 0:
                raise CostModelError(f"cost model: verify_costs[{lookahead}] needs L >= 1 and a cost > 0, got {value}")

    def verify(self, lookahead: int) -> float:
        """Cost of one batched target call on ``lookahead`` windows per sample."""
        if lookahead in self.verify_costs:
            return float(self.verify_costs[lookahead])
        return 1.0 + self.batch_ratio * (lookahead - 1)

    def round_cost(self, lookahead: int, draft: str) -> float:
        """Cost of one round that drafts ``lookahead`` rows with ``draft`` (1 for a plain row, L = 1)."""
        if lookahead <= 1:
            return 1.0
        return self.verify(lookahead) + lookahead * float(self.draft_costs.get(draft, 0.0))

    def to_dict(self) -> dict:
        return {"batch_ratio": self.batch_ratio, "verify_costs": {str(k): v for k, v in self.verify_costs.items()},
                "draft_costs": dict(self.draft_costs)}


def reward_range(cost: CostModel, arms: Sequence[tuple[int, str]]) -> tuple[float, float]:
    """(lowest, highest) rows per cost a round of these arms can give: 1 row at the dearest round, L rows
    at arm L's cost. A shorter round (the end of an AR step) is clamped into this range by the caller."""
    costs = [cost.round_cost(int(L), d) for L, d in arms]
    low = min(1.0 / c for c in costs)
    high = max(int(L) / c for (L, _), c in zip(arms, costs))
    return low, max(high, low)


def regret_over_time(rows: Sequence[float], costs: Sequence[float], best_rate: float,
                     points: int = 10) -> list[dict[str, float]]:
    """Cost regret of a played sequence against an oracle arm advancing ``best_rate`` rows per unit cost.

    At ``points`` round counts t (evenly spaced, the last = all rounds): the cost spent so far, the cost the
    oracle arm would have spent for the same rows (rows / best_rate), their difference (the regret, in
    target-equivalent calls) and the difference relative to the oracle's cost.
    """
    if best_rate <= 0:
        raise CostModelError(f"regret_over_time: best_rate must be > 0, got {best_rate}")
    rows_c, cost_c = np.cumsum(np.asarray(rows, dtype=np.float64)), np.cumsum(np.asarray(costs, dtype=np.float64))
    n = len(rows_c)
    out = []
    for t in sorted({max(1, round(n * (i + 1) / points)) for i in range(points)} if n else set()):
        oracle = rows_c[t - 1] / best_rate
        out.append({"round": int(t), "rows": float(rows_c[t - 1]), "cost": float(cost_c[t - 1]),
                    "oracle_cost": float(oracle), "regret": float(cost_c[t - 1] - oracle),
                    "relative_regret": float(cost_c[t - 1] / oracle - 1)})
    return out


def hindsight_cost_regret(arms: Sequence[int], rows: Sequence[float], costs: Sequence[float],
                          n_arms: int) -> dict[str, float]:
    """Cost regret when only the played rounds are known (a real rollout, no counterfactuals).

    The best arm in hindsight is the one with the most rows per unit cost over its own rounds (Σ rows / Σ cost);
    it would have spent about Σ rows / that rate for what the policy advanced. ``regret`` is the policy's extra
    cost in target-equivalent calls, ``relative_regret`` that over the estimate.
    """
    arms_a = np.asarray(arms, dtype=np.int64)
    rows_a, costs_a = np.asarray(rows, dtype=np.float64), np.asarray(costs, dtype=np.float64)
    rates = np.array([rows_a[arms_a == i].sum() / costs_a[arms_a == i].sum() if (arms_a == i).any() else np.nan
                      for i in range(n_arms)])
    best = int(np.nanargmax(rates))
    oracle = float(rows_a.sum() / rates[best])
    return {"best_arm": best, "best_arm_rows_per_cost": float(rates[best]), "rounds": int(len(rows_a)),
            "cost": float(costs_a.sum()), "cost_best_arm_estimate": oracle, "regret": float(costs_a.sum() - oracle),
            "relative_regret": float(costs_a.sum() / oracle - 1)}
