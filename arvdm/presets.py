"""The named presets: each is a dict of `section.key` overrides on the `Config` defaults (data only).

    from arvdm.config import get_preset
    cfg = get_preset("tiny")        # the README's main job; "tiny_time" = tiny with time-chosen memory; "paper"

`tiny_time` is applied on top of `tiny` (`arvdm.config.get_preset`). Every figure a setting rests on is in
benchmarks/RESULTS.md.
"""

from __future__ import annotations

from typing import Any

__all__ = ["PRESETS"]

PRESETS: dict[str, dict[str, Any]] = {
    # The README's main job on a laptop CPU (data, training and a rollout; timings in benchmarks/RESULTS.md):
    # Memory Maze at 32x32 from 48 generated mazes, a small conv U-Net (32 channels at 32 px, 64 at 16 px)
    # around 2 transformer blocks on 8x8 tokens, where the temporal attention, the memory and the KV caches
    # live; 6 memory frames (4 chosen by camera pose, 2 recent) + 4 window frames; lr 2e-3 with min-SNR-5 loss
    # weighting (each setting's effect is measured in benchmarks/RESULTS.md).
    "tiny": {
        "model.image_size": 32, "model.unet_channels": [32, 64], "model.patch_size": 2, "model.dim": 128,
        "model.depth": 2, "model.heads": 4,
        "memory.length": 6, "memory.select": "pose", "memory.pose_frames": 4,
        "data.resize": 32, "data.path": "datasets/memory_maze_32_mixed",
        "data.generate_episodes": 48, "data.generate_policy": "mixed",
        "train.window": 4, "train.batch_size": 8, "train.lr": 2e-3, "train.warmup_steps": 100,
        # 0.995 is reached only from step 1,790 (the EMA's warm-up min(decay, (1+t)/(10+t))): at 1,050 steps the
        # EMA follows the warm-up throughout (0.9915 at the end; 0.998 gives the same weights bit for bit)
        "train.ema_decay": 0.995,
        # two CPU ranks of batch 8 (global batch 16) for 1,050 steps: the main job's ~13 min of training on a 2-core
        # CPU with bf16 (train.bf16, native on CPUs with AVX512-BF16/AMX); against one process at batch 8 for 1,600
        # steps in about the same time, +0.8 / +1.1 dB over generated frames 17-64 of fresh random-action / mixed
        # episodes, paired (benchmarks/RESULTS.md)
        "train.cpu_ranks": 2, "train.max_steps": 1050, "train.val_every": 525, "train.ckpt_every": 525,
        "train.sample_every": 1050,
        # the issue-21 levers (benchmarks/RESULTS.md): context frames noised up to level 100 in training, generated
        # frames committed at level 20 when sampling; memory dropped in 10% of the steps (history guidance)
        "train.context_noise_max": 100, "diffusion.context_level": 20, "train.memory_dropout": 0.1,
        # the most recent past frame at full resolution beside every window frame (benchmarks/RESULTS.md:
        # +1.3 dB over frames 17-64 of fresh random-action episodes, paired)
        "model.last_frame_input": True,
        # that frame moved along the window's actions by learned 21x21 kernels (CDNA advection; a turn shifts the
        # 32 px frame ~7 px): +0.43 / +0.24 dB over generated frames 1-4 / 17-64 of fresh random-action episodes,
        # paired; look-around memory gain +5.78 dB against +6.45 (benchmarks/RESULTS.md)
        "model.action_advection": 10,
        # a gate that copies the last observed frame where the scene is still, trained by its own BCE to the better
        # of copying and the network (the v-MSE detached from it): first 4 generated frames of fresh random-action
        # episodes +2.1 to +2.3 dB over the main job before it, above copy-last in the mean (benchmarks/RESULTS.md)
        "model.copy_gate": "observed", "train.copy_gate_loss": 0.02, "train.copy_gate_detach": True,
        # sampling holds each frame's low frequencies (1 px Gaussian) to its level-K prediction in the calls above
        # level 100 (arvdm.pipeline.anchor): paired on fresh 32-episode sets, every span gains, frames 17-64 +0.63 /
        # +0.14 dB (random-action / mixed), first 4 +0.17 / +0.27, no extra model call (benchmarks/RESULTS.md)
        "diffusion.anchor_sigma": 1.0, "diffusion.anchor_floor": 100,
        # a second member, an anchor member: forked from member 0 at step 875 (5/6 of the run) with seed 1 and trained
        # 175 steps (~2.5 min) on the one call it answers, every window frame at level K (train.member_top_level_p);
        # its level-K prediction joins the anchor. Paired on fresh random-action episodes against the plain fork
        # (lr set back 525 steps, all levels; the default before), frames 17-64 +0.40 dB, 65-120 +0.48, first 4 +0.06
        # (benchmarks/RESULTS.md, "anchor members")
        "train.members": 2, "train.member_fork": 5 / 6, "train.member_fork_lr_back": 0.0,
        "train.member_top_level_p": 1.0,
    },
    # The tiny model with time-based memory (the 4 most recent frames; the main job before pose-aware memory):
    # the baseline a pose-aware run is compared with, and the preset tests of time-based machinery build on.
    # Without the levers and with the old step count: exactly the time-based main job the earlier measurements used.
    "tiny_time": {"memory.length": 4, "memory.select": "time", "memory.pose_frames": 0,
                  "train.context_noise_max": 0, "diffusion.context_level": 0, "train.memory_dropout": 0.0,
                  "diffusion.anchor_sigma": 0.0, "diffusion.anchor_floor": 0,
                  "model.last_frame_input": False, "model.action_advection": 0, "model.copy_gate": "off",
                  "train.copy_gate_loss": 0.0, "train.copy_gate_detach": False, "train.cpu_ranks": 1,
                  "train.members": 1, "train.member_fork": 0.0, "train.member_fork_lr_back": 0.0,
                  "train.member_top_level_p": 0.0,
                  "train.max_steps": 1500, "train.val_every": 500, "train.ckpt_every": 500, "train.sample_every": 1500},
    # Paper-scale (Meta-ARVDM's DMLab setting: 64 px, 16-frame windows, long memory); for a GPU.
    "paper": {
        "model.patch_size": 4, "model.dim": 512, "model.depth": 12, "model.heads": 8,
        "model.temporal_attention": "full",
        "memory.length": 48,
        "train.window": 16, "train.batch_size": 32, "train.lr": 1e-4, "train.warmup_steps": 2000,
        "train.max_steps": 200_000, "train.val_every": 2000, "train.sample_every": 10_000,
        "train.ckpt_every": 2000, "train.ema_decay": 0.9999,
        "data.generate_episodes": 2000, "data.generate_length": 300, "data.num_workers": 8,
    },
}
