"""kernels: the mask rule, the PyTorch reference, input checks and backend dispatch (fast, CPU).

The Triton kernel's tests are in test_kernels_triton.py.
"""

import math
import random

import pytest
import torch

import kernels
from kernels import chunked_attention, chunked_attention_mask, flex_mask_mod, visible_key_frames
from kernels.reference import reference_attention


def brute_force_mask(Lq, Lk, t, c, off, sink, recent):
    """The rule exactly as issue 4 words it, with Python's floor division (negative chunks included)."""
    m = torch.zeros(Lq, Lk, dtype=torch.bool)
    for i in range(Lq):
        fq = off + i // t
        cq = (fq - off) // c
        for j in range(Lk):
            fk = j // t
            ok = (fk - off) // c <= cq
            if recent is not None:
                ok = ok and (fk < sink or fk >= off + cq * c - recent)
            m[i, j] = ok
    return m


def random_rules(n, seed=0):
    rng = random.Random(seed)
    for _ in range(n):
        t = rng.choice([1, 1, 2, 3])
        c = rng.choice([1, 2, 3, 5])
        fq = rng.randint(1, 9)
        off = rng.choice([0, rng.randint(0, 7)])
        fk = off + fq + rng.choice([0, 0, rng.randint(0, 3)])  # keys may run past the window
        recent = rng.choice([None, rng.randint(1, 6)])
        sink = rng.randint(0, 4) if recent is not None else 0
        yield fq * t, fk * t, t, c, off, sink, recent


@pytest.mark.parametrize("rule", list(random_rules(60)))
def test_mask_matches_issue_rule_and_ranges(rule):
    Lq, Lk, t, c, off, sink, recent = rule
    mask = chunked_attention_mask(Lq, Lk, tokens_per_frame=t, frames_per_chunk=c, q_frame_offset=off,
                                  sink_frames=sink, recent_frames=recent)
    assert torch.equal(mask, brute_force_mask(Lq, Lk, t, c, off, sink, recent))
    assert mask.any(dim=1).all(), "every query sees at least one key"

    # visible_key_frames: the per-chunk ranges are exactly the mask, at frame level
    vis = visible_key_frames(Lq // t, Lk // t, frames_per_chunk=c, q_frame_offset=off,
                             sink_frames=sink, recent_frames=recent)
    frame_mask = mask[::t, ::t]  # (query frames, key frames)
    covered = 0
    for cv in vis:
        qs, qe = cv.query_frames
        assert cv.num_key_frames >= 1
        assert list(cv.key_ranges) == sorted(cv.key_ranges)
        for f in range(qs, qe):
            assert torch.equal(frame_mask[f - off], cv.key_frame_mask(Lk // t))
        covered += qe - qs
    assert covered == Lq // t

    # FlexAttention's mask_mod gives the same mask
    mm = flex_mask_mod(tokens_per_frame=t, frames_per_chunk=c, q_frame_offset=off, sink_frames=sink,
                       recent_frames=recent)
    qi = torch.arange(Lq)[:, None]
    kj = torch.arange(Lk)[None, :]
    assert torch.equal(mm(0, 0, qi, kj).expand(Lq, Lk), mask)


def test_mask_docstring_picture():
    m = chunked_attention_mask(4, 6, frames_per_chunk=2, q_frame_offset=2)
    rows = ["".join("#" if x else "." for x in r) for r in m.tolist()]
    assert rows == ["####..", "####..", "######", "######"]
    s = chunked_attention_mask(4, 6, frames_per_chunk=2, q_frame_offset=2, sink_frames=1, recent_frames=1)
    rows = ["".join("#" if x else "." for x in r) for r in s.tolist()]
    assert rows == ["####..", "####..", "#..###", "#..###"]  # the picture in docs/kernels.md
    s = chunked_attention_mask(4, 10, q_frame_offset=6, sink_frames=1, recent_frames=2)
    rows = ["".join("#" if x else "." for x in r) for r in s.tolist()]
    assert rows == ["#...###...", "#....###..", "#.....###.", "#......###"]
    vis = visible_key_frames(4, 10, q_frame_offset=6, sink_frames=1, recent_frames=2)
    ranges = [v.key_ranges for v in vis]
    assert ranges[:2] == [((0, 1), (4, 7)), ((0, 1), (5, 8))]


def _inputs(B, H, Lq, Lk, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, L, D, generator=g, dtype=torch.float32).to(dtype) for L in (Lq, Lk, Lk)]


def manual_attention(q, k, v, mask, scale):
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ v.double(), torch.logsumexp(s, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_backend_matches_softmax(dtype):
    q, k, v = _inputs(2, 3, 12, 20, 16, dtype)
    rule = dict(tokens_per_frame=2, frames_per_chunk=3, q_frame_offset=4, sink_frames=1, recent_frames=2)
    out, lse = chunked_attention(q, k, v, **rule, return_lse=True, backend="reference")
    assert out.dtype == dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == (2, 3, 12)
    mask = chunked_attention_mask(12, 20, **rule)
    o_ref, l_ref = manual_attention(q, k, v, mask, 16 ** -0.5)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out.double(), o_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), l_ref, rtol=1e-5, atol=1e-5)


def test_reference_gradients_and_custom_scale():
    # float64 is not a public dtype, so call the reference function directly (it is the tests' oracle)
    q, k, v = [x.requires_grad_() for x in _inputs(1, 2, 6, 9, 8, torch.float64)]
    kw = dict(tokens_per_frame=3, frames_per_chunk=1, q_frame_offset=1, sink_frames=0, recent_frames=None)
    out, lse = reference_attention(q, k, v, **kw, scale=0.3, return_lse=True)
    g_out, g_lse = torch.randn_like(out), torch.randn_like(lse)
    grads = torch.autograd.grad((out * g_out).sum() + (lse * g_lse).sum(), (q, k, v))
    o_ref, l_ref = manual_attention(q, k, v, chunked_attention_mask(6, 9, **kw), 0.3)
    ref_grads = torch.autograd.grad((o_ref * g_out).sum() + (l_ref * g_lse).sum(), (q, k, v))
    torch.testing.assert_close(out, o_ref)
    torch.testing.assert_close(lse, l_ref)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)


def test_empty_query_window():
    q, k, v = _inputs(1, 2, 0, 4, 8)
    out, lse = chunked_attention(q, k, v, q_frame_offset=4, return_lse=True)
    assert out.shape == (1, 2, 0, 8) and lse.shape == (1, 2, 0)


def test_auto_is_reference_on_cpu_and_env_var(monkeypatch):
    q = torch.zeros(1, 1, 2, 16)
    monkeypatch.delenv(kernels.BACKEND_ENV_VAR, raising=False)
    assert kernels.resolve_backend("auto", q) == "reference"
    monkeypatch.setenv(kernels.BACKEND_ENV_VAR, "reference")
    assert kernels.resolve_backend("auto", q) == "reference"
    monkeypatch.setenv(kernels.BACKEND_ENV_VAR, "Triton ")
    from kernels import triton_attention as ta

    if ta.INTERPRETED:
        assert kernels.resolve_backend("auto", q) == "triton"
    assert kernels.resolve_backend("reference", q) == "reference"  # an explicit argument wins
    monkeypatch.setenv(kernels.BACKEND_ENV_VAR, "cuda")
    with pytest.raises(ValueError, match="ARVDM_ATTENTION_BACKEND"):
        kernels.resolve_backend("auto", q)
    with pytest.raises(ValueError, match="backend must be one of"):
        chunked_attention(q, q, q, backend="flash")


def test_forcing_triton_on_cpu_needs_the_interpreter(monkeypatch):
    from kernels import triton_attention as ta

    monkeypatch.setattr(ta, "INTERPRETED", False)
    q = torch.zeros(1, 1, 2, 16)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        chunked_attention(q, q, q, backend="triton")


def _ok(B=1, H=2, Lq=4, Lk=8, D=16, dtype=torch.float32):
    return _inputs(B, H, Lq, Lk, D, dtype)


@pytest.mark.parametrize(
    "make, kwargs, exc, match",
    [
        (lambda: (_ok()[0][0], *_ok()[1:]), {}, ValueError, "q must be 4-D"),
        (lambda: (_ok()[0], _ok()[1], _ok(Lk=9)[2]), {}, ValueError, "k and v must have the same shape"),
        (lambda: (_ok(B=2)[0], *_ok()[1:]), {}, ValueError, "batch, heads and head dim"),
        (lambda: (_ok(H=3)[0], *_ok()[1:]), {}, ValueError, "batch, heads and head dim"),
        (lambda: (_ok(D=8)[0], *_ok()[1:]), {}, ValueError, "batch, heads and head dim"),
        (lambda: (_ok()[0].half(), *_ok()[1:]), {}, TypeError, "share one dtype"),
        (lambda: [x.double() for x in _ok()], {}, TypeError, "dtype torch.float64"),
        (lambda: _ok(Lq=3), dict(tokens_per_frame=2), ValueError, "Lq=3 is not a multiple of tokens_per"),
        (lambda: _ok(Lk=7), dict(tokens_per_frame=2, q_frame_offset=0), ValueError, "Lk=7"),
        (lambda: _ok(), dict(q_frame_offset=5), ValueError, "runs past the 8 key frames"),
        (lambda: _ok(), dict(q_frame_offset=-1), ValueError, "q_frame_offset must be >= 0"),
        (lambda: _ok(), dict(frames_per_chunk=0), ValueError, "frames_per_chunk must be >= 1"),
        (lambda: _ok(), dict(tokens_per_frame=0), ValueError, "tokens_per_frame must be >= 1"),
        (lambda: _ok(), dict(recent_frames=0), ValueError, "recent_frames must be >= 1"),
        (lambda: _ok(), dict(sink_frames=-2, recent_frames=2), ValueError, "sink_frames must be >= 0"),
        (lambda: _ok(), dict(frames_per_chunk=2.0), TypeError, "frames_per_chunk must be an int"),
        (lambda: _ok(), dict(scale=0.0), ValueError, "scale must be"),
        (lambda: _ok(), dict(scale=float("nan")), ValueError, "scale must be"),
        (lambda: _ok(D=160), dict(backend="triton"), ValueError, "head dim 160"),
    ],
)
def test_contract_violations_raise(make, kwargs, exc, match):
    q, k, v = make()
    with pytest.raises(exc, match=match):
        chunked_attention(q, k, v, **kwargs)


def test_check_is_cheap_for_long_windows():
    # the "every query sees a key" check is O(1), not a mask: a 1M-frame window validates instantly
    from kernels.mask import check_rule

    assert check_rule(10**6, 10**6 + 5, frames_per_chunk=1, q_frame_offset=5)[0] == 10**6
    with pytest.raises(ValueError, match="would see no key"):
        check_rule(10**6, 10**6 + 4, q_frame_offset=5)


def test_scale_default_is_inverse_sqrt_head_dim():
    q, k, v = _inputs(1, 1, 3, 3, 16)
    a = chunked_attention(q, k, v)
    b = chunked_attention(q, k, v, scale=1 / math.sqrt(16))
    assert torch.equal(a, b)


def test_auto_takes_pytorch_path_on_cuda_until_triton_is_verified(monkeypatch):
    """Until the compiled kernel has passed its tests on a GPU, "auto" never picks Triton; it is opt-in."""
    from types import SimpleNamespace

    from kernels import attention
    from kernels import triton_attention as ta

    q = SimpleNamespace(is_cuda=True, shape=(1, 1, 2, 64), dtype=torch.bfloat16)  # all resolve_backend reads
    monkeypatch.delenv(kernels.BACKEND_ENV_VAR, raising=False)
    monkeypatch.setattr(ta, "INTERPRETED", False)
    monkeypatch.setattr(ta, "HAS_TRITON", True)
    assert attention.TRITON_VERIFIED_ON_GPU is False
    assert kernels.resolve_backend("auto", q) == "reference"
    assert kernels.resolve_backend("triton", q) == "triton"  # opt-in by argument
    monkeypatch.setenv(kernels.BACKEND_ENV_VAR, "triton")
    assert kernels.resolve_backend("auto", q) == "triton"  # opt-in by environment
    monkeypatch.delenv(kernels.BACKEND_ENV_VAR)
    monkeypatch.setattr(attention, "TRITON_VERIFIED_ON_GPU", True)
    assert kernels.resolve_backend("auto", q) == "triton"
    assert kernels.resolve_backend("auto", SimpleNamespace(is_cuda=False, shape=q.shape, dtype=q.dtype)) == \
        "reference"
