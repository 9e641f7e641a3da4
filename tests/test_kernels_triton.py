"""The Triton chunked-attention kernel against the reference.

On the CPU these run under ``TRITON_INTERPRET=1`` (set by conftest.py before triton is imported) on small
shapes with the interpreter's fixed 16x16 blocks; the interpreter has no bf16, so fp32 and fp16 only.
On a GPU run them compiled with ``TRITON_INTERPRET=0 pytest tests/test_kernels_triton.py`` (then the
autotuned block sizes are used and bf16 cases are added).

Every output buffer is filled with NaN before each launch (``POISON_OUTPUTS``), so a finite result that
matches the reference proves every element was written.
"""

import random

import pytest
import torch

from kernels import chunked_attention, chunked_attention_mask
from kernels.reference import reference_attention

ta = pytest.importorskip("kernels.triton_attention")
if not ta.HAS_TRITON:
    pytest.skip("triton is not importable", allow_module_level=True)
if ta.INTERPRETED:
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:
    pytest.skip("compiled Triton needs CUDA; run with TRITON_INTERPRET=1 on the CPU", allow_module_level=True)

DTYPES = [torch.float32, torch.float16] + ([] if ta.INTERPRETED else [torch.bfloat16])
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}  # relative to max |reference|


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(ta, "POISON_OUTPUTS", True)


def test_poison_hook_fills_nan():
    assert torch.isnan(ta._new(torch.zeros(1), (3, 2), torch.float16)).all()


def assert_rel(name, actual, expected, tol):
    """All finite (nothing left unwritten) and max |error| <= tol * max |expected|."""
    assert actual.shape == expected.shape, name
    assert torch.isfinite(actual).all(), f"{name}: non-finite elements (unwritten or NaN)"
    err = (actual.double() - expected.double()).abs().max().item()
    ref = expected.double().abs().max().item()
    assert err <= tol * max(ref, 1e-6), f"{name}: max error {err:.3g} vs max |ref| {ref:.3g} (tol {tol:g})"


def check(B, H, Fq, Fk, T, D, dtype=torch.float32, grads=True, seed=0, layout="bhld", **rule):
    """Forward, lse and grads of q, k, v (through both out and lse) against the float64 reference."""
    Lq, Lk = Fq * T, Fk * T
    g = torch.Generator().manual_seed(seed)

    def make(L):
        if layout == "blhd":  # a (B, L, H, D) projection viewed as (B, H, L, D): non-contiguous
            return torch.randn(B, L, H, D, generator=g).to(dtype).to(DEVICE).transpose(1, 2)
        return torch.randn(B, H, L, D, generator=g).to(dtype).to(DEVICE)

    q, k, v = make(Lq), make(Lk), make(Lk)
    q.requires_grad_(grads), k.requires_grad_(grads), v.requires_grad_(grads)
    out, lse = chunked_attention(q, k, v, tokens_per_frame=T, return_lse=True, backend="triton", **rule)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (B, H, Lq)

    full_rule = dict(frames_per_chunk=1, q_frame_offset=0, sink_frames=0, recent_frames=None)
    full_rule.update(rule)
    q64, k64, v64 = [x.detach().double().requires_grad_(grads) for x in (q, k, v)]
    o_ref, l_ref = reference_attention(q64, k64, v64, tokens_per_frame=T, scale=D ** -0.5, return_lse=True,
                                       **full_rule)
    tol = TOL[dtype]
    assert_rel("out", out, o_ref, tol)
    assert_rel("lse", lse, l_ref, 1e-4 if dtype == torch.float32 else 2e-3)
    if grads:
        g_out = torch.randn(out.shape, generator=g).to(DEVICE)
        g_lse = torch.randn(lse.shape, generator=g).to(DEVICE)
        got = torch.autograd.grad((out.float() * g_out).sum() + (lse * g_lse).sum(), (q, k, v))
        ref = torch.autograd.grad((o_ref * g_out.double()).sum() + (l_ref * g_lse.double()).sum(),
                                  (q64, k64, v64))
        for name, a, b in zip(("dq", "dk", "dv"), got, ref):
            assert a.dtype == dtype
            assert_rel(name, a, b, 2 * tol)


# (B, H, query frames, key frames, tokens_per_frame, head dim, rule): small shapes, block sizes 16
CASES = {
    # causal, one frame per chunk, length 37 (not a multiple of the blocks)
    "causal_ragged": (1, 2, 37, 37, 1, 32, dict()),
    # one chunk holds every frame: plain full attention
    "one_chunk": (1, 1, 10, 10, 3, 32, dict(frames_per_chunk=10)),
    # memory prefix of 5 frames, chunks of 2, 3 tokens per frame (chunks straddle blocks)
    "memory_prefix": (2, 1, 6, 11, 3, 32, dict(frames_per_chunk=2, q_frame_offset=5)),
    # streaming: 2 sink frames + 3 recent frames, with a memory prefix; head dim 48 (padded to 64)
    "streaming": (1, 2, 8, 20, 2, 48, dict(frames_per_chunk=2, q_frame_offset=10, sink_frames=2,
                                           recent_frames=3)),
    # streaming over a long token axis: the middle key blocks are skipped altogether
    "streaming_skip": (1, 1, 48, 48, 1, 32, dict(sink_frames=3, recent_frames=5)),
    # streaming with a recent window wider than a block: fully visible middle blocks run unmasked
    "streaming_wide": (1, 1, 12, 24, 4, 32, dict(frames_per_chunk=2, q_frame_offset=12, sink_frames=3,
                                                 recent_frames=6)),
    # cached decode: one 4-frame chunk of queries against 20 cached + window frames; head dim 80
    "decode": (1, 1, 4, 20, 4, 80, dict(frames_per_chunk=4, q_frame_offset=16)),
    # decode, streaming, keys running past the window inside the last (partial) chunk
    "decode_streaming": (1, 1, 3, 13, 2, 32, dict(frames_per_chunk=2, q_frame_offset=8, sink_frames=1,
                                                   recent_frames=2)),
    # keys run past the window's last chunk: those keys are seen by no query (dK, dV exactly 0)
    "keys_past_window": (1, 1, 3, 12, 2, 32, dict(q_frame_offset=4)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference_fp32(case):
    B, H, Fq, Fk, T, D, rule = CASES[case]
    check(B, H, Fq, Fk, T, D, torch.float32, **rule)


@pytest.mark.parametrize("dtype", DTYPES[1:])
@pytest.mark.parametrize("case", ["memory_prefix", "streaming", "decode"])
def test_matches_reference_half(case, dtype):
    B, H, Fq, Fk, T, D, rule = CASES[case]
    check(B, H, Fq, Fk, T, D, dtype, **rule)


@pytest.mark.parametrize("D", [32, 64, 96, 128])
def test_head_dims(D):
    check(1, 1, 5, 7, 3, D, torch.float32, grads=D == 96, frames_per_chunk=2, q_frame_offset=2)


def test_non_contiguous_inputs():
    # q, k, v as transposed views of (B, L, H, D) projections: the kernels take strides, no copies
    check(2, 3, 6, 9, 2, 32, torch.float32, layout="blhd", frames_per_chunk=3, q_frame_offset=3)


@pytest.mark.parametrize("blocks", [(32, 16), (16, 32)])
def test_unequal_block_sizes(monkeypatch, blocks):
    if not ta.INTERPRETED:
        pytest.skip("block sizes are autotuned when compiled")
    monkeypatch.setattr(ta, "INTERPRETER_BLOCKS", blocks)
    check(1, 1, 12, 22, 3, 32, torch.float32, frames_per_chunk=2, q_frame_offset=10, sink_frames=1,
          recent_frames=3)
    check(1, 1, 20, 20, 2, 32, torch.float32, frames_per_chunk=3)


def test_grad_of_output_only_and_of_lse_only():
    q, k, v = [torch.randn(1, 2, 12, 32, device=DEVICE, requires_grad=True) for _ in range(3)]
    rule = dict(tokens_per_frame=2, frames_per_chunk=2)
    q64, k64, v64 = [x.detach().double().requires_grad_() for x in (q, k, v)]
    o_ref, l_ref = reference_attention(q64, k64, v64, q_frame_offset=0, sink_frames=0, recent_frames=None,
                                       scale=32 ** -0.5, return_lse=True, **rule)
    out = chunked_attention(q, k, v, backend="triton", **rule)  # no lse: its gradient is None
    ref = torch.autograd.grad(o_ref.sum(), (q64, k64, v64))
    for a, b in zip(torch.autograd.grad(out.sum(), (q, k, v)), ref):
        assert_rel("grad via out", a, b, 2e-4)
    _, lse = chunked_attention(q, k, v, backend="triton", return_lse=True, **rule)  # out unused: dO None
    dq, dk, dv = torch.autograd.grad(lse.sum(), (q, k, v))
    for a, b in zip((dq, dk), torch.autograd.grad(l_ref.sum(), (q64, k64))):
        assert_rel("grad via lse", a, b, 2e-4)
    assert torch.equal(dv, torch.zeros_like(dv))  # lse does not depend on v


def test_bf16_refused_by_the_interpreter():
    if not ta.INTERPRETED:
        pytest.skip("compiled Triton supports bf16")
    q = torch.zeros(1, 1, 4, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16"):
        chunked_attention(q, q, q, backend="triton")


# ---------------------------------------------------------------------------------------------------------
# block skipping: run the kernels' own range helpers and compare with the dense mask
# ---------------------------------------------------------------------------------------------------------

if ta.INTERPRETED:
    import triton
    import triton.language as tl

    @triton.jit
    def _ranges_probe(OUT, Lq, Lk, T, C, OFF, SINK, RECENT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      STREAMING: tl.constexpr, KEY_SIDE: tl.constexpr):
        pid = tl.program_id(0)
        if KEY_SIDE:  # the key ranges of query block pid (forward, dQ): s1, b0, u0, u1, hi
            r0, r1, r2, r3, r4 = ta._key_ranges(pid, Lq, Lk, T, C, OFF, SINK, RECENT, BLOCK_M, BLOCK_N,
                                                STREAMING)
        else:  # the query ranges of key block pid (dK/dV): a0, u0, u1, a1
            r0, r1, r2, r3 = ta._query_ranges(pid, Lq, Lk, T, C, OFF, SINK, RECENT, BLOCK_M, BLOCK_N,
                                              STREAMING)
            r4 = r0 * 0
        tl.store(OUT + pid * 5 + 0, r0)
        tl.store(OUT + pid * 5 + 1, r1)
        tl.store(OUT + pid * 5 + 2, r2)
        tl.store(OUT + pid * 5 + 3, r3)
        tl.store(OUT + pid * 5 + 4, r4)


def _probe(key_side, n_blocks, Lq, Lk, t, c, off, sink, recent, bm, bn):
    out = torch.full((n_blocks, 5), -1, dtype=torch.int32)
    _ranges_probe[(n_blocks,)](out, Lq, Lk, t, c, off, sink, 0 if recent is None else recent,
                               BLOCK_M=bm, BLOCK_N=bn, STREAMING=recent is not None, KEY_SIDE=key_side)
    return out.tolist()


def _blocks(lo, hi, step):
    assert lo % step == 0 or lo >= hi, "loops must start on a block boundary (tl.multiple_of hint)"
    return list(range(lo, hi, step))


def _random_rules(n, seed=1):
    rng = random.Random(seed)
    for _ in range(n):
        t = rng.choice([1, 2, 3, 5])
        c = rng.choice([1, 2, 3, 4])
        fq = rng.randint(1, 12)
        off = rng.choice([0, rng.randint(1, 12)])
        fk = off + fq + rng.choice([0, 0, rng.randint(1, 4)])
        recent = rng.choice([None, rng.randint(1, 6)])
        sink = rng.randint(0, 3) if recent is not None else 0
        bm, bn = rng.choice([(16, 16), (32, 16), (16, 32), (64, 32)])
        yield fq * t, fk * t, t, c, off, sink, recent, bm, bn


@pytest.mark.skipif(not ta.INTERPRETED, reason="probes the kernels' helpers under the interpreter")
@pytest.mark.parametrize("rule", list(_random_rules(40)))
def test_block_skipping_visits_exactly_the_needed_blocks(rule):
    """Forward/dQ: a query block visits exactly the key blocks holding a visible element; dK/dV: a key
    block visits exactly the query blocks that see it. Ranges are disjoint, and a range visited without
    the elementwise mask (MASKED=False) is fully visible to every valid row."""
    Lq, Lk, t, c, off, sink, recent, bm, bn = rule
    mask = chunked_attention_mask(Lq, Lk, tokens_per_frame=t, frames_per_chunk=c, q_frame_offset=off,
                                  sink_frames=sink, recent_frames=recent)
    streaming = recent is not None
    nqb, nkb = -(-Lq // bm), -(-Lk // bn)

    for i, (s1, b0, u0, u1, hi) in enumerate(_probe(True, nqb, Lq, Lk, t, c, off, sink, recent, bm, bn)):
        rows = mask[i * bm:(i + 1) * bm]
        needed = [j * bn for j in range(nkb) if rows[:, j * bn:(j + 1) * bn].any()]
        if not streaming:
            assert s1 == b0 == u0 == 0
        masked = _blocks(0, s1, bn) + _blocks(b0, min(u0, hi), bn) + _blocks(u1, hi, bn)
        unmasked = _blocks(u0, u1, bn)
        visited = masked + unmasked
        assert len(set(visited)) == len(visited), "a key block visited twice"
        assert sorted(visited) == needed, (i, (s1, b0, u0, u1, hi))
        assert u0 == u1 or (u1 <= Lk and rows[:, u0:u1].all()), "unmasked keys must be visible to every row"

    for j, (a0, u0, u1, a1, _) in enumerate(_probe(False, nkb, Lq, Lk, t, c, off, sink, recent, bm, bn)):
        cols = mask[:, j * bn:(j + 1) * bn]
        needed = [i * bm for i in range(nqb) if cols[i * bm:(i + 1) * bm].any()]
        if not streaming:
            assert u1 >= a1  # no tail loop is compiled when not streaming: it must be empty
        masked = _blocks(a0, min(u0, a1), bm) + _blocks(u1, a1, bm)
        unmasked = _blocks(u0, u1, bm)
        visited = masked + unmasked
        assert len(set(visited)) == len(visited), "a query block visited twice"
        assert sorted(visited) == needed, (j, (a0, u0, u1, a1))
        # rows past Lq contribute exact zeros there, so only valid rows must see every key
        assert u0 == u1 or (u1 <= Lq and cols[u0:u1].all()), "unmasked rows must see every key of the block"


def test_only_the_needed_gradients():
    # q frozen (e.g. a cached-query probe) -> no dQ kernel; k, v frozen -> no dK/dV kernel
    q, k, v = [torch.randn(1, 1, 8, 32, device=DEVICE) for _ in range(3)]
    for need in ((True, False, False), (False, True, False), (False, False, True)):
        x = [t.clone().requires_grad_(n) for t, n in zip((q, k, v), need)]
        out = chunked_attention(*x, frames_per_chunk=2, backend="triton")
        x64 = [t.detach().double().requires_grad_(n) for t, n in zip(x, need)]
        ref = reference_attention(*x64, tokens_per_frame=1, frames_per_chunk=2, q_frame_offset=0, sink_frames=0,
                                  recent_frames=None, scale=32 ** -0.5, return_lse=False)
        (g,) = torch.autograd.grad(out.sum(), [t for t in x if t.requires_grad])
        (g_ref,) = torch.autograd.grad(ref.sum(), [t for t in x64 if t.requires_grad])
        assert_rel("grad", g, g_ref, 2e-4)


def test_autotune_pruning():
    # fp32 keeps small tiles only; a padded head dim drops 128x128; something always survives
    def kept(configs, **kw):
        return sorted((c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in ta._prune_configs(configs, {}, **kw))

    assert max(m * n for m, n in kept(ta._BWD_CONFIGS, DOT_PRECISION="ieee", BLOCK_D=64)) <= 64 * 64
    assert (128, 128) not in kept(ta._FWD_CONFIGS, DOT_PRECISION="tf32", BLOCK_D=128)
    assert kept(ta._FWD_CONFIGS, DOT_PRECISION="tf32", BLOCK_D=64) == kept(ta._FWD_CONFIGS)
    big = [c for c in ta._FWD_CONFIGS if c.kwargs["BLOCK_M"] == 128]
    assert kept(big, DOT_PRECISION="ieee", BLOCK_D=128) == [(128, 32)]
