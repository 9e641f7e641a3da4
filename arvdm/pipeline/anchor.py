"""The low-frequency anchor: a sampler lever against error accumulation on views the model must invent (issue 21).

    from arvdm.pipeline.anchor import LowFrequencyAnchor, gaussian_lowpass
    frames = rollout(..., anchor_sigma=1.0)                        # sample.py --anchor-sigma 1
    frames = rollout(..., anchor_sigma=1.0, anchor_floor=300)      # ... --anchor-floor 300: pull above level 300 only

At the top level K a frame's clean-frame prediction x̂0 = E[x0 | past] is the model's conditional mean: blurred
where the future is uncertain, but the best guess under squared error. A sample drawn from there commits to one
layout and pays the spread of the model's distribution in PSNR; most of that spread is in the low frequencies
(which wall where), most of what makes a frame look sharp in the high ones. The anchor keeps each frame's low
frequencies at that first prediction's and lets the sampler draw the rest: at every denoising call of a frame
that started at level K,

    x̂0' = x̂0 + G_σ * (a − x̂0),   a = x̂0 at level K,   G_σ a Gaussian blur of σ pixels,

and the call's v is replaced by the one that predicts x̂0' from the same x_t. With x_t = √ᾱ x0 + √(1−ᾱ) ε and
x̂0 = √ᾱ x_t − √(1−ᾱ) v (Salimans & Ho 2022, App. D) that is v' = v − (x̂0' − x̂0) / √(1−ᾱ). With ``floor`` 0
the frame ends at level 0 with x0 = x̂0' of its last call: the anchor's low frequencies, the sample's high ones.
With a ``floor`` L > 0 only the calls that start above level L pull; below it the sampler draws the frame's last
details freely (sharper frames, first frames unharmed; benchmarks/RESULTS.md). No model call is added; σ = 0 is
the plain sampler, exactly. This is a hedge, not a sample of the model's distribution: the layout of an invented
view is the conditional mean's (benchmarks/RESULTS.md, "the low-frequency anchor").

A frame that never sat at level K (a schedule file whose windows start lower) is not anchored. The anchor is kept
per window position and moves with the window (:meth:`LowFrequencyAnchor.shift`), so FIFO and pyramid schedules,
whose frames enter at K at different rows, anchor every frame to its own first prediction.

A run's own anchor is its ``diffusion.anchor_sigma`` / ``anchor_floor`` (the tiny preset: 1 px above level 100),
which ``rollout`` uses when given None; the experiments' CLIs take sample.py's flags through
:func:`add_anchor_flags` and :func:`use_anchor`.

The anchor is only as good as the level-K prediction, and that prediction is where training seeds differ most
(benchmarks/RESULTS.md: one seed of the main job lags the others by 0.6 dB over frames 17–64 at equal sharpness).
:class:`AnchorEnsemble` (``sample.py --anchor-runs RUN,...``) averages the level-K v of several runs of the same
configuration, so the anchor is their mean's, while the sampled run alone draws every later call::

    model = with_anchor_runs(model, ("runs/seed1", "runs/seed2"), sigma=1.0)   # AnchorEnsemble of the three
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from arvdm.errors import USER_ERRORS, SamplingError
from arvdm.model.diffusion import PerFrameDiffusion
from arvdm.pipeline.runs import load_for_inference, member_folders
from arvdm.setting_checks import parse_anchor_runs

__all__ = ["AnchorEnsemble", "LowFrequencyAnchor", "add_anchor_flags", "gaussian_lowpass", "use_anchor",
           "with_anchor_runs"]

# what the members of an AnchorEnsemble must share with the sampled run (the rest, e.g. train.seed, may differ)
SHARED_SECTIONS = ("model", "memory")
SHARED_DIFFUSION = ("num_levels", "beta_schedule", "prediction_type")


def add_anchor_flags(parser: argparse.ArgumentParser) -> None:
    """sample.py's ``--anchor-sigma S`` / ``--anchor-floor L`` / ``--anchor-runs RUN,RUN`` on another CLI (default:
    the run's anchor, from the run alone)."""
    parser.add_argument("--anchor-sigma", type=float, default=None, metavar="S",
                        help="the rollouts' low-frequency anchor, as sample.py's (default: the run's "
                             "diffusion.anchor_sigma; 0 = the plain sampler)")
    parser.add_argument("--anchor-floor", type=int, default=None, metavar="L",
                        help="its floor level, as sample.py's (default: the run's diffusion.anchor_floor)")
    parser.add_argument("--anchor-runs", type=parse_anchor_runs, default=(), metavar="RUN,RUN",
                        help="other runs of the same config whose level-K predictions are averaged into the anchor, "
                             "as sample.py's (default: none)")


def use_anchor(cfg: Any, sigma: float | None, floor: int | None) -> dict[str, Any]:
    """Make ``sigma`` / ``floor`` (None = keep the run's) the anchor of the run's config ``cfg`` (checked, errors
    naming sample.py's flags), so every ``rollout`` built on ``cfg.diffusion`` uses it; returns it to record."""
    d = cfg.diffusion
    d.anchor_sigma, d.anchor_floor = d.anchor(sigma, floor, ("--anchor-sigma", "--anchor-floor"))
    return {"anchor_sigma": d.anchor_sigma, "anchor_floor": d.anchor_floor}


def with_anchor_runs(model: nn.Module, runs: tuple[str, ...], sigma: float, *, use_ema: bool = True,
                     device: str | torch.device = "cpu", flag: str = "--anchor-runs",
                     run: str | os.PathLike | None = None) -> nn.Module:
    """``model`` with its anchor averaged over the denoisers of ``runs`` and, given the sampled ``run``'s folder, of
    its other members (a run trained as ``train.members`` > 1; ``member_folders``) (:class:`AnchorEnsemble`;
    ``model`` itself when there are none). ``sigma`` is the anchor the rollouts use: 0 is refused for ``runs``, as
    there is no anchor to average; a run's members are then left out (the plain sampler draws from member 0 alone).
    Errors (a missing checkpoint, another configuration) name ``flag`` and the run."""
    members = member_folders(run, model.cfg) if run is not None and sigma > 0 else ()
    if runs and not sigma > 0:
        raise SamplingError(f"{flag} {','.join(map(str, runs))} needs an anchor (--anchor-sigma > 0, the run's by "
                            "default): the runs' mean only sets the anchor")
    runs = (*members, *runs)
    if not runs:
        return model
    others = []
    for other in runs:  # not `run`, the sampled run's folder
        try:
            others.append(load_for_inference(other, use_ema=use_ema, device=device)[0])
        except USER_ERRORS as err:
            raise SamplingError(f"{flag} {other}: {err}") from err
    return AnchorEnsemble(model, others, names=[str(r) for r in runs], flag=flag)


def gaussian_lowpass(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """``x`` (..., H, W) blurred by a normalized Gaussian of ``sigma`` pixels (radius ⌈3σ⌉, edges replicated), as two
    separable 1-D convolutions; a constant image is returned unchanged."""
    r = max(1, math.ceil(3 * sigma))
    t = torch.arange(-r, r + 1, device=x.device, dtype=x.dtype)
    k = torch.exp(-t.square() / (2 * sigma * sigma))
    k = k / k.sum()  # (2r+1,)
    shape = x.shape
    y = x.reshape(-1, 1, shape[-2], shape[-1])  # (N, 1, H, W)
    y = F.conv2d(F.pad(y, (r, r, 0, 0), mode="replicate"), k.view(1, 1, 1, -1))  # along W
    y = F.conv2d(F.pad(y, (0, 0, r, r), mode="replicate"), k.view(1, 1, -1, 1))  # along H
    return y.reshape(shape)


class LowFrequencyAnchor:
    """Per window position, the level-K prediction a frame's low frequencies are held to (module docstring), by
    every denoising call that starts above level ``floor``.

    ``apply`` is called once per denoising call with the window, the call's v and levels; ``shift`` when Δ frames
    leave the window; ``select`` when the rollout keeps some samples' windows (candidates per AR step)."""

    def __init__(self, diffusion: PerFrameDiffusion, sigma: float, floor: int = 0):
        self.diffusion = diffusion
        self.sigma = float(sigma)
        self.floor = int(floor)  # calls from a level <= floor are not pulled (0: every call below K is)
        self.anchor: torch.Tensor | None = None  # (B, w, C, H, W) each position's level-K x̂0
        self.held: torch.Tensor | None = None  # (B, w) bool: the position's frame has an anchor

    def apply(self, x: torch.Tensor, v: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
        """The call's v (B, w, C, H, W) for window ``x`` at ``levels`` (B, w), with every anchored frame's x̂0
        low frequencies moved to its anchor's."""
        d = self.diffusion
        x0 = d.pred_x0(x, v, levels)  # (B, w, C, H, W)
        top = levels == d.num_levels  # (B, w): frames whose x̂0 is the conditional mean
        if self.anchor is None:
            self.anchor, self.held = x0.detach().clone(), top.clone()
        else:
            self.anchor = torch.where(top[..., None, None, None], x0.detach(), self.anchor)
            self.held = self.held | top
        pull = self.held & ~top & (levels > self.floor)  # (B, w): at level K the anchor is x̂0 itself
        # computed for every frame and masked: no host read of `pull` (a device sync per call on a GPU)
        moved = gaussian_lowpass(self.anchor - x0, self.sigma) * pull[..., None, None, None]  # x̂0' − x̂0
        noise_std = (1 - d.alpha_bar(levels)).sqrt().to(v.dtype)[..., None, None, None]  # √(1−ᾱ), > 0 below K
        return v - moved / noise_std.clamp(min=1e-6)

    def shift(self, delta: int) -> None:
        """Δ frames left the window: positions move up by Δ, the Δ entering ones have no anchor yet."""
        if self.anchor is None:
            return
        self.anchor = torch.cat([self.anchor[:, delta:], torch.zeros_like(self.anchor[:, :delta])], dim=1)
        self.held = torch.cat([self.held[:, delta:], torch.zeros_like(self.held[:, :delta])], dim=1)

    def select(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` (B,) of the batch, as the rollout did with its windows."""
        if self.anchor is not None:
            self.anchor, self.held = self.anchor[index], self.held[index]


class AnchorEnsemble(nn.Module):
    """A rollout model (:class:`arvdm.pipeline.rollout_model.RolloutModel`) made of the sampled run's denoiser and
    the denoisers of other runs of the same configuration (e.g. other training seeds; ``sample.py --anchor-runs``).

    For a frame at level K, the one call where its x̂0 is a conditional mean and becomes its anchor, v is the mean
    of every member's v (so x̂0 = √ᾱ x − √(1−ᾱ) v̄ is the members' mean prediction); every other frame's v is the
    first member's alone. So with the anchor on, a frame's low frequencies are the ensemble's conditional mean and
    its details the sampled run's samples. Each member keeps its own KV caches and memory bank (``state`` is one
    per member) and is committed the same frames. The extra cost is one call per member in each call that has a
    frame at level K (1 in ``--steps`` calls on the chunked schedule) and their commits. Without an anchor only
    the first step from K changes; the sampler refuses that (``--anchor-runs`` needs ``--anchor-sigma > 0``).
    """

    def __init__(self, model: nn.Module, others: list[nn.Module], names: list[str] | None = None,
                 flag: str = "--anchor-runs"):
        super().__init__()
        if not others:
            raise SamplingError(f"{flag}: give at least one other run")
        names = names or [f"member {i + 1}" for i in range(len(others))]
        mine = model.cfg.to_dict()
        for name, other in zip(names, others):
            theirs = other.cfg.to_dict()
            for section in SHARED_SECTIONS:
                _check_same(mine[section], theirs[section], section, name, flag)
            _check_same({k: mine["diffusion"][k] for k in SHARED_DIFFUSION},
                        {k: theirs["diffusion"][k] for k in SHARED_DIFFUSION}, "diffusion", name, flag)
        self.members = nn.ModuleList([model, *others])
        self.cfg = model.cfg
        self.frames_per_chunk = model.frames_per_chunk
        self.num_levels = model.cfg.diffusion.num_levels

    def check_schedule(self, delta: int, window: int) -> None:
        for m in self.members:
            m.check_schedule(delta, window)

    def init_state(self, batch_size: int, *args: Any, **kwargs: Any) -> list[Any]:
        return [m.init_state(batch_size, *args, **kwargs) for m in self.members]

    def commit(self, state: list[Any], *args: Any, **kwargs: Any) -> None:
        for m, s in zip(self.members, state):
            m.commit(s, *args, **kwargs)

    def forward(self, x: torch.Tensor, levels: torch.Tensor, actions: torch.Tensor, *, memory: Any = None,
                state: list[Any] | None = None, **kwargs: Any) -> torch.Tensor:
        states = state if state is not None else [None] * len(self.members)
        v = self.members[0](x, levels, actions, memory=memory, state=states[0], **kwargs)  # (B, w, C, H, W)
        top = levels == self.num_levels  # (B, w): frames whose x̂0 is their anchor
        # a host read per call (a sync on a GPU), which saves the other members' calls in the calls without a
        # frame at K: 19 of 20 on the chunked schedule
        if not bool(top.any()):
            return v
        total = v.clone()
        for m, s in zip(self.members[1:], states[1:]):
            total += m(x, levels, actions, memory=memory, state=s, **kwargs)
        return torch.where(top[..., None, None, None], total / len(self.members), v)


def _check_same(mine: dict[str, Any], theirs: dict[str, Any], section: str, name: str, flag: str) -> None:
    """Refuse a member whose ``section`` settings differ from the sampled run's, naming the first key that does."""
    for key in sorted(set(mine) | set(theirs)):
        if mine.get(key) != theirs.get(key):
            raise SamplingError(f"{flag} {name}: {section}.{key} is {theirs.get(key)!r} but the sampled run's is "
                                f"{mine.get(key)!r}; the anchor's runs must share the sampled run's model, memory "
                                f"and diffusion settings (other training seeds of the same config)")
