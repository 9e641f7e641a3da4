"""Benchmark chunked temporal attention: Triton kernel vs SDPA with a dense mask vs FlexAttention.

GPU (the real benchmark; bf16, head dim 64, 256 tokens per frame, chunks of 4 frames)::

    python benchmarks/attention.py                  # all shapes, forward and forward+backward
    python benchmarks/attention.py --shapes decode  # one shape; --markdown FILE also writes the table

CPU smoke test (tiny shapes, only checks that nothing crashes; the Triton column runs only under the
interpreter, ``TRITON_INTERPRET=1``)::

    python benchmarks/attention.py --cpu-smoke

Shapes:
  decode   - rollout-like cached decode: a 4-frame window (one chunk) against a 64-frame KV cache
  train    - training-like full sequence: 64 frames, block-causal in chunks of 4
  stream   - the training shape for a streaming layer: 1 sink frame + 8 recent frames

TFLOP/s count only the unmasked work (visible query-key pairs): forward 4*D flops per pair (QK^T and PV),
forward+backward 14*D (the backward recomputes QK^T and does 4 more matmuls: 2.5x the forward). Ratios
are other-method time / Triton time (> 1: Triton is faster). The issue's target: Triton at least as fast
as FlexAttention and at least 1.5x SDPA-with-mask.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kernels import chunked_attention, chunked_attention_mask, flex_mask_mod, visible_key_frames  # noqa: E402


@dataclass
class Shape:
    name: str
    B: int
    H: int
    q_frames: int
    k_frames: int
    tokens_per_frame: int
    D: int
    rule: dict = field(default_factory=dict)

    @property
    def Lq(self):
        return self.q_frames * self.tokens_per_frame

    @property
    def Lk(self):
        return self.k_frames * self.tokens_per_frame

    def visible_pairs(self) -> int:
        """Query-key token pairs the mask allows, per (batch, head), from the rule's per-chunk ranges."""
        t = self.tokens_per_frame
        return sum((cv.query_frames[1] - cv.query_frames[0]) * t * cv.num_key_frames * t
                   for cv in visible_key_frames(self.q_frames, self.k_frames, **self.rule))


def gpu_shapes():
    T, D, C = 256, 64, 4
    return [
        Shape("decode", 1, 16, 4, 64, T, D, dict(frames_per_chunk=C, q_frame_offset=60)),
        Shape("train", 1, 16, 64, 64, T, D, dict(frames_per_chunk=C)),
        Shape("stream", 1, 16, 64, 64, T, D, dict(frames_per_chunk=C, sink_frames=1, recent_frames=8)),
    ]


def smoke_shapes():
    return [
        Shape("decode", 1, 2, 2, 8, 4, 32, dict(frames_per_chunk=2, q_frame_offset=6)),
        Shape("train", 1, 2, 8, 8, 4, 32, dict(frames_per_chunk=2)),
        Shape("stream", 1, 2, 8, 8, 4, 32, dict(frames_per_chunk=2, sink_frames=1, recent_frames=2)),
    ]


def make_methods(shape: Shape, device, compile_flex: bool, with_triton: bool):
    """name -> fn(q, k, v) for one shape. Masks / block masks are built once, outside the timing."""
    kw = dict(tokens_per_frame=shape.tokens_per_frame, **shape.rule)
    methods = {}
    if with_triton:
        methods["triton"] = lambda q, k, v: chunked_attention(q, k, v, backend="triton", **kw)
    dense = chunked_attention_mask(shape.Lq, shape.Lk, device=device, **kw)  # (Lq, Lk) bool
    methods["sdpa+mask"] = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        print("FlexAttention is not available in this torch; skipped")
        return methods
    # FlexAttention's mask_mod sees q_idx counted from the window, as the rule does
    block_mask = create_block_mask(flex_mask_mod(**kw), B=None, H=None, Q_LEN=shape.Lq, KV_LEN=shape.Lk,
                                   device=device)
    flex = torch.compile(flex_attention, dynamic=False) if compile_flex else flex_attention
    methods["flex"] = lambda q, k, v: flex(q, k, v, block_mask=block_mask)
    return methods


def bench(fn, device, warmup, iters, grad_to_none=()):
    """Median milliseconds of fn()."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=warmup, rep=iters, grad_to_none=list(grad_to_none))
    for _ in range(2):
        fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[1]


def run(shapes, device, dtype, compile_flex, with_triton, warmup, iters, check=True):
    rows = []
    for s in shapes:
        g = torch.Generator(device="cpu").manual_seed(0)
        q, k, v = [torch.randn(s.B, s.H, L, s.D, generator=g).to(device=device, dtype=dtype)
                   for L in (s.Lq, s.Lk, s.Lk)]
        pairs = s.visible_pairs() * s.B * s.H
        dense_pairs = s.Lq * s.Lk * s.B * s.H
        methods = make_methods(s, device, compile_flex, with_triton)
        outs = {}
        for name, fn in methods.items():
            with torch.no_grad():
                outs[name] = fn(q, k, v).float()
            t_fwd = bench(lambda fn=fn, q=q, k=k, v=v: fn(q, k, v), device, warmup, iters)
            qg, kg, vg = [x.clone().requires_grad_() for x in (q, k, v)]
            do = torch.randn_like(q)

            def fwd_bwd(fn=fn, qg=qg, kg=kg, vg=vg, do=do):
                fn(qg, kg, vg).backward(do)

            try:
                t_fb = bench(fwd_bwd, device, warmup, iters, grad_to_none=(qg, kg, vg))
            except NotImplementedError as e:  # FlexAttention has no backward on the CPU
                print(f"  [{s.name}] {name} forward+backward skipped: {e}")
                t_fb = None
            rows.append(dict(shape=s.name, method=name, fwd_ms=t_fwd, fb_ms=t_fb,
                             fwd_tflops=4 * s.D * pairs / t_fwd / 1e9,
                             fb_tflops=None if t_fb is None else 14 * s.D * pairs / t_fb / 1e9,
                             density=pairs / dense_pairs))
        if check:
            base = outs.get("sdpa+mask")
            for name, o in outs.items():
                if name == "sdpa+mask":
                    continue
                err = (o - base).abs().max().item()
                print(f"  [{s.name}] max |{name} - sdpa+mask| = {err:.2e}")
    return rows


def table(rows, dtype, device):
    lines = [f"device: {device_name(device)}, dtype: {dtype}, TFLOP/s on the unmasked work",
             "", "| shape | visible | method | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s "
             "| fwd vs triton | fwd+bwd vs triton |",
             "|---|---|---|---|---|---|---|---|---|"]
    tri = {r["shape"]: r for r in rows if r["method"] == "triton"}
    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    for r in rows:
        t = tri.get(r["shape"])
        rf = f"{r['fwd_ms'] / t['fwd_ms']:.2f}x" if t else "-"
        rb = f"{r['fb_ms'] / t['fb_ms']:.2f}x" if t and r["fb_ms"] and t["fb_ms"] else "-"
        cells = [r["shape"], f"{r['density']:.0%}", r["method"], num(r["fwd_ms"], ".3f"),
                 num(r["fwd_tflops"], ".3g"), num(r["fb_ms"], ".3f"), num(r["fb_tflops"], ".3g"), rf, rb]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def device_name(device):
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU: check nothing crashes")
    p.add_argument("--shapes", nargs="*", default=None, help="subset of: decode train stream")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"])
    p.add_argument("--warmup", type=int, default=25, help="ms of warm-up (GPU)")
    p.add_argument("--iters", type=int, default=100, help="ms of timed repetitions (GPU)")
    p.add_argument("--no-compile", action="store_true", help="run FlexAttention eagerly")
    p.add_argument("--markdown", default=None, help="also write the table to this file")
    a = p.parse_args(argv)

    if a.cpu_smoke:
        device = torch.device("cpu")
        shapes = smoke_shapes()
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype or "fp32"]
        # Triton runs on the CPU only through its interpreter (no bf16 there)
        with_triton = os.environ.get("TRITON_INTERPRET") == "1" and dtype != torch.bfloat16
        compile_flex = False  # compiled FlexAttention needs a GPU to be meaningful; eager is enough here
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        if not with_triton:
            print("triton skipped (set TRITON_INTERPRET=1 to run it through the interpreter)")
    else:
        if not torch.cuda.is_available():
            p.error("no CUDA device: use --cpu-smoke on a CPU")
        device = torch.device("cuda")
        shapes = gpu_shapes()
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype or "bf16"]
        with_triton = True
        compile_flex = not a.no_compile
    if a.shapes:
        unknown = set(a.shapes) - {s.name for s in shapes}
        if unknown:
            p.error(f"unknown shapes {sorted(unknown)}")
        shapes = [s for s in shapes if s.name in a.shapes]
    for s in shapes:
        print(f"{s.name}: B={s.B} H={s.H} Lq={s.Lq} Lk={s.Lk} D={s.D} "
              f"tokens/frame={s.tokens_per_frame} {s.rule}")
    rows = run(shapes, device, dtype, compile_flex, with_triton, a.warmup, a.iters)
    out = table(rows, dtype, device)
    print(out)
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(out + "\n")


if __name__ == "__main__":
    main()
