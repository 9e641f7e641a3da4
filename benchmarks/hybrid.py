"""Hybrid attention vs the base model against memory length: KV bytes, frames/s with spread, the Amdahl bound
from the measured attention share, and PSNR with an interval.

    python benchmarks/hybrid.py --run RUN                                 # memories 64, 256, 1024; fraction 0.5
    python benchmarks/hybrid.py --run RUN --memories 112 --set hybrid.ratios=/tmp/lazy_ratios.json

One run, side by side (arvdm.hybrid; LightTransfer, arXiv 2410.13846), for every memory length m of
``--memories`` (the full layers keep the last m frames, retention last):

1. **cost with a full memory**: base and hybrid commit the same m frames (validation episodes tiled), then an
   AR step (``--steps`` denoising calls on a ``train.window`` window + the commit of its frames) is timed
   round-robin, base and hybrid alternating (``--repeats`` rounds after one warm-up): frames/s as median
   [min, max] over the rounds, and the hybrid / base ratio of each round (median [min, max]). KV bytes are
   ``RolloutState.nbytes()``; expected hybrid / base = P + (1 - P)(s + r)/m with P the share of full layers;
2. **attention share**: in ``--profile`` further (untimed) AR steps of the base model, the time inside each
   temporal layer's attention-kernel calls (``TemporalAttention._attend``: mask + scores + softmax + values)
   over the step's time. Making the chosen layers stream can at best remove their share a_S (a streaming
   layer still attends to s + r + window frames), so the speed-up is at most the Amdahl bound 1 / (1 - a_S);
3. **quality** (``--episodes`` > 0): rollouts of ``--psnr-frames`` frames after ``--context`` frames on
   validation episodes under a ``--psnr-memory``-frame memory, base vs hybrid (same seed, same noise); mean
   PSNR / SSIM and the per-episode PSNR loss (base - hybrid) with a 95% t-interval over episodes.

The streaming layers come from the run's hybrid settings plus ``--set hybrid.*``: ``select=offline`` (the
default here) reads the lazy ratios (``hybrid.ratios`` or RUN/lazy_ratios.json), calibrating them first
when absent. Single-threaded by default (``--threads``); the machine's load moves every figure, the ratios
measured within one round move less.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python benchmarks/hybrid.py` from the repo root

from arvdm.evaluation.metrics import psnr_per_frame, ssim_per_frame  # noqa: E402
from arvdm.hybrid import convert as H  # noqa: E402
from arvdm.hybrid import lazy as L  # noqa: E402
from arvdm.hybrid import report as HR  # noqa: E402
from arvdm.model.diffusion import PerFrameDiffusion  # noqa: E402
from arvdm.pipeline.rollout import rollout  # noqa: E402
from arvdm.pipeline.runs import load_for_inference, load_validation_episodes  # noqa: E402
from arvdm.schedules import get_schedule  # noqa: E402
from benchmarks.common import interleaved, median, print_table, set_threads  # noqa: E402
from data.atomic import atomic_write_json  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="run folder written by train.py")
    p.add_argument("--data", default=None, help="TECO-layout data folder (default: the run's)")
    p.add_argument("--fraction", type=float, default=0.5, help="share of temporal layers that stream")
    p.add_argument("--memories", default="64,256,1024", help="memory lengths m (frames the full layers keep)")
    p.add_argument("--steps", type=int, default=10, help="denoising calls per AR step")
    p.add_argument("--repeats", type=int, default=7, help="timed AR steps per model (round-robin)")
    p.add_argument("--profile", type=int, default=3, help="AR steps of the base model for the attention share")
    p.add_argument("--episodes", type=int, default=5, help="validation episodes for PSNR (0: skip)")
    p.add_argument("--psnr-frames", type=int, default=120, help="frames generated per episode for PSNR")
    p.add_argument("--psnr-memory", type=int, default=64, help="memory length of the PSNR rollouts")
    p.add_argument("--context", type=int, default=None, help="context frames for PSNR (default: the run's "
                                                              "memory.length)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="hybrid.KEY=VALUE")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    return p.parse_args(argv)


def _setup(args):
    """(model, run config, run context, hybrid config, offline ratios, diffusion, schedule, device)."""
    dev = torch.device(args.device)
    model, cfg = load_for_inference(args.run, device=dev)
    if cfg.memory.select == "pose":  # its memory is re-chosen every window and never grows: nothing to measure here
        sys.exit(f"benchmarks/hybrid.py: error: {args.run} chooses memory by pose (memory.select=pose); this "
                 "benchmark grows a time-based memory to 64..1,024 frames. Use a time-memory run, e.g. "
                 "python train.py --preset tiny_time --out runs/tiny_time")
    h = HR.hybrid_settings(cfg, ["hybrid.select=offline", *args.overrides, f"hybrid.fraction={args.fraction}"])
    rpath = L.ratios_path(h, args.run)
    if h.select == "offline" and not rpath.is_file():
        print(f"no {rpath}: calibrating first", file=sys.stderr)
        HR.run_calibration(args.run, data=args.data, overrides=list(args.overrides), device=args.device,
                           out=str(rpath))
    offline = L.load_lazy_ratios(rpath) if rpath.is_file() else None
    run_context = cfg.default_context()  # before the memory length changes below
    sched = get_schedule("chunked", cfg.train.window, cfg.diffusion.num_levels, args.steps)
    return model, cfg, run_context, h, offline, PerFrameDiffusion(cfg.diffusion), sched, dev


def _wrappers(model, cfg, h, offline, memory):
    """Base and hybrid wrappers of one model whose full layers (and bank) keep the last ``memory`` frames."""
    for m in (model.cfg.memory, cfg.memory):
        m.retention, m.length = "last", memory
    base = H.HybridModel(model, dataclasses.replace(h, fraction=0.0, select="fixed", layers=[]), offline)
    return {"base": base, "hybrid": H.HybridModel(model, h, offline)}


class AttentionClock:
    """Seconds spent inside each temporal layer's attention-kernel calls while ``on``."""

    def __init__(self, layers):
        self.seconds = [0.0] * len(layers)
        self.on = False
        for i, layer in enumerate(layers):
            layer._attend = self._wrap(i, layer._attend)

    def _wrap(self, i, attend):
        def timed(*a, **kw):
            if not self.on:
                return attend(*a, **kw)
            t0 = time.perf_counter()
            out = attend(*a, **kw)
            self.seconds[i] += time.perf_counter() - t0
            return out
        return timed


def _cost(args, models, diffusion, sched, real, actions, w, memory, dev, clock):
    """Per model: KV bytes, cached frames per layer, AR-step seconds per round, per-layer attention shares."""
    n_fill = -(-memory // w) * w  # the memory is full
    reps = -(-(n_fill + w) // real.shape[1])
    tiled = real[:1].repeat(1, reps, 1, 1, 1)[:, :n_fill + w].to(dev)  # (1, F + w, C, H, W)
    tiled_act = actions[:1].repeat(1, reps)[:, :n_fill + w].to(dev)
    states = {}
    for name, m in models.items():
        state = m.init_state(1)
        for s in range(0, n_fill, w):
            m.commit(state, tiled[:, s:s + w], tiled_act[:, s:s + w])
        states[name] = state
    x = torch.randn((1, w, *tiled.shape[2:]), generator=torch.Generator().manual_seed(0)).to(dev)
    S = torch.tensor(sched.matrix, device=dev)
    win_act = tiled_act[:, n_fill:n_fill + w]

    def ar_step(name):
        m, state = models[name], states[name]  # (the wrappers share one model; each sets its own switches)
        xx = x
        for r in range(S.shape[0] - 1):
            lv = S[r].unsqueeze(0)
            xx = diffusion.step(xx, m(xx, lv, win_act, state=state), lv, S[r + 1].unsqueeze(0), 0.0)
        m.commit(state, xx.clamp(-1, 1), win_act)

    out = {k: {"kv_bytes": st.nbytes(), "layer_frames": [c.num_frames for c in st.caches]}
           for k, st in states.items()}
    times = interleaved({k: (lambda k=k: ar_step(k)) for k in models}, repeats=args.repeats, warmup=1, device=dev)
    for name in models:
        out[name]["step_s"] = times[name]
        shares = []
        for _ in range(args.profile):
            clock.seconds = [0.0] * len(clock.seconds)
            clock.on = True
            t0 = time.perf_counter()
            ar_step(name)
            total = time.perf_counter() - t0
            clock.on = False
            shares.append([s / total for s in clock.seconds])
        out[name]["attention_share"] = [median([s[i] for s in shares]) for i in range(len(clock.seconds))]
    return out


def _t95(n: int) -> float:
    """Two-sided 95% Student t quantile for n - 1 degrees of freedom."""
    try:
        from scipy.stats import t  # lazy: optional, only for the interval

        return float(t.ppf(0.975, n - 1))
    except ImportError:
        return 1.96


def _quality(models, diffusion, sched, real, actions, ctx, n, dev):
    """Per model: per-episode mean PSNR and SSIM of a rollout of n frames after ctx context frames."""
    out = {}
    for name, m in models.items():
        gen = rollout(m, diffusion, sched, real[:, :ctx].to(dev), actions[:, :ctx].to(dev),
                      actions[:, ctx:ctx + n].to(dev), n, generator=torch.Generator().manual_seed(1), progress=False)
        target = real[:, ctx:ctx + n]
        out[name] = {"psnr": psnr_per_frame(gen.float().cpu(), target).mean(1).tolist(),
                     "ssim": ssim_per_frame(gen.float().cpu(), target).mean(1).tolist()}
    return out


def _spread(xs):
    return f"{median(xs):.2f} [{min(xs):.2f}, {max(xs):.2f}]"


def _cost_rows(memory, h, n_layers, chosen, res, w):
    full_share = 1 - len(chosen) / n_layers
    expected = full_share + (1 - full_share) * (h.sink + h.recent) / memory
    b, y = res["base"], res["hybrid"]
    fps = {k: [w / s for s in res[k]["step_s"]] for k in res}
    ratio = [fb / fy for fb, fy in zip(b["step_s"], y["step_s"])]  # hybrid / base frames/s, same round
    a_all, a_s = sum(b["attention_share"]), sum(b["attention_share"][i] for i in chosen)
    return [
        [memory, f"{b['kv_bytes']:,}", f"{y['kv_bytes'] / b['kv_bytes']:.3f} ({expected:.3f})",
         f"{b['layer_frames']} / {y['layer_frames']}", _spread(fps["base"]), _spread(fps["hybrid"]),
         _spread(ratio), f"{a_all:.3f} / {a_s:.3f}", f"{1 / (1 - a_s):.3f}", f"{sum(y['attention_share']):.3f}"]]


@torch.no_grad()
def main(argv=None) -> int:
    args = parse_args(argv)
    set_threads(args.threads)
    model, cfg, run_context, h, offline, diffusion, sched, dev = _setup(args)
    w = cfg.train.window
    memories = [int(x) for x in args.memories.split(",") if x.strip()]
    real, actions, _ = load_validation_episodes(args.data or cfg.data.path, cfg, max(args.episodes, 1), 0, None)
    clock = AttentionClock(L.temporal_layers(model))
    rows, figures = [], {"args": vars(args), "memories": {}}
    for memory in memories:
        models = _wrappers(model, cfg, h, offline, memory)
        chosen = models["hybrid"].streaming_layers
        res = _cost(args, models, diffusion, sched, real, actions, w, memory, dev, clock)
        rows += _cost_rows(memory, h, len(clock.seconds), chosen, res, w)
        figures["memories"][memory] = dict(res, streaming_layers=chosen)
        print(f"memory {memory}: done", file=sys.stderr, flush=True)
    print(f"streaming layers {chosen} of {len(clock.seconds)} (fraction {args.fraction:g}); sink {h.sink} + "
          f"recent {h.recent}; window {w}, {args.steps} denoising calls + 1 commit per AR step; "
          f"{args.repeats} rounds, {args.threads} thread(s)")
    print_table(["memory m", "base KV bytes", "hybrid/base KV (expected)", "cached frames base / hybrid",
                 "base frames/s med [min, max]", "hybrid frames/s", "hybrid/base per round",
                 "attention share all / streamed layers", "Amdahl bound", "hybrid attention share"], rows)
    if args.episodes > 0:
        ctx = args.context if args.context is not None else run_context
        n = min(args.psnr_frames, real.shape[1] - ctx)
        q = _quality(_wrappers(model, cfg, h, offline, args.psnr_memory), diffusion, sched, real, actions, ctx, n, dev)
        loss = [b - y for b, y in zip(q["base"]["psnr"], q["hybrid"]["psnr"])]
        half = _t95(len(loss)) * statistics.stdev(loss) / math.sqrt(len(loss)) if len(loss) > 1 else float("nan")
        print_table(["metric", "base", f"hybrid {args.fraction:g}", "hybrid vs base"], [
            [f"PSNR dB ({len(loss)} ep x {n} frames, memory {args.psnr_memory})",
             f"{statistics.mean(q['base']['psnr']):.3f}", f"{statistics.mean(q['hybrid']['psnr']):.3f}",
             f"loss {statistics.mean(loss):+.3f} dB, 95% CI [{statistics.mean(loss) - half:+.3f}, "
             f"{statistics.mean(loss) + half:+.3f}]"],
            ["SSIM", f"{statistics.mean(q['base']['ssim']):.4f}", f"{statistics.mean(q['hybrid']['ssim']):.4f}",
             f"{statistics.mean(q['hybrid']['ssim']) - statistics.mean(q['base']['ssim']):+.4f}"]])
        figures["quality"] = dict(q, psnr_loss=loss, ci_half_width=half, frames=n, context=ctx)
    if args.json:
        atomic_write_json(args.json, figures, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
