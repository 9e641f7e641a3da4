"""Hybrid attention vs the base model: KV-cache bytes and frames/s at a late frame, PSNR on validation.

    python benchmarks/hybrid.py --run RUN                       # frame 256, 112-frame memory, fraction 0.5
    python benchmarks/hybrid.py --run RUN --fraction 0.25 --set hybrid.sink=1 --set hybrid.recent=8

One run, side by side (arvdm.hybrid; LightTransfer, arXiv 2410.13846):

1. **cost at frame F** (`--frame`, default 256) with an `--memory`-frame memory (default 112; the full
   layers keep the last 112 frames): both models commit the same F frames (validation episodes tiled to F
   frames), then an AR step (`--steps` denoising calls on a `train.window` window + the commit of its
   frames) is timed round-robin, base and hybrid alternating (`--repeats`, medians). KV bytes are
   `RolloutState.nbytes()` at frame F; expected hybrid / base ~ P + (1 - P)(s + r)/n with P the share of
   full layers, s + r the streaming frames and n the memory;
2. **quality**: rollouts of `--psnr-frames` frames on `--episodes` validation episodes under the same
   memory, PSNR / SSIM against ground truth, base vs hybrid (same seed, same noise).

The streaming layers come from the run's hybrid settings plus `--set hybrid.*`: `select=offline` (the
default here) reads RUN/lazy_ratios.json, calibrating it first when absent.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="run folder written by train.py")
    p.add_argument("--data", default=None, help="TECO-layout data folder (default: the run's)")
    p.add_argument("--fraction", type=float, default=0.5, help="share of temporal layers that stream")
    p.add_argument("--memory", type=int, default=112, help="frames the full layers remember (retention last)")
    p.add_argument("--frame", type=int, default=256, help="frame index at which cost is measured")
    p.add_argument("--steps", type=int, default=10, help="denoising calls per AR step")
    p.add_argument("--repeats", type=int, default=5, help="timed AR steps per model (round-robin)")
    p.add_argument("--episodes", type=int, default=2, help="validation episodes for the PSNR comparison")
    p.add_argument("--psnr-frames", type=int, default=64, help="frames generated per episode for PSNR")
    p.add_argument("--context", type=int, default=None, help="context frames for PSNR (default: the run's "
                                                              "memory.length)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="hybrid.KEY=VALUE")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    return p.parse_args(argv)


def _models(args):
    """(run config, the run's default context (Config.default_context), hybrid config, base wrapper, hybrid
    wrapper, diffusion, schedule, device); the config's memory is then set to --memory frames (retention last)."""
    dev = torch.device(args.device)
    model, cfg = load_for_inference(args.run, device=dev)
    overrides = ["hybrid.select=offline", *args.overrides, f"hybrid.fraction={args.fraction}"]
    h = HR.hybrid_settings(cfg, overrides)
    rpath = L.ratios_path(h, args.run)
    if h.select == "offline" and not rpath.is_file():
        print(f"no {rpath}: calibrating first", file=sys.stderr)
        HR.run_calibration(args.run, data=args.data, overrides=[o for o in args.overrides], device=args.device)
    offline = L.load_lazy_ratios(rpath) if rpath.is_file() else None
    run_context = cfg.default_context()  # before --memory changes the config
    # the full layers (and the bank) remember the last --memory frames
    for m in (model.cfg.memory, cfg.memory):
        m.retention, m.length = "last", args.memory
    sched = get_schedule("chunked", cfg.train.window, cfg.diffusion.num_levels, args.steps)
    base = H.HybridModel(model, dataclasses.replace(h, fraction=0.0, select="fixed", layers=[]), offline)
    hyb = H.HybridModel(model, h, offline)
    return cfg, run_context, h, base, hyb, PerFrameDiffusion(cfg.diffusion), sched, dev


def _cost_at_frame(args, models, diffusion, sched, real, actions, w, dev):
    """KV bytes, cached frames per layer and frames/s of one AR step at frame --frame, per model."""
    reps = -(-(args.frame + w) // real.shape[1])
    tiled = real[:1].repeat(1, reps, 1, 1, 1)[:, :args.frame + w].to(dev)  # (1, F + w, C, H, W)
    tiled_act = actions[:1].repeat(1, reps)[:, :args.frame + w].to(dev)

    def fill(m):
        state = m.init_state(1)
        for s in range(0, args.frame, w):
            m.commit(state, tiled[:, s:s + w], tiled_act[:, s:s + w])
        return state

    states = {name: (m, fill(m)) for name, m in models.items()}
    nbytes = {k: st.nbytes() for k, (_, st) in states.items()}
    layer_frames = {k: [c.num_frames for c in st.caches] for k, (_, st) in states.items()}
    x = torch.randn((1, w, *tiled.shape[2:]), generator=torch.Generator().manual_seed(0)).to(dev)
    S = torch.tensor(sched.matrix, device=dev)
    win_act = tiled_act[:, args.frame:args.frame + w]

    def ar_step(name):
        m, state = states[name]  # (the wrappers share one model; each sets its own switches when called)
        xx = x
        for r in range(S.shape[0] - 1):
            lv = S[r].unsqueeze(0)
            v = m(xx, lv, win_act, state=state)
            xx = diffusion.step(xx, v, lv, S[r + 1].unsqueeze(0), 0.0)
        m.commit(state, xx.clamp(-1, 1), win_act)

    times = interleaved({k: (lambda k=k: ar_step(k)) for k in states}, repeats=args.repeats, warmup=1,
                        device=dev)
    return nbytes, layer_frames, {k: w / median(v) for k, v in times.items()}


def _quality(models, diffusion, sched, real, actions, ctx, n, dev):
    """Mean PSNR and SSIM of each model's rollout of n frames after ctx context frames."""
    psnr, ssim = {}, {}
    for name, m in models.items():
        gen = rollout(m, diffusion, sched, real[:, :ctx].to(dev), actions[:, :ctx].to(dev),
                      actions[:, ctx:].to(dev), n, generator=torch.Generator().manual_seed(1), progress=False)
        target = real[:, ctx:ctx + n]
        psnr[name] = float(psnr_per_frame(gen.float().cpu(), target).mean())
        ssim[name] = float(ssim_per_frame(gen.float().cpu(), target).mean())
    return psnr, ssim


@torch.no_grad()
def main(argv=None) -> int:
    args = parse_args(argv)
    set_threads(args.threads)
    cfg, run_context, h, base, hyb, diffusion, sched, dev = _models(args)
    w = cfg.train.window
    ctx = args.context if args.context is not None else run_context
    print(f"streaming layers {hyb.fixed[0] if hyb.fixed else '(online)'} of {len(hyb.layers)}; sink {h.sink} + "
          f"recent {h.recent}; memory {args.memory}; measured at frame {args.frame}")
    real, actions, _ = load_validation_episodes(args.data or cfg.data.path, cfg, args.episodes,
                                                0, None)  # whole episodes
    models = {"base": base, "hybrid": hyb}
    nbytes, layer_frames, fps = _cost_at_frame(args, models, diffusion, sched, real, actions, w, dev)
    n = min(args.psnr_frames, real.shape[1] - ctx)
    psnr, ssim = _quality(models, diffusion, sched, real, actions, ctx, n, dev)
    chosen = hyb.streaming_layers
    hyb.restore()

    full_share = 1 - len(chosen) / len(hyb.layers)
    expected = full_share + (1 - full_share) * (h.sink + h.recent) / args.memory
    rows = [
        ["KV-cache bytes at frame %d" % args.frame, f"{nbytes['base']:,}", f"{nbytes['hybrid']:,}",
         f"{nbytes['hybrid'] / nbytes['base']:.3f} (expected {expected:.3f}); "
         f"{nbytes['base'] / nbytes['hybrid']:.2f}x less"],
        ["cached frames per layer", str(layer_frames["base"]), str(layer_frames["hybrid"]), ""],
        ["frames/s at frame %d" % args.frame, f"{fps['base']:.2f}", f"{fps['hybrid']:.2f}",
         f"{fps['hybrid'] / fps['base']:.2f}x"],
        [f"PSNR dB ({args.episodes} ep x {n} frames)", f"{psnr['base']:.3f}", f"{psnr['hybrid']:.3f}",
         f"loss {psnr['base'] - psnr['hybrid']:+.3f} dB"],
        ["SSIM", f"{ssim['base']:.4f}", f"{ssim['hybrid']:.4f}", f"{ssim['hybrid'] - ssim['base']:+.4f}"],
    ]
    print_table(["metric", "base", f"hybrid {args.fraction:g}", "hybrid vs base"], rows)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "args": vars(args), "streaming_layers": chosen, "kv_bytes": nbytes, "frames_per_s": fps,
            "psnr": psnr, "ssim": ssim, "expected_kv_ratio": expected}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
