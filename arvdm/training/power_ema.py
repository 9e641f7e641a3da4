"""Power-function EMAs of the weights during training and their snapshots (`train.ema_posthoc`, EDM2: Karras et
al. 2024, *Analyzing and Improving the Training Dynamics of Diffusion Models*, Sec. 3); after training
`arvdm.training.posthoc_ema` rebuilds an EMA of any length from the snapshots.

A power-function EMA of exponent γ averages the weights θ(τ) of steps τ ∈ [0, t] with the profile p(τ) ∝ τ^γ; its
length is given as σ_rel, the profile's standard deviation over t:

    σ_rel = (γ + 1)^½ (γ + 2)^-1 (γ + 3)^-½            (σ_rel 0.05 ↔ γ 16.97, 0.10 ↔ γ 6.94)

and one update after step t is θ̂ ← β θ̂ + (1 − β) θ with β = (1 − 1/t)^(γ+1). The trainer keeps one per
`train.ema_posthoc` value and writes each every `train.ema_posthoc_every` steps (and at the last step) to
``RUN/ema_snapshots/sigma_rel_S/step_N.safetensors`` (4 bytes per parameter each: 5.5 MB for `tiny`). The main
job's own EMA (`train.ema_decay`, warm-up c = 10) is close to γ = 8, σ_rel ≈ 0.09.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from arvdm.errors import ArvdmError
from arvdm.model.checkpoint import CheckpointError, atomic_write, load_weights, state_dict_for_safetensors
from arvdm.training.objective import EMA
from arvdm.training.sharding import ShardedEMA

SNAPSHOT_DIRNAME = "ema_snapshots"
SIGMA_REL_MAX = 0.28  # σ_rel(γ = 0) = 0.2887, the flat profile; longer ones need γ < 0, a profile peaked at step 0


def sigma_rel_of(gamma: float) -> float:
    """σ_rel of the power profile τ^γ on [0, t] (its standard deviation over t)."""
    return math.sqrt(gamma + 1) / ((gamma + 2) * math.sqrt(gamma + 3))


def gamma_of(sigma_rel: float) -> float:
    """The exponent γ ≥ 0 whose profile has this σ_rel (σ_rel falls monotonically on γ ≥ 0): bisection."""
    if not (isinstance(sigma_rel, (int, float)) and 0 < sigma_rel <= SIGMA_REL_MAX):
        raise ArvdmError(f"sigma_rel {sigma_rel!r} must be a number in (0, {SIGMA_REL_MAX}]")
    lo, hi = 0.0, 1e9
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if sigma_rel_of(mid) > sigma_rel else (lo, mid)
    return 0.5 * (lo + hi)


class PowerEMA(EMA):
    """EDM2's power-function EMA of exponent γ (from `sigma_rel`): β(t) = (1 − 1/t)^(γ+1) after step t."""

    def __init__(self, model: torch.nn.Module, sigma_rel: float):
        super().__init__(model, decay=0.0)
        self.gamma = gamma_of(sigma_rel)

    def decay_at(self, step: int) -> float:
        return (1.0 - 1.0 / step) ** (self.gamma + 1)


class PostHocEMA:
    """The running power EMAs of one training run and their snapshots (train.ema_posthoc, _every); with no σ_rel
    given every method does nothing, so the trainer calls them unconditionally."""

    def __init__(self, model: torch.nn.Module, sigma_rels: list[float], every: int):
        self.emas: list[EMA] = [PowerEMA(model, s) for s in sigma_rels]  # ShardedEMAs once `shard` has run
        self.sigma_rels, self.every = [float(s) for s in sigma_rels], every

    def update(self, model: torch.nn.Module, step: int) -> None:
        for ema in self.emas:
            ema.update(model, step)

    def shard(self, sharded: torch.nn.Module) -> None:
        """train.fsdp: each power EMA sharded like the model (`ShardedEMA`, which keeps this EMA's β(t))."""
        self.emas = [ShardedEMA(e, sharded) for e in self.emas]

    def due(self, step: int, last: bool) -> bool:
        return bool(self.emas) and (step % self.every == 0 or last)

    def save(self, run_dir: str | Path, step: int, is_main: bool) -> None:
        """Write every power EMA at `step` (every rank calls: a read is a collective under FSDP; rank 0 writes,
        each file atomically)."""
        for ema, sigma_rel in zip(self.emas, self.sigma_rels):
            with ema.read() as model:
                if is_main:
                    path = snapshot_path(run_dir, sigma_rel, step)
                    path.parent.mkdir(parents=True, exist_ok=True)
                    meta = {"sigma_rel": repr(sigma_rel), "gamma": repr(gamma_of(sigma_rel)), "step": str(step)}
                    weights = state_dict_for_safetensors(model)
                    atomic_write(path, lambda p, w=weights, m=meta: save_file(w, str(p), metadata=m))

    def load(self, run_dir: str | Path, step: int) -> None:
        """A resume: each power EMA from its snapshot at the checkpoint's step (before any sharding)."""
        for ema, sigma_rel in zip(self.emas, self.sigma_rels):
            path = snapshot_path(run_dir, sigma_rel, step)
            if not path.is_file():
                raise CheckpointError(f"{path} is missing: resuming with train.ema_posthoc needs each power EMA's "
                                      f"snapshot at the checkpoint's step {step}")
            load_weights(ema.model, path, what="power-EMA snapshot")


def snapshot_path(run_dir: str | Path, sigma_rel: float, step: int) -> Path:
    return Path(run_dir) / SNAPSHOT_DIRNAME / f"sigma_rel_{sigma_rel:.4f}" / f"step_{step:07d}.safetensors"
