"""Diffusion-forcing training of the denoiser, with exact resume and DistributedDataParallel.

    from arvdm.config import get_preset
    from arvdm.training.trainer import train
    train(get_preset("tiny"), "runs/tiny")                  # fresh run
    train(get_preset("tiny"), "runs/tiny", resume=True)     # continue from the newest checkpoint

What one step does (Diffusion Forcing, with the paper's memory): a clip holds m = memory.length
clean memory frames followed by w = train.window window frames; every window frame gets its own
noise level k ~ U{0..K}; the denoiser sees the noisy window and the clean memory and predicts v;
the loss is the MSE to the true v over the window frames.

Exact resume: everything random comes from state that a checkpoint holds. The data order is a seeded
stream of dataset indices (one torch.randperm per epoch, seeded from (seed, epoch)) and the checkpoint
stores how far into it the run got; noise and levels come from a dedicated torch.Generator whose state
is saved; model, EMA, optimizer, lr schedule and step are saved. A run killed after a checkpoint and
resumed reaches bit-identical weights to an unbroken one (fp32 on a CPU; tests/test_training.py).

Under torchrun every rank takes its own slice of each global batch (batch_size samples per rank),
DDP averages the gradients so the ranks' weights stay identical, and only rank 0 writes logs, sample
videos and checkpoints (behind barriers).
"""

from __future__ import annotations

import contextlib
import copy
import csv
import datetime
import hashlib
import math
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from arvdm.config import Config, ConfigError
from arvdm.errors import ArvdmError
from arvdm.model.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_config,
    load_training_state,
    load_weights,
    resolve_data_path,
    save_checkpoint,
    state_dict_for_safetensors,
    unwrap,
)

MIN_LR_RATIO = 0.1  # cosine decay ends at lr / 10 (as in nanoGPT / Chinchilla)
SAMPLE_WINDOWS = 2  # ... and how many windows of frames it then generates
SAMPLE_STEPS = 20  # denoising steps per AR step for the sample video (chunked schedule)
SAMPLE_CLIPS = 2  # validation clips in the sample video (stacked vertically)
LOG_COLUMNS = ["step", "loss", "lr", "grad_norm", "steps_per_s", "frames_per_s", "val_loss", "val_loss_ema",
               "elapsed_s"]


class TrainingError(ArvdmError):
    """A user-facing problem with the data or the run folder (missing data, wrong resolution, ...)."""


class DistributedError(ArvdmError, RuntimeError):
    """Under DDP, this rank lost the others: one died, hung past train.dist_timeout_s, or cannot be reached."""


# Words in a collective's error that mean "another rank is gone", not a bug in this process.
_COMM_FAILURE_WORDS = ("gloo", "nccl", "connection", "timed out", "timeout", "broken pipe", "peer", "socket")


# -- distributed ------------------------------------------------------------------------------------
@dataclass
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def setup_distributed(device: str | None = None, timeout_s: float = 600.0) -> DistInfo:
    """Join the process group when launched by torchrun (RANK/WORLD_SIZE set); else one process.

    NCCL on GPUs, gloo on CPUs. Each rank uses cuda:LOCAL_RANK when CUDA is available. A collective
    that waits `timeout_s` for a rank that died or hung raises instead of hanging the job.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and "RANK" in os.environ:
        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
        use_cuda = torch.cuda.is_available() and device != "cpu"
        if use_cuda:
            torch.cuda.set_device(local)
        if not dist.is_initialized():
            dist.init_process_group(backend="nccl" if use_cuda else "gloo",
                                    timeout=datetime.timedelta(seconds=timeout_s))
        return DistInfo(rank, local, world, torch.device(f"cuda:{local}" if use_cuda else "cpu"))
    dev = torch.device(device) if device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return DistInfo(device=dev)


def cleanup_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def _mix(*parts: Any) -> int:
    """A 63-bit seed from several values (seed, epoch, rank, ...); stable across runs and machines."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") >> 1


# -- data order ---------------------------------------------------------------------------------------
class ResumableSampler:
    """An endless, seeded stream of dataset indices, sharded over ranks, that can start anywhere.

    The global stream is epoch 0's permutation, then epoch 1's, ... (torch.randperm with a generator
    seeded from (seed, epoch)). Step s consumes stream items [s*G, (s+1)*G) with G = batch_size *
    world_size, and rank r takes the r-th slice of batch_size of them. `position` (items consumed
    before the first batch) is all a checkpoint needs to restart the stream exactly.
    """

    def __init__(self, n: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1,
                 position: int = 0):
        if n < 1:
            raise TrainingError("the training split has no clips")
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.rank, self.world_size, self.position = rank, world_size, position

    def permutation(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(_mix(self.seed, "epoch", epoch))
        return torch.randperm(self.n, generator=g)

    def take(self, start: int, count: int) -> list[int]:
        out: list[int] = []
        while len(out) < count:
            epoch, offset = divmod(start + len(out), self.n)
            perm = self.permutation(epoch)
            out += perm[offset:offset + count - len(out)].tolist()
        return out

    def __iter__(self) -> Iterator[list[int]]:
        pos, global_batch = self.position, self.batch_size * self.world_size
        while True:
            chunk = self.take(pos, global_batch)
            yield chunk[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
            pos += global_batch


# -- data sets -------------------------------------------------------------------------------------
def prepare_data(cfg: Config) -> Path:
    """Generate the stand-in data set at cfg.data.path if it is absent or incomplete (resumable)."""
    from data.generate import ensure_dataset

    size = cfg.data.resize or cfg.model.image_size
    return Path(ensure_dataset(cfg.data.path, cfg.data.env, cfg.data.generate_episodes, cfg.data.generate_length,
                               cfg.data.generate_policy, cfg.data.generate_seed, size=size,
                               workers=max(1, min(2, os.cpu_count() or 1))))


def make_dataset(cfg: Config, split: str, n_frames: int, random_start: bool = True, progress: bool = False):
    """ClipDataset of `split` with clips of `n_frames`; checks resolution and actions against the model."""
    from data.dataset import ClipDataset

    root = Path(cfg.data.abs_path or cfg.data.path)  # Trainer sets abs_path to where it found the data
    if not root.is_dir():
        raise TrainingError(f"no data: {root} does not exist (data.path must hold training/ and validation/; "
                            f"run `python train.py` without --data to generate the stand-in, or "
                            f"`python -m data.generate memory_maze --out {root}`)")
    # uint8 clips: the loader only slices bytes; Trainer._to_device converts them on the device.
    ds = ClipDataset(root / split, n_frames, frame_skip=cfg.data.frame_skip, random_start=random_start,
                     resize=cfg.data.resize, skip_bad=cfg.data.skip_bad_files, progress=progress,
                     video_dtype="uint8")
    h, w = ds.frame_size
    if (h, w) != (cfg.model.image_size, cfg.model.image_size):
        raise TrainingError(
            f"data at another resolution: {ds.split_dir} has {h}x{w} frames but model.image_size="
            f"{cfg.model.image_size}; set data.resize={cfg.model.image_size} (or model.image_size={h})")
    if ds.num_actions > cfg.model.num_actions:
        raise TrainingError(f"{ds.split_dir} has actions up to {ds.num_actions - 1} but model.num_actions="
                            f"{cfg.model.num_actions}; set model.num_actions={ds.num_actions}")
    return ds


def _collate(items: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    return {"video": torch.stack([it["video"] for it in items]),
            "actions": torch.stack([torch.as_tensor(it["actions"]) for it in items]).long()}


class _Batches(torch.utils.data.Dataset):
    """Adapts a clip dataset to the loader; the batch sampler hands in lists of indices."""

    def __init__(self, ds):
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return self.ds[i]


# -- the objective -----------------------------------------------------------------------------------
def memory_frames(frames: torch.Tensor, actions: torch.Tensor):
    """The model's `memory=` argument for clean past frames (B,m,C,H,W) and their actions (B,m)."""
    from memory import MemoryFrames

    return MemoryFrames(frames, actions)  # positions 0..m-1; the window follows at m..m+w-1


def diffusion_forcing_loss(model, diffusion, video: torch.Tensor, actions: torch.Tensor, memory_length: int,
                           num_levels: int, generator: torch.Generator, autocast=contextlib.nullcontext,
                           weight: str = "uniform", gamma: float = 5.0):
    """Sum over frames of the weighted per-frame v-MSE, and how many frames were counted.

    video (B, m+w, C, H, W), actions (B, m+w): the first m frames are clean memory, the rest the window.
    Each window frame draws its own level in 0..K (diffusion forcing). Frames that drew level 0 are clean
    inputs: their v-target is pure noise the model cannot know, so they condition the others but are
    left out of the loss (they still teach it to read clean frames in the window). `weight` is
    `PerFrameDiffusion.loss_weight`'s kind (uniform or min_snr with `gamma`).
    """
    m = memory_length
    x0, act = video[:, m:], actions[:, m:]  # (B, w, C, H, W), (B, w)
    b, w = x0.shape[:2]
    levels = torch.randint(0, num_levels + 1, (b, w), generator=generator, device=generator.device)
    noise = torch.randn(x0.shape, generator=generator, device=generator.device, dtype=x0.dtype)
    levels, noise = levels.to(x0.device), noise.to(x0.device)
    x_t = diffusion.add_noise(x0, noise, levels)  # (B, w, C, H, W)
    target = diffusion.v_target(x0, noise, levels)
    mem = memory_frames(video[:, :m], actions[:, :m]) if m > 0 else None
    with autocast():
        v = model(x_t, levels, act, memory=mem)
    per_frame = (v.float() - target.float()).pow(2).mean(dim=(2, 3, 4))  # (B, w)
    counted = (levels > 0).to(per_frame.dtype)  # (B, w)
    w_levels = diffusion.loss_weight(levels, weight, gamma).to(per_frame.dtype)  # (B, w)
    return (per_frame * w_levels * counted).sum(), counted.sum()


def lr_factor(step: int, warmup: int, max_steps: int) -> float:
    """Linear warm-up to 1 over `warmup` steps, then cosine decay to MIN_LR_RATIO at `max_steps`."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return MIN_LR_RATIO + (1.0 - MIN_LR_RATIO) * 0.5 * (1.0 + math.cos(math.pi * progress))


class EMA:
    """Exponential moving average of the weights, kept in fp32 whatever the training precision.

    The decay warms up as min(decay, (1 + t) / (10 + t)): with a plain 0.999 a short run's EMA would
    still be mostly the random initial weights, and the EMA is what the sample videos use.
    """

    def __init__(self, model: torch.nn.Module, decay: float):
        self.decay = decay
        self.model = copy.deepcopy(unwrap(model)).float().eval().requires_grad_(False)

    @torch.no_grad()
    def update(self, model: torch.nn.Module, step: int) -> None:
        d = min(self.decay, (1 + step) / (10 + step))
        src = unwrap(model)
        for e, p in zip(self.model.parameters(), src.parameters()):
            e.lerp_(p.detach().float(), 1.0 - d)
        for e, b in zip(self.model.buffers(), src.buffers()):
            e.copy_(b)


# -- the trainer ---------------------------------------------------------------------------------------
class Trainer:
    """Builds data, model, EMA, optimizer; runs `fit()`; saves and restores checkpoints.

    `resume=True` continues from the newest complete checkpoint in `run_dir` (an error if there is none);
    `resume=False` refuses a run folder that already holds checkpoints, so a run is never overwritten.
    """

    def __init__(self, cfg: Config, run_dir: str | os.PathLike, resume: bool = False, *,
                 dist_info: DistInfo | None = None, device: str | None = None):
        from arvdm.model.denoiser import Denoiser
        from arvdm.model.diffusion import PerFrameDiffusion

        cfg.validate()
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.dist = dist_info or setup_distributed(device, cfg.train.dist_timeout_s)
        self.device = self.dist.device
        tc = cfg.train
        self.m, self.w, self.K = cfg.memory.length, tc.window, cfg.diffusion.num_levels
        # One optimizer step takes grad_accum micro-batches of batch_size clips on every rank.
        self.global_batch = tc.batch_size * self.dist.world_size * tc.grad_accum

        ckpt = latest_checkpoint(self.run_dir)
        if resume and ckpt is None:
            raise CheckpointError(f"--resume: {self.run_dir} has no complete checkpoint to resume from")
        if not resume and ckpt is not None:
            raise CheckpointError(f"{self.run_dir} already holds checkpoints (newest {ckpt.name}); pass --resume "
                                  f"to continue it or choose another --out")
        if resume:
            _check_resumable(load_config(ckpt), cfg, ckpt)
        # Found from here, else beside the run folder; saved absolute so the run samples from anywhere.
        cfg.data.abs_path = str(resolve_data_path(cfg, self.run_dir, flag="--data").resolve())

        # Data: clips of m memory frames + w window frames from the same episode.
        self.train_ds = make_dataset(cfg, "training", self.m + self.w, progress=self.dist.is_main)
        self.val_ds = make_dataset(cfg, "validation", self.m + self.w, progress=self.dist.is_main)
        self.sampler = ResumableSampler(len(self.train_ds), tc.batch_size, tc.seed, self.dist.rank,
                                        self.dist.world_size)

        # Model: the same seed on every rank gives the same initial weights (DDP also broadcasts them).
        torch.manual_seed(tc.seed)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True  # tf32 matmuls where bf16 autocast does not reach
            torch.backends.cudnn.allow_tf32 = True
        self.model = Denoiser(cfg).to(self.device)
        if cfg.hybrid.active:  # fine-tune mode: the chosen layers train with streaming masks (arvdm.hybrid)
            from arvdm.hybrid.convert import apply_for_training

            apply_for_training(self.model, cfg, self.run_dir)  # records them in cfg.hybrid (saved with the run)
        self.diffusion = PerFrameDiffusion(cfg.diffusion)  # noise tables; moves them to the data's device
        self.ema = EMA(self.model, tc.ema_decay)

        # AdamW; weight decay only on matrices (not on norms, biases, embeddings' scales), as in nanoGPT.
        params = [p for p in self.model.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": tc.weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=tc.lr, betas=(0.9, 0.99))
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, tc.warmup_steps, tc.max_steps))

        # Noise and levels: one generator per rank (ranks must draw different noise), saved in checkpoints.
        self.generator = torch.Generator(device=self.device).manual_seed(_mix(tc.seed, "noise", self.dist.rank))
        self.step = 0
        self.elapsed = 0.0  # training seconds over all sessions of this run
        # Where in the sample stream this session starts (a resumed run starts where the checkpoint was).
        self._start_step, self._start_position = 0, 0
        if resume:
            self._load(ckpt)

        # torch.compile first, then DDP (as nanoGPT does); `unwrap` finds the plain module under both.
        self.net = torch.compile(self.model) if tc.compile else self.model
        if self.dist.enabled:
            self.net = torch.nn.parallel.DistributedDataParallel(
                self.net, device_ids=[self.dist.local_rank] if self.device.type == "cuda" else None,
                find_unused_parameters=tc.find_unused_parameters)
        use_bf16 = tc.bf16 and self.device.type == "cuda"
        self.autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if use_bf16 \
            else contextlib.nullcontext

    # -- one step ------------------------------------------------------------------------------------
    def train_step(self, batch: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step on one batch, or on a list of micro-batches (gradient accumulation).

        The objective is Σ loss / Σ counted frames over every micro-batch and rank, so N micro-batches of b
        clips give exactly the loss and gradients of one batch of N·b (a mean of per-micro-batch means
        would not: each micro-batch counts a different number of noisy frames). Each micro-batch's sum is
        back-propagated as it comes (activations of one micro-batch at a time); the gradients are divided
        by the total count at the end, on the device, so the step reads nothing back to the host.
        """
        micro_batches = batch if isinstance(batch, list) else [batch]
        tc = self.cfg.train
        self.net.train()
        self.optimizer.zero_grad(set_to_none=True)
        total_sum = torch.zeros((), device=self.device)
        count_sum = torch.zeros((), device=self.device)
        for i, mb in enumerate(micro_batches):
            video, actions = self._to_device(mb)  # (b, m+w, C, H, W) float in [-1, 1], (b, m+w)
            # DDP all-reduces the gradients on the last micro-batch only.
            last = i == len(micro_batches) - 1
            sync = contextlib.nullcontext() if last or not self.dist.enabled else self.net.no_sync()
            with sync:
                total, count = diffusion_forcing_loss(self.net, self.diffusion, video, actions, self.m, self.K,
                                                      self.generator, self.autocast, tc.loss_weight,
                                                      tc.min_snr_gamma)
                total.backward()
            total_sum += total.detach().float()
            count_sum += count.detach().float()
        grad_scale = 1.0 / count_sum.clamp(min=1)
        if self.dist.enabled:  # DDP averaged the per-rank gradient sums: scale by world / Σ counts of all ranks
            sums = torch.stack([total_sum, count_sum])
            torch.distributed.all_reduce(sums)
            total_sum, count_sum = sums[0], sums[1]
            grad_scale = self.dist.world_size / count_sum.clamp(min=1)
        if self.step == self._start_step:
            self._check_all_parameters_used()
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        torch._foreach_mul_(grads, grad_scale)  # Σ-loss gradients -> gradients of the mean loss
        loss = total_sum / count_sum.clamp(min=1)
        # Gradients are already averaged over ranks here, so every rank clips by the same norm.
        gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                               self.cfg.train.grad_clip if self.cfg.train.grad_clip > 0 else
                                               float("inf"))
        self.optimizer.step()
        self.lr_scheduler.step()
        self.step += 1
        self.ema.update(self.model, self.step)
        return loss.detach(), gnorm.detach()

    def _check_all_parameters_used(self) -> None:
        """After the first backward: a parameter without a gradient would stall DDP's gradient buckets
        (find_unused_parameters=False); name it instead, on one process and under DDP alike."""
        if self.cfg.train.find_unused_parameters:
            return
        unused = [n for n, p in self.model.named_parameters() if p.requires_grad and p.grad is None]
        if unused:
            raise TrainingError(f"{len(unused)} parameters got no gradient in the first step (e.g. "
                                f"{', '.join(unused[:3])}): with memory.structure={self.cfg.memory.structure} and "
                                f"memory.compressor={self.cfg.memory.compressor} the loss does not use them; "
                                f"set train.find_unused_parameters=true to train anyway")
    def _to_device(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """A collated batch on the device: video float (B, T, C, H, W) in [-1, 1] (uint8 converted there), actions."""
        from data.dataset import to_float_video

        video = to_float_video(batch["video"].to(self.device, non_blocking=True))
        return video, batch["actions"].to(self.device, non_blocking=True)

    # -- the loop --------------------------------------------------------------------------------------
    def fit(self, stop_at: int | None = None) -> Path | None:
        """Train to cfg.train.max_steps; returns the last checkpoint written.

        `stop_at` ends the session after that step as if the process were killed (tests use it).
        """
        tc, main = self.cfg.train, self.dist.is_main
        self.sampler.position = self.data_position()
        loader = torch.utils.data.DataLoader(
            _Batches(self.train_ds), batch_sampler=self.sampler, collate_fn=_collate,
            num_workers=self.cfg.data.num_workers, pin_memory=self.device.type == "cuda",
            persistent_workers=self.cfg.data.num_workers > 0,
            # Its own generator, so building the loader does not consume the global RNG (exact resume).
            generator=torch.Generator().manual_seed(_mix(tc.seed, "loader")))
        batches = iter(loader)
        log = _Logger(self.run_dir, self.step) if main else None
        bar = tqdm(total=tc.max_steps, initial=self.step, disable=not main, dynamic_ncols=True, desc="train")
        last_ckpt, loss_sum, loss_n = None, torch.zeros((), device=self.device), 0
        t_log, steps_since_log = time.perf_counter(), 0
        if main:
            tqdm.write(f"training {self.cfg.preset} on {self.device} x{self.dist.world_size}: "
                       f"{sum(p.numel() for p in self.model.parameters()) / 1e6:.2f}M params, "
                       f"{len(self.train_ds)} training clips of {self.m}+{self.w} frames, global batch "
                       f"{self.global_batch}, run folder {self.run_dir}")
        while self.step < tc.max_steps:
            t0 = time.perf_counter()
            loss, gnorm = self.train_step([next(batches) for _ in range(tc.grad_accum)])
            self.elapsed += time.perf_counter() - t0
            loss_sum += loss
            loss_n += 1
            steps_since_log += 1
            row: dict[str, Any] = {}
            last = self.step == tc.max_steps
            if _due(self.step, tc.log_every) or last:
                dt = time.perf_counter() - t_log
                sps = steps_since_log / dt
                row.update(loss=(loss_sum / loss_n).item(), lr=self.lr_scheduler.get_last_lr()[0],
                           grad_norm=gnorm.item(), steps_per_s=sps, frames_per_s=sps * self.global_batch * self.w)
                loss_sum.zero_()
                loss_n, steps_since_log, t_log = 0, 0, time.perf_counter()
                bar.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}", steps_s=f"{sps:.2f}")
            if tc.val_every > 0 and (_due(self.step, tc.val_every) or last):
                row["val_loss"] = self.validate(self.net)
                row["val_loss_ema"] = self.validate(self.ema.model)
                if main:
                    tqdm.write(f"step {self.step}: val loss {row['val_loss']:.4f} (EMA {row['val_loss_ema']:.4f})")
            if row and log is not None:
                log.write(self.step, self.elapsed, row)
            if tc.sample_every > 0 and (_due(self.step, tc.sample_every) or last):
                self.write_sample()
            if _due(self.step, tc.ckpt_every) or last:
                last_ckpt = self.save()
            bar.update(1)
            if stop_at is not None and self.step >= stop_at:
                break
        bar.close()
        if log is not None:
            log.close()
        dump = os.environ.get("ARVDM_TEST_DUMP_WEIGHTS")
        if dump:  # test hook (tests/test_ddp.py): every rank writes its final weights
            from safetensors.torch import save_file
            Path(dump).mkdir(parents=True, exist_ok=True)
            save_file(state_dict_for_safetensors(self.model), str(Path(dump) / f"rank{self.dist.rank}.safetensors"))
        return last_ckpt

    # -- validation ------------------------------------------------------------------------------------
    @torch.no_grad()
    def validate(self, model: torch.nn.Module) -> float:
        """Mean v-MSE on fixed validation clips with fixed noise: comparable from step to step.

        Batch j always holds the same clips and draws its noise from a generator seeded by j, so the
        number does not depend on how many ranks share the work (they sum, then all-reduce).
        """
        tc, n = self.cfg.train, len(self.val_ds)
        count = min(n, tc.val_batches * tc.batch_size)
        clips = [round(i * n / count) for i in range(count)]  # spread over the split
        batches = [clips[i:i + tc.batch_size] for i in range(0, count, tc.batch_size)]
        was_training = model.training
        model.eval()
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)
        for j in range(self.dist.rank, len(batches), self.dist.world_size):
            batch = _collate([self.val_ds[i] for i in batches[j]])
            g = torch.Generator(device=self.device).manual_seed(_mix(tc.seed, "val", j))
            video, actions = self._to_device(batch)
            total, cnt = diffusion_forcing_loss(unwrap(model), self.diffusion, video, actions, self.m, self.K, g,
                                                self.autocast)
            sums += torch.stack([total.double(), cnt.double()])
        if self.dist.enabled:
            dist.all_reduce(sums)
        model.train(was_training)
        return (sums[0] / sums[1].clamp(min=1)).item()

    # -- sample video --------------------------------------------------------------------------------------
    @torch.no_grad()
    def write_sample(self) -> Path | None:
        """Roll out the EMA model from a few validation frames; write GT | generated as an mp4 (rank 0)."""
        if not self.dist.is_main:
            return None
        from arvdm.pipeline.rollout import rollout
        from arvdm.schedules.matrix import get_schedule

        ctx = self.cfg.default_context()  # the frames the model remembers in training, as sample.py
        n_gen = SAMPLE_WINDOWS * self.w
        if not hasattr(self, "_sample_ds"):
            from data.dataset import DatasetError
            try:
                self._sample_ds = make_dataset(self.cfg, "validation", ctx + n_gen, random_start=False)
            except DatasetError as e:  # e.g. validation episodes shorter than context + 2 windows
                self._sample_ds = None
                tqdm.write(f"note: sample videos skipped: {e}")
        ds = self._sample_ds
        if ds is None:
            return None
        picks = [round(i * len(ds) / SAMPLE_CLIPS) for i in range(min(SAMPLE_CLIPS, len(ds)))]
        batch = _collate([ds[i] for i in picks])
        video, actions = self._to_device(batch)
        schedule = get_schedule("chunked", self.w, self.K, SAMPLE_STEPS)
        g = torch.Generator(device=self.device).manual_seed(_mix(self.cfg.train.seed, "sample"))
        fake = rollout(self.ema.model, self.diffusion, schedule, video[:, :ctx], actions[:, :ctx],
                       actions[:, ctx:], n_gen, eta=self.cfg.diffusion.eta, generator=g,
                       progress=False)  # (B, n_gen, C, H, W)
        real = video[:, ctx:]
        path = self.run_dir / "samples" / f"step_{self.step:07d}.mp4"
        write_side_by_side(path, real, fake)
        tqdm.write(f"step {self.step}: sample video {path}")
        return path

    # -- checkpoints -----------------------------------------------------------------------------------------
    def training_state(self) -> dict[str, Any]:
        """Everything besides the weights that an exact resume needs (weights_only-loadable)."""
        rng = {"noise": self.generator.get_state(), "torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        per_rank = _gather(rng, self.dist)  # each rank's generators differ: keep them all
        return {
            "step": self.step,
            "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "rng": per_rank,
            "data": {"position": self.data_position(),
                     "dataset_len": len(self.train_ds), "batch_size": self.cfg.train.batch_size,
                     "world_size": self.dist.world_size},
            "elapsed_s": self.elapsed,
        }

    def data_position(self) -> int:
        """Samples of the global index stream consumed so far (every step takes one global batch)."""
        return self._start_position + (self.step - self._start_step) * self.global_batch

    def save(self) -> Path | None:
        state = self.training_state()  # a collective under DDP: every rank calls it
        path = None
        _barrier(self.dist)
        if self.dist.is_main:
            path = save_checkpoint(self.run_dir, self.step, self.model, self.cfg, ema=self.ema.model, state=state,
                                   keep=self.cfg.train.keep_checkpoints)
        _barrier(self.dist)  # nobody runs ahead (or exits) before the checkpoint is complete
        return path

    def _load(self, ckpt: Path) -> None:
        state = load_training_state(ckpt)
        load_weights(self.model, ckpt / "model.safetensors")
        load_weights(self.ema.model, ckpt / "ema.safetensors", what="EMA weights")
        self.optimizer.load_state_dict(state["optimizer"])
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.step = self._start_step = int(state["step"])
        self.elapsed = float(state.get("elapsed_s", 0.0))
        data = state["data"]
        self._start_position = int(data["position"])
        if data["dataset_len"] != len(self.train_ds) or data["world_size"] != self.dist.world_size \
                or data["batch_size"] != self.cfg.train.batch_size:
            print(f"warning: resuming {ckpt} with a different data set size, batch size or number of ranks "
                  f"({data}); training continues but will not match an unbroken run", file=sys.stderr)
        rngs = state["rng"]
        if len(rngs) == self.dist.world_size:
            mine = rngs[self.dist.rank]
            self.generator.set_state(mine["noise"])
            torch.set_rng_state(mine["torch"])
            if self.device.type == "cuda" and "cuda" in mine:
                torch.cuda.set_rng_state(mine["cuda"], self.device)
        if self.dist.is_main:
            print(f"resumed {ckpt} at step {self.step}", file=sys.stderr)


def _due(step: int, every: int) -> bool:
    """Periodic events; every <= 0 means never (the last step still logs, validates and checkpoints)."""
    return every > 0 and step % every == 0


def _check_resumable(saved: Config, cfg: Config, ckpt: Path) -> None:
    """The model, memory and diffusion sections must equal the checkpoint's (the weights depend on them)."""
    a, b = saved.to_dict(), cfg.to_dict()
    diff = [f"{s}.{k}: checkpoint {a[s][k]!r}, now {b[s].get(k)!r}"
            for s in ("model", "memory", "diffusion") for k in a[s] if a[s][k] != b[s].get(k)]
    if diff:
        raise ConfigError(f"cannot resume {ckpt}: the config differs from the checkpoint's: " + "; ".join(diff))


def _gather(obj: dict[str, torch.Tensor], info: DistInfo) -> list[dict[str, torch.Tensor]]:
    obj = {k: v.cpu() for k, v in obj.items()}
    if not info.enabled:
        return [obj]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


# -- outputs ----------------------------------------------------------------------------------------------
def write_side_by_side(path: str | os.PathLike, real: torch.Tensor, fake: torch.Tensor, fps: int = 8) -> Path:
    """mp4 with ground truth (left) beside generated (right), one row per clip; (B,T,C,H,W) in [-1, 1]."""
    from arvdm.pipeline.video import side_by_side, write_video

    scale = max(1, 128 // real.shape[-2])  # small frames are upscaled so the video is watchable
    return write_video(path, side_by_side(real.cpu(), fake.cpu(), scale=scale), fps=fps)


class _Logger:
    """log.csv (appended across resumes; rows after the resumed step are dropped) + optional TensorBoard."""

    def __init__(self, run_dir: Path, step: int):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "log.csv"
        kept: list[dict[str, str]] = []
        if self.path.exists():  # a resumed run: forget what happened after its checkpoint
            with open(self.path, newline="") as f:
                kept = [r for r in csv.DictReader(f) if r.get("step", "").isdigit() and int(r["step"]) <= step]
        self.file = open(self.path, "w", newline="")  # noqa: SIM115 - open for the whole run, closed in close()
        self.writer = csv.DictWriter(self.file, fieldnames=LOG_COLUMNS)
        self.writer.writeheader()
        self.writer.writerows({k: r.get(k, "") for k in LOG_COLUMNS} for r in kept)
        self.file.flush()
        self.tb = None
        try:  # TensorBoard only when it is installed; torch.utils.tensorboard alone needs the package
            import tensorboard  # noqa: F401
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(run_dir / "tensorboard"))
        except ImportError:
            pass

    def write(self, step: int, elapsed: float, row: dict[str, float]) -> None:
        out = {k: "" for k in LOG_COLUMNS}
        out.update({k: f"{v:.6g}" for k, v in row.items()}, step=str(step), elapsed_s=f"{elapsed:.1f}")
        self.writer.writerow(out)
        self.file.flush()
        if self.tb is not None:
            for k, v in row.items():
                self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


# -- entry point -------------------------------------------------------------------------------------------
def train(cfg: Config, run_dir: str | os.PathLike, resume: bool = False, *, generate_data: bool = False,
          device: str | None = None) -> Path | None:
    """Train (or resume) a run; under torchrun joins the process group. Returns the last checkpoint.

    With `generate_data` the stand-in data set is generated first when absent (by local rank 0 of each
    node; the others wait), so a fresh machine needs nothing but `python train.py`.
    """
    info = setup_distributed(device, cfg.train.dist_timeout_s)
    try:
        if generate_data and not (resume and _found_elsewhere(cfg, run_dir)):
            if info.local_rank == 0:
                prepare_data(cfg)
            _barrier(info)
        trainer = Trainer(cfg, run_dir, resume, dist_info=info)
        return trainer.fit()
    except RuntimeError as e:
        if info.enabled and (isinstance(e, dist.DistError) or any(w in str(e).lower() for w in _COMM_FAILURE_WORDS)):
            raise DistributedError(f"rank {info.rank} of {info.world_size} lost the other ranks (one died, hung "
                                   f"longer than train.dist_timeout_s={cfg.train.dist_timeout_s:g} s, or is "
                                   f"unreachable): {str(e).strip().splitlines()[0]}; continue the run with "
                                   f"--resume from its last checkpoint") from e
        raise
    finally:
        cleanup_distributed()


def _found_elsewhere(cfg: Config, run_dir: str | os.PathLike) -> bool:
    """A resumed run whose data is not at data.path from here but was found beside the run folder."""
    try:
        return not Path(cfg.data.path).is_dir() and resolve_data_path(cfg, run_dir).is_dir()
    except CheckpointError:
        return False
