"""Diffusion-forcing training of the denoiser, with exact resume and DistributedDataParallel.

    from arvdm.config import get_preset
    from arvdm.training import train
    train(get_preset("tiny"), "runs/tiny")                  # fresh run
    train(get_preset("tiny"), "runs/tiny", resume=True)     # continue from the newest checkpoint

What one step does (Diffusion Forcing, with the paper's memory): a clip holds m = memory.length memory frames
and w = train.window window frames; every window frame gets its own noise level k ~ U{0..K}; the denoiser sees
the noisy window and the memory and predicts v; the loss is the MSE to the true v (arvdm.training.objective).

Exact resume: everything random comes from state that a checkpoint holds. The data order is a seeded stream of
dataset indices (arvdm.training.loader.ResumableSampler) and the checkpoint stores how far into it the run got;
noise and levels come from a dedicated torch.Generator whose state is saved; model, EMA, optimizer, lr schedule
and step are saved (train.ema_posthoc's power EMAs: their snapshots). A run killed after a checkpoint and resumed
reaches bit-identical weights to an unbroken one (fp32 on a CPU; tests/test_training.py).

Under torchrun every rank takes its own slice of each global batch (batch_size samples per rank), DDP averages
the gradients so the ranks' weights stay identical, and only rank 0 writes logs, sample videos and checkpoints
(behind barriers). `train.fsdp` shards the model instead (arvdm.training.sharding): same arithmetic, checkpoints.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from arvdm.config import Config, ConfigError
from arvdm.hybrid.convert import apply_for_training
from arvdm.model.checkpoint import (
    CheckpointError,
    checkpoint_step,
    load_training_state,
    load_weights,
    resolve_data_path,
    run_folder,
    save_checkpoint,
    unwrap,
)
from arvdm.model.denoiser import Denoiser
from arvdm.model.diffusion import PerFrameDiffusion
from arvdm.runtime import bf16_autocast, native_bf16
from arvdm.schedules.presets import chunked
from arvdm.training import sharding
from arvdm.training.distributed import DistInfo, barrier, cleanup_distributed, distributed_error, setup_distributed
from arvdm.training.loader import (
    ResumableSampler,
    TrainingError,
    collate,
    make_clips,
    make_loader,
    mix_seed,
    pose_memory,
    prepare_data,
    to_device,
)
from arvdm.training.log import LossMeter, RunLogger
from arvdm.training.objective import EMA, diffusion_forcing_loss, make_optimizer, rollout_context
from arvdm.training.power_ema import PostHocEMA
from arvdm.training.resume import Fork, checkpoint_to_resume, restore_rng, rng_states, warn_if_data_differs
from arvdm.training.sample_video import SampleVideo
from data.mirror import mirror_clip, mirror_permutation
from memory.select import recent_frames

UNUSED_NAMES_SHOWN = 3  # parameters named in the "got no gradient" error
# with memory dropout, steps in a row that must leave a parameter without gradient before it is an error
# (p = 0.1: a false alarm has probability 1e-8)
UNUSED_CHECK_STEPS = 8


class Trainer:
    """Builds data, model, EMA, optimizer; runs `fit()`; saves and restores checkpoints.

    `resume=True` continues from the newest complete checkpoint in `run_dir` (an error if there is none);
    `resume=False` refuses a run folder that already holds checkpoints, so a run is never overwritten.
    `fork` (a fresh member k >= 1 of a run with train.member_fork): start from member 0's checkpoint instead.
    """

    def __init__(self, cfg: Config, run_dir: str | os.PathLike, resume: bool = False, *,
                 dist_info: DistInfo | None = None, device: str | None = None, fork: Fork | None = None):
        cfg.validate()
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.dist = dist_info or setup_distributed(device, cfg.train.dist_timeout_s)
        self.device = self.dist.device
        tc = cfg.train
        self.m, self.w, self.K = cfg.memory.length, tc.window, cfg.diffusion.num_levels
        # One optimizer step takes grad_accum micro-batches of batch_size clips on every rank.
        self.global_batch = tc.batch_size * self.dist.world_size * tc.grad_accum
        ckpt = checkpoint_to_resume(self.run_dir, cfg, resume)
        start = ckpt or (fork.start(cfg) if fork else None)  # the weights and training state to load (None: step 0)
        # Found from here, else beside the run folder; saved absolute so the run samples from anywhere.
        cfg.data.abs_path = str(resolve_data_path(cfg, self.run_dir, flag="--data").resolve())

        # Data: clips of m memory frames + w window frames from the same episode.
        self.train_ds = make_clips(cfg, "training", progress=self.dist.is_main)
        self.val_ds = make_clips(cfg, "validation", progress=self.dist.is_main)
        self.sampler = ResumableSampler(len(self.train_ds), tc.batch_size, tc.seed, self.dist.rank,
                                        self.dist.world_size)
        self._build_model()
        if start is not None:
            self._load_weights(start)
        if tc.fsdp:
            self._shard()
        self.optimizer, self.lr_scheduler = make_optimizer(self.model, tc)  # after sharding: it keeps the shards
        # Noise and levels: one generator per rank (ranks must draw different noise), saved in checkpoints.
        self.generator = torch.Generator(device=self.device).manual_seed(mix_seed(tc.seed, "noise", self.dist.rank))
        self.step = 0
        self.elapsed = 0.0  # training seconds over all sessions of this run
        # Where in the sample stream this session starts (a resumed run starts where the checkpoint was).
        self._start_step, self._start_position = 0, 0
        # train.rollout_frames: the one AR step that generates each clip's G frames (as sample.py's chunked schedule)
        self.rollout_schedule = chunked(tc.rollout_frames, self.K, tc.rollout_steps) if tc.rollout_frames else None
        # steps left in which to find every parameter with a gradient (_check_all_parameters_used)
        self._unused_checks_left = UNUSED_CHECK_STEPS if tc.memory_dropout > 0 else 1
        if start is not None:
            self._load(start, fork if ckpt is None else None)
        # train.member_fork: member 0 keeps its step-F checkpoint, which members 1.. start from (0: none kept)
        self.fork_step = tc.fork_steps()[0] if tc.members > 1 else 0
        self._wrap_for_training()
        self.sample_video = SampleVideo(cfg, self.run_dir, self.device)

    def _build_model(self) -> None:
        """The denoiser (seeded: the same initial weights on every rank), its noise tables and its EMA."""
        torch.manual_seed(self.cfg.train.seed)
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True  # tf32 matmuls where bf16 autocast does not reach
            torch.backends.cudnn.allow_tf32 = True
        self.model = Denoiser(self.cfg).to(self.device)
        if self.cfg.hybrid.active:  # fine-tune mode: the chosen layers train with streaming masks (arvdm.hybrid)
            apply_for_training(self.model, self.cfg, self.run_dir)  # records them in cfg.hybrid (saved with the run)
        self.diffusion = PerFrameDiffusion(self.cfg.diffusion)  # noise tables; moves them to the data's device
        self.ema = EMA(self.model, self.cfg.train.ema_decay, self.cfg.train.ema_warmup)
        self.posthoc = PostHocEMA(self.model, self.cfg.train.ema_posthoc, self.cfg.train.ema_posthoc_every)

    def _shard(self) -> None:
        """train.fsdp: the model (and the EMA's state) sharded over the ranks, in place (arvdm.training.sharding)."""
        if not self.dist.enabled:
            raise ConfigError("train.fsdp=true shards the model over several processes; this is one: launch with "
                              "torchrun --nproc_per_node N (on a CPU, train.py with train.cpu_ranks >= 2)")
        sharding.shard_model(self.model, self.device, self.dist.world_size)
        self.ema = sharding.ShardedEMA(self.ema, self.model)
        self.posthoc.shard(self.model)

    def _wrap_for_training(self) -> None:
        """`self.net`: the model compiled and/or wrapped in DDP; `self.autocast`: bf16 where native, when asked."""
        tc = self.cfg.train
        # torch.compile first, then DDP (as nanoGPT does); `unwrap` finds the plain module under both.
        self.net = torch.compile(self.model) if tc.compile else self.model
        if self.dist.enabled and not tc.fsdp:
            self.net = torch.nn.parallel.DistributedDataParallel(
                self.net, device_ids=[self.dist.local_rank] if self.device.type == "cuda" else None,
                # memory dropout leaves the memory's own parameters (pose tags, last-frame stem, cross-attention)
                # without gradient in the steps that drop it: DDP must look for unused parameters then
                find_unused_parameters=tc.find_unused_parameters or tc.memory_dropout > 0)
        device = self.device
        self.autocast = (lambda: bf16_autocast(device)) if tc.bf16 and native_bf16(device) else contextlib.nullcontext

    def close(self) -> None:
        """Drop the DDP wrapper, whose reducer holds the process group, so `cleanup_distributed` can free it."""
        if isinstance(self.net, torch.nn.parallel.DistributedDataParallel):
            self.net = self.net.module

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
        # memory dropout under DDP: one coin per step, a pure function of (seed, step), the same on every rank (a
        # per-rank coin leaves the memory path without gradients on some ranks only); one process keeps the
        # objective's own coin from the noise generator (the sequence the measured main job was trained with)
        drop = (random.Random(mix_seed(tc.seed, "memory_dropout", self.step)).random() < tc.memory_dropout
                if tc.memory_dropout > 0 and self.dist.enabled else None)
        # rollout-trained context reads the EMA in every micro-batch: one read (under FSDP one gather) per step
        with self.ema.read() if tc.rollout_frames else contextlib.nullcontext() as ema_model:
            for i, mb in enumerate(micro_batches):
                video, actions = self._to_device(mb)  # (b, m+w, C, H, W) float in [-1, 1], (b, m+w)
                extras = pose_memory(mb, self.device)  # pose-chosen memory: poses (b, m+w, 3), ages (b, m)
                if tc.mirror_p > 0:  # a share of the clips replaced by their mirror images
                    video, actions, extras = self._mirror(video, actions, extras, i)
                if tc.rollout_frames:  # (b, m+G+w) -> (b, m+w): the recent memory generated by the EMA model
                    video, actions, extras = self._rollout_context(ema_model, video, actions, extras, self.generator)
                # DDP all-reduces the gradients on the last micro-batch only.
                last = i == len(micro_batches) - 1
                with sharding.gradient_sync(self.net, last):
                    total, count = diffusion_forcing_loss(self.net, self.diffusion, video, actions, self.m, self.K,
                                                          self.generator, self.autocast, tc.loss_weight,
                                                          tc.min_snr_gamma, **extras,
                                                          context_noise_max=tc.context_noise_max,
                                                          memory_dropout=tc.memory_dropout, drop_memory=drop,
                                                          copy_gate_loss=tc.copy_gate_loss,
                                                          copy_gate_detach=tc.copy_gate_detach,
                                                          action_dropout=tc.action_dropout,
                                                          shared_levels=self._coins("shared_level", i, len(video),
                                                                                    tc.shared_level_p)
                                                          if tc.shared_level_p > 0 else None,
                                                          top_levels=self._coins("top_level", i, len(video),
                                                                                 tc.top_level_p)
                                                          if tc.top_level_p > 0 else None)
                    total.backward()
                total_sum += total.detach().float()
                count_sum += count.detach().float()
        grad_scale = 1.0 / count_sum.clamp(min=1)
        if self.dist.enabled:  # DDP averaged the per-rank gradient sums: scale by world / Σ counts of all ranks
            sums = torch.stack([total_sum, count_sum])
            dist.all_reduce(sums)
            total_sum, count_sum = sums[0], sums[1]
            grad_scale = self.dist.world_size / count_sum.clamp(min=1)
        if self._unused_checks_left:
            self._check_all_parameters_used()
        torch._foreach_mul_(sharding.local_grads(self.model), grad_scale)  # Σ-loss grads -> grads of the mean loss
        loss = total_sum / count_sum.clamp(min=1)
        # Gradients are already averaged over ranks here, so every rank clips by the same norm.
        max_norm = tc.grad_clip if tc.grad_clip > 0 else float("inf")
        gnorm = sharding.full_tensor(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        self.optimizer.step()
        self.lr_scheduler.step()
        self.step += 1
        self.ema.update(self.model, self.step)
        self.posthoc.update(self.model, self.step)
        return loss.detach(), gnorm.detach()

    def _coins(self, name: str, micro_batch: int, b: int, p: float) -> torch.Tensor:
        """(b,) bool on the device, each True with probability p: a pure function of (seed, name, step, rank,
        micro-batch), not drawn from the noise generator, so a resumed run draws the same ones and p = 0 leaves
        every other draw as it was."""
        gen = torch.Generator().manual_seed(mix_seed(self.cfg.train.seed, name, self.step, self.dist.rank,
                                                     micro_batch))
        return (torch.rand(b, generator=gen) < p).to(self.device)

    def _mirror(self, video: torch.Tensor, actions: torch.Tensor, extras: dict[str, torch.Tensor], micro_batch: int
                ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """train.mirror_p: each clip of the micro-batch replaced by its left-right mirror image (`data.mirror`) with
        that probability (`_coins`)."""
        flip = self._coins("mirror", micro_batch, video.shape[0], self.cfg.train.mirror_p)  # (b,)
        perm = mirror_permutation(self.cfg.data.mirror_actions, self.cfg.model.num_actions)  # (num_actions,)
        m_video, m_actions, m_poses = mirror_clip(video, actions, extras.get("poses"), perm)
        video = torch.where(flip[:, None, None, None, None], m_video, video)  # (b, T, C, H, W)
        actions = torch.where(flip[:, None], m_actions, actions)  # (b, T)
        if m_poses is not None:
            extras = {**extras, "poses": torch.where(flip[:, None, None], m_poses, extras["poses"])}  # (b, T, 3)
        return video, actions, extras

    def _rollout_context(self, model: torch.nn.Module, video: torch.Tensor, actions: torch.Tensor,
                         extras: dict[str, torch.Tensor], generator: torch.Generator
                         ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """train.rollout_frames: the clip with its recent memory generated by `model` (`rollout_context`); `model` is
        the EMA (always in eval mode) or the model being validated (put in eval mode by `validate`)."""
        tc, mem = self.cfg.train, self.cfg.memory
        recent = recent_frames(self.m, mem.pose_frames, mem.select)  # all m with time-chosen memory
        return rollout_context(model, self.diffusion, video, actions, self.m, recent, self.rollout_schedule,
                               generator, self.autocast, eta=self.cfg.diffusion.eta, share=tc.rollout_share, **extras)

    def _check_all_parameters_used(self) -> None:
        """After a session's first backward: a parameter without a gradient would stall DDP's gradient buckets
        (find_unused_parameters=False); name it instead, on one process and under DDP alike. With memory dropout
        a step may have dropped the memory (its parameters then get none): look again on the next steps, and
        raise only when UNUSED_CHECK_STEPS steps in a row left a parameter out."""
        if self.cfg.train.find_unused_parameters:
            self._unused_checks_left = 0
            return
        unused = [n for n, p in self.model.named_parameters() if p.requires_grad and p.grad is None]
        self._unused_checks_left = self._unused_checks_left - 1 if unused else 0
        if unused and not self._unused_checks_left:
            when = f" and the next {UNUSED_CHECK_STEPS - 1}" if self.cfg.train.memory_dropout > 0 else ""
            raise TrainingError(f"{len(unused)} parameters got no gradient in the first step{when} (e.g. "
                                f"{', '.join(unused[:UNUSED_NAMES_SHOWN])}): with memory.structure="
                                f"{self.cfg.memory.structure} and memory.compressor={self.cfg.memory.compressor} "
                                f"the loss does not use them; set train.find_unused_parameters=true to train anyway")

    def _to_device(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """A collated batch on the device: video float (B, T, C, H, W) in [-1, 1] (uint8 converted there), actions."""
        return to_device(batch, self.device)

    # -- the loop --------------------------------------------------------------------------------------
    def fit(self, stop_at: int | None = None) -> Path | None:
        """Train to cfg.train.max_steps; returns the last checkpoint written.

        `stop_at` ends the session after that step as if the process were killed (exact-resume tests use it
        to kill a run at a known step).
        """
        tc, main = self.cfg.train, self.dist.is_main
        self.sampler.position = self.data_position()
        batches = iter(make_loader(self.train_ds, self.sampler, self.cfg.data.num_workers, self.device, tc.seed))
        log = RunLogger(self.run_dir, self.step) if main else None
        bar = tqdm(total=tc.max_steps, initial=self.step, disable=not main, dynamic_ncols=True, desc="train")
        meter = LossMeter(self.device)
        last_ckpt = None
        if main:
            tqdm.write(f"training {self.cfg.preset} on {self.device} x{self.dist.world_size}: "
                       f"{sum(p.numel() for p in self.model.parameters()) / 1e6:.2f}M params, "
                       f"{len(self.train_ds)} training clips of {self.m}+{self.w} frames, global batch "
                       f"{self.global_batch}, run folder {self.run_dir}")
        while self.step < tc.max_steps:
            t0 = time.perf_counter()
            loss, gnorm = self.train_step([next(batches) for _ in range(tc.grad_accum)])
            self.elapsed += time.perf_counter() - t0
            meter.add(loss)
            last = self.step == tc.max_steps
            row = self._log_and_validate(meter, gnorm, bar, last)
            if row and log is not None:
                log.write(self.step, self.elapsed, row)
            if tc.sample_every > 0 and (_due(self.step, tc.sample_every) or last):
                self.write_sample()
            fork = self.step == self.fork_step  # a checkpoint (and post-hoc snapshot) the other members start from
            if self.posthoc.due(self.step, last or fork):  # before the checkpoint: a resume reads its step's snapshot
                self.posthoc.save(self.run_dir, self.step, main)
            if _due(self.step, tc.ckpt_every) or last or fork:
                last_ckpt = self.save()
            bar.update(1)
            if stop_at is not None and self.step >= stop_at:
                break
        bar.close()
        if log is not None:
            log.close()
        return last_ckpt

    def _log_and_validate(self, meter: LossMeter, gnorm: torch.Tensor, bar: tqdm, last: bool) -> dict[str, float]:
        """The log row of the step just taken: training numbers when a log is due, validation when one is."""
        tc, row = self.cfg.train, {}
        if _due(self.step, tc.log_every) or last:
            row.update(meter.report(gnorm, self.lr_scheduler.get_last_lr()[0], self.global_batch * self.w))
            bar.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{row['lr']:.2e}", steps_s=f"{row['steps_per_s']:.2f}")
        if tc.val_every > 0 and (_due(self.step, tc.val_every) or last):
            row["val_loss"] = self.validate(self.net)
            with self.ema.read() as ema_model:  # every rank: a collective under FSDP
                row["val_loss_ema"] = self.validate(ema_model)
            if self.dist.is_main:
                tqdm.write(f"step {self.step}: val loss {row['val_loss']:.4f} (EMA {row['val_loss_ema']:.4f})")
        return row

    # -- validation ------------------------------------------------------------------------------------
    @torch.no_grad()
    def validate(self, model: torch.nn.Module) -> float:
        """Mean v-MSE on fixed validation clips with fixed noise: comparable from step to step.

        Batch j always holds the same clips and draws its noise from a generator seeded by j, so the
        number does not depend on how many ranks share the work (they sum, then all-reduce). A sharded model's
        forward is a collective: then every rank runs as many batches, the ones past the end counted as 0.
        """
        tc, n = self.cfg.train, len(self.val_ds)
        count = min(n, tc.val_batches * tc.batch_size)
        clips = [round(i * n / count) for i in range(count)]  # spread over the split
        batches = [clips[i:i + tc.batch_size] for i in range(0, count, tc.batch_size)]
        was_training = model.training
        model.eval()
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # (Σ loss, Σ counted frames)
        ws = self.dist.world_size
        stop = -(-len(batches) // ws) * ws if sharding.is_sharded(unwrap(model)) else len(batches)
        for j in range(self.dist.rank, stop, ws):
            batch = collate([self.val_ds[i] for i in batches[j % len(batches)]])
            g = torch.Generator(device=self.device).manual_seed(mix_seed(tc.seed, "val", j))
            video, actions = self._to_device(batch)
            extras = pose_memory(batch, self.device)
            if tc.rollout_frames:  # the validated model generates the recent memory, from the same fixed noise
                video, actions, extras = self._rollout_context(unwrap(model), video, actions, extras, g)
            total, cnt = diffusion_forcing_loss(unwrap(model), self.diffusion, video, actions, self.m, self.K, g,
                                                self.autocast, **extras, advection_loss=0.0)  # the v-MSE alone
            sums += torch.stack([total.double(), cnt.double()]) * (j < len(batches))
        if self.dist.enabled:
            dist.all_reduce(sums)
        if sharding.is_sharded(unwrap(model)):  # a forward without backward leaves the root's weights gathered
            unwrap(model).reshard()
        model.train(was_training)
        return (sums[0] / sums[1].clamp(min=1)).item()

    def write_sample(self) -> Path | None:
        """Roll out the EMA model from a few validation clips; write GT | generated as an mp4 (rank 0 only)."""
        with self.ema.read() as ema_model:  # every rank: a collective under FSDP
            return self.sample_video.write(ema_model, self.diffusion, self.step) if self.dist.is_main else None

    # -- checkpoints -----------------------------------------------------------------------------------------
    def training_state(self) -> dict[str, Any]:
        """Everything besides the weights that an exact resume needs (weights_only-loadable)."""
        per_rank = rng_states(self.generator, self.device, self.dist)  # a collective under DDP
        return {
            "step": self.step,
            # under FSDP gathered (a collective) into the unsharded layout: one checkpoint format for all
            "optimizer": (sharding.full_optimizer_state(self.model, self.optimizer) if self.cfg.train.fsdp
                          else self.optimizer.state_dict()),
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
        """Write a checkpoint (rank 0; every rank must call it: it gathers and waits); its folder on rank 0."""
        state = self.training_state()  # a collective under DDP: every rank calls it
        model = sharding.full_model_state(self.model) if self.cfg.train.fsdp else self.model  # FSDP: gathered on rank 0
        path = None
        with self.ema.read() as ema_model:  # every rank: a collective under FSDP
            barrier(self.dist)
            if self.dist.is_main:
                path = save_checkpoint(self.run_dir, self.step, model, self.cfg, ema=ema_model, state=state,
                                       keep=self.cfg.train.keep_checkpoints, protect=(self.fork_step,))
            barrier(self.dist)  # nobody runs ahead (or exits) before the checkpoint is complete
        return path

    def _load_weights(self, ckpt: Path) -> None:
        """The checkpoint's weights and EMA, into the full modules (before FSDP shards them)."""
        load_weights(self.model, ckpt / "model.safetensors")
        load_weights(self.ema.model, ckpt / "ema.safetensors", what="EMA weights")
        self.posthoc.load(run_folder(ckpt), checkpoint_step(ckpt))

    def _load(self, ckpt: Path, fork: Fork | None = None) -> None:
        """Everything else a resume needs: optimizer, lr schedule, step, data position, generators (a fork: not
        the generators, and the lr schedule set back; arvdm.training.resume)."""
        state = load_training_state(ckpt)
        if self.cfg.train.fsdp:
            sharding.load_optimizer_state(self.model, self.optimizer, state["optimizer"])
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.step = self._start_step = int(state["step"])
        self.elapsed = float(state.get("elapsed_s", 0.0))
        data = state["data"]
        self._start_position = int(data["position"])
        warn_if_data_differs(data, {"dataset_len": len(self.train_ds), "world_size": self.dist.world_size,
                                    "batch_size": self.cfg.train.batch_size}, ckpt)
        if fork is None:
            restore_rng(state["rng"], self.generator, self.device, self.dist)
        else:
            fork.set_lr_back(self.lr_scheduler)
        if self.dist.is_main:
            print(f"{'forked from' if fork else 'resumed'} {ckpt} at step {self.step}", file=sys.stderr)


def _due(step: int, every: int) -> bool:
    """Periodic events; every <= 0 means never (the last step still logs, validates and checkpoints)."""
    return every > 0 and step % every == 0


# -- entry point -------------------------------------------------------------------------------------------
def train(cfg: Config, run_dir: str | os.PathLike, resume: bool = False, *, generate_data: bool = False,
          device: str | None = None, fork: Fork | None = None) -> Path | None:
    """Train (or resume) a run; under torchrun joins the process group. Returns the last checkpoint.

    With `generate_data` the stand-in data set is generated first when absent (by local rank 0 of each
    node; the others wait), so a fresh machine needs nothing but `python train.py`.
    """
    joined = dist.is_initialized()  # a caller that joined the group (train.py, for several members) leaves it
    info = setup_distributed(device, cfg.train.dist_timeout_s)
    if cfg.train.cpu_ranks > 1 and not info.enabled and info.device.type == "cpu":
        warnings.warn(f"train.cpu_ranks={cfg.train.cpu_ranks} is launched by train.py's command line; this call "
                      f"trains in one process at batch {cfg.train.batch_size}", stacklevel=2)
    trainer = None
    try:
        if generate_data and not (resume and _found_elsewhere(cfg, run_dir)):
            if info.local_rank == 0:
                prepare_data(cfg)
            barrier(info)
        trainer = Trainer(cfg, run_dir, resume, dist_info=info, fork=fork)
        return trainer.fit()
    except RuntimeError as e:
        lost = distributed_error(e, info, cfg.train.dist_timeout_s)
        if lost is not None:
            raise lost from e
        raise
    finally:
        if trainer is not None:
            trainer.close()
        if not joined:
            cleanup_distributed()


def _found_elsewhere(cfg: Config, run_dir: str | os.PathLike) -> bool:
    """A resumed run whose data is not at data.path from here but was found beside the run folder."""
    try:
        return not Path(cfg.data.path).is_dir() and resolve_data_path(cfg, run_dir).is_dir()
    except CheckpointError:
        return False
