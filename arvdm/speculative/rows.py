"""Speculative denoising rows: a row runner for ``pipeline.rollout`` (De Bortoli et al., arXiv 2501.05370;
BanditSpec, arXiv 2505.15141).

    spec = make_speculation("ucb", lookaheads=(1, 2, 3, 4))
    video = rollout(model, diffusion, schedule, context, context_actions, actions, n, eta=1.0,
                    generator=g, rows=SpeculativeRows(spec))      # spec.rounds / spec.checks filled in

:class:`SpeculativeRows` implements ``arvdm.pipeline.rows.RowRunner``; the rollout knows nothing of it.

Within one AR step the memory does not change, so the rows of the scheduling matrix are a Markov chain of
Gaussian transitions x_{m+1} ~ N(mean_p(x_m), σ_m²) (``PerFrameDiffusion.transition``). A round:

1. the bandit policy picks an arm = (lookahead L, draft); L = 1 is a plain step (no speculation);
2. the draft proposes L rows y_1..y_L from the round's start y_0 = x_m, y_{i+1} = mean_q(y_i) + σ_i z_i,
   with z_i drawn from the rollout's generator in the same order a plain rollout draws them;
3. the target runs once on the L states y_0..y_{L−1} as one batch of L·B windows (the KV-cached state
   tiled L times, L-major: copy l holds batch rows l·B..l·B+B−1);
4. rows are verified in order with :func:`arvdm.speculative.gaussian_accept_or_reflect`; the round ends at
   the first row where some sample is rejected (that row's output is the reflection for the rejected samples
   and the drafted row for the others: every sample's chain stays exact), or after L rows;
5. the policy is rewarded with the rows the batch advanced (the slowest sample's: what the batch actually
   advances) per unit of the round's cost in target-equivalent calls (``arvdm.speculative.cost.CostModel``:
   the batched verification of L windows and L draft calls), so the best arm depends on acceptance and cost.

Drafts: ``"frozen"`` reuses the newest target v-prediction for all L drafted rows (no network call; the
newest is the target's v at the state one row before the round's start, and at an AR step's first row the
previous window's v shifted by Δ with 0 — "predict the mean frame" — for the entering frames); or any model
with the denoiser's call signature (e.g. a shallower or streaming ``Denoiser``), run with its own state.
If the draft *is* the target model it shares the target's state, every row is accepted (up to the
rounding of a batched call) and the output equals plain sampling bit for bit.

Exactness needs σ > 0: with eta = 0 every transition is deterministic and a drafted row is accepted only
if it equals the target's bit for bit. Frames landing on level 0 are deterministic too (σ = 0), so a row
in which a frame finishes is accepted only when the draft's mean there is exact: on a FIFO schedule (a
frame finishes in every row) speculation with a frozen draft accepts nothing; chunked AR finishes all
frames only in its last row.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from arvdm.config import FROZEN_DRAFT as FROZEN
from arvdm.errors import ArvdmError
from arvdm.pipeline.rows import RolloutContext
from arvdm.speculative.bandits import ArmPolicy, EXP3Spec, FixedArm, PerContext, UCBSpec, hindsight_regret
from arvdm.speculative.cost import CostModel, hindsight_cost_regret, reward_range
from arvdm.speculative.rules import gaussian_accept_or_reflect
from data.atomic import atomic_write
from memory import MemoryBank, MemoryFrames
from memory.cache import KVCache

__all__ = ["Speculation", "SpeculativeRows", "SpeculationError", "RoundRecord", "RowCheck", "tile_state",
           "make_speculation", "speculation_report", "plot_arms", "report_bin_width", "FROZEN", "NO_DRAFT",
           "REPORT_LEVEL_BINS", "VERIFY_MODES"]

NO_DRAFT = "none"
VERIFY_MODES = ("batched", "sequential")  # SpeculativeRows(verify=): one call on L·B windows, or L calls of B
REPORT_LEVEL_BINS = 10  # reports bin the acceptance of drafted rows by noise level into tenths of K
ARMS_PLOT_WINDOWS = 40  # plot_arms smooths rows per round with a running mean over 1/40 of the rounds


def report_bin_width(num_levels: int) -> int:
    """Width in noise levels of one acceptance-by-level bin of a report (K / ``REPORT_LEVEL_BINS``, >= 1)."""
    return max(1, num_levels // REPORT_LEVEL_BINS)


class SpeculationError(ArvdmError):
    """Speculative-sampling settings that cannot run (arms, drafts, --speculate, eta = 0)."""


@dataclass
class RoundRecord:
    """One speculative round starting at matrix ``row`` (the lowest among the samples): ``rows`` the batch
    advanced (the lowest sample's row moved by that much, 1..lookahead), ``accepted`` drafted rows kept and
    ``sample_rows`` rows advanced, both means over the samples still moving, for ``target_states`` windows
    evaluated (L·B in one batched call; B for a plain step), ``draft_calls`` sequential draft-network calls,
    ``cost`` target-equivalent calls (``CostModel.round_cost``) and the policy's ``reward`` (rows / cost,
    shifted into the policy's range: 1 + rows / cost − the lowest rows / cost of the arms)."""

    stage: str
    ar_step: int
    row: int
    arm: int
    lookahead: int
    rows: float
    accepted: float
    target_states: int
    draft_calls: int
    seconds: float
    cost: float = 1.0
    reward: float = 1.0
    sample_rows: float = 1.0
    draft_seconds: float = 0.0  # wall-clock of drafting the rows (0 for a plain row)
    verify_seconds: float = 0.0  # wall-clock of the target call(s) (the whole row for a plain row)


@dataclass
class RowCheck:
    """One verified drafted row: matrix ``row``, mean level of its moving frames, samples accepted / checked."""

    row: int
    level: float
    accepted: int
    checked: int


@dataclass
class Speculation:
    """How a rollout speculates its denoising rows, and what happened (filled in by :class:`SpeculativeRows`).

    Args:
        arms: (lookahead L, draft name) per arm; L = 1 means a plain step (draft ignored).
        policy: picks an arm per round (``arvdm.speculative.bandits``); its reward is the rows a round advanced
            per unit of its ``cost`` (``RoundRecord``), in [1, 1 + high − low] for ``reward_range(cost, arms)``.
        drafts: draft name -> model (``FROZEN`` needs no entry).
        seed: seed of the uniforms of the accept tests, kept apart from the rollout's generator so that the
            transitions draw the same noise as a plain rollout.
        cost: prices a round (default ``CostModel()``: every window evaluated costs one target call).
    """

    arms: list[tuple[int, str]]
    policy: ArmPolicy
    drafts: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    cost: CostModel = field(default_factory=CostModel)
    rounds: list[RoundRecord] = field(default_factory=list)
    checks: list[RowCheck] = field(default_factory=list)
    rows: int = 0  # rows every sample went through (a plain rollout makes one target call per row)

    def __post_init__(self):
        if not self.arms:
            raise SpeculationError("Speculation needs at least one arm")
        for lookahead, draft in self.arms:
            if int(lookahead) < 1:
                raise SpeculationError(f"arm lookahead must be >= 1, got {lookahead}")
            if int(lookahead) > 1 and draft != FROZEN and draft not in self.drafts:
                raise SpeculationError(f"arm draft {draft!r} is neither {FROZEN!r} nor a key of drafts "
                                 f"({sorted(self.drafts)})")
        if self.policy.n_arms != len(self.arms):
            raise SpeculationError(f"policy has {self.policy.n_arms} arms, Speculation has {len(self.arms)}")
        self.reward_low, self.reward_high = reward_range(self.cost, self.arms)

    def reward(self, rows: float, cost: float) -> float:
        """The policy's reward for ``rows`` advanced at ``cost``: 1 + rows / cost − low, within [1, 1 + high − low]."""
        return 1.0 + min(max(rows / cost, self.reward_low), self.reward_high) - self.reward_low

    # -- summaries ------------------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        """Target rounds (sequential calls; a plain rollout makes ``rows``), batched window evaluations,
        rows per round (the speed-up in sequential target calls), mean reward, acceptance of drafted rows."""
        rounds = self.rounds
        checked = sum(c.checked for c in self.checks)
        cost = sum(r.cost for r in rounds)
        return {"target_rounds": len(rounds), "target_evaluations": sum(r.target_states for r in rounds),
                "draft_calls": sum(r.draft_calls for r in rounds), "rows": self.rows,
                "rows_per_round": self.rows / max(1, len(rounds)), "cost": cost,
                "rows_per_cost": self.rows / cost if cost else float("nan"),
                "sample_rows_per_round": sum(r.sample_rows for r in rounds) / max(1, len(rounds)),
                "mean_reward": sum(r.reward for r in rounds) / max(1, len(rounds)),
                "accepted_rows_per_round": sum(r.accepted for r in rounds) / max(1, len(rounds)),
                "acceptance": sum(c.accepted for c in self.checks) / checked if checked else float("nan"),
                "arm_counts": [sum(r.arm == i for r in rounds) for i in range(len(self.arms))]}

    def acceptance_by_level(self, width: int = 1) -> dict[int, float]:
        """Acceptance rate of drafted rows grouped by the noise level they start from, in bins of ``width``
        levels (key: the bin's lowest level)."""
        acc: dict[int, list[int]] = {}
        for c in self.checks:
            a = acc.setdefault(int(c.level) // width * width, [0, 0])
            a[0] += c.accepted
            a[1] += c.checked
        return {lv: a / n for lv, (a, n) in sorted(acc.items()) if n}


def tile_state(obj: Any, copies: int) -> Any:
    """A copy of a rollout state for a batch of ``copies`` stacked windows (L-major: copy l = rows l·B..).

    Tensors are repeated along their leading (batch-major) dim — (B, ...) and (B·N, ...) alike —, KV caches
    get new tiled buffers, banks tiled frames; ``batch_size`` is multiplied. The original is not touched.
    """
    if isinstance(obj, torch.Tensor):
        return obj.repeat(copies, *([1] * (obj.dim() - 1)))  # (copies·B, ...)
    if isinstance(obj, KVCache):
        new = KVCache(obj.policy, obj.tokens_per_frame, initial_capacity=max(1, obj.num_frames))
        kv = obj.keys_values()
        if kv is not None:
            new.append(tile_state(kv[0], copies), tile_state(kv[1], copies), obj.frame_ids)
        return new
    if isinstance(obj, MemoryBank):
        new = copy.copy(obj)
        new.positions = list(obj.positions)
        for name in ("frames", "actions", "poses"):
            value = getattr(obj, name)
            setattr(new, name, None if value is None else tile_state(value, copies))
        return new
    if isinstance(obj, (list, tuple)):
        return type(obj)(tile_state(o, copies) for o in obj)
    if isinstance(obj, dict):
        return {k: tile_state(v, copies) for k, v in obj.items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: (getattr(obj, f.name) * copies if f.name == "batch_size"
                            else tile_state(getattr(obj, f.name), copies)) for f in dataclasses.fields(obj)}
        return dataclasses.replace(obj, **changes)
    return obj


class SpeculativeRows:
    """The speculative :class:`arvdm.pipeline.rows.RowRunner` (see the module docstring):
    ``rollout(..., eta=1.0, rows=SpeculativeRows(spec))``; ``spec``'s ``rounds`` / ``checks`` / ``rows`` are
    filled in. One runner per rollout is the rule (``start`` resets everything but ``spec``).

    ``verify="batched"`` (the default) checks a round's L drafted rows in one target call on L·B stacked
    windows; ``"sequential"`` makes L calls of B windows instead: the same numbers up to the rounding of a
    batched call (bit for bit for a model whose arithmetic does not depend on the batch; tested), the
    reference the batched path is checked against and the baseline of its cost."""

    def __init__(self, spec: Speculation, verify: str = "batched"):
        if verify not in VERIFY_MODES:
            raise SpeculationError(f"verify must be one of {VERIFY_MODES}, got {verify!r}")
        self.spec, self.verify = spec, verify

    def start(self, rollout: RolloutContext) -> None:
        """Bind to one rollout: refuse eta = 0 and recorded steps, seed the accept tests, start draft states."""
        if rollout.eta <= 0:
            raise SpeculationError("speculative sampling needs eta > 0: with eta = 0 every transition is "
                                   "deterministic (sigma = 0), a drafted row is accepted only if it equals the "
                                   "target's bit for bit, so speculation cannot save a target call")
        if rollout.record is not None:
            raise SpeculationError("return_intermediate is not available with speculation: samples move through "
                                   "the rows at their own pace, there is no single model call per row to record")
        self.rollout, self.model, self.diffusion, self.eta = rollout, rollout.model, rollout.diffusion, rollout.eta
        self.batch = rollout.batch_size
        self.accept_generator = torch.Generator().manual_seed(self.spec.seed)
        self._tiled: dict[int, Any] = {}
        # Draft models other than the target keep their own cached state, committed in lockstep.
        self.draft_states = {name: (None if m is self.model else m.init_state(self.batch))
                             for name, m in self.spec.drafts.items()}
        self.v_newest: torch.Tensor | None = None  # newest target v-prediction (frozen draft)

    # -- memory ------------------------------------------------------------------------------------------------
    def commit(self, frames: torch.Tensor, actions: torch.Tensor) -> None:
        """Frames left the window: the tiled copies are stale; draft states get the frames too."""
        self._tiled.clear()
        for name, st in self.draft_states.items():
            if st is not None:
                self.spec.drafts[name].commit(st, frames, actions)

    def shift(self, delta: int) -> None:
        """The window moved by Δ: the frozen draft's v follows it (0 for the entering frames)."""
        if self.v_newest is not None:
            v = self.v_newest
            self.v_newest = torch.cat([v[:, delta:], torch.zeros_like(v[:, :delta])], dim=1)  # (B, w, ...)

    # -- calls -------------------------------------------------------------------------------------------------
    def _target(self, x: torch.Tensor, levels: torch.Tensor, acts: torch.Tensor, copies: int) -> torch.Tensor:
        """Target v for ``copies`` stacked windows (copies·B, w, ...) in one call."""
        if copies == 1:
            return self.rollout.predict(x, levels, acts)
        if self.rollout.bank is None:
            if copies not in self._tiled:
                self._tiled[copies] = tile_state(self.rollout.state, copies)
            return self.model(x, levels, acts, state=self._tiled[copies])
        mem = self.rollout.bank.memory()
        if mem is not None:
            mem = MemoryFrames(tile_state(mem.frames, copies), tile_state(mem.actions, copies), mem.positions,
                               None if mem.poses is None else tile_state(mem.poses, copies))
        return self.model(x, levels, acts, memory=mem)

    def _draft(self, name: str, y: torch.Tensor, levels: torch.Tensor, acts: torch.Tensor) -> torch.Tensor:
        if name == FROZEN:
            return self.v_newest if self.v_newest is not None else torch.zeros_like(y)
        draft = self.spec.drafts[name]
        if draft is self.model:
            return self._target(y, levels, acts, 1)
        return draft(y, levels, acts, state=self.draft_states[name])

    # -- rows --------------------------------------------------------------------------------------------------
    def run_rows(self, x: torch.Tensor, rows: torch.Tensor, win_actions: torch.Tensor, stage: str,
                 ar_step: int, frame_offset: int) -> torch.Tensor:
        """Take the window ``x`` (B, w, ...) from ``rows[0]`` to ``rows[-1]`` (``RowRunner.run_rows``).

        Every sample keeps its own row ``pos[b]`` (levels are per sample anyway): a sample whose draft is
        rejected early does not hold back the others. A sample that reached the last row stays there
        (level b = a: the transition returns it unchanged, σ = 0, always accepted) until all have.
        """
        n_rows = rows.shape[0] - 1
        self.spec.rows += n_rows
        pos = torch.zeros(self.batch, dtype=torch.long, device=rows.device)  # (B,) row of every sample
        while int(pos.min()) < n_rows:
            t0 = time.perf_counter()
            if isinstance(self.spec.policy, PerContext):  # context = noise-level bin of the round's start
                level = float(rows[int(pos.min())].double().mean())  # mean level of the slowest sample's row
                bins = len(self.spec.policy.policies)
                self.spec.policy.set_context(min(bins - 1, int(level * bins / (self.diffusion.num_levels + 1))))
            arm = self.spec.policy.select()
            lookahead, draft = self.spec.arms[arm]
            size = min(int(lookahead), n_rows - int(pos.min()))
            active = pos < n_rows  # (B,)
            start = pos.clone()
            if size == 1:
                x, pos = self._plain_row(x, rows, pos, win_actions), (pos + 1).clamp_max(n_rows)
                accepted, draft_calls = torch.zeros_like(pos), 0
            else:
                x, pos, accepted, draft_calls = self._round(x, rows, pos, size, draft, win_actions)
            advanced = float(pos.min() - start.min())  # what the batch advanced: its slowest sample's rows
            cost = self.spec.cost.round_cost(size, draft)
            reward = self.spec.reward(advanced, cost)
            self.spec.policy.update(arm, reward)
            self.spec.rounds.append(RoundRecord(stage, ar_step, int(start.min()), arm, int(lookahead), advanced,
                                                accepted[active].double().mean().item(),
                                                size * self.batch if size > 1 else self.batch, draft_calls,
                                                time.perf_counter() - t0, cost, reward,
                                                (pos - start)[active].double().mean().item(), *self._split))
        return x

    def _levels(self, rows: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, w) levels from row pos[b] to row pos[b] + 1 (a finished sample stays on the last row)."""
        last = rows.shape[0] - 1
        return rows[pos.clamp_max(last)], rows[(pos + 1).clamp_max(last)]

    def _plain_row(self, x, rows, pos, win_actions) -> torch.Tensor:
        """Exactly a plain rollout's row (same call, same noise)."""
        lv_from, lv_to = self._levels(rows, pos)
        t0 = time.perf_counter()
        v = self._target(x, lv_from, win_actions, 1)  # (B, w, ch, H, W)
        self._split = (0.0, time.perf_counter() - t0)  # (draft, verify) seconds
        z = self.rollout.noise(x.shape)
        self.v_newest = v
        return self.diffusion.step(x, v, lv_from, lv_to, self.eta, noise=z)

    def _round(self, x, rows, pos, size, draft, win_actions):
        b, n_rows = self.batch, rows.shape[0] - 1
        t0 = time.perf_counter()
        # 1. draft `size` rows from y_0 = x
        ys, means_q, sigmas_q, zs, levels = [x], [], [], [], []
        for i in range(size):
            lv_from, lv_to = self._levels(rows, pos + i)  # (B, w) each
            v_q = self._draft(draft, ys[i], lv_from, win_actions)
            mean_q, sigma_q = self.diffusion.transition(ys[i], v_q, lv_from, lv_to, self.eta)
            z = self.rollout.noise(x.shape)  # (B, w, ch, H, W), in a plain rollout's order
            ys.append(mean_q + sigma_q * z)  # exactly diffusion.step's arithmetic
            means_q.append(mean_q)
            sigmas_q.append(sigma_q)
            zs.append(z)
            levels.append((lv_from, lv_to))
        draft_calls = 0 if draft == FROZEN else size
        # 2. the target on the `size` states y_0..y_{size-1}: one batch of size·B windows (L-major), or size calls
        t1 = time.perf_counter()
        if self.verify == "batched":
            lv_all = torch.cat([lv for lv, _ in levels])  # (size·B, w)
            v_all = self._target(torch.cat(ys[:size]), lv_all, win_actions.repeat(size, 1), size)
            v_all = v_all.reshape(size, b, *x.shape[1:])  # (size, B, w, ch, H, W)
        else:
            v_all = torch.stack([self._target(ys[i], levels[i][0], win_actions, 1) for i in range(size)])
        self._split = (t1 - t0, time.perf_counter() - t1)  # (draft, verify) seconds
        # 3. verify in order; a sample stops at its first rejection (its reflection is exact)
        shape = (b,) + (1,) * (x.ndim - 1)
        alive = torch.ones(b, dtype=torch.bool, device=x.device)  # (B,) accepted every row so far
        out, advanced = ys[size].clone(), torch.full((b,), size, dtype=torch.long, device=x.device)
        for i in range(size):
            lv_from, lv_to = levels[i]
            mean_p, sigma_p = self.diffusion.transition(ys[i], v_all[i], lv_from, lv_to, self.eta)
            u = torch.rand(b, generator=self.accept_generator, dtype=torch.float64).to(x.device)  # (B,)
            y, ok = gaussian_accept_or_reflect(zs[i], means_q[i], mean_p, sigmas_q[i], sigma_p, u)
            checked = alive & (pos + i < n_rows)  # finished samples "stay": not a check
            moving = lv_to < lv_from  # (B, w)
            level = float(lv_from[moving].double().mean()) if moving.any() else 0.0
            self.spec.checks.append(RowCheck(int((pos + i).min()), level, int((ok & checked).sum()),
                                             int(checked.sum())))
            rejected = alive & ~ok  # (B,)
            out = torch.where(rejected.reshape(shape), y, out)
            advanced = torch.where(rejected, i + 1, advanced)
            alive &= ok
            if not bool(alive.any()):
                break
        # the frozen draft's next v: the target's at the state each sample's new position was drawn from
        self.v_newest = v_all[advanced - 1, torch.arange(b, device=x.device)]  # (B, w, ch, H, W)
        accepted = torch.where(advanced < size, advanced - 1, advanced)  # drafted rows kept per sample
        return out, (pos + advanced).clamp_max(n_rows), accepted, draft_calls


# -- building and reporting ----------------------------------------------------------------------------------

def make_speculation(mode: str, lookaheads: Sequence[int] = (1, 2, 3, 4),
                     drafts: dict[str, Any] | None = None, seed: int = 0, level_bins: int = 1,
                     cost: CostModel | None = None) -> Speculation:
    """A :class:`Speculation` from the CLI's words.

    Args:
        mode: ``"ucb"`` (UCBSpec) or ``"exp3"`` (EXP3Spec) over the arms, or ``"fixed:L"`` (one arm: lookahead L
            with the first draft).
        lookaheads: the bandits' lookaheads; L = 1 (no speculation) is always an arm of a bandit.
        drafts: draft name -> model, ``{FROZEN: None}`` for the frozen draft (the default). A bandit's arms are
            (1, no draft) and every (L > 1, draft).
        seed: seeds the accept tests' uniforms and EXP3's arm draws.
        level_bins: > 1 gives a bandit one independent copy per bin of the noise level a round starts from
            (the mean level of the window's row at the round's start; ``bandits.PerContext``): acceptance
            depends on the noise level, so the best lookahead does too.
        cost: prices the rounds for the reward (default ``CostModel()``, every window one target call).
    """
    cost = CostModel() if cost is None else cost
    drafts = {FROZEN: None} if not drafts else dict(drafts)
    for name, model in drafts.items():
        if (name == FROZEN) != (model is None):
            raise SpeculationError(f"draft {name!r}: the frozen draft takes no model, any other draft needs one")
    names = list(drafts)
    models = {name: m for name, m in drafts.items() if m is not None}
    if mode.startswith("fixed:"):
        try:
            lookahead = int(mode.split(":", 1)[1])
        except ValueError:
            lookahead = 0
        if lookahead < 1:
            raise SpeculationError(f"--speculate {mode!r}: expected fixed:L with an integer lookahead L >= 1")
        return Speculation([(lookahead, names[0] if lookahead > 1 else NO_DRAFT)], FixedArm(1, 0), models, seed, cost)
    if mode not in ("ucb", "exp3"):
        raise SpeculationError(f"--speculate {mode!r}: expected ucb, exp3 or fixed:L")
    ls = sorted({int(v) for v in lookaheads} | {1})
    if ls[0] < 1:
        raise SpeculationError(f"lookaheads must be >= 1, got {list(lookaheads)}")
    arms = [(1, NO_DRAFT)] + [(L, name) for name in names for L in ls if L > 1]
    low, high = reward_range(cost, arms)
    width = high - low if high > low else 1.0  # rewards lie in [1, 1 + width] (Speculation.reward)

    def make_policy(context: int) -> ArmPolicy:
        if mode == "ucb":
            return UCBSpec(len(arms), width)
        return EXP3Spec(len(arms), width, seed=seed + 1000 * context)

    policy = make_policy(0) if level_bins <= 1 else PerContext(make_policy, int(level_bins))
    return Speculation(arms, policy, models, seed, cost)


def speculation_report(spec: Speculation, seconds: float, frames: int, level_bin: int = 1) -> dict[str, Any]:
    """Everything a run prints and saves: summary, acceptance per noise level (bins of ``level_bin``
    levels), regret in rounds (``regret``: rows per round, the old reward) and in cost (``cost_regret``:
    target-equivalent calls, against the arm with the most rows per cost; the policy's objective), frames/s."""
    arms = [r.arm for r in spec.rounds]
    rewards = [r.rows for r in spec.rounds]
    report = spec.summary()
    report.update({
        "arms": [f"L={L} {d}" for L, d in spec.arms], "cost_model": spec.cost.to_dict(),
        "acceptance_by_level": {str(k): v for k, v in spec.acceptance_by_level(level_bin).items()},
        "regret": hindsight_regret(arms, rewards, len(spec.arms)) if rewards else None,
        "cost_regret": hindsight_cost_regret(arms, rewards, [r.cost for r in spec.rounds], len(spec.arms))
        if rewards else None,
        "seconds": seconds, "frames_per_second": frames / seconds if seconds > 0 else float("nan"),
        "arm_per_round": arms, "rows_per_round_trace": rewards,
        "accepted_per_round_trace": [r.accepted for r in spec.rounds]})
    return report


def plot_arms(runs: dict[str, Sequence[Speculation]], path: str | os.PathLike, title: str = "") -> Path:
    """Arms chosen over the rounds (top) and rows advanced per round (bottom); one column per policy, its
    rollouts one after another (dashed lines between them), since one policy learns across them."""
    # lazy: matplotlib is slow to import and only the reports draw
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5 * len(runs) + 1, 5), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, len(runs), sharex="col", squeeze=False)
    for col, (name, specs) in enumerate(runs.items()):
        ax_arm, ax_rows = axes[0, col], axes[1, col]
        arms = np.array([r.arm for spec in specs for r in spec.rounds])
        rows = np.array([r.rows for spec in specs for r in spec.rounds])
        ax_arm.plot(np.arange(len(arms)), arms, ".", ms=2)
        k = max(1, len(rows) // ARMS_PLOT_WINDOWS)  # running-mean width
        ax_rows.plot(np.arange(len(rows) - k + 1) + k // 2, np.convolve(rows, np.ones(k) / k, mode="valid"), lw=1)
        edge = 0
        for spec in specs[:-1]:
            edge += len(spec.rounds)
            for ax in (ax_arm, ax_rows):
                ax.axvline(edge, color="grey", ls="--", lw=0.7)
        if specs:
            ax_arm.set_yticks(range(len(specs[0].arms)), [f"L={L} {d}" for L, d in specs[0].arms], fontsize=7)
        ax_arm.set_title(name)
        ax_rows.set_ylabel(f"rows / round (mean of {k})")
        ax_rows.set_xlabel("round (one sequential target call); dashed: next rollout")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"))
    return path
