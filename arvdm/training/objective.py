"""What training optimizes and how: the diffusion-forcing loss, AdamW with its lr schedule, the EMA of the weights.

    total, counted = diffusion_forcing_loss(model, diffusion, video, actions, m, K, generator)
    loss = total / counted.clamp(min=1)                  # mean v-MSE over the noisy window frames
    optimizer, lr_scheduler = make_optimizer(model, cfg.train)
    ema = EMA(model, cfg.train.ema_decay, cfg.train.ema_warmup); ema.update(model, step)

Contract: `diffusion_forcing_loss` draws its levels, then its noise, from `generator` only (never the global
RNG), so a run that restores the generator's state draws the same numbers again (exact resume). The two
error-accumulation levers draw after those, and only when on: the memory frames' levels and noise
(`context_noise_max` > 0, noisy context), then the memory-dropout coin (`memory_dropout` > 0, history
guidance); with both off the draws, and so the run, are what they were before the levers existed.
`copy_gate_loss` > 0 (model.copy_gate) adds a supervised term for the copy gate, model.action_advection the advected
last frame's reconstruction term; neither draws. model.copy_gate=observed draws last of all: which clips' last frame
counts as observed (gated), a share `OBSERVED_GATE_SHARE`.
"""

from __future__ import annotations

import contextlib
import copy
import math

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from arvdm.config import TrainConfig
from arvdm.model.checkpoint import unwrap
from arvdm.model.copy_gate import OBSERVED_GATE_SHARE, own_v
from arvdm.model.denoiser import DenoiserOutput
from arvdm.schedules.matrix import ARSchedule
from memory import MemoryFrames

MIN_LR_RATIO = 0.1  # cosine decay ends at lr / 10 (as in nanoGPT / Chinchilla)
ADAMW_BETAS = (0.9, 0.99)  # AdamW (beta1, beta2)
ADVECTION_LOSS_WEIGHT = 1.0  # model.action_advection: the advected last frame's |adv - x0|^2 beside the v-MSE


def _window_draws(x0: torch.Tensor, num_levels: int, generator: torch.Generator,
                  shared_levels: torch.Tensor | None, top_levels: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The window's levels (B, w) in 0..K, one per frame (diffusion forcing), and noise like ``x0`` (B, w, C, H, W),
    drawn in that order from ``generator``, on x0's device. ``shared_levels`` (B,) bool (train.shared_level_p; the
    trainer's coins, nothing drawn here): those clips' frames all take their first frame's level, the pattern a
    chunked rollout's window has (every frame at K, then every frame one step lower), which independent levels
    almost never show (all 4 frames of a window within the top 5% of levels: 5%^4). ``top_levels`` (B,) bool
    (train.top_level_p): those clips' frames all sit at level K, the one call an anchor member answers
    (arvdm.pipeline.anchor.AnchorEnsemble); it wins over ``shared_levels``. Neither draws anything."""
    b, w = x0.shape[:2]
    levels = torch.randint(0, num_levels + 1, (b, w), generator=generator, device=generator.device)
    if shared_levels is not None:
        levels = torch.where(shared_levels.to(levels.device)[:, None], levels[:, :1], levels)  # (B, w)
    if top_levels is not None:
        levels = torch.where(top_levels.to(levels.device)[:, None], num_levels, levels)  # (B, w)
    noise = torch.randn(x0.shape, generator=generator, device=generator.device, dtype=x0.dtype)
    return levels.to(x0.device), noise.to(x0.device)


def diffusion_forcing_loss(model, diffusion, video: torch.Tensor, actions: torch.Tensor, memory_length: int,
                           num_levels: int, generator: torch.Generator, autocast=contextlib.nullcontext,
                           weight: str = "uniform", gamma: float = 5.0, poses: torch.Tensor | None = None,
                           ages: torch.Tensor | None = None, context_noise_max: int = 0, memory_dropout: float = 0.0,
                           drop_memory: bool | None = None, copy_gate_loss: float = 0.0, copy_gate_detach: bool = False,
                           advection_loss: float = ADVECTION_LOSS_WEIGHT, generated_last: torch.Tensor | None = None,
                           action_dropout: float = 0.0, shared_levels: torch.Tensor | None = None,
                           top_levels: torch.Tensor | None = None):
    """Sum over frames of the weighted per-frame v-MSE, and how many frames were counted.

    video (B, m+w, C, H, W), actions (B, m+w): the first m frames are clean memory, the rest the window.
    Each window frame draws its own level in 0..K (diffusion forcing). Frames that drew level 0 are clean
    inputs: their v-target is pure noise the model cannot know, so they condition the others but are
    left out of the loss (they still teach it to read clean frames in the window). `weight` is
    `PerFrameDiffusion.loss_weight`'s kind (uniform or min_snr with `gamma`). `poses` (B, m+w, 3) and `ages`
    (B, m) come with pose-chosen memory (`arvdm.training.loader.pose_memory`).

    `context_noise_max` k (noisy context, GameNGen / Diffusion Forcing): each memory frame draws a level in
    0..k and is noised to it (`diffusion.add_noise`); the model is told its level. `memory_dropout` p (history
    guidance, DFoT): with probability p the whole batch sees no memory (the coin is read on the host: one sync
    per step, only when p > 0). Both draw after the window's levels and noise, and nothing when 0.
    `drop_memory` given (True/False) replaces the coin: the trainer decides per step, the same on every DDP rank
    (a per-rank coin would leave the memory path's gradients missing on some ranks only).

    `copy_gate_loss` λ > 0 (model.copy_gate): each counted frame's term also gets λ · BCE(gate, g*), the gate told
    directly the share of the last frame that makes the network's x̂0 best (`copy_target`),
    rather than only through the v-MSE, whose pull on the gate fades as the gate opens. Nothing is added for a
    batch without memory (no last frame, no gate). model.copy_gate=observed: a random `OBSERVED_GATE_SHARE` of the
    clips get the gate (their last frame counts as observed, `MemoryFrames.last_observed`), the others the network
    alone, as a rollout has it once a generated frame is the last one; the BCE only on the gated clips
    (`_gated_clips`; `generated_last` from `rollout_context`: those clips are never gated).
    `copy_gate_detach` (needs λ > 0): the v-MSE is taken on the network's own v̂, before the gate (`copy_gate.own_v`),
    so the network trains as one without a gate and the gate learns from the BCE alone.

    model.action_advection adds `advection_loss` (ADVECTION_LOSS_WEIGHT) · |advected − x0|² per counted frame: the
    last frame advected along the window's actions (`ActionAdvection`) should be the frame itself (CDNA's
    reconstruction loss), which trains the kernels directly; nothing for a batch without memory. Draws nothing.
    Validation passes 0: its loss stays the v-MSE alone. `action_dropout` p: `_dropped_actions` (action guidance).
    `shared_levels`, `top_levels`: `_window_draws`.
    """
    m = memory_length
    x0, act = video[:, m:], actions[:, m:]  # (B, w, C, H, W), (B, w)
    b, w = x0.shape[:2]
    levels, noise = _window_draws(x0, num_levels, generator, shared_levels, top_levels)  # (B, w), (B, w, C, H, W)
    x_t = diffusion.add_noise(x0, noise, levels)  # (B, w, C, H, W)
    target = diffusion.v_target(x0, noise, levels)  # (B, w, C, H, W)
    mem = _memory(diffusion, video[:, :m], actions[:, :m], poses, ages, generator, context_noise_max,
                  memory_dropout, drop_memory) if m > 0 else None
    logit, advected, on = None, None, None
    core = unwrap(model)
    advect = advection_loss > 0 and getattr(core, "advection", None) is not None
    if mem is not None and getattr(core, "gate_on_embed", None) is not None:  # copy_gate=observed
        on = mem.last_observed = _gated_clips(b, generator, x0.device, generated_last)  # (B,) bool
    kw = _dropped_actions(action_dropout, b, generator, x0.device)
    with autocast():
        if copy_gate_loss > 0 or advect:  # extras asked only when used: a plain model is called exactly as before
            outs = model(x_t, levels, act, memory=mem, return_extras=True, **kw)
        else:
            outs = DenoiserOutput(model(x_t, levels, act, memory=mem, **kw), None, None, None)
    v = outs.v  # (B, w, C, H, W)
    if copy_gate_loss > 0:
        logit, x0_hat = outs.gate_logit, outs.x0_hat  # logit (B,w,1,H|1,W|1) | None
        if copy_gate_detach and x0_hat is not None:  # the v-MSE on the network's own v̂, not the gated one
            v = own_v(core, x_t, levels, x0_hat)  # (B, w, C, H, W) float32
    if advect:
        advected = outs.advected  # (B, w, C, H, W) | None (no last frame)
    per_frame = (v.float() - target.float()).pow(2).mean(dim=(2, 3, 4))  # (B, w)
    counted = (levels > 0).to(per_frame.dtype)  # (B, w)
    w_levels = diffusion.loss_weight(levels, weight, gamma).to(per_frame.dtype)  # (B, w)
    per_frame = per_frame * w_levels
    if logit is not None:
        source = video[:, m - 1, None] if advected is None else advected  # what the gate copies (B, 1|w, C, H, W)
        share = copy_target(x0, source, x0_hat, per_pixel=logit.shape[-1] > 1)  # (B, w, 1, H|1, W|1)
        bce = F.binary_cross_entropy_with_logits(logit.float(), share, reduction="none").mean(dim=(2, 3, 4))  # (B, w)
        if on is not None:  # the gate of an ungated clip copies nothing: nothing to supervise
            bce = bce * on[:, None].to(bce.dtype)
        per_frame = per_frame + copy_gate_loss * bce  # (B, w)
    if advected is not None:  # CDNA's objective for the kernels: the advected last frame should be the next frame
        per_frame = per_frame + advection_loss * (advected - x0.float()).pow(2).mean(dim=(2, 3, 4))  # (B, w)
    return (per_frame * counted).sum(), counted.sum()


def _dropped_actions(p: float, b: int, generator: torch.Generator, device: torch.device) -> dict[str, torch.Tensor]:
    """`action_dropout` p (action guidance: classifier-free guidance over the actions, Ho & Salimans 2022): each of
    the b clips' window actions become the null action with probability p, one (B,) draw after every other, so the
    model learns v with and without the actions and `--action-guidance W` can push a rollout along them. The
    model's keyword arguments: none when p = 0 (nothing drawn; the model called exactly as without the lever)."""
    if p <= 0:
        return {}
    return {"drop_actions": (torch.rand(b, generator=generator, device=generator.device) < p).to(device)}  # (B,)


def copy_target(frames: torch.Tensor, last: torch.Tensor, x0_hat: torch.Tensor,
                per_pixel: bool = False) -> torch.Tensor:
    """The share g* in [0, 1] of the last past frame (B,1,C,H,W; advected: B,w,C,H,W) that brings the network's x̂0
    (B,w,C,H,W) closest to the true frame (B,w,C,H,W): x̂0 + g (last − x̂0) is nearest at
    g* = <x0 − x̂0, last − x̂0> / |last − x̂0|², clipped
    (the v-MSE's own optimum for this sample). A scene that stands still gives 1 at every level; a moving one 0, or
    a part at high noise where x̂0 is a blur. Over the frame, or with `per_pixel` over channels only. Returns
    (B,w,1,1,1) or (B,w,1,H,W); no gradient (x̂0 is detached)."""
    d_true = frames.float() - x0_hat.detach().float()  # (B,w,C,H,W)
    d_last = last.float() - x0_hat.detach().float()  # (B,w,C,H,W)
    dims = (2,) if per_pixel else (2, 3, 4)
    num = (d_true * d_last).sum(dim=dims, keepdim=True)  # (B,w,1,H,W) or (B,w,1,1,1)
    den = d_last.pow(2).sum(dim=dims, keepdim=True)
    return (num / den.clamp_min(1e-8)).clamp(0.0, 1.0)


def _memory(diffusion, frames: torch.Tensor, actions: torch.Tensor, poses: torch.Tensor | None,
            ages: torch.Tensor | None, generator: torch.Generator, context_noise_max: int,
            memory_dropout: float, drop_memory: bool | None = None) -> MemoryFrames | None:
    """The loss's memory (frames (B,m,C,H,W)): noised to drawn levels, or dropped; draws only for a lever that is on."""
    levels, last = None, frames[:, -1]  # (B, C, H, W) the newest memory frame, clean
    if context_noise_max > 0:
        b, m = actions.shape
        levels = torch.randint(0, context_noise_max + 1, (b, m), generator=generator, device=generator.device)
        noise = torch.randn(frames.shape, generator=generator, device=generator.device, dtype=frames.dtype)
        levels, noise = levels.to(frames.device), noise.to(frames.device)
        frames = diffusion.add_noise(frames, noise, levels)  # (B, m, C, H, W) at their levels
    if drop_memory is not None:
        return None if drop_memory else MemoryFrames.of_clip(frames, actions, poses, ages, levels, last)
    if memory_dropout > 0:
        coin = torch.rand((), generator=generator, device=generator.device)
        if bool(coin < memory_dropout):  # the whole batch sees the window only (as v_nomem does at sampling)
            return None
    return MemoryFrames.of_clip(frames, actions, poses, ages, levels, last)


def _gated_clips(b: int, generator: torch.Generator, device: torch.device,
                 generated_last: torch.Tensor | None = None) -> torch.Tensor:
    """model.copy_gate=observed: which of the b clips count their last frame as observed (gated), (B,) bool: a
    share `OBSERVED_GATE_SHARE`, one (B,) draw. `generated_last` (B,) bool: clips whose last memory frame the model
    generated (`rollout_context`) are never gated, whatever the draw (still made: the generator advances alike)."""
    on = torch.rand((b,), generator=generator, device=generator.device).to(device) < OBSERVED_GATE_SHARE
    return on if generated_last is None else on & ~generated_last.to(device)


@torch.no_grad()
def rollout_context(model, diffusion, video: torch.Tensor, actions: torch.Tensor, memory_length: int, recent: int,
                    schedule: ARSchedule, generator: torch.Generator, autocast=contextlib.nullcontext,
                    eta: float = 1.0, poses: torch.Tensor | None = None, ages: torch.Tensor | None = None,
                    share: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """A clip whose recent memory the model generated itself (Self-Forcing, Huang et al. 2025, for one chunk).

    In: video (B, m+G+w, C, H, W), actions (B, m+G+w): m memory frames (k = m - `recent` chosen by pose, then
    the r = `recent` most recent ones; r = m with time-chosen memory), G = `rollout_frames` frames, w window
    frames; with pose-chosen memory also poses (B, m+G+w, 3) and ages (B, m), counted from the first of the G
    frames (`PoseMemoryClips` with window G + w). `model` generates the G frames from the clip's memory with their
    actions through the rows of `schedule` (a `chunked` schedule of window G: one AR step, K to 0; DDIM-eta
    transitions, noise from `generator`), as a chunked rollout's AR step does. Out: the
    diffusion-forcing clip (B, m+w) of the window with the memory it then has, actions (B, m+w) and the extras
    ({"poses": (B, m+w, 3), "ages": (B, m)} with poses; "generated_last" below): with select=time the last m of
    [m memory + G generated] frames; with select=pose the same k chosen frames (G older) and the last r of
    [r recent + G generated].
    `share` < 1: each clip keeps the generated frames with that probability (a draw per clip from `generator`,
    after the generation's; none when 1), the others the real G frames, as a rollout's first window has them.
    The extras also hold "generated_last" (B,) bool: the clips that took the generated frames (their last memory
    frame is the model's own, so `diffusion_forcing_loss` never gates it under model.copy_gate=observed).
    """
    m, g, keep = memory_length, schedule.window, recent
    b = actions.shape[0]
    k = m - keep  # frames chosen by pose (0 with time-chosen memory)
    x = torch.randn((b, g, *video.shape[2:]), generator=generator, device=generator.device, dtype=video.dtype)
    x = x.to(video.device)  # (B, G, C, H, W) at level K
    rows = torch.tensor(schedule.matrix, device=video.device)[:, None].expand(-1, b, g)  # (M+1, B, G) levels
    mem = MemoryFrames.of_clip(video[:, :m], actions[:, :m], None if poses is None else poses[:, :m + g], ages)
    act = actions[:, m:m + g]  # (B, G)
    for la, lb in zip(rows[:-1], rows[1:]):
        with autocast():
            v = model(x, la, act, memory=mem)  # (B, G, C, H, W)
        x = diffusion.step(x, v.to(x.dtype), la, lb, eta, generator)
    own = torch.ones((b,), dtype=torch.bool, device=video.device)  # (B,) clips that keep the generated frames
    if share < 1.0:  # the others take the real ones
        own = torch.rand((b,), generator=generator, device=generator.device).to(video.device) < share
        x = torch.where(own[:, None, None, None, None], x, video[:, m:m + g])
    past = torch.cat([video[:, k:m], x], dim=1)  # (B, r+G, C, H, W): recent memory, then the generated frames
    idx = list(range(k)) + list(range(m + g - keep, m + g))  # the memory after the G frames, in clip positions
    new_video = torch.cat([video[:, :k], past[:, -keep:], video[:, m + g:]], dim=1)  # (B, m+w, C, H, W)
    new_actions = torch.cat([actions[:, idx], actions[:, m + g:]], dim=1)  # (B, m+w)
    extras: dict[str, torch.Tensor] = {"generated_last": own}
    if poses is not None:
        extras["poses"] = torch.cat([poses[:, idx], poses[:, m + g:]], dim=1)  # (B, m+w, 3)
        extras["ages"] = torch.cat([ages[:, :k] + g, ages[:, k:]], dim=1)  # the chosen are G frames older
    return new_video, new_actions, extras


def lr_factor(step: int, warmup: int, max_steps: int) -> float:
    """Linear warm-up to 1 over `warmup` steps, then cosine decay to MIN_LR_RATIO at `max_steps`."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return MIN_LR_RATIO + (1.0 - MIN_LR_RATIO) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, tc: TrainConfig
                   ) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the trainable parameters, and its warm-up + cosine lr schedule (`lr_factor`).

    Weight decay only on matrices (not on norms, biases, embeddings' scales), as in nanoGPT.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": tc.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=tc.lr, betas=ADAMW_BETAS)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, tc.warmup_steps, tc.max_steps))
    return optimizer, lr_scheduler


class EMA:
    """Exponential moving average of the weights, kept in fp32 whatever the training precision.

    The decay warms up as min(decay, (1 + t) / (warmup + t)): with a plain 0.999 a short run's EMA would
    still be mostly the random initial weights, and the EMA is what the sample videos use. Until `decay` caps it
    the EMA averages roughly the last t / (warmup - 1) steps (`train.ema_warmup`; 10 = diffusers' warm-up).
    """

    def __init__(self, model: torch.nn.Module, decay: float, warmup: float = 10.0):
        self.decay, self.warmup = decay, warmup
        self.model = copy.deepcopy(unwrap(model)).float().eval().requires_grad_(False)

    def decay_at(self, step: int) -> float:
        """The decay of the update after optimizer step `step` (1, 2, ...)."""
        return min(self.decay, (1 + step) / (self.warmup + step))

    @torch.no_grad()
    def update(self, model: torch.nn.Module, step: int) -> None:
        d = self.decay_at(step)
        src = unwrap(model)
        for e, p in zip(self.averages(), src.parameters()):  # under FSDP each rank its own slices of both
            _local(e).lerp_(_local(p.detach()).float(), 1.0 - d)
        for e, b in zip(self.model.buffers(), src.buffers()):  # buffers are never sharded
            e.copy_(b)

    def averages(self) -> list[torch.Tensor]:
        """The tensors `update` averages into: `model`'s parameters (a sharded EMA keeps its own)."""
        return list(self.model.parameters())

    @contextlib.contextmanager
    def read(self):
        """The full EMA module, up to date, for one read (validation, a sample video, a checkpoint, rollout-trained
        context): ``with ema.read() as m: ...``. A sharded EMA gathers it on entry and frees it on exit (every rank
        enters: a collective); this one is always whole."""
        yield self.model


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a sharded tensor (a DTensor under FSDP); a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t
