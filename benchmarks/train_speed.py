"""Training throughput: steps/s, frames/s and MFU of the diffusion-forcing step: fp32, as configured, compiled.

    python benchmarks/train_speed.py                          # tiny, this CPU: fp32 vs as configured (bf16 if native)
    python benchmarks/train_speed.py --modes eager compiled   # eager vs torch.compile (minutes of compile time)
    python benchmarks/train_speed.py --preset paper --device cuda --peak-tflops 989   # bf16 on an H100/H200
    python benchmarks/train_speed.py --modes fp32 --profile 4  # where a step's time goes, by op and input shape

Each mode is the real Trainer's `train_step` (forward, backward, AdamW, EMA): `eager` as configured (bf16
autocast when train.bf16 and the device has native bf16: CUDA, a CPU with AVX512-BF16/AMX), `fp32` the same
with train.bf16 off, `compiled` as configured under torch.compile; on a few batches of a small synthetic data
set, loaded once and cycled (the cost of a step does not depend on the pixels; the loader is measured by
benchmarks/data_throughput.py). Warm-up steps (where torch.compile compiles) are untimed; then the modes take
turns, `--steps` steps per turn for `--rounds` rounds, and each reports its median turn, so load on a shared
machine hits them alike. `--profile N` then runs N more steps of each mode under torch.profiler and prints its
costliest ops (self time per step, grouped by input shape) and the step's time by kind of op (convolutions,
matmuls, attention, the rest): the answer to "can kernels make this much faster". FLOPs per step are counted
once with torch.utils.flop_counter (matmuls, convolutions, attention; forward + backward), which gives achieved
TFLOP/s and, with --peak-tflops (or a known GPU), MFU.
frames/s counts window frames (the ones with a loss): batch_size x window per step; memory frames are extra
input on top.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see train.py

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from arvdm.config import apply_overrides, get_preset
from arvdm.runtime import native_bf16
from arvdm.training.loader import collate, pose_memory
from arvdm.training.objective import diffusion_forcing_loss
from arvdm.training.trainer import Trainer
from data.episodes import write_episode


def synthetic_data(root: Path, cfg, episodes: int = 4) -> Path:
    size = cfg.data.resize or cfg.model.image_size
    length = (cfg.memory.length + cfg.train.window) * cfg.data.frame_skip + 8
    rng = np.random.default_rng(0)
    for split in ("training", "validation"):
        (root / split).mkdir(parents=True, exist_ok=True)
        for e in range(episodes):
            video = rng.integers(0, 256, (length, size, size, 3), dtype=np.uint8)
            pose = np.cumsum(rng.normal(0.0, 0.1, (length, 3)), axis=0).astype(np.float32)  # for pose memory
            write_episode(root / split / f"ep{e:04d}.npz", video,
                          rng.integers(0, min(6, cfg.model.num_actions), length), pose)
    return root


# mode -> overrides on the preset: as configured (bf16 where native), bf16 off, as configured and compiled
MODES = {"eager": ["train.compile=false"], "fp32": ["train.compile=false", "train.bf16=false"],
         "compiled": ["train.compile=true"]}
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0, "L40S": 362.0, "A10": 125.0}  # dense, no sparsity


def peak_tflops(device: torch.device, given: float | None) -> float | None:
    if given:
        return given
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in PEAK_BF16_TFLOPS.items():
            if key in name:
                return value
    return None


def count_step_flops(trainer: Trainer, batch: dict) -> int:
    """FLOPs of one training step's forward + backward (the optimizer's elementwise work is not counted)."""
    model = trainer.model  # eager, whatever the mode: dynamo-compiled graphs hide their ops from the counter
    g = torch.Generator(device=trainer.device).manual_seed(0)
    with FlopCounterMode(display=False) as counter:
        video, actions = trainer._to_device(batch)
        total, count = diffusion_forcing_loss(model, trainer.diffusion, video, actions, trainer.m, trainer.K, g,
                                              trainer.autocast, **pose_memory(batch, trainer.device))
        (total / count.clamp(min=1)).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


# torch.profiler op names -> the kind of work they are, for the per-kind shares (`--profile`)
OP_KINDS = (("convolution", ("conv",)), ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul")),
            ("attention", ("attention",)), ("normalisation", ("norm",)), ("activation", ("gelu", "silu")),
            ("copies / cat", ("aten::copy_", "aten::cat")), ("optimizer", ("Optimizer", "lerp", "addcdiv", "sqrt")))


def op_kind(name: str) -> str:
    """The kind of an aten op (`OP_KINDS`), "other" when none matches."""
    for kind, keys in OP_KINDS:
        if any(k in name for k in keys):
            return kind
    return "other"


def profile_steps(trainer: Trainer, batches: list, steps: int, top: int = 12) -> str:
    """Where `steps` training steps spend their time, as lines to print: the `top` costliest ops by self time
    (grouped by input shape) and the shares per kind of op, each per step."""
    from torch.profiler import ProfilerActivity, profile

    cuda = trainer.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=True) as prof:
        for i in range(steps):
            loss, _ = trainer.train_step(batches[i % len(batches)])
        loss.item()
    events = [e for e in prof.key_averages(group_by_input_shape=True) if not e.key.startswith("autograd::")]
    self_us = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    total = sum(self_us(e) for e in events) or 1.0
    lines = [f"  profile of {steps} steps ({'device' if cuda else 'CPU'} self time, "
             f"{total / steps / 1e3:.1f} ms per step):"]
    for e in sorted(events, key=self_us, reverse=True)[:top]:
        shapes = ", ".join(str(tuple(x)) for x in e.input_shapes if x)[:80]
        lines.append(f"    {self_us(e) / steps / 1e3:8.1f} ms {100 * self_us(e) / total:5.1f}%  "
                     f"{e.count // steps:4d}x  {e.key[:40]:<40} {shapes}")
    kinds: dict[str, float] = {}
    for e in events:
        kind = op_kind(e.key)
        kinds[kind] = kinds.get(kind, 0.0) + self_us(e)
    lines.append("  by kind: " + ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in
                                          sorted(kinds.items(), key=lambda kv: -kv[1])))
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--modes", nargs="+", default=["fp32", "eager"], choices=MODES)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per mode (compilation happens here)")
    p.add_argument("--steps", type=int, default=5, help="steps per turn")
    p.add_argument("--rounds", type=int, default=3, help="turns per mode")
    p.add_argument("--device", default=None)
    p.add_argument("--peak-tflops", type=float, default=None, help="the device's peak (bf16) TFLOP/s, for MFU")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="then profile N steps of each mode: costliest ops and the time by kind of op")
    args = p.parse_args()
    if args.profile < 0:
        p.error(f"--profile must be >= 0 steps, got {args.profile}")
    return args


def main() -> None:
    args = parse_args()
    base = apply_overrides(get_preset(args.preset), args.overrides)
    with tempfile.TemporaryDirectory() as tmp:
        base.data.path = str(synthetic_data(Path(tmp) / "data", base))
        base.train.max_steps = 10 ** 9
        base.train.val_every = base.train.sample_every = 0
        base.train.ckpt_every = 10 ** 9
        trainers = {}
        for mode in args.modes:
            cfg = apply_overrides(copy.deepcopy(base), MODES[mode])
            trainers[mode] = Trainer(cfg.validate(), Path(tmp) / f"run_{mode}", device=args.device)
        first = next(iter(trainers.values()))
        loader = torch.utils.data.DataLoader(first.train_ds, batch_sampler=first.sampler, collate_fn=collate)
        batches = [next(iter(loader)) for _ in range(2)]
        dev = first.device
        batches = [{k: v.to(dev) for k, v in b.items()} for b in batches]
        sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
        warm = {}
        for mode, trainer in trainers.items():
            t0 = time.perf_counter()
            for i in range(args.warmup):
                loss, _ = trainer.train_step(batches[i % 2])
            loss.item()
            warm[mode] = time.perf_counter() - t0
        turns: dict[str, list[float]] = {mode: [] for mode in trainers}
        for _ in tqdm(range(args.rounds), desc="rounds", leave=False):
            for mode, trainer in trainers.items():
                sync()
                t0 = time.perf_counter()
                for i in range(args.steps):
                    loss, _ = trainer.train_step(batches[i % 2])
                loss.item()
                sync()
                turns[mode].append((time.perf_counter() - t0) / args.steps)
        flops = count_step_flops(first, batches[0])
        profiles = {mode: profile_steps(trainer, batches, args.profile)
                    for mode, trainer in trainers.items()} if args.profile else {}
    cfg = base
    n_params = sum(p.numel() for p in first.model.parameters())
    peak = peak_tflops(dev, args.peak_tflops)
    frames = cfg.train.batch_size * cfg.train.window
    print(f"preset {cfg.preset} {' '.join(args.overrides)}".strip())
    print(f"  device {dev}{' ' + torch.cuda.get_device_name(dev) if dev.type == 'cuda' else ''}, torch threads "
          f"{torch.get_num_threads()}, bf16 autocast as configured {cfg.train.bf16 and native_bf16(dev)}, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}")
    print(f"  {n_params / 1e6:.2f}M params, {cfg.model.image_size}px, patch {cfg.model.patch_size}, batch "
          f"{cfg.train.batch_size} x ({cfg.memory.length} memory + {cfg.train.window} window) frames, "
          f"{flops / 1e9:.2f} GFLOP per step (forward + backward, counted)")
    rows = []
    for mode in trainers:
        step_s = statistics.median(turns[mode])
        sps = 1.0 / step_s
        achieved = flops * sps / 1e12
        rows.append([mode, f"{warm[mode]:.1f}", f"{sps:.3f}", f"{sps * frames:.1f}", f"{achieved:.4g}",
                     f"{100 * achieved / peak:.1f}%" if peak else "n/a"])
    print(f"{'mode':<9} {'warm-up s':>9} {'steps/s':>8} {'frames/s':>9} {'TFLOP/s':>8} {'MFU':>6}")
    for r in rows:
        print(f"{r[0]:<9} {r[1]:>9} {r[2]:>8} {r[3]:>9} {r[4]:>8} {r[5]:>6}")
    reference = args.modes[0]
    for mode in args.modes[1:]:
        ratio = statistics.median(turns[reference]) / statistics.median(turns[mode])
        print(f"{mode} / {reference} speed: {ratio:.2f}x "
              f"(median of {args.rounds} alternating turns of {args.steps} steps)")
    if peak:
        print(f"  MFU against {peak:g} TFLOP/s peak")
    for mode, text in profiles.items():
        print(f"{mode}:\n{text}")


if __name__ == "__main__":
    main()
