"""Per-frame rollout cost and cache bytes against memory length and budget, per memory structure.

    python benchmarks/memory_cost.py                       # small dims, CPU, ~a few minutes
    python benchmarks/memory_cost.py --device cuda --image 64 --patch 8 --dim 256 --depth 4

For every structure (prepend / channel_concat / cross_attention) and retention (full vs sink + recent)
the script fills a cached rollout state with L committed frames (L = 16, 112, 300 by default), records
the model-side state bytes (`RolloutState.nbytes()`: per-layer KV caches for prepend, the projected
memory for channel_concat, the memory K/V for cross_attention) and the bank's raw-frame bytes, then
times the two calls of a rollout loop: a denoising forward on a `--window`-frame window (median of
`--repeats`) and a commit of the window's frames (median of `--ar-steps`). Per-frame cost =
(`--denoise-steps` x forward + commit) / window, i.e. a chunked schedule finishing the whole window per
AR step. A second table sweeps the compression budget B at m = max(budgets) (joint compressor). Ratios
are against the first memory length / budget of each row group. "full" retention is `all` for
prepend and `last` with m = L for the others (channel_concat's slots are fixed by m).
"""

from __future__ import annotations

import argparse
import time

import torch

from arvdm.config import apply_overrides, get_preset
from arvdm.model.denoiser import Denoiser


def build(args, *overrides) -> Denoiser:
    cfg = apply_overrides(get_preset("tiny_time"), [
        f"model.image_size={args.image}", f"model.patch_size={args.patch}", f"model.dim={args.dim}",
        f"model.depth={args.depth}", f"model.heads={args.heads}", f"model.temporal_attention={args.form}",
        "model.num_actions=6", *overrides])
    return Denoiser(cfg).to(args.device).eval()


@torch.no_grad()
def measure(model: Denoiser, args, fill: int) -> dict:
    """Fill a state with `fill` frames, then time the AR loop; returns ms/frame and bytes."""
    b, w, dev = args.batch, args.window, args.device
    shape = (b, w, model.channels, model.image_size, model.image_size)
    state = model.init_state(b)
    g = torch.Generator(device="cpu").manual_seed(0)
    for start in range(0, fill, w):  # untimed: bring the memory to `fill` frames
        n = min(w, fill - start)
        model.commit(state, (torch.rand(b, n, *shape[2:], generator=g) * 2 - 1).to(dev),
                     torch.randint(0, 6, (b, n), generator=g).to(dev))
    kept, state_bytes, bank_bytes = len(state.bank), state.nbytes(), state.bank.nbytes()  # memory at L
    x = torch.randn(shape, generator=g).to(dev)
    actions = torch.randint(0, 6, (b, w), generator=g).to(dev)
    levels = torch.full((b, w), model.num_levels // 2, dtype=torch.long, device=dev)
    for _ in range(args.warmup):  # allocations, kernel selection: not timed
        model(x, levels, actions, state=state)
    fwd = _median_time(lambda: model(x, levels, actions, state=state), args.repeats, dev)  # state unchanged
    # a commit changes the state (memory grows by one window): time a few, take the median
    commit = _median_time(lambda: model.commit(state, x.clamp(-1, 1), actions), args.ar_steps, dev)
    per_frame = (args.denoise_steps * fwd + commit) / w  # one AR step finishes w frames
    return dict(ms=1000 * per_frame, fwd=1000 * fwd, commit=1000 * commit, state=state_bytes, bank=bank_bytes,
                kept=kept, params=model.num_params())


def _median_time(fn, repeats: int, dev: str) -> float:
    times = []
    for _ in range(max(1, repeats)):
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def table(rows: list[dict], cols: list[str]) -> str:
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in cols]
    lines = ["| " + " | ".join(c.ljust(wd) for c, wd in zip(cols, widths)) + " |",
             "|" + "|".join("-" * (wd + 2) for wd in widths) + "|"]
    lines += ["| " + " | ".join(str(r[c]).ljust(wd) for c, wd in zip(cols, widths)) + " |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="CPU intra-op threads (1 is steadiest when shared)")
    ap.add_argument("--image", type=int, default=32)
    ap.add_argument("--patch", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--form", default="factorized", choices=["factorized", "full"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--denoise-steps", type=int, default=4)
    ap.add_argument("--ar-steps", type=int, default=3, help="commits timed (median)")
    ap.add_argument("--repeats", type=int, default=5, help="forward calls timed (median)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--lengths", default="16,112,300")
    ap.add_argument("--budgets", default="8,16,32,48")
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--recent", type=int, default=12)
    args = ap.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    lengths = [int(v) for v in args.lengths.split(",")]
    budgets = [int(v) for v in args.budgets.split(",")]
    s, r = args.sink, args.recent

    rows = []
    for structure in ("prepend", "channel_concat", "cross_attention"):
        for retention in ("full", "sink_recent"):
            base = None
            for L in lengths:
                if retention == "full":
                    keep = "memory.retention=all" if structure == "prepend" else "memory.retention=last"
                    over = [keep, f"memory.length={L}"]
                else:
                    over = ["memory.retention=sink_recent", f"memory.length={s + r}", f"memory.sink={s}",
                            f"memory.recent={r}"]
                res = measure(build(args, f"memory.structure={structure}", *over), args, fill=L)
                base = base or res
                rows.append(dict(structure=structure, retention=retention, committed=L, kept=res["kept"],
                                 params=res["params"], state_KiB=f"{res['state'] / 1024:.0f}",
                                 bank_KiB=f"{res['bank'] / 1024:.0f}", fwd_ms=f"{res['fwd']:.1f}",
                                 commit_ms=f"{res['commit']:.1f}", ms_per_frame=f"{res['ms']:.1f}",
                                 bytes_ratio=f"{res['state'] / max(base['state'], 1):.2f}",
                                 time_ratio=f"{res['ms'] / base['ms']:.2f}"))
                print(rows[-1], flush=True)
    print(f"\n## Rollout cost vs memory length (image {args.image}, patch {args.patch}, dim {args.dim}, depth "
          f"{args.depth}, {args.form}, window {args.window}, {args.denoise_steps} denoising steps per AR step, "
          f"sink_recent = {s} + {r}, device {args.device}, {args.threads} thread(s))\n")
    print(table(rows, ["structure", "retention", "committed", "kept", "params", "state_KiB", "bank_KiB",
                       "fwd_ms", "commit_ms", "ms_per_frame", "bytes_ratio", "time_ratio"]))

    rows = []
    m = max(budgets)
    for structure in ("prepend", "channel_concat", "cross_attention"):
        base = None
        for bud in budgets:
            res = measure(build(args, f"memory.structure={structure}", "memory.retention=last", f"memory.length={m}",
                                "memory.compressor=joint", f"memory.budget={bud}"), args, fill=m)
            base = base or res
            rows.append(dict(structure=structure, m=m, budget=bud, params=res["params"],
                             state_KiB=f"{res['state'] / 1024:.0f}", fwd_ms=f"{res['fwd']:.1f}",
                             commit_ms=f"{res['commit']:.1f}", ms_per_frame=f"{res['ms']:.1f}",
                             bytes_ratio=f"{res['state'] / max(base['state'], 1):.2f}",
                             time_ratio=f"{res['ms'] / base['ms']:.2f}"))
            print(rows[-1], flush=True)
    print(f"\n## Compressed memory (joint compressor, m = {m}) vs budget\n")
    print(table(rows, ["structure", "m", "budget", "params", "state_KiB", "fwd_ms", "commit_ms", "ms_per_frame",
                       "bytes_ratio", "time_ratio"]))


if __name__ == "__main__":
    main()
