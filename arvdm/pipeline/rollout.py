"""Auto-regressive rollout: a Meta-ARVDM schedule drives a sliding window over a long video.

    from arvdm.pipeline.rollout import rollout
    video = rollout(model, diffusion, get_schedule("fifo", w, K, steps=16), context, context_actions,
                    actions, n_frames=300, generator=torch.Generator().manual_seed(0))   # (B, 300, C, H, W)

The loop (Meta-ARVDM, arXiv 2503.10704, Alg. 1):

1. the context frames are committed to the model's memory (bank + per-layer KV caches);
2. the window of ``w`` frames starts as pure noise (level K);
3. initialization stage: the rows of ``schedule.init_matrix()`` take it to ``t^I`` (one model call per row
   transition, then ``diffusion.step`` per frame from row ``s`` to row ``s + 1``);
4. AR step: the rows of ``S`` take it from ``t^I`` to ``t^O`` (M calls); the first Δ frames are now clean:
   they are emitted and committed to memory, the window shifts by Δ and Δ pure-noise frames enter at the end
   (circularity + the 0–T boundary make the window's levels ``t^I`` again);
5. repeat 4 until ``n_frames`` frames are out (frames past ``n_frames`` are generated with the last action
   repeated and discarded).

``use_cache=False`` is the Diffusion Forcing reference behaviour: no KV cache; at every denoising call the
model re-encodes the remembered past frames, passed as ``memory=MemoryFrames(...)``. Which past frames are
remembered is decided by the same retention policy (``memory.RetentionPolicy`` from ``cfg.memory``) that
the model's own cache uses, through the same ``memory.MemoryBank`` — so the two paths see the same past.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from tqdm.auto import tqdm

from arvdm.model.diffusion import PerFrameDiffusion
from arvdm.schedules.matrix import ARSchedule
from arvdm.speculative.rows import Speculation, SpeculativeRows
from memory import MemoryBank, RetentionPolicy

__all__ = ["RolloutStep", "rollout"]


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


@torch.no_grad()
def rollout(model: Any, diffusion: PerFrameDiffusion, schedule: ARSchedule, context: torch.Tensor,
            context_actions: torch.Tensor, actions: torch.Tensor, n_frames: int, *, eta: float = 0.0,
            generator: torch.Generator | None = None, use_cache: bool = True, progress: bool = True,
            return_intermediate: bool = False, speculation: Speculation | None = None
            ) -> torch.Tensor | tuple[torch.Tensor, list[RolloutStep]]:
    """Generate ``n_frames`` frames after ``context`` with a Meta-ARVDM schedule.

    Args:
        model: a denoiser with ``init_state``, ``commit``, ``check_schedule`` and
            ``model(x, levels, actions, state=... | memory=...) -> v`` (see docs/INTERFACES.md). Put it in
            eval mode first.
        diffusion: the per-frame transitions (its K must be the schedule's).
        schedule: Δ, w, S and the initialization stage.
        context: (B, C, ch, H, W) clean frames in [-1, 1] to condition on; C may be 0. C must be a multiple
            of the model's ``frames_per_chunk``.
        context_actions: (B, C) int64 actions of the context frames.
        actions: (B, >= n_frames) int64 actions of the frames to generate (only the first ``n_frames`` are
            used; the frames generated past the end get the last one repeated and are discarded).
        n_frames: how many new frames to return.
        eta: 0 = DDIM (deterministic given the initial noise), 1 = DDPM-like.
        generator: the source of all noise (initial window, entering frames, eta > 0 steps), drawn in a
            fixed order, so a rollout is reproducible from the generator's seed.
        use_cache: True = the model's KV cache (``state``); False = recompute the memory at every call.
        progress: a tqdm bar over frames.
        return_intermediate: also return one :class:`RolloutStep` per model call (not with ``speculation``:
            there samples move through the rows at their own pace).
        speculation: run the denoising rows speculatively (exact; needs eta > 0): see
            :mod:`arvdm.speculative.rows`. Its ``rounds`` / ``checks`` are filled in. None = plain rows.

    Returns:
        (B, n_frames, ch, H, W) generated frames, or ``(frames, steps)`` with ``return_intermediate``.
    """
    b, n_ctx = _check_inputs(context, context_actions, actions, n_frames)
    if schedule.num_levels != diffusion.num_levels:
        raise ValueError(f"schedule {schedule.name!r} has K={schedule.num_levels} levels but the diffusion has "
                         f"num_levels={diffusion.num_levels}")
    if hasattr(model, "check_schedule"):
        model.check_schedule(schedule.delta, schedule.window)
    _check_action_range(model, context_actions, actions[:, :n_frames])  # once per rollout, not per call
    chunk = _frames_per_chunk(model)
    if n_ctx % chunk:
        raise ValueError(f"context has {n_ctx} frames; the model commits whole chunks, so it must be a multiple "
                         f"of model.frames_per_chunk={chunk}")

    device, dtype = context.device, context.dtype
    w, delta = schedule.window, schedule.delta
    n_steps = schedule.num_ar_steps(n_frames)
    # Actions of every frame that will ever enter the window: the given ones, then the last one repeated.
    total = n_steps * delta + w - delta
    acts = actions[:, :n_frames].to(device=device, dtype=torch.long)  # (B, n_frames)
    acts = torch.cat([acts, acts[:, -1:].expand(b, max(0, total - n_frames))], dim=1)  # (B, total)

    # Past frames: the model's own state (KV caches + bank), or a bank we keep ourselves under the same
    # retention policy and hand over in full at every call (the recomputing reference).
    if use_cache:
        state = model.init_state(b)

        def commit(frames: torch.Tensor, frame_actions: torch.Tensor) -> None:
            model.commit(state, frames, frame_actions)

        def call(x: torch.Tensor, levels: torch.Tensor, win_actions: torch.Tensor) -> torch.Tensor:
            return model(x, levels, win_actions, state=state)
    else:
        bank = MemoryBank(RetentionPolicy.from_config(_model_config(model).memory))
        commit = bank.append

        def call(x: torch.Tensor, levels: torch.Tensor, win_actions: torch.Tensor) -> torch.Tensor:
            return model(x, levels, win_actions, memory=bank.memory())  # the whole past, recomputed
    spec_rows = None
    if speculation is not None:  # its own functions; the plain path below stays as it is
        if return_intermediate:
            raise ValueError("return_intermediate is not available with speculation: samples move through the "
                             "rows at their own pace, there is no single model call per row to record")
        spec_rows = SpeculativeRows(speculation, model, diffusion, eta, generator, b,
                                    lambda shape: _randn(shape, generator, device, dtype),
                                    state=state if use_cache else None, bank=None if use_cache else bank)
        plain_commit = commit

        def commit(frames: torch.Tensor, frame_actions: torch.Tensor) -> None:
            plain_commit(frames, frame_actions)
            spec_rows.commit(frames, frame_actions)
    if n_ctx:
        commit(context, context_actions.to(device=device, dtype=torch.long))

    shape = context.shape[2:]  # (ch, H, W)
    S = torch.tensor(schedule.matrix, device=device)  # (M+1, w) (a copy: the schedule's array is read-only)
    init = torch.tensor(schedule.init_matrix(), device=device)  # (M_init+1, w)
    record: list[RolloutStep] = []
    x = _randn((b, w, *shape), generator, device, dtype)  # the window starts at level K: pure noise

    # Per-call levels as (B, w) views of one (rows, B, w) tensor per matrix: built once, not once per call.
    S_b = S.unsqueeze(1).expand(-1, b, -1)  # (M+1, B, w)
    init_b = init.unsqueeze(1).expand(-1, b, -1)  # (M_init+1, B, w)

    def run_rows(rows: torch.Tensor, rows_b: torch.Tensor, stage: str, ar_step: int, offset: int) -> torch.Tensor:
        nonlocal x
        win_actions = acts[:, offset:offset + w]  # (B, w)
        for m in range(rows.shape[0] - 1):
            lv_from, lv_to = rows_b[m], rows_b[m + 1]  # (B, w) each
            v = call(x, lv_from, win_actions)  # (B, w, ch, H, W)
            z = _randn(x.shape, generator, device, dtype) if eta > 0 else None
            x_new = diffusion.step(x, v, lv_from, lv_to, eta, noise=z)
            if return_intermediate:
                record.append(RolloutStep(stage, ar_step, m, offset, rows[m].clone(), rows[m + 1].clone(),
                                          x_new.clone(), diffusion.pred_x0(x, v, lv_from)))
            x = x_new
        return x

    if spec_rows is not None:
        def run_rows_speculative(rows: torch.Tensor, rows_b: torch.Tensor, stage: str, ar_step: int,
                                 offset: int) -> torch.Tensor:
            nonlocal x
            x = spec_rows.run_rows(x, rows, acts[:, offset:offset + w], stage, ar_step)
            return x

        run_rows = run_rows_speculative

    out: list[torch.Tensor] = []
    bar = tqdm(total=n_frames, unit="frame", desc=f"rollout ({schedule.name})", disable=not progress,
               leave=False)
    try:
        run_rows(init, init_b, "init", -1, 0)
        emitted = 0
        for a in range(n_steps):
            offset = a * delta
            run_rows(S, S_b, "ar", a, offset)
            done = x[:, :delta]  # (B, Δ, ...): level 0 by the 0-T boundary t^O[0:Δ] = 0
            out.append(done)
            bar.update(min(delta, n_frames - emitted))
            emitted += delta
            if emitted >= n_frames:
                break  # nothing will look at these frames again: skip the commit
            commit(done, acts[:, offset:offset + delta])
            # Shift: the window keeps t^O[Δ:] = t^I[:w-Δ] (circularity); Δ new frames enter at level K.
            x = torch.cat([x[:, delta:], _randn((b, delta, *shape), generator, device, dtype)], dim=1)
            if spec_rows is not None:
                spec_rows.shift(delta)
    finally:
        bar.close()
    video = torch.cat(out, dim=1)[:, :n_frames]  # (B, n_frames, ch, H, W)
    return (video, record) if return_intermediate else video


def _check_inputs(context: torch.Tensor, context_actions: torch.Tensor, actions: torch.Tensor,
                  n_frames: int) -> tuple[int, int]:
    if context.dim() != 5:
        raise ValueError(f"context must be (B, C, ch, H, W) (C may be 0), got shape {tuple(context.shape)}")
    b, n_ctx = context.shape[:2]
    if tuple(context_actions.shape) != (b, n_ctx):
        raise ValueError(f"context_actions must be (B, C) = {(b, n_ctx)}, got {tuple(context_actions.shape)}")
    if int(n_frames) < 1:
        raise ValueError(f"n_frames must be >= 1, got {n_frames}")
    if actions.dim() != 2 or actions.shape[0] != b or actions.shape[1] < n_frames:
        raise ValueError(f"actions must be (B, >= n_frames) = ({b}, >= {n_frames}), got {tuple(actions.shape)}")
    if actions.dtype.is_floating_point or context_actions.dtype.is_floating_point:
        raise TypeError("actions must be integer tensors")
    return b, n_ctx


def _check_action_range(model: Any, *action_tensors: torch.Tensor) -> None:
    """Actions in 0..num_actions-1 of the model's config: a value check, so it runs here at the API boundary
    (one host read per rollout) and not inside the model's per-call forward."""
    cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
    n_actions = getattr(getattr(cfg, "model", None), "num_actions", None)
    if not isinstance(n_actions, int):
        return
    for name, a in zip(("context_actions", "actions"), action_tensors):
        if a.numel() and (int(a.min()) < 0 or int(a.max()) >= n_actions):
            raise ValueError(f"{name} must be in 0..{n_actions - 1} (model.num_actions={n_actions}), got "
                             f"{int(a.min())}..{int(a.max())}")


def _model_config(model: Any) -> Any:
    """The run Config a model was built from (``Denoiser.cfg``; ``.config`` accepted too)."""
    cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "memory"):
        raise TypeError(f"{type(model).__name__} has no run config (.cfg with .memory): the uncached rollout "
                        "needs its memory retention policy")
    return cfg


def _frames_per_chunk(model: Any) -> int:
    if hasattr(model, "frames_per_chunk"):
        return int(model.frames_per_chunk)
    cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
    return int(getattr(getattr(cfg, "model", None), "frames_per_chunk", 1) or 1)


def _randn(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device,
           dtype: torch.dtype) -> torch.Tensor:
    """Standard normal noise from ``generator`` (drawn on the generator's device, then moved)."""
    gdev = generator.device if generator is not None else device
    return torch.randn(shape, generator=generator, device=gdev, dtype=dtype).to(device)
