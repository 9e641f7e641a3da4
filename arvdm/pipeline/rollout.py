"""Auto-regressive rollout: a Meta-ARVDM schedule drives a sliding window over a long video.

    from arvdm.pipeline.rollout import rollout
    video = rollout(model, diffusion, get_schedule("fifo", w, K, steps=16), context, context_actions,
                    actions, n_frames=300, generator=torch.Generator().manual_seed(0))   # (B, 300, C, H, W)

Without ``eta=`` the transitions use the diffusion's own ``diffusion.cfg.eta`` (the run's sampling eta).

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

Error-accumulation levers (docs/sampling.md): ``context_level`` k_ctx (the schedule's by default) commits the
finished frames, and the context, re-noised to level k_ctx and tells the model so (noisy context, GameNGen
2024 / Diffusion Forcing 2024); ``history_guidance`` W guides each row's v towards the memory (DFoT 2025),
``action_guidance`` W_a towards the actions (classifier-free guidance over the actions, Ho & Salimans 2022).
k_ctx = 0 and W = W_a = 0 are exactly the plain rollout (nothing extra drawn, one model call per row).
``candidates`` N > 1 rolls N candidates of every sample side by side and, at every AR step, keeps the one whose
finished frames are closest (summed squared distance) to the others' — the minimum-Bayes-risk choice under a
squared-error loss (Kumar & Byrne 2004) — copies its window to all N, and commits it: one sharp rollout that
pays less of a sample's own spread, for N times the compute. N = 1 is exactly the plain rollout.
``anchor_sigma`` σ > 0 holds every frame's low frequencies (a Gaussian blur of σ pixels) at its level-K
prediction, the model's conditional mean, and lets the sampler draw the rest (:mod:`arvdm.pipeline.anchor`);
σ = 0 is exactly the plain rollout; by default σ and its floor are the run's (``diffusion.cfg.anchor_sigma`` /
``anchor_floor``: 1 px above level 100 for the tiny preset), as eta is.

``use_cache=False`` is the Diffusion Forcing reference behaviour: no KV cache; at every denoising call the
model re-encodes the remembered past frames, passed as ``memory=MemoryFrames(...)``. Which past frames are
remembered is decided by the same retention policy (``memory.RetentionPolicy`` from ``cfg.memory``) that
the model's own cache uses, through the same ``memory.MemoryBank`` — so the two paths see the same past.

What the model must offer is :class:`arvdm.pipeline.rollout_model.RolloutModel`; how the window goes through
the rows of a matrix is a :class:`arvdm.pipeline.rows.RowRunner` (``rows=``; default :class:`PlainRows`, one
model call per row; ``arvdm.speculative.rows.SpeculativeRows`` speculates them).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
from tqdm.auto import tqdm

from arvdm.config import SamplingError
from arvdm.model.diffusion import PerFrameDiffusion
from arvdm.pipeline.anchor import LowFrequencyAnchor
from arvdm.pipeline.rollout_model import RolloutModel
from arvdm.pipeline.rows import Generators, PlainRows, RolloutContext, RolloutStep, RowRunner
from arvdm.schedules.matrix import ARSchedule, check_context_level
from arvdm.setting_checks import check_eta, check_guidance
from memory import make_bank

__all__ = ["rollout", "episode_generators", "candidate_generators", "medoid"]


@torch.no_grad()
def rollout(model: RolloutModel, diffusion: PerFrameDiffusion, schedule: ARSchedule, context: torch.Tensor,
            context_actions: torch.Tensor, actions: torch.Tensor, n_frames: int, *, eta: float | None = None,
            generator: Generators = None, use_cache: bool = True, progress: bool = True,
            return_intermediate: bool = False, rows: RowRunner | None = None, poses: torch.Tensor | None = None,
            memory_select: str | None = None, context_level: int | None = None, history_guidance: float = 0.0,
            candidates: int = 1, anchor_sigma: float | None = None, anchor_floor: int | None = None,
            action_guidance: float = 0.0) -> torch.Tensor | tuple[torch.Tensor, list[RolloutStep]]:
    """Generate ``n_frames`` frames after ``context`` with a Meta-ARVDM schedule.

    Args:
        model: a :class:`RolloutModel` (``init_state``, ``commit``, ``check_schedule``, ``cfg``,
            ``frames_per_chunk``, ``model(x, levels, actions, state=... | memory=...) -> v``; see
            docs/INTERFACES.md). Put it in eval mode first.
        diffusion: the per-frame transitions (its K must be the schedule's).
        schedule: Δ, w, S and the initialization stage.
        context: (B, C, ch, H, W) clean frames in [-1, 1] to condition on; C may be 0. C must be a multiple
            of the model's ``frames_per_chunk``.
        context_actions: (B, C) int64 actions of the context frames.
        actions: (B, >= n_frames) int64 actions of the frames to generate (only the first ``n_frames`` are
            used; the frames generated past the end get the last one repeated and are discarded).
        n_frames: how many new frames to return.
        eta: 0 = DDIM (deterministic given the initial noise), 1 = DDPM-like; None = the diffusion's own
            ``diffusion.cfg.eta`` (the run's sampling eta).
        generator: the source of all noise (initial window, entering frames, eta > 0 steps), drawn in a
            fixed order, so a rollout is reproducible from the generator's seed: one ``torch.Generator`` for the
            batch, or a sequence of B, one per sample (:func:`episode_generators`), so that each sample's noise, and
            so the sample, does not depend on which batch it is rolled out in.
        use_cache: True = the model's KV cache (``state``); False = recompute the memory at every call.
        progress: a tqdm bar over frames.
        return_intermediate: also return one :class:`RolloutStep` per model call (plain rows only: a
            speculative runner moves samples through the rows at their own pace).
        rows: the :class:`RowRunner` that takes the window through each matrix's rows; None =
            :class:`PlainRows`. E.g. ``arvdm.speculative.rows.SpeculativeRows(spec)`` (exact; eta > 0).
        poses: (B, >= C + n_frames, 3) float camera poses (x, y, heading) of the context and the frames to
            generate, as they come with the episode (like its actions). Required by a pose-aware model
            (memory.select=pose), which chooses each window's memory by them; ignored by other models.
        memory_select: how a pose-aware model chooses memory (``memory.SELECTIONS``: pose, time, none, other;
            same weights, another choice: the memory ablation); None = the model's own (pose / retention).
        context_level: k_ctx in 0..K-1: the context and every finished frame are committed to memory re-noised
            to level k_ctx (fresh noise from ``generator``, drawn at each commit after the window's own draws),
            and the model is told their level; the emitted frames stay clean. None = ``schedule.context_level``.
            Meant for a model trained with ``train.context_noise_max >= k_ctx``.
        history_guidance: W, any finite number: every row's v is ``v_mem + W (v_mem - v_nomem)``, ``v_nomem``
            the same window without memory (two calls per row). 0 = one call, exactly the unguided rollout.
            Meant for a model trained with ``train.memory_dropout > 0``.
        action_guidance: W_a, any finite number: ``W_a (v - v_noact)`` is added to every row's v (after history
            guidance's term), ``v_noact`` the same call with the window's actions replaced by the null action (one
            more call per row). 0 = exactly the unguided rollout. Meant for a model trained with
            ``train.action_dropout > 0``.
        candidates: N >= 1 candidates per sample (plain rows, no ``return_intermediate``): at every AR step the
            candidate whose finished frames have the least summed squared distance to the other candidates' is
            kept (:func:`medoid`), its whole window is copied to the N, and its frames are emitted and committed.
            Candidate 0 of a sample draws from the sample's own generator, candidate j from
            :func:`candidate_generators`; N times the batch, memory and compute. 1 = the plain rollout.
        anchor_sigma: σ >= 0 pixels (plain rows): every frame's x̂0 keeps the low frequencies (Gaussian blur of σ)
            of its prediction at level K, the model's conditional mean (:mod:`arvdm.pipeline.anchor`); no model
            call is added. 0 = exactly the plain sampler. None = the diffusion's own ``diffusion.cfg.anchor_sigma``
            (the run's; 0 with a speculative ``rows`` runner, which does not support the anchor).
        anchor_floor: L in 0..K-1: the anchor pulls only in calls that start above level L (0 = every call).
            None = ``diffusion.cfg.anchor_floor`` when there is an anchor, else 0.

    Returns:
        (B, n_frames, ch, H, W) generated frames, or ``(frames, steps)`` with ``return_intermediate``.
    """
    n_cand = _check_candidates(candidates, rows, return_intermediate, memory_select)
    if n_cand == 1:
        return _rollout(model, diffusion, schedule, context, context_actions, actions, n_frames, eta, generator,
                        use_cache, progress, return_intermediate, rows, poses, memory_select, context_level,
                        history_guidance, anchor_sigma, anchor_floor, n_candidates=1,
                        action_guidance=action_guidance)
    b = _check_inputs(context, context_actions, actions, n_frames)[0]
    # N candidates of every sample side by side: sample i's are rows i*N .. i*N + N-1
    context, context_actions, actions = (t.repeat_interleave(n_cand, dim=0)
                                         for t in (context, context_actions, actions))
    poses = None if poses is None else poses.repeat_interleave(n_cand, dim=0)
    video = _rollout(model, diffusion, schedule, context, context_actions, actions, n_frames, eta,
                     candidate_generators(generator, n_cand, b), use_cache, progress, False, None, poses,
                     memory_select, context_level, history_guidance, anchor_sigma, anchor_floor,
                     n_candidates=n_cand, action_guidance=action_guidance)  # (B*N, n_frames, ...)
    return video[::n_cand]  # the N are identical after every choice: (B, n_frames, ch, H, W)


def _rollout(model: RolloutModel, diffusion: PerFrameDiffusion, schedule: ARSchedule, context: torch.Tensor,
             context_actions: torch.Tensor, actions: torch.Tensor, n_frames: int, eta: float | None,
             generator: Generators, use_cache: bool, progress: bool, return_intermediate: bool,
             rows: RowRunner | None, poses: torch.Tensor | None, memory_select: str | None, context_level: int | None,
             history_guidance: float, anchor_sigma: float | None, anchor_floor: int | None,
             n_candidates: int, action_guidance: float = 0.0) -> torch.Tensor | tuple[torch.Tensor, list[RolloutStep]]:
    """:func:`rollout` on a batch that holds ``n_candidates`` consecutive candidates of every sample."""
    b, n_ctx = _check_inputs(context, context_actions, actions, n_frames)
    _check_generators(generator, b)
    eta = check_eta(diffusion.cfg.eta if eta is None else eta, "rollout eta", SamplingError)
    k_ctx = schedule.context_level if context_level is None else check_context_level(
        context_level, schedule.num_levels, "rollout context_level")
    guidance = check_guidance(history_guidance, "rollout history_guidance", SamplingError)
    act_guidance = check_guidance(action_guidance, "rollout action_guidance", SamplingError)
    runner = PlainRows() if rows is None else rows
    # None = the run's, as eta (diffusion.cfg); not with speculative rows, which do not support an anchor
    sigma, floor = diffusion.cfg.anchor(anchor_sigma, anchor_floor, ("rollout anchor_sigma", "rollout anchor_floor"),
                                        supported=isinstance(runner, PlainRows))
    if (k_ctx or guidance or act_guidance or sigma) and not isinstance(runner, PlainRows):
        raise SamplingError(f"context_level={k_ctx} / history_guidance={guidance} / action_guidance={act_guidance} / "
                            f"anchor_sigma={sigma} need the plain row runner; {type(runner).__name__} does not support "
                            "them yet (set them to 0, or no speculation)")
    _check_model(model, diffusion, schedule, n_ctx)
    _check_action_range(model, context_actions, actions[:, :n_frames])  # once per rollout, not per call
    ctx = RolloutContext(model, diffusion, eta, generator, b, context.device, context.dtype,
                         record=[] if return_intermediate else None, context_level=k_ctx,
                         history_guidance=guidance, action_guidance=act_guidance, candidates=n_candidates,
                         anchor=LowFrequencyAnchor(diffusion, sigma, floor) if sigma > 0 else None)
    select = {} if memory_select is None else {"memory_select": memory_select}
    if use_cache:  # the model's own state (KV caches + bank)
        ctx.state = model.init_state(b, **select)
    else:  # a bank we keep ourselves, as the model's own (the recomputing reference)
        ctx.bank = make_bank(model.cfg.memory, memory_select)
    runner.start(ctx)
    ctx_poses, win_poses = _poses(model, poses, schedule, n_ctx, n_frames, b, context.device)
    if n_ctx:
        _commit(ctx, runner, context, context_actions.to(device=context.device, dtype=torch.long), ctx_poses,
                None if win_poses is None else win_poses[:, :schedule.window], observed=True)
    video = _run_schedule(ctx, runner, schedule, _window_actions(actions, schedule, n_frames, context.device),
                          n_frames, context.shape[2:], progress, win_poses)  # (B, n_frames, ch, H, W)
    return (video, ctx.record) if return_intermediate else video


def episode_generators(seed: int, episodes: Iterable[int], device: str | torch.device = "cpu"
                       ) -> list[torch.Generator]:
    """One generator per episode, seeded by (``seed``, episode index) only: rolled out with these, episode e gets the
    same noise whatever batch it is in and whatever the batch size (``rollout(generator=...)``)."""
    return [torch.Generator(device=device).manual_seed(
        int(np.random.SeedSequence([int(seed), int(e)]).generate_state(1)[0])) for e in episodes]


def candidate_generators(generator: Generators, n_candidates: int, batch_size: int) -> Generators:
    """The noise source of ``n_candidates`` candidates per sample, laid out sample-major (sample i's candidate j at
    row i*N + j). Per-sample generators: candidate 0 keeps the sample's own (so its first AR step is exactly the plain
    rollout's), candidate j >= 1 gets a fresh one seeded by (the sample generator's seed, j). One generator or
    None: the same source, now drawing for the whole B*N batch."""
    if not _check_generators(generator, batch_size):
        return generator
    out = []
    for g in generator:
        out.append(g)
        out += [torch.Generator(device=g.device).manual_seed(
            int(np.random.SeedSequence([int(g.initial_seed()), j]).generate_state(1)[0]))
            for j in range(1, n_candidates)]
    return out


def medoid(candidates: torch.Tensor) -> torch.Tensor:
    """Index (B,) of the minimum-Bayes-risk candidate under squared error: of ``candidates`` (B, N, ...), the one
    with the least summed squared distance to the others (ties: the lowest index)."""
    flat = candidates.flatten(2).float()  # (B, N, D)
    dist = (flat.unsqueeze(2) - flat.unsqueeze(1)).square().sum(dim=3)  # (B, N, N) squared distances
    return dist.sum(dim=2).argmin(dim=1)  # (B,)


def _select_candidate(x: torch.Tensor, n_cand: int, delta: int) -> torch.Tensor:
    """Row index (B*N,) that replaces every sample's N candidate windows (B*N, w, ...) by the one whose first
    ``delta`` (finished) frames are the medoid of the N."""
    groups = x.unflatten(0, (-1, n_cand))  # (B, N, w, ch, H, W)
    best = medoid(groups[:, :, :delta])  # (B,)
    rows = torch.arange(groups.shape[0], device=x.device) * n_cand + best  # (B,) the chosen rows of x
    return rows.repeat_interleave(n_cand)  # (B*N,)


def _run_schedule(ctx: RolloutContext, runner: RowRunner, schedule: ARSchedule, acts: torch.Tensor, n_frames: int,
                  frame_shape: tuple[int, ...], progress: bool, poses: torch.Tensor | None) -> torch.Tensor:
    """The initialization stage, then AR steps until ``n_frames`` frames are out: (B, n_frames, ch, H, W).
    ``poses`` (B, total, 3) are the window frames' poses (pose-aware models), aligned with ``acts``."""
    b, w, delta = ctx.batch_size, schedule.window, schedule.delta
    S = torch.tensor(schedule.matrix, device=ctx.device)  # (M+1, w) (a copy: the schedule's array is read-only)
    init = torch.tensor(schedule.init_matrix(), device=ctx.device)  # (M_init+1, w)
    x = ctx.noise((b, w, *frame_shape))  # the window starts at level K: pure noise
    out: list[torch.Tensor] = []
    bar = tqdm(total=n_frames, unit="frame", desc=f"rollout ({schedule.name})", disable=not progress, leave=False)
    try:
        ctx.window_poses = None if poses is None else poses[:, :w]
        x = runner.run_rows(x, init, acts[:, :w], "init", -1, 0)
        emitted = 0
        for a in range(schedule.num_ar_steps(n_frames)):
            offset = a * delta
            x = runner.run_rows(x, S, acts[:, offset:offset + w], "ar", a, offset)
            if ctx.candidates > 1:  # keep every sample's medoid candidate; the N go on from its window
                keep = _select_candidate(x, ctx.candidates, delta)  # (B*N,)
                x = x[keep]
                if ctx.anchor is not None:
                    ctx.anchor.select(keep)
            done = x[:, :delta]  # (B, Δ, ...): level 0 by the 0-T boundary t^O[0:Δ] = 0
            out.append(done)
            bar.update(min(delta, n_frames - emitted))
            emitted += delta
            if emitted >= n_frames:
                break  # nothing will look at these frames again: skip the commit
            nxt = offset + delta
            ctx.window_poses = None if poses is None else poses[:, nxt:nxt + w]  # the next window's
            _commit(ctx, runner, done, acts[:, offset:nxt], None if poses is None else poses[:, offset:nxt],
                    ctx.window_poses)
            # Shift: the window keeps t^O[Δ:] = t^I[:w-Δ] (circularity); Δ new frames enter at level K.
            x = torch.cat([x[:, delta:], ctx.noise((b, delta, *frame_shape))], dim=1)
            runner.shift(delta)
            if ctx.anchor is not None:
                ctx.anchor.shift(delta)
    finally:
        bar.close()
    return torch.cat(out, dim=1)[:, :n_frames]  # (B, n_frames, ch, H, W)


def _commit(ctx: RolloutContext, runner: RowRunner, frames: torch.Tensor, actions: torch.Tensor,
            poses: torch.Tensor | None = None, target_poses: torch.Tensor | None = None,
            observed: bool = False) -> None:
    """Frames into the past (re-noised to the context level when it is > 0); the runner hears of what went in.
    ``observed``: the real context, not generated frames (model.copy_gate=observed)."""
    runner.commit(ctx.commit(frames, actions, poses, target_poses, observed), actions)


def _poses(model: RolloutModel, poses: torch.Tensor | None, schedule: ARSchedule, n_ctx: int, n_frames: int, b: int,
           device: torch.device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(context poses (B, C, 3), window poses (B, total, 3): the generated frames', then the last repeated), or
    (None, None) for a model that does not choose memory by pose."""
    if model.cfg.memory.select != "pose":
        return None, None
    if poses is None:
        raise ValueError("this model chooses memory by camera pose (memory.select=pose): pass rollout(poses=...), "
                         "the (B, C + n_frames, 3) poses that come with the episode (data sets with a 'pose' array)")
    if poses.dim() != 3 or poses.shape[0] != b or poses.shape[1] < n_ctx + n_frames or poses.shape[2] != 3:
        raise ValueError(f"poses must be (B, >= C + n_frames, 3) = ({b}, >= {n_ctx + n_frames}, 3), got "
                         f"{tuple(poses.shape)}")
    if not poses.is_floating_point() or not bool(torch.isfinite(poses).all()):
        raise ValueError("poses must be finite floats (x, y, heading): NaN, infinite or integer poses given")
    poses = poses.to(device=device, dtype=torch.float32)
    gen = poses[:, n_ctx:n_ctx + n_frames]  # (B, n_frames, 3)
    total = schedule.num_ar_steps(n_frames) * schedule.delta + schedule.window  # every frame that enters a window
    return poses[:, :n_ctx], torch.cat([gen, gen[:, -1:].expand(b, max(0, total - n_frames), 3)], dim=1)


def _window_actions(actions: torch.Tensor, schedule: ARSchedule, n_frames: int, device: torch.device
                    ) -> torch.Tensor:
    """Actions of every frame that will ever enter the window: the given ones, then the last one repeated."""
    b, w, delta = actions.shape[0], schedule.window, schedule.delta
    total = schedule.num_ar_steps(n_frames) * delta + w - delta
    acts = actions[:, :n_frames].to(device=device, dtype=torch.long)  # (B, n_frames)
    return torch.cat([acts, acts[:, -1:].expand(b, max(0, total - n_frames))], dim=1)  # (B, total)


def _check_generators(generator: Generators, batch_size: int) -> bool:
    """True for per-sample generators (then one per sample of the batch), False for one generator or None."""
    if not isinstance(generator, (list, tuple)):
        return False
    if len(generator) != batch_size:
        raise SamplingError(f"rollout generator: {len(generator)} per-sample generators for a batch of {batch_size} "
                            f"(give one per sample, or a single torch.Generator)")
    return True


def _check_candidates(candidates: int, rows: RowRunner | None, return_intermediate: bool,
                      memory_select: str | None) -> int:
    """N of ``rollout(candidates=N)``: an integer >= 1 that the row runner and the outputs asked for allow."""
    if isinstance(candidates, bool) or not isinstance(candidates, int) or candidates < 1:
        raise SamplingError(f"rollout candidates must be an integer >= 1, got {candidates!r}")
    if candidates > 1 and (rows is not None and not isinstance(rows, PlainRows) or return_intermediate):
        raise SamplingError(f"rollout candidates={candidates} needs the plain row runner and no return_intermediate "
                            "(a speculative runner keeps per-sample state the candidate choice would overwrite)")
    if candidates > 1 and memory_select == "other":
        raise SamplingError(f"rollout candidates={candidates} with memory_select='other': that ablation takes "
                            "memory from the neighbouring sample of the batch, which would be another candidate of "
                            "the same one")
    return candidates


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


def _check_model(model: RolloutModel, diffusion: PerFrameDiffusion, schedule: ARSchedule, n_ctx: int) -> None:
    """The schedule fits the diffusion and the model; the context is whole chunks."""
    if schedule.num_levels != diffusion.num_levels:
        raise ValueError(f"schedule {schedule.name!r} has K={schedule.num_levels} levels but the diffusion has "
                         f"num_levels={diffusion.num_levels}")
    model.check_schedule(schedule.delta, schedule.window)
    chunk = int(model.frames_per_chunk)
    if n_ctx % chunk:
        raise ValueError(f"context has {n_ctx} frames; the model commits whole chunks, so it must be a multiple "
                         f"of model.frames_per_chunk={chunk}")


def _check_action_range(model: RolloutModel, *action_tensors: torch.Tensor) -> None:
    """Actions in 0..num_actions-1 of the model's config: a value check, so it runs here at the API boundary
    (one host read per rollout) and not inside the model's per-call forward."""
    n_actions = model.cfg.model.num_actions
    for name, a in zip(("context_actions", "actions"), action_tensors):
        if a.numel() and (int(a.min()) < 0 or int(a.max()) >= n_actions):
            raise ValueError(f"{name} must be in 0..{n_actions - 1} (model.num_actions={n_actions}), got "
                             f"{int(a.min())}..{int(a.max())}")
