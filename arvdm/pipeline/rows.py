"""Row runners: how a rollout takes its window through the rows of a scheduling matrix.

    from arvdm.pipeline.rows import PlainRows, RolloutContext, RowRunner

:func:`arvdm.pipeline.rollout.rollout` owns the window, the memory and the schedule; per matrix (the
initialization stage's, then ``S`` once per AR step) it hands the window to a :class:`RowRunner`, which
returns it at the matrix's last row. :class:`PlainRows` (the default) makes one model call per row;
``arvdm.speculative.rows.SpeculativeRows`` drafts several rows and verifies them in one batched call. A
runner sees the rollout through a :class:`RolloutContext`: the model, the transitions, eta, the noise
source and the past frames.

Contract of a runner: every random number comes from ``RolloutContext.noise`` (the rollout's generator),
drawn in the order a plain rollout draws them, so that a rollout is reproducible from its seed; a runner
never commits frames itself (the rollout does, then tells it through :meth:`RowRunner.commit`).

Three error-accumulation levers live in the context, so every runner gets them through the same two methods:
``RolloutContext.commit`` re-noises the frames to the context level k_ctx (noisy context), and
``RolloutContext.predict`` applies history guidance ``v = v_mem + W (v_mem - v_nomem)`` (DFoT, Song et al.
2025), where ``v_nomem`` is the same window with no memory (W = 0 makes exactly one model call), then the
low-frequency anchor (:mod:`arvdm.pipeline.anchor`; none = v unchanged).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

from arvdm.model.diffusion import PerFrameDiffusion
from arvdm.pipeline.anchor import LowFrequencyAnchor
from arvdm.pipeline.rollout_model import RolloutModel
from memory import MemoryBank, PoseBank

__all__ = ["Generators", "RolloutStep", "RolloutContext", "RowRunner", "PlainRows"]


class RolloutStep(NamedTuple):
    """One denoising call of a rollout (returned with ``return_intermediate=True``).

    ``stage`` is ``"init"`` or ``"ar"``; ``ar_step`` counts AR steps (−1 in the init stage); ``row`` is
    the matrix row ``m`` the call starts from; ``frame_offset`` is the index (among generated frames) of the
    window's first frame; ``levels_from``/``levels_to`` are (w,) int64; ``x`` is the window after the
    call and ``x0`` the model's clean-frame prediction at the call, both (B, w, C, H, W).
    """

    stage: str
    ar_step: int
    row: int
    frame_offset: int
    levels_from: torch.Tensor
    levels_to: torch.Tensor
    x: torch.Tensor
    x0: torch.Tensor


Generators = torch.Generator | Sequence[torch.Generator] | None
"""A rollout's noise source: one generator for the whole batch, one per sample (a sample's noise then does not
depend on the batch it is rolled out in), or None (torch's global generator)."""


def _standard_normal(shape: tuple[int, ...], generator: Generators, device: torch.device,
                     dtype: torch.dtype) -> torch.Tensor:
    """Standard normal noise of ``shape`` (batch first) from ``generator`` (drawn on the generator's device, then
    moved); with one generator per sample, sample i's part comes from generator i."""
    if isinstance(generator, (list, tuple)):  # drawn where the generators live, moved once
        return torch.stack([torch.randn(shape[1:], generator=g, device=g.device, dtype=dtype)
                            for g in generator]).to(device)  # (B, *shape[1:])
    gdev = generator.device if generator is not None else device
    return torch.randn(shape, generator=generator, device=gdev, dtype=dtype).to(device)


@dataclass
class RolloutContext:
    """One rollout as its row runner sees it (built by ``rollout``, handed to :meth:`RowRunner.start`).

    Exactly one of ``state`` (``use_cache=True``: the model's KV caches + bank) and ``bank`` (``use_cache=False``:
    a bank under the model's retention policy, handed over in full at every call) is set. ``record`` is a
    list to append one :class:`RolloutStep` per model call to (``return_intermediate=True``), else None.
    ``context_level`` k_ctx: committed frames are re-noised to it (0 = clean, nothing drawn);
    ``history_guidance`` W: the guidance weight (0 = the memory-conditioned v alone); ``action_guidance`` W_a the
    same over the window's actions (0 = the action-conditioned v alone).
    """

    model: RolloutModel
    diffusion: PerFrameDiffusion
    eta: float
    generator: Generators
    batch_size: int
    device: torch.device
    dtype: torch.dtype
    state: Any = None
    bank: MemoryBank | PoseBank | None = None
    record: list[RolloutStep] | None = None
    window_poses: torch.Tensor | None = None  # (B, w, 3) poses of the window's frames (pose-aware models), else None
    context_level: int = 0
    history_guidance: float = 0.0
    action_guidance: float = 0.0
    candidates: int = 1  # N candidates per sample side by side (rollout(candidates=N)); the batch is B*N
    anchor: LowFrequencyAnchor | None = None  # rollout(anchor_sigma > 0): low frequencies held to the level-K x̂0

    def noise(self, shape: tuple[int, ...]) -> torch.Tensor:
        """The next standard normal draw of the rollout's generator(s), ``shape`` batch first."""
        return _standard_normal(shape, self.generator, self.device, self.dtype)

    def predict(self, x: torch.Tensor, levels: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """The model's v (B, w, C, H, W) for the window ``x`` at ``levels`` (B, w), given the whole past;
        with history guidance W != 0, ``v_mem + W (v_mem - v_nomem)`` (a second call, without memory); with action
        guidance W_a != 0, ``+ W_a (v - v_noact)`` (a call with the null action); with an anchor, that v moved so
        that the frames' x̂0 keep their anchor's low frequencies (arvdm.pipeline.anchor)."""
        past = ({"state": self.state} if self.bank is None
                else {"memory": self.bank.memory(self.window_poses)})  # cached, or recomputed
        v_cond = v = self.model(x, levels, actions, **past)  # (B, w, C, H, W)
        if self.history_guidance != 0:
            # the window alone: positions 0..w-1, the same relative positions (RoPE) as with memory
            v_nomem = self.model(x, levels, actions, memory=None)  # (B, w, C, H, W)
            v = v + self.history_guidance * (v_cond - v_nomem)
        if self.action_guidance != 0:  # the same past, the window's actions replaced by the null action
            dropped = torch.ones(actions.shape[0], dtype=torch.bool, device=actions.device)  # (B,)
            v = v + self.action_guidance * (v_cond - self.model(x, levels, actions, drop_actions=dropped, **past))
        return v if self.anchor is None else self.anchor.apply(x, v, levels)

    def commit(self, frames: torch.Tensor, actions: torch.Tensor, poses: torch.Tensor | None = None,
               target_poses: torch.Tensor | None = None, observed: bool = False) -> torch.Tensor:
        """Frames (B, n, C, H, W) that left the window, with their (B, n) actions, into the past; pose-aware models
        also take their poses (B, n, 3) and the next window's (B, w, 3), by which its memory is chosen.

        With a context level k_ctx > 0 the frames are first re-noised to k_ctx with fresh noise (drawn here, from
        the rollout's generator) and committed with their levels. ``observed``: the frames are the real context, not
        generated ones (model.copy_gate=observed gates only then). Returns the frames as committed.
        """
        levels, clean = None, frames
        if self.context_level > 0:
            b, n = actions.shape
            levels = torch.full((b, n), self.context_level, dtype=torch.long, device=frames.device)  # (B, n)
            frames = self.diffusion.add_noise(frames, self.noise(frames.shape), levels)  # (B, n, C, H, W) at k_ctx
        # a model without noisy context is called as before; with it, the clean frames go along (model.copy_gate)
        kw = {} if levels is None else {"levels": levels, "clean": clean}
        if observed and self.model.cfg.model.copy_gate == "observed":  # asked of the one model that reads it
            kw["observed"] = True
        if self.bank is not None:
            self.bank.append(frames, actions, poses, **kw)
        elif poses is None:
            self.model.commit(self.state, frames, actions, **kw)
        else:
            self.model.commit(self.state, frames, actions, poses, target_poses, **kw)
        return frames


class RowRunner(Protocol):
    """Takes a rollout's window through the rows of a scheduling matrix (see the module docstring)."""

    def start(self, rollout: RolloutContext) -> None:
        """Once per rollout, after its past is made and before the context frames are committed."""

    def run_rows(self, x: torch.Tensor, rows: torch.Tensor, win_actions: torch.Tensor, stage: str, ar_step: int,
                 frame_offset: int) -> torch.Tensor:
        """Take the window ``x`` (B, w, C, H, W) from the levels ``rows[0]`` to ``rows[-1]`` (``rows``:
        (R+1, w) int64) with the window's actions ``win_actions`` (B, w). ``stage`` (``"init"`` | ``"ar"``),
        ``ar_step`` (−1 in the init stage) and ``frame_offset`` (the window's first generated frame) say
        where the rollout is. Returns the window at ``rows[-1]``."""

    def commit(self, frames: torch.Tensor, actions: torch.Tensor) -> None:
        """The rollout committed ``frames`` (B, n, C, H, W) with ``actions`` (B, n) to its past."""

    def shift(self, delta: int) -> None:
        """The window moved by ``delta`` frames; ``delta`` pure-noise frames entered at its end."""


class PlainRows:
    """The default runner: one model call per row, ``x_{m+1} = diffusion.step(x_m, v, S[m], S[m+1], eta, z)``
    with ``z`` drawn after the call when eta > 0 (deterministic DDIM draws nothing)."""

    def start(self, rollout: RolloutContext) -> None:
        self.rollout = rollout

    def run_rows(self, x: torch.Tensor, rows: torch.Tensor, win_actions: torch.Tensor, stage: str, ar_step: int,
                 frame_offset: int) -> torch.Tensor:
        r = self.rollout
        rows_b = rows.unsqueeze(1).expand(-1, r.batch_size, -1)  # (R+1, B, w) views: every sample on the row
        for m in range(rows.shape[0] - 1):
            lv_from, lv_to = rows_b[m], rows_b[m + 1]  # (B, w) each
            v = r.predict(x, lv_from, win_actions)  # (B, w, ch, H, W)
            z = r.noise(x.shape) if r.eta > 0 else None
            x_new = r.diffusion.step(x, v, lv_from, lv_to, r.eta, noise=z)
            if r.record is not None:
                r.record.append(RolloutStep(stage, ar_step, m, frame_offset, rows[m].clone(), rows[m + 1].clone(),
                                            x_new.clone(), r.diffusion.pred_x0(x, v, lv_from)))
            x = x_new
        return x

    def commit(self, frames: torch.Tensor, actions: torch.Tensor) -> None:
        pass  # the past lives in the rollout's state / bank

    def shift(self, delta: int) -> None:
        pass  # nothing of the window is kept between rows
