"""Run configuration: nested dataclasses, named presets, dotted `key=value` overrides.

A run is described by one `Config`; its JSON form is saved beside every checkpoint so that
`from_pretrained` rebuilds the same model and `sample.py` knows how it was trained.

    cfg = get_preset("tiny")
    cfg = apply_overrides(cfg, ["memory.structure=cross_attention", "train.max_steps=200"])
    cfg.validate()
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from arvdm.errors import ArvdmError, ConfigError, SamplingError  # errors importable from here too, as before
from arvdm.presets import PRESETS  # the named presets' overrides (data only)
from arvdm.setting_checks import as_number, check_anchor_floor, check_anchor_sigma, check_eta
from memory.select import recent_frames

SCHEDULE_PRESETS = ("chunked", "fifo", "pyramid")  # names arvdm.schedules.get_schedule builds
MEMORY_SELECT = ("time", "pose")  # how training chooses memory frames (memory/select.py)
MEMORY_STRUCTURES = ("prepend", "channel_concat", "cross_attention")  # how the past reaches the network
PREPEND, CHANNEL_CONCAT, CROSS_ATTENTION = MEMORY_STRUCTURES
TEMPORAL_ATTENTION_FORMS = ("factorized", "full")  # per spatial position | all tokens of all frames
FACTORIZED, FULL = TEMPORAL_ATTENTION_FORMS
COPY_GATES = ("off", "pixel", "frame", "observed")  # none, per pixel, per frame, per pixel on real last frames
FROZEN_DRAFT = "frozen"  # speculation's default draft: the target with frozen v (arvdm.speculative.rows)


@dataclass
class DiffusionConfig:
    """Noise tables come from a diffusers scheduler; levels 0..num_levels, 0 = clean, K = pure noise."""

    num_levels: int = 1000  # K; level k >= 1 is diffusers timestep k - 1
    beta_schedule: str = "squaredcos_cap_v2"  # any diffusers beta_schedule: linear, scaled_linear, sigmoid, ...
    prediction_type: str = "v_prediction"
    eta: float = 1.0  # DDIM eta when sampling (sample.py --eta, training sample videos): 0 = DDIM, 1 = DDPM-like
    # k_ctx when sampling (sample.py --context-level): the level finished frames sit at in memory (Diffusion Forcing /
    # GameNGen, for train.context_noise_max > 0); 0 = clean, the schedules as written. Schedule files keep their own.
    context_level: int = 0
    # the low-frequency anchor when sampling (sample.py --anchor-sigma / --anchor-floor, arvdm.pipeline.anchor):
    # blur σ in pixels (0 = off) and the level its pull stops at
    anchor_sigma: float = 0.0
    anchor_floor: int = 0

    def anchor(self, sigma: float | None = None, floor: int | None = None, flags: tuple[str, str] = (
            "anchor_sigma", "anchor_floor"), error: type[ArvdmError] = SamplingError,
               supported: bool = True) -> tuple[float, int]:
        """The anchor's (σ, floor) to sample with, checked: None = this config's σ (0 where the sampler does not
        support an anchor, ``supported=False``: speculative rows), and its floor when σ > 0 (else 0); errors name
        ``flags``."""
        own = self.anchor_sigma if supported else 0.0
        sigma = check_anchor_sigma(own if sigma is None else sigma, flags[0], error)
        floor = check_anchor_floor((self.anchor_floor if sigma else 0) if floor is None else floor,
                                   self.num_levels, flags[1], error)
        if floor and not sigma:
            own_sigma = "" if flags[0] == "diffusion.anchor_sigma" else f" (diffusion.anchor_sigma {self.anchor_sigma})"
            raise error(f"{flags[1]} {floor} needs an anchor, but {flags[0]} is 0{own_sigma}; give {flags[0]} > 0")
        return sigma, floor

    def validate(self) -> None:
        _check(self.num_levels >= 2, "diffusion.num_levels", self.num_levels, "must be >= 2")
        self.anchor(self.anchor_sigma, self.anchor_floor, ("diffusion.anchor_sigma", "diffusion.anchor_floor"),
                    ConfigError)
        _check(type(self.context_level) is int and 0 <= self.context_level < self.num_levels, "diffusion.context_level",
               self.context_level, f"must be an integer in 0..{self.num_levels - 1} (a noise level below pure noise)")
        _check(self.beta_schedule in ("linear", "scaled_linear", "squaredcos_cap_v2", "sigmoid"),
               "diffusion.beta_schedule", self.beta_schedule,
               "must be one of linear, scaled_linear, squaredcos_cap_v2, sigmoid")
        _check(self.prediction_type == "v_prediction", "diffusion.prediction_type", self.prediction_type,
               "only v_prediction is supported")
        check_eta(self.eta, "diffusion.eta")


@dataclass
class ModelConfig:
    """The spatio-temporal denoiser (pixel space, patchified)."""

    image_size: int = 64
    channels: int = 3
    patch_size: int = 8
    dim: int = 128
    depth: int = 4
    heads: int = 4
    mlp_ratio: float = 4.0
    num_actions: int = 18  # Memory Maze has 6, Crafter 17
    # Conv U-Net levels around the token grid (level i: unet_channels[i] channels at image_size / 2**i); [] = a DiT
    unet_channels: list = field(default_factory=list)
    frames_per_chunk: int = 1  # c: frames that see each other; serves schedules whose delta is a multiple of c
    temporal_attention: str = FACTORIZED  # one of TEMPORAL_ATTENTION_FORMS
    last_frame_input: bool = False  # the last past frame at full resolution (GameNGen); needs unet_channels, memory
    copy_gate: str = "off"  # a gate on the predicted clean frame that copies the last frame: COPY_GATES (Denoiser)
    action_advection: int = 0  # r > 0: that frame moved along the actions by learned (2r+1)^2 kernels (ActionAdvection)

    @property
    def token_grid(self) -> int:
        """Tokens per side of a frame: image_size / (2**(levels-1) * patch_size)."""
        return self.image_size // (2 ** max(0, len(self.unet_channels) - 1) * self.patch_size)

    def validate(self) -> None:
        _check(isinstance(self.unet_channels, list) and all(isinstance(c, int) and c >= 1
                                                             for c in self.unet_channels),
               "model.unet_channels", self.unet_channels, "must be a list of positive ints, e.g. [32, 64]")
        step = 2 ** max(0, len(self.unet_channels) - 1) * self.patch_size
        _check(self.image_size > 0 and self.image_size % step == 0, "model.image_size", self.image_size,
               f"must be a positive multiple of model.patch_size={self.patch_size}"
               + (f" x 2**(levels-1) = {step} (model.unet_channels={self.unet_channels})"
                  if len(self.unet_channels) > 1 else ""))
        _check(self.dim % self.heads == 0, "model.dim", self.dim, f"must be divisible by model.heads={self.heads}")
        _check((self.dim // self.heads) % 2 == 0, "model.dim", self.dim,
               f"/ model.heads={self.heads} = {self.dim // self.heads} channels per head must be even "
               "(temporal RoPE rotates pairs of channels)")
        _check(self.depth >= 1, "model.depth", self.depth, "must be >= 1")
        _check(self.num_actions >= 1, "model.num_actions", self.num_actions, "must be >= 1")
        _check(self.frames_per_chunk >= 1, "model.frames_per_chunk", self.frames_per_chunk, "must be >= 1")
        _check(self.temporal_attention in TEMPORAL_ATTENTION_FORMS, "model.temporal_attention",
               self.temporal_attention, "must be 'factorized' or 'full'")
        _check(isinstance(self.last_frame_input, bool), "model.last_frame_input", self.last_frame_input, "must be bool")
        _check(self.copy_gate in COPY_GATES and (self.copy_gate == "off" or self.last_frame_input), "model.copy_gate",
               self.copy_gate, f"must be one of {COPY_GATES}; all but off need model.last_frame_input=true")
        _check(type(self.action_advection) is int and 0 <= self.action_advection < self.image_size and not (
            self.action_advection and not self.last_frame_input), "model.action_advection", self.action_advection,
            f"must be an int in 0..{self.image_size - 1} (0 = off); > 0 needs model.last_frame_input=true")
        _check(not self.last_frame_input or bool(self.unet_channels), "model.last_frame_input", self.last_frame_input,
               "needs conv levels (model.unet_channels, e.g. [32, 64]): the last frame enters through the first conv")
        patch_values = self.patch_size ** 2 * self.channels
        if self.dim < patch_values and not self.unet_channels:
            warnings.warn(f"model.dim={self.dim} is smaller than the {patch_values} values of a "
                          f"{self.patch_size}x{self.patch_size} patch: tokens cannot carry the noise, and samples "
                          f"stay noisy; use model.dim >= {patch_values} or a smaller model.patch_size", stacklevel=3)


@dataclass
class MemoryConfig:
    """How the past reaches the network (paper: prepend / channel concat / cross-attention)."""

    structure: str = PREPEND  # one of MEMORY_STRUCTURES
    length: int = 8  # m: past frames the bank keeps (under `retention`)
    compressor: str = "none"  # none | joint | modulated
    budget: int = 0  # B latent frames after compression; 0 = no compression (B = m)
    retention: str = "last"  # all | last | sink_recent
    sink: int = 0  # s, for sink_recent
    recent: int = 0  # r, for sink_recent
    # memory/select.py: "time" = the retention policy above; "pose" = `pose_frames` of the m memory frames chosen from
    # the older past by pose match to the window, the rest the most recent (training clips alike; poses read).
    select: str = "time"  # time | pose
    pose_frames: int = 0  # k (select=pose): memory frames chosen by pose, 1..length
    bank_size: int = 1024  # select=pose: frames a rollout keeps per sample to choose from (redundant views dropped)
    match_share: float = 0.5  # select=pose: share of training windows with an earlier matching view (oversampled)
    stop_share: float = 0.0  # select=pose: share of training windows where the agent comes to a stop (oversampled)

    def validate(self) -> None:
        _check(self.structure in MEMORY_STRUCTURES, "memory.structure",
               self.structure, "must be prepend, channel_concat or cross_attention")
        _check(self.length >= 0, "memory.length", self.length, "must be >= 0")
        _check(self.length >= 1 or self.structure == PREPEND, "memory.length", self.length,
               f"must be >= 1 with memory.structure={self.structure} (with 0 memory frames the memory layers "
               "would have nothing to read)")
        _check(self.compressor in ("none", "joint", "modulated"), "memory.compressor", self.compressor,
               "must be none, joint or modulated")
        _check(self.retention in ("all", "last", "sink_recent"), "memory.retention", self.retention,
               "must be all, last or sink_recent")
        if self.compressor != "none":
            _check(1 <= self.budget <= self.length, "memory.budget", self.budget,
                   f"must be in 1..memory.length={self.length} when memory.compressor={self.compressor}")
        else:
            _check(self.budget in (0, self.length), "memory.budget", self.budget,
                   "needs memory.compressor=joint|modulated (budget 0 = keep all m raw frames)")
        if self.retention == "sink_recent":
            _check(self.sink >= 0 and self.recent >= 1 and self.sink + self.recent <= max(self.length, 1),
                   "memory.sink/recent", (self.sink, self.recent),
                   f"need sink >= 0, recent >= 1 and sink + recent <= memory.length={self.length}")
        _check(not (self.structure == CHANNEL_CONCAT and self.compressor == "none" and self.retention == "all"),
               "memory.retention", self.retention,
               "is unbounded, but memory.structure=channel_concat with memory.compressor=none has a fixed number "
               "of slots (memory.length): use last or sink_recent, or a compressor")
        _check(self.select in MEMORY_SELECT, "memory.select", self.select, f"must be one of {MEMORY_SELECT}")
        if self.select == "pose":
            _check(1 <= self.pose_frames <= self.length, "memory.pose_frames", self.pose_frames,
                   f"must be in 1..memory.length={self.length} with memory.select=pose")
            _check(self.bank_size >= self.length, "memory.bank_size", self.bank_size,
                   f"must be >= memory.length={self.length}")
            _check(0.0 <= self.match_share and 0.0 <= self.stop_share and self.match_share + self.stop_share < 1.0,
                   "memory.match_share/stop_share", (self.match_share, self.stop_share), "must be >= 0, sum < 1")
            _check(self.compressor == "none" and self.retention == "last", "memory.compressor/retention",
                   (self.compressor, self.retention), "must be none/last with memory.select=pose (the window's "
                   "memory is chosen per window; compressed or streaming banks are not supported with it)")


@dataclass
class DataConfig:
    path: str = "datasets/memory_maze_64"  # a TECO-layout folder with training/ and validation/
    abs_path: str = ""  # `path` made absolute by train.py (a run folder then finds its data from anywhere)
    env: str = "memory_maze"  # generator used when `path` is absent: memory_maze | crafter
    generate_episodes: int = 24
    generate_length: int = 128
    generate_policy: str = "revisit"
    generate_seed: int = 0  # seed of the generated stand-in data set (independent of train.seed)
    frame_skip: int = 1
    resize: int = 0  # 0 = native resolution
    num_workers: int = 0
    skip_bad_files: bool = False
    # the data's left-right mirror (data.mirror): which action each action becomes in a clip's mirror image, e.g.
    # Memory Maze [0, 1, 3, 2, 5, 4] (turns swap); empty = no mirror (train.mirror_p needs one)
    mirror_actions: list = field(default_factory=list)

    def validate(self) -> None:
        _check(self.env in ("memory_maze", "crafter"), "data.env", self.env, "must be memory_maze or crafter")
        for key, low in (("frame_skip", 1), ("generate_seed", 0), ("resize", 0)):
            _check(getattr(self, key) >= low, f"data.{key}", getattr(self, key), f"must be >= {low}")


@dataclass
class TrainConfig:
    window: int = 8  # w: frames the denoiser sees at once (the schedule's window)
    batch_size: int = 8
    lr: float = 3e-4
    weight_decay: float = 0.0
    warmup_steps: int = 100
    max_steps: int = 2000
    grad_clip: float = 1.0
    loss_weight: str = "min_snr"  # uniform | min_snr: per-level weight of the v-MSE (PerFrameDiffusion.loss_weight)
    min_snr_gamma: float = 5.0
    ema_decay: float = 0.999
    # c in the EMA's warm-up min(ema_decay, (1+t)/(c+t)): until the decay caps it the EMA averages roughly the last
    # t/(c-1) steps (10: t/9; smaller = a longer average). ema_decay is reached from step (c*d - 1)/(1 - d)
    ema_warmup: float = 10.0
    # Post-hoc EMA (EDM2; arvdm.training.posthoc_ema): power-function EMAs of these lengths σ_rel (e.g. [0.05, 0.1]),
    # written every ema_posthoc_every steps to RUN/ema_snapshots/; any length is rebuilt from them after training
    ema_posthoc: list = field(default_factory=list)
    ema_posthoc_every: int = 25
    log_every: int = 10
    val_every: int = 250
    val_batches: int = 4
    sample_every: int = 1000  # 0 = never
    ckpt_every: int = 250
    keep_checkpoints: int = 2
    seed: int = 0
    # M independent models trained one after another, each for max_steps with seed + k (arvdm.training.members):
    # member 0 in the run folder, member k in RUN/members/k; sampling averages their level-K predictions (the anchor)
    members: int = 1
    # Late fork (0 = off; shares of max_steps, so they scale with it; no effect with one member): members 1.. start
    # from member 0's checkpoint at step F = member_fork x max_steps (kept) with their own seed, and train on to
    # max_steps with the lr schedule set B = member_fork_lr_back x max_steps steps back (arvdm.training.resume.Fork)
    member_fork: float = 0.0
    member_fork_lr_back: float = 0.0
    member_top_level_p: float = 0.0  # members 1..'s train.top_level_p (anchor members; none with one member)
    bf16: bool = True  # bf16 autocast where native: CUDA, a CPU with AVX512-BF16/AMX (arvdm.runtime.native_bf16)
    dist_timeout_s: float = 600.0  # DDP: a rank waiting this long on the others (one died or hung) gives up
    # data-parallel ranks of one thread each that `python train.py` launches on a CPU (torchrun, gloo); each takes
    # batch_size, like a GPU rank. Faster than one process on all cores for small models (docs/training.md)
    cpu_ranks: int = 1
    find_unused_parameters: bool = False  # DDP: a loss leaving some parameter unused (on with memory_dropout > 0)
    fsdp: bool = False  # shard weights, gradients and AdamW state over the ranks (FSDP2) instead of DDP's replicas
    grad_accum: int = 1  # micro-batches of batch_size per optimizer step (exact: one batch of grad_accum x)
    compile: bool = False  # torch.compile the denoiser for training (a GPU speed-up; slow first steps)
    # Noisy context (GameNGen 2024, Diffusion Forcing 2024): each memory frame is noised to a level drawn in
    # 0..context_noise_max (told to the model); 0 = clean memory, no extra draw (bit-identical to before).
    context_noise_max: int = 0
    # History guidance (DFoT 2025): the share of training steps whose batch sees no memory; 0 = no extra draw.
    memory_dropout: float = 0.0
    # share of training clips replaced by their left-right mirror image (data.mirror_actions says how actions map)
    mirror_p: float = 0.0
    # share of training clips whose window frames share one level (a chunked rollout's window), not one each
    shared_level_p: float = 0.0
    # share of training clips whose window frames all sit at level K (the one call an anchor member answers)
    top_level_p: float = 0.0
    action_dropout: float = 0.0  # action guidance (CFG over actions): share of clips whose window has no actions
    # Rollout-trained context (Self-Forcing, Huang et al. 2025; 0 = off): the EMA model generates the G frames before
    # each window from its memory in rollout_steps steps; the window trains with the memory it would then have.
    rollout_frames: int = 0
    rollout_steps: int = 5
    rollout_share: float = 1.0  # share of clips given the generated frames; the rest keep the real ones
    copy_gate_loss: float = 0.0  # model.copy_gate: weight of the BCE to the best gate (objective.copy_target)
    copy_gate_detach: bool = False  # v-MSE on the network's own v (before the gate); the gate learns by the BCE alone

    def fork_steps(self) -> tuple[int, int]:
        """(F, B): the step members 1.. fork from member 0 at (0: no fork) and the steps their lr schedule goes back."""
        n = self.max_steps
        return round(as_number(self.member_fork) * n), round(as_number(self.member_fork_lr_back) * n)

    def validate(self) -> None:
        for key in ("window", "batch_size", "max_steps", "keep_checkpoints", "grad_accum", "cpu_ranks", "members"):
            _check(getattr(self, key) >= 1, f"train.{key}", getattr(self, key), "must be >= 1")
        _check(0 <= as_number(self.member_fork) < 1, "train.member_fork", self.member_fork,
               "must be 0 (no fork) or a share in (0, 1) of train.max_steps (the step members 1.. fork at)")
        _check(0 <= as_number(self.member_fork_lr_back) <= as_number(self.member_fork), "train.member_fork_lr_back",
               self.member_fork_lr_back, f"must be a share of train.max_steps in 0..train.member_fork="
               f"{self.member_fork} (how far back the fork's lr schedule goes)")
        fork = self.fork_steps()[0]  # with one member there is nobody to fork: the setting has no effect
        _check(as_number(self.member_fork) == 0 or self.members == 1 or 1 <= fork < self.max_steps, "train.member_fork",
               self.member_fork, f"forks at step {fork} of train.max_steps={self.max_steps}, which must be in "
               f"1..{self.max_steps - 1} (or train.members=1: no fork, one model)")
        _check(self.lr > 0, "train.lr", self.lr, "must be > 0")
        _check(0.0 <= self.ema_decay < 1.0, "train.ema_decay", self.ema_decay, "must be in [0, 1)")
        _check(math.isfinite(as_number(self.ema_warmup)) and self.ema_warmup > 1.0, "train.ema_warmup", self.ema_warmup,
               "must be a number > 1 (the c of the warm-up (1+t)/(c+t))")
        _check(isinstance(self.ema_posthoc, list) and all(
            isinstance(x, (int, float)) and 0 < as_number(x) <= 0.28 for x in self.ema_posthoc),
               "train.ema_posthoc", self.ema_posthoc, "must be a list of lengths sigma_rel in (0, 0.28]")
        _check(type(self.ema_posthoc_every) is int and self.ema_posthoc_every >= 1 and (
            not self.ema_posthoc or self.ckpt_every % self.ema_posthoc_every == 0), "train.ema_posthoc_every",
            self.ema_posthoc_every, f"must be an integer >= 1 dividing train.ckpt_every={self.ckpt_every} (a resume "
            "takes the power EMAs from the snapshots at the checkpoint's step)")
        _check(self.loss_weight in ("uniform", "min_snr"), "train.loss_weight", self.loss_weight,
               "must be uniform or min_snr")
        _check(self.min_snr_gamma > 0, "train.min_snr_gamma", self.min_snr_gamma, "must be > 0")
        _check(self.dist_timeout_s > 0, "train.dist_timeout_s", self.dist_timeout_s, "must be > 0 seconds")
        for key, what in (("memory_dropout", "steps without memory"), ("action_dropout", "clips without actions")):
            _check(isinstance(v := getattr(self, key), (int, float)) and not isinstance(v, bool) and 0.0 <= v < 1.0,
                   f"train.{key}", v, f"must be in [0, 1) (the share of {what})")
        for key, low in (("rollout_frames", 0), ("rollout_steps", 1)):
            _check(type(v := getattr(self, key)) is int and v >= low, f"train.{key}", v, f"must be an integer >= {low}")
        _check(0 < as_number(self.rollout_share) <= 1, "train.rollout_share", self.rollout_share, "must be in (0, 1]")
        for key, what in (("mirror_p", "mirrored clips"), ("shared_level_p", "clips with one level per window"),
                          ("top_level_p", "clips whose window sits at level K"),
                          ("member_top_level_p", "members 1..'s clips whose window sits at level K")):
            _check(0 <= as_number(v := getattr(self, key)) <= 1, f"train.{key}", v,
                   f"must be in [0, 1] (the share of {what})")


HYBRID_SELECT = ("online", "offline", "fixed")


@dataclass
class HybridConfig:
    """Hybrid attention (LightTransfer, arXiv 2410.13846): the `fraction` of temporal-attention layers with the
    highest lazy ratios stream (keep `sink` first + `recent` last frames); the others keep all. See arvdm.hybrid."""

    fraction: float = 0.0  # share of temporal layers made streaming; 0 = the base model
    select: str = "online"  # online (during the context commit) | offline (lazy_ratios.json) | fixed (`layers`)
    layers: list = field(default_factory=list)  # select=fixed: the layer indices that stream
    sink: int = 2  # s: first frames a streaming layer keeps
    recent: int = 4  # r: most recent frames a streaming layer keeps
    last_frames: int = 2  # the lazy ratio averages the kept mass of the queries of the last frames
    ratios: str = ""  # select=offline: a lazy_ratios.json; "" = the run folder's own

    @property
    def active(self) -> bool:
        """True when some layer may become streaming."""
        return self.fraction > 0 or (self.select == "fixed" and len(self.layers) > 0)

    def validate(self) -> None:
        _check(0.0 <= self.fraction <= 1.0, "hybrid.fraction", self.fraction, "must be in [0, 1]")
        _check(self.select in HYBRID_SELECT, "hybrid.select", self.select, f"must be one of {HYBRID_SELECT}")
        _check(isinstance(self.layers, list) and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                      for i in self.layers)
               and len(set(self.layers)) == len(self.layers), "hybrid.layers", self.layers,
               "must be a list of distinct layer indices >= 0, e.g. [0, 2]")
        for key, low in (("sink", 0), ("recent", 1), ("last_frames", 1)):
            _check(getattr(self, key) >= low, f"hybrid.{key}", getattr(self, key), f"must be >= {low}")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    diffusion: DiffusionConfig = field(default_factory=DiffusionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    hybrid: HybridConfig = field(default_factory=HybridConfig)
    preset: str = "tiny"

    def validate(self) -> "Config":
        for part in (self.model, self.memory, self.diffusion, self.data, self.train, self.hybrid):
            part.validate()
        _check(self.train.window % self.model.frames_per_chunk == 0, "train.window", self.train.window,
               f"must be a multiple of model.frames_per_chunk={self.model.frames_per_chunk}")
        _check(not self.model.last_frame_input or self.memory.length >= 1, "model.last_frame_input",
               self.model.last_frame_input, f"needs memory.length >= 1 (its last frame), got {self.memory.length}")
        tc, k_max = self.train, self.diffusion.num_levels - 1
        _check(type(tc.context_noise_max) is int and 0 <= tc.context_noise_max <= k_max, "train.context_noise_max",
               tc.context_noise_max, f"must be an integer in 0..diffusion.num_levels-1 = 0..{k_max} (0 = clean memory)")
        g, c, mem = tc.rollout_frames, self.model.frames_per_chunk, self.memory
        _check(g % c == 0, "train.rollout_frames", g, f"must be a multiple of model.frames_per_chunk={c}")
        _check(not g or recent_frames(mem.length, mem.pose_frames, mem.select) >= 1, "train.rollout_frames", g,
               "needs recent memory frames for the generated ones")
        _check(not g or tc.rollout_steps <= k_max + 1, "train.rollout_steps", tc.rollout_steps,
               f"must be <= diffusion.num_levels={k_max + 1}")
        gate_loss = as_number(tc.copy_gate_loss)
        _check(0 <= gate_loss < math.inf and (not gate_loss or self.model.copy_gate != "off"), "train.copy_gate_loss",
               tc.copy_gate_loss, "must be a finite number >= 0; > 0 needs model.copy_gate")
        _check(type(tc.copy_gate_detach) is bool and (not tc.copy_gate_detach or tc.copy_gate_loss > 0),
               "train.copy_gate_detach", tc.copy_gate_detach, "must be true or false; true needs copy_gate_loss > 0")
        perm, n = self.data.mirror_actions, self.model.num_actions
        _check(isinstance(perm, list) and len(perm) <= n and all(type(a) is int for a in perm) and sorted(perm) == list(
            range(len(perm))) and all(perm[a] == i for i, a in enumerate(perm)), "data.mirror_actions", perm,
               f"must list actions 0..L-1 (L <= model.num_actions={n}; actions from L on stay themselves) each once, "
               "each pair swapped both ways (mirroring twice is the identity), or be empty")
        _check(not tc.mirror_p or perm, "train.mirror_p", tc.mirror_p,
               "needs data.mirror_actions (which action each action becomes in the mirror image)")
        return self

    def default_context(self) -> int:
        """Ground-truth frames a rollout conditions on unless told otherwise: memory.length rounded up to whole
        chunks, at least one chunk (the one rule of sample.py, the sample videos, the grids, the hybrid report)."""
        c = self.model.frames_per_chunk
        return -(-max(self.memory.length, 1) // c) * c

    # -- (de)serialisation -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Config":
        cfg = cls()
        for section, values in d.items():
            if not hasattr(cfg, section):
                raise ConfigError(f"unknown config section {section!r}")
            if isinstance(values, dict):
                for k, v in values.items():
                    _set(cfg, f"{section}.{k}", v)
            else:
                setattr(cfg, section, values)
        return cfg

def parse_device(name: str | None, flag: str = "--device") -> "torch.device":
    """"auto" or None (cuda when available, else cpu), or a torch device name that this machine has."""
    if name is None or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as e:
        raise ConfigError(f"{flag} {name!r} is not a device name (auto, cpu, cuda, cuda:1): {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{flag} {name}: CUDA is not available on this machine; use {flag} cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"{flag} {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def get_preset(name: str) -> Config:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    cfg = Config(preset=name)
    for key, value in {**(PRESETS["tiny"] if name == "tiny_time" else {}), **PRESETS[name]}.items():
        _set(cfg, key, value)
    return cfg


def apply_overrides(cfg: Config, overrides: list[str]) -> Config:
    """Apply `section.key=value` strings (values parsed as JSON when they parse, else as strings)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, raw = item.split("=", 1)
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        _set(cfg, key.strip(), value)
    return cfg


def _set(cfg: Config, key: str, value: Any) -> None:
    parts = key.split(".")
    if len(parts) != 2:
        raise ConfigError(f"config key {key!r} must be section.name, e.g. memory.length")
    section, name = parts
    obj = getattr(cfg, section, None)
    if obj is None or not dataclasses.is_dataclass(obj):
        sections = [f.name for f in dataclasses.fields(cfg) if dataclasses.is_dataclass(getattr(cfg, f.name))]
        raise ConfigError(f"unknown config section {section!r} in {key!r}; sections: {sections}")
    fields = {f.name: f for f in dataclasses.fields(obj)}
    if name not in fields:
        raise ConfigError(f"unknown config key {key!r}; {section} has {sorted(fields)}")
    current = getattr(obj, name)
    if isinstance(current, bool):
        if isinstance(value, str) and value.lower() in ("true", "false"):
            value = value.lower() == "true"
        ok = isinstance(value, bool)
    elif isinstance(current, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(current, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif isinstance(current, str):
        value = str(value) if not isinstance(value, (dict, list)) else value
        ok = isinstance(value, str)
    else:
        ok = True
    if not ok:
        raise ConfigError(f"config key {key!r} expects {type(current).__name__}, got {value!r}")
    setattr(obj, name, value)


def _check(ok: bool, key: str, value: Any, why: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} {why}")
