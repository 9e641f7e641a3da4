"""Exact speculative sampling for the rollout's denoising rows, with bandits choosing the lookahead.

    from arvdm.speculative import SpeculativeRows, make_speculation
    spec = make_speculation("ucb")
    video = rollout(model, diffusion, schedule, ctx, ctx_actions, actions, n, eta=1.0, rows=SpeculativeRows(spec))

``rules`` (accept / reflect, generic), ``bandits`` (BanditSpec policies, generic), ``cost`` (what a round
costs: the bandits' reward is rows per cost, generic), ``rows`` (the row runner).
"""

from arvdm.speculative.bandits import (
    ArmPolicy,
    EXP3Spec,
    FixedArm,
    PerContext,
    UCBSpec,
    hindsight_regret,
    stopping_time_regret,
)
from arvdm.speculative.cost import CostModel, CostModelError, hindsight_cost_regret, regret_over_time
from arvdm.speculative.rows import (
    FROZEN,
    NO_DRAFT,
    REPORT_LEVEL_BINS,
    RoundRecord,
    RowCheck,
    Speculation,
    SpeculationError,
    SpeculativeRows,
    make_speculation,
    plot_arms,
    report_bin_width,
    speculation_report,
    tile_state,
)
from arvdm.speculative.rules import (
    SigmaMismatchError,
    gaussian_accept_or_reflect,
    gaussian_acceptance_probability,
    token_accept_or_resample,
)

__all__ = ["ArmPolicy", "UCBSpec", "EXP3Spec", "FixedArm", "PerContext", "hindsight_regret", "stopping_time_regret",
           "Speculation", "SpeculativeRows", "SpeculationError", "RoundRecord", "RowCheck", "make_speculation",
           "speculation_report", "plot_arms", "tile_state", "report_bin_width", "REPORT_LEVEL_BINS", "FROZEN",
           "NO_DRAFT", "CostModel", "CostModelError", "hindsight_cost_regret", "regret_over_time",
           "SigmaMismatchError", "gaussian_accept_or_reflect", "gaussian_acceptance_probability",
           "token_accept_or_resample"]
