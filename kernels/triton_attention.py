"""Triton chunked temporal attention: forward, backward, autograd wrapper.

In the style of Triton's fused-attention tutorial (FlashAttention-2):

* **forward** - one program per (query block, batch*head); online softmax in fp32 (exp2 domain), the
  scores and the mask are never materialised; returns the output and the natural-log log-sum-exp;
* **backward** - the FA2 recomputation: a preprocess kernel computes ``delta = rowsum(dO * O)``
  (minus the incoming gradient of the log-sum-exp, see :func:`_bwd_preprocess`), a dK/dV kernel walks the
  query blocks of one key block, a dQ kernel walks the key blocks of one query block;
* **block skipping** - a query block only visits the key blocks in the token ranges that the rule allows
  (``[0, chunk_end)``, or the sink range then the recent range for a streaming layer), and a key block
  only visits the query blocks that can see it. Blocks fully visible to every row skip the elementwise
  mask; only blocks on a boundary apply it (``MASKED`` constexpr);
* the streaming rule is a compile-time switch (``STREAMING`` constexpr); the chunk rule is always on
  (``frames_per_chunk >= number of frames`` makes it plain full attention).

The rule (see :mod:`kernels.mask`), per query row ``m`` and key column ``n``::

    cs  = OFF + ((m // T) // C) * C          # first frame of the query's chunk (a key-frame index)
    fk  = n // T                             # key frame
    vis = fk < cs + C                         # chunk(f_k) <= chunk(f_q)
          and (not STREAMING or fk < SINK or fk >= cs - RECENT)

All integer divisions in the kernels have non-negative operands (Triton's ``//`` truncates like C).

Block sizes are autotuned on CUDA; under ``TRITON_INTERPRET=1`` (CPU tests) a fixed small config is
used, because autotuning needs a GPU and the interpreter is slow.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # e.g. macOS: the reference backend still works
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "INTERPRETED", "MAX_HEAD_DIM", "triton_chunked_attention"]

MAX_HEAD_DIM = 128  # q, k, v tiles of BLOCK_D <= 128 fit the registers / shared memory of one program

# Test hooks (module-level so tests can monkeypatch them):
# block sizes used under the interpreter (no autotuning there), and whether to fill every output buffer
# with NaN before the launch, so a test can check that the kernels wrote every element.
INTERPRETER_BLOCKS = (16, 16)  # (BLOCK_M, BLOCK_N)
POISON_OUTPUTS = False

def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


if HAS_TRITON:

    @triton.jit
    def _visible(m, n, Lq, Lk, T, C, OFF, SINK, RECENT, STREAMING: tl.constexpr):
        """Elementwise rule. ``m`` (query rows) and ``n`` (key columns) come pre-shaped for broadcasting:
        (BM, 1) x (1, BN) gives the (BM, BN) mask, (1, BM) x (BN, 1) its transpose."""
        cs = OFF + ((m // T) // C) * C  # chunk start frame of the query
        fk = n // T
        vis = (fk < cs + C) & (m < Lq) & (n < Lk)
        if STREAMING:
            vis = vis & ((fk < SINK) | (fk >= cs - RECENT))
        return vis

    @triton.jit
    def _key_ranges(start_m, Lq, Lk, T, C, OFF, SINK, RECENT,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STREAMING: tl.constexpr):
        """Key-token ranges that query block ``start_m`` visits (forward and dQ)::

            [0, s1)            sink keys, masked                    (streaming only)
            [b0, min(u0, hi))  head of the recent range, masked     (empty when not streaming)
            [u0, u1)           keys every row of the block sees: no elementwise mask
            [u1, hi)           tail up to the last row's chunk end, masked

        Every range starts at a multiple of BLOCK_N, the ranges are disjoint, and together they hold
        exactly the key blocks that contain a visible key for some row of the block."""
        m_first = start_m * BLOCK_M
        m_last = tl.minimum(m_first + BLOCK_M, Lq) - 1
        cs_first = OFF + ((m_first // T) // C) * C  # chunk start of the block's first row
        cs_last = OFF + ((m_last // T) // C) * C  # ... and of its last row (chunk starts grow with rows)
        hi = tl.minimum(Lk, (cs_last + C) * T)  # no row sees keys at or past the last row's chunk end
        # keys before the first row's chunk end are causally visible to all rows
        u1 = (tl.minimum(Lk, (cs_first + C) * T) // BLOCK_N) * BLOCK_N
        if STREAMING:
            s1 = tl.cdiv(tl.minimum(SINK * T, hi), BLOCK_N) * BLOCK_N
            # the earliest recent key of any row is the first row's; keys from the last row's earliest
            # recent key on are recent for every row
            b0 = tl.maximum((tl.maximum(cs_first - RECENT, 0) * T // BLOCK_N) * BLOCK_N, s1)
            u0 = tl.maximum(tl.cdiv(tl.maximum(cs_last - RECENT, 0) * T, BLOCK_N) * BLOCK_N, b0)
        else:
            s1 = hi * 0  # runtime zeros, like the other bounds
            b0 = s1
            u0 = s1
        u1 = tl.maximum(u1, u0)
        return s1, b0, u0, u1, hi

    @triton.jit
    def _query_ranges(start_n, Lq, Lk, T, C, OFF, SINK, RECENT,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STREAMING: tl.constexpr):
        """Query-token ranges that key block ``start_n`` visits (dK/dV), the transpose of
        :func:`_key_ranges`::

            [a0, min(u0, a1))  rows that see only part of the block, masked
            [u0, u1)           rows that see the whole block: no elementwise mask
            [u1, a1)           rows past those (streaming: the block drops out of their window), masked

        A query of window chunk c sees key frame f causally iff f < OFF + (c + 1) * C, i.e.
        c >= cmin(f) = max(f - OFF, 0) // C; a non-sink key is recent for it iff
        OFF + c * C - RECENT <= f, i.e. c <= cmax(f) = (f - OFF + RECENT) // C."""
        n_first = start_n * BLOCK_N
        n_last = tl.minimum(n_first + BLOCK_N, Lk) - 1
        fk_first = n_first // T
        fk_last = n_last // T
        rows_per_chunk = C * T
        # the first row that sees any key of the block, and the first that sees all of them (causally)
        q_first = tl.minimum((tl.maximum(fk_first - OFF, 0) // C) * rows_per_chunk, Lq)
        a0 = (q_first // BLOCK_M) * BLOCK_M
        q_full = tl.minimum((tl.maximum(fk_last - OFF, 0) // C) * rows_per_chunk, Lq)
        u0 = tl.maximum(tl.cdiv(q_full, BLOCK_M) * BLOCK_M, a0)
        if STREAMING:
            # one past the last row that sees the block's last key / its first key as recent
            n_hi = fk_last - OFF + RECENT
            a1 = tl.where(n_hi >= 0, (tl.maximum(n_hi, 0) // C + 1) * rows_per_chunk, 0)
            a1 = tl.where(fk_first < SINK, Lq, tl.minimum(a1, Lq))  # sink keys stay visible to the end
            n_lo = fk_first - OFF + RECENT
            u1 = tl.where(n_lo >= 0, (tl.maximum(n_lo, 0) // C + 1) * rows_per_chunk, 0)
            u1 = (tl.minimum(u1, Lq) // BLOCK_M) * BLOCK_M
            u1 = tl.where(fk_first < SINK, u0, u1)  # sinks mixed with non-sinks: keep the mask
            u1 = tl.where(fk_last < SINK, Lq, u1)  # all sinks: every later row sees the whole block
        else:
            a1 = Lq
            u1 = Lq  # rows past Lq load zeros (q, dO, lse, delta) and add exact zeros to dK, dV
        # keys past the last query chunk (the keys may run past the window) are seen by no query
        live = q_first < Lq
        a1 = tl.where(live, a1, a0)
        u1 = tl.maximum(u1, u0)
        return a0, u0, u1, a1

    # ------------------------------------------------------------------------------------------------
    # forward
    # ------------------------------------------------------------------------------------------------

    @triton.jit
    def _fwd_inner(acc, l_i, m_i, q, k_ptrs0, v_ptrs0, stride_kn, stride_vn, offs_m, offs_d,
                   lo, hi, Lq, Lk, T, C, OFF, SINK, RECENT, qk_scale,
                   HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                   STREAMING: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """Online softmax over key blocks ``[lo, hi)``; ``acc`` (BM, BD), ``l_i``/``m_i`` (BM,) fp32."""
        d_ok = offs_d < HEAD_DIM
        for start_n in range(lo, hi, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            offs_n = start_n + tl.arange(0, BLOCK_N)
            # k^T tile (BD, BN); keys past Lk load as 0 (and are masked below)
            kt = tl.load(k_ptrs0 + offs_n[None, :] * stride_kn, mask=d_ok[:, None] & (offs_n[None, :] < Lk),
                         other=0.0)
            qk = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale  # (BM, BN) fp32, log2 domain
            if MASKED:
                vis = _visible(offs_m[:, None], offs_n[None, :], Lq, Lk, T, C, OFF, SINK, RECENT, STREAMING)
                qk = tl.where(vis, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            # A row may have seen no visible key yet (m_new = -inf): subtract 0 instead, so that
            # exp2(-inf - (-inf)) never makes a NaN; its p and alpha are then exactly 0.
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(qk - m_use[:, None])  # (BM, BN)
            alpha = tl.math.exp2(m_i - m_use)  # (BM,) rescales what was accumulated so far
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptrs0 + offs_n[:, None] * stride_vn, mask=(offs_n[:, None] < Lk) & d_ok[None, :],
                        other=0.0)  # (BN, BD)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        return acc, l_i, m_i

    @triton.jit
    def _fwd_kernel(Q, K, V, Out, LSE,
                    stride_qb, stride_qh, stride_qm, stride_qd,
                    stride_kb, stride_kh, stride_kn, stride_kd,
                    stride_vb, stride_vh, stride_vn, stride_vd,
                    stride_ob, stride_oh, stride_om, stride_od,
                    H, Lq, Lk, T, C, OFF, SINK, RECENT, sm_scale,
                    Q_BUCKET, K_BUCKET,  # autotune keys only (pow2 buckets of Lq / Lk)
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    STREAMING: tl.constexpr, DOT_PRECISION: tl.constexpr):
        start_m = tl.program_id(0)
        off_bh = tl.program_id(1)
        off_b = (off_bh // H).to(tl.int64)  # int64: batch*head offsets can pass 2**31 elements
        off_h = (off_bh % H).to(tl.int64)
        Q += off_b * stride_qb + off_h * stride_qh
        K += off_b * stride_kb + off_h * stride_kh
        V += off_b * stride_vb + off_h * stride_vh
        Out += off_b * stride_ob + off_h * stride_oh
        LSE += off_bh.to(tl.int64) * Lq  # lse is (B, H, Lq) contiguous

        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)  # BLOCK_D = pow2 >= HEAD_DIM; the padding is masked to 0
        m_ok = offs_m < Lq
        d_ok = offs_d < HEAD_DIM
        q = tl.load(Q + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                    mask=m_ok[:, None] & d_ok[None, :], other=0.0)  # (BM, BD)
        k_ptrs0 = K + offs_d[:, None] * stride_kd  # (BD, 1): column offsets added per block
        v_ptrs0 = V + offs_d[None, :] * stride_vd  # (1, BD)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        qk_scale = sm_scale * 1.4426950408889634  # exp(x) = exp2(x * log2(e))

        s1, b0, u0, u1, hi = _key_ranges(start_m, Lq, Lk, T, C, OFF, SINK, RECENT,
                                         BLOCK_M, BLOCK_N, STREAMING)
        if STREAMING:  # the sinks, then the head of the recent range
            acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_ptrs0, v_ptrs0, stride_kn, stride_vn,
                                       offs_m, offs_d, hi * 0, s1, Lq, Lk, T, C, OFF, SINK, RECENT,
                                       qk_scale, HEAD_DIM, BLOCK_N, True, STREAMING, DOT_PRECISION)
            acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_ptrs0, v_ptrs0, stride_kn, stride_vn,
                                       offs_m, offs_d, b0, tl.minimum(u0, hi), Lq, Lk, T, C, OFF, SINK,
                                       RECENT, qk_scale, HEAD_DIM, BLOCK_N, True, STREAMING, DOT_PRECISION)
        # keys every row sees: no mask
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_ptrs0, v_ptrs0, stride_kn, stride_vn,
                                   offs_m, offs_d, u0, u1, Lq, Lk, T, C, OFF, SINK, RECENT,
                                   qk_scale, HEAD_DIM, BLOCK_N, False, STREAMING, DOT_PRECISION)
        # tail up to the last row's chunk end
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_ptrs0, v_ptrs0, stride_kn, stride_vn,
                                   offs_m, offs_d, u1, hi, Lq, Lk, T, C, OFF, SINK, RECENT,
                                   qk_scale, HEAD_DIM, BLOCK_N, True, STREAMING, DOT_PRECISION)

        # every valid row saw at least its own frame, so l_i > 0 there; padded rows are not stored
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        acc = acc / l_safe[:, None]
        lse = (m_i + tl.math.log2(l_safe)) * 0.6931471805599453  # back to natural log
        tl.store(LSE + offs_m, lse, mask=m_ok)
        tl.store(Out + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
                 acc.to(Out.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])

    # ------------------------------------------------------------------------------------------------
    # backward
    # ------------------------------------------------------------------------------------------------

    @triton.jit
    def _bwd_preprocess(Out, DO, DLSE, DELTA,
                        stride_ob, stride_oh, stride_om, stride_od,
                        stride_dob, stride_doh, stride_dom, stride_dod,
                        H, Lq,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                        HAS_DLSE: tl.constexpr):
        """delta = rowsum(dO * O) - dLSE, (B, H, Lq) fp32.

        With P = softmax(S), dS = P * (dP - rowsum(dO * O)); a gradient g on lse = logsumexp(S) adds
        P * g to dS, so it folds into the same formula by subtracting g from delta."""
        start_m = tl.program_id(0)
        off_bh = tl.program_id(1)
        off_b = (off_bh // H).to(tl.int64)
        off_h = (off_bh % H).to(tl.int64)
        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_m[:, None] < Lq) & (offs_d[None, :] < HEAD_DIM)
        o = tl.load(Out + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_om
                    + offs_d[None, :] * stride_od, mask=mask, other=0.0).to(tl.float32)
        do = tl.load(DO + off_b * stride_dob + off_h * stride_doh + offs_m[:, None] * stride_dom
                     + offs_d[None, :] * stride_dod, mask=mask, other=0.0).to(tl.float32)
        delta = tl.sum(o * do, 1)
        if HAS_DLSE:
            delta -= tl.load(DLSE + off_bh.to(tl.int64) * Lq + offs_m, mask=offs_m < Lq, other=0.0)
        tl.store(DELTA + off_bh.to(tl.int64) * Lq + offs_m, delta, mask=offs_m < Lq)

    @triton.jit
    def _bwd_dkdv_inner(dk, dv, k, v, Q, DO, LSE, DELTA, stride_qm, stride_qd, stride_dom, stride_dod,
                        offs_n, offs_d, lo, hi, Lq, Lk, T, C, OFF, SINK, RECENT, qk_scale,
                        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
                        STREAMING: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """Accumulate dK, dV (BN, BD) of one key block over query blocks ``[lo, hi)``. Works on the
        transposed scores (BN, BM) so that dV = P^T dO and dK = dS^T Q need no transposes of results."""
        d_ok = offs_d < HEAD_DIM
        for start_m in range(lo, hi, BLOCK_M):
            start_m = tl.multiple_of(start_m, BLOCK_M)
            offs_m = start_m + tl.arange(0, BLOCK_M)
            m_ok = offs_m < Lq
            # rows past Lq load as 0 (q, dO, lse, delta): their P^T dO and dS^T Q are then exactly 0
            qt = tl.load(Q + offs_m[None, :] * stride_qm + offs_d[:, None] * stride_qd,
                         mask=m_ok[None, :] & d_ok[:, None], other=0.0)  # (BD, BM)
            do = tl.load(DO + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                         mask=m_ok[:, None] & d_ok[None, :], other=0.0)  # (BM, BD)
            lse = tl.load(LSE + offs_m, mask=m_ok, other=0.0) * 1.4426950408889634  # (BM,) log2 domain
            delta = tl.load(DELTA + offs_m, mask=m_ok, other=0.0)  # (BM,)
            st = tl.dot(k, qt, input_precision=DOT_PRECISION) * qk_scale  # (BN, BM) = S^T, log2 domain
            pt = tl.math.exp2(st - lse[None, :])  # P^T, exact probabilities (lse is final)
            if MASKED:
                vis = _visible(offs_m[None, :], offs_n[:, None], Lq, Lk, T, C, OFF, SINK, RECENT, STREAMING)
                pt = tl.where(vis, pt, 0.0)
            dv += tl.dot(pt.to(do.dtype), do, input_precision=DOT_PRECISION)
            dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # (BN, BM) = (dO V^T)^T
            dst = pt * (dpt - delta[None, :])
            dk += tl.dot(dst.to(qt.dtype), tl.trans(qt), input_precision=DOT_PRECISION)
        return dk, dv

    @triton.jit
    def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV,
                         stride_qb, stride_qh, stride_qm, stride_qd,
                         stride_kb, stride_kh, stride_kn, stride_kd,
                         stride_vb, stride_vh, stride_vn, stride_vd,
                         stride_dob, stride_doh, stride_dom, stride_dod,
                         stride_dkb, stride_dkh, stride_dkn, stride_dkd,  # dk and dv share a layout
                         H, Lq, Lk, T, C, OFF, SINK, RECENT, sm_scale,
                         Q_BUCKET, K_BUCKET,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         STREAMING: tl.constexpr, DOT_PRECISION: tl.constexpr):
        start_n = tl.program_id(0)
        off_bh = tl.program_id(1)
        off_b = (off_bh // H).to(tl.int64)
        off_h = (off_bh % H).to(tl.int64)
        Q += off_b * stride_qb + off_h * stride_qh
        K += off_b * stride_kb + off_h * stride_kh
        V += off_b * stride_vb + off_h * stride_vh
        DO += off_b * stride_dob + off_h * stride_doh
        DK += off_b * stride_dkb + off_h * stride_dkh
        DV += off_b * stride_dkb + off_h * stride_dkh
        LSE += off_bh.to(tl.int64) * Lq
        DELTA += off_bh.to(tl.int64) * Lq

        offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        kv_mask = (offs_n[:, None] < Lk) & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(K + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
        v = tl.load(V + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
        dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        qk_scale = sm_scale * 1.4426950408889634

        a0, u0, u1, a1 = _query_ranges(start_n, Lq, Lk, T, C, OFF, SINK, RECENT,
                                       BLOCK_M, BLOCK_N, STREAMING)
        # rows that see part of the block, then rows that see all of it (no mask)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Q, DO, LSE, DELTA, stride_qm, stride_qd, stride_dom,
                                 stride_dod, offs_n, offs_d, a0, tl.minimum(u0, a1), Lq, Lk, T, C, OFF, SINK,
                                 RECENT, qk_scale, HEAD_DIM, BLOCK_M, True, STREAMING, DOT_PRECISION)
        dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Q, DO, LSE, DELTA, stride_qm, stride_qd, stride_dom,
                                 stride_dod, offs_n, offs_d, u0, u1, Lq, Lk, T, C, OFF, SINK, RECENT,
                                 qk_scale, HEAD_DIM, BLOCK_M, False, STREAMING, DOT_PRECISION)
        if STREAMING:  # rows whose window has moved past part of the block
            dk, dv = _bwd_dkdv_inner(dk, dv, k, v, Q, DO, LSE, DELTA, stride_qm, stride_qd, stride_dom,
                                     stride_dod, offs_n, offs_d, u1, a1, Lq, Lk, T, C, OFF, SINK, RECENT,
                                     qk_scale, HEAD_DIM, BLOCK_M, True, STREAMING, DOT_PRECISION)
        dk *= sm_scale  # dS is w.r.t. the scaled scores
        out_ptrs = offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd
        tl.store(DK + out_ptrs, dk.to(DK.dtype.element_ty), mask=kv_mask)
        tl.store(DV + out_ptrs, dv.to(DV.dtype.element_ty), mask=kv_mask)

    @triton.jit
    def _bwd_dq_inner(dq, q, do, lse, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                      offs_m, offs_d, lo, hi, Lq, Lk, T, C, OFF, SINK, RECENT, qk_scale,
                      HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                      STREAMING: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """Accumulate dQ (BM, BD) of one query block over key blocks ``[lo, hi)``."""
        d_ok = offs_d < HEAD_DIM
        for start_n in range(lo, hi, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            offs_n = start_n + tl.arange(0, BLOCK_N)
            t_mask = d_ok[:, None] & (offs_n[None, :] < Lk)
            kt = tl.load(K + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd, mask=t_mask,
                         other=0.0)  # (BD, BN)
            vt = tl.load(V + offs_n[None, :] * stride_vn + offs_d[:, None] * stride_vd, mask=t_mask,
                         other=0.0)  # (BD, BN)
            s = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale  # (BM, BN) log2 domain
            p = tl.math.exp2(s - lse[:, None])
            if MASKED:
                vis = _visible(offs_m[:, None], offs_n[None, :], Lq, Lk, T, C, OFF, SINK, RECENT, STREAMING)
                p = tl.where(vis, p, 0.0)
            dp = tl.dot(do, vt, input_precision=DOT_PRECISION)  # (BM, BN)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(kt.dtype), tl.trans(kt), input_precision=DOT_PRECISION)
        return dq

    @triton.jit
    def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ,
                       stride_qb, stride_qh, stride_qm, stride_qd,
                       stride_kb, stride_kh, stride_kn, stride_kd,
                       stride_vb, stride_vh, stride_vn, stride_vd,
                       stride_dob, stride_doh, stride_dom, stride_dod,
                       stride_dqb, stride_dqh, stride_dqm, stride_dqd,
                       H, Lq, Lk, T, C, OFF, SINK, RECENT, sm_scale,
                       Q_BUCKET, K_BUCKET,
                       HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       STREAMING: tl.constexpr, DOT_PRECISION: tl.constexpr):
        start_m = tl.program_id(0)
        off_bh = tl.program_id(1)
        off_b = (off_bh // H).to(tl.int64)
        off_h = (off_bh % H).to(tl.int64)
        Q += off_b * stride_qb + off_h * stride_qh
        K += off_b * stride_kb + off_h * stride_kh
        V += off_b * stride_vb + off_h * stride_vh
        DO += off_b * stride_dob + off_h * stride_doh
        DQ += off_b * stride_dqb + off_h * stride_dqh
        LSE += off_bh.to(tl.int64) * Lq
        DELTA += off_bh.to(tl.int64) * Lq

        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        m_ok = offs_m < Lq
        q_mask = m_ok[:, None] & (offs_d[None, :] < HEAD_DIM)
        q = tl.load(Q + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd, mask=q_mask, other=0.0)
        do = tl.load(DO + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod, mask=q_mask,
                     other=0.0)
        lse = tl.load(LSE + offs_m, mask=m_ok, other=0.0) * 1.4426950408889634
        delta = tl.load(DELTA + offs_m, mask=m_ok, other=0.0)
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        qk_scale = sm_scale * 1.4426950408889634

        s1, b0, u0, u1, hi = _key_ranges(start_m, Lq, Lk, T, C, OFF, SINK, RECENT,
                                         BLOCK_M, BLOCK_N, STREAMING)
        if STREAMING:  # the same ranges as the forward
            dq = _bwd_dq_inner(dq, q, do, lse, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                               offs_m, offs_d, hi * 0, s1, Lq, Lk, T, C, OFF, SINK, RECENT, qk_scale,
                               HEAD_DIM, BLOCK_N, True, STREAMING, DOT_PRECISION)
            dq = _bwd_dq_inner(dq, q, do, lse, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                               offs_m, offs_d, b0, tl.minimum(u0, hi), Lq, Lk, T, C, OFF, SINK, RECENT,
                               qk_scale, HEAD_DIM, BLOCK_N, True, STREAMING, DOT_PRECISION)
        dq = _bwd_dq_inner(dq, q, do, lse, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                           offs_m, offs_d, u0, u1, Lq, Lk, T, C, OFF, SINK, RECENT, qk_scale,
                           HEAD_DIM, BLOCK_N, False, STREAMING, DOT_PRECISION)
        dq = _bwd_dq_inner(dq, q, do, lse, delta, K, V, stride_kn, stride_kd, stride_vn, stride_vd,
                           offs_m, offs_d, u1, hi, Lq, Lk, T, C, OFF, SINK, RECENT, qk_scale,
                           HEAD_DIM, BLOCK_N, True, STREAMING, DOT_PRECISION)
        dq *= sm_scale
        tl.store(DQ + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd,
                 dq.to(DQ.dtype.element_ty), mask=q_mask)

    # ------------------------------------------------------------------------------------------------
    # autotuning (CUDA only)
    # ------------------------------------------------------------------------------------------------

    from triton.runtime.interpreter import InterpretedFunction as _InterpretedFunction

    INTERPRETED = isinstance(_fwd_kernel, _InterpretedFunction)

    def _configs(shapes):
        return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
                for bm, bn, w, s in shapes]

    _AUTOTUNE_KEY = ["Q_BUCKET", "K_BUCKET", "HEAD_DIM", "STREAMING"]
    # forward: wide query blocks amortise the q tile; backward: smaller tiles (more live tiles per program)
    _FWD_CONFIGS = _configs([(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 4, 4),
                             (64, 64, 4, 3), (64, 64, 4, 4), (64, 32, 4, 4), (64, 128, 4, 3)])
    _BWD_CONFIGS = _configs([(64, 64, 4, 3), (64, 64, 8, 2), (32, 64, 4, 3), (64, 32, 4, 3),
                             (128, 64, 8, 2), (64, 128, 8, 2), (32, 32, 4, 3), (128, 128, 8, 2)])

    def _prune_configs(configs, named_args, **kwargs):
        """Drop tiles that cannot pay off before compiling them (each compile costs seconds to minutes):
        fp32 inputs (IEEE dots, 4-byte tiles) keep tiles up to 64x64; head dims padded to 128 drop
        128x128. Always keeps at least the smallest config."""
        args = {**named_args, **kwargs}
        limit = 64 * 64 if args.get("DOT_PRECISION") == "ieee" else 128 * 128
        if args.get("BLOCK_D", 0) > 64:
            limit = min(limit, 128 * 64)
        kept = [c for c in configs if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= limit]
        return kept or [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"])]

    if INTERPRETED:
        _fwd_launch, _dkdv_launch, _dq_launch = _fwd_kernel, _bwd_dkdv_kernel, _bwd_dq_kernel
    else:
        def _tuned(configs, kernel):
            return triton.autotune(configs, key=_AUTOTUNE_KEY,
                                   prune_configs_by={"early_config_prune": _prune_configs})(kernel)

        _fwd_launch = _tuned(_FWD_CONFIGS, _fwd_kernel)
        _dkdv_launch = _tuned(_BWD_CONFIGS, _bwd_dkdv_kernel)
        _dq_launch = _tuned(_BWD_CONFIGS, _bwd_dq_kernel)
else:
    INTERPRETED = False


# ----------------------------------------------------------------------------------------------------
# host side
# ----------------------------------------------------------------------------------------------------


def _new(like: torch.Tensor, shape, dtype) -> torch.Tensor:
    """An output buffer: uninitialised normally, NaN-filled when a test asks (POISON_OUTPUTS)."""
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype, device=like.device)
    return torch.empty(shape, dtype=dtype, device=like.device)


def _launch(kernel, length, per, bh, **kw):
    """Launch one program per block of ``length`` rows (``per`` = "BLOCK_M": query blocks, "BLOCK_N": key
    blocks) and per batch*head, with the interpreter's fixed blocks or the autotuner's choice."""
    if INTERPRETED:
        bm, bn = INTERPRETER_BLOCKS
        kernel[(triton.cdiv(length, bm if per == "BLOCK_M" else bn), bh)](**kw, BLOCK_M=bm, BLOCK_N=bn)
    else:
        kernel[lambda meta: (triton.cdiv(length, meta[per]), bh)](**kw)


def _strides(name: str, t: torch.Tensor, dims: str = "bhmd") -> dict:
    """{"stride_<name>b": ..., "stride_<name>h": ..., ...}: the kernels take any (B, H, L, D) layout."""
    return {f"stride_{name}{d}": st for d, st in zip(dims, t.stride())}


def _common(q, k, rule, scale):
    """Launch arguments shared by the forward, dK/dV and dQ kernels."""
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    T, C, OFF, SINK, RECENT = rule
    return dict(H=H, Lq=Lq, Lk=Lk, T=T, C=C, OFF=OFF, SINK=SINK, RECENT=0 if RECENT is None else RECENT,
                sm_scale=scale, Q_BUCKET=_next_pow2(max(Lq, 1)), K_BUCKET=_next_pow2(max(Lk, 1)),
                HEAD_DIM=D, BLOCK_D=max(16, _next_pow2(D)), STREAMING=RECENT is not None,
                # fp32 inputs: IEEE fp32 dots (TF32 would miss the reference by ~1e-3, and torch's own
                # default for fp32 matmuls is no TF32); fp16/bf16: the tensor-core default
                DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32")


def _forward(q, k, v, rule, scale):
    """o (B, H, Lq, D) in q's dtype and lse (B, H, Lq) fp32, natural log."""
    B, H, Lq, D = q.shape
    o = _new(q, (B, H, Lq, D), q.dtype)
    lse = _new(q, (B, H, Lq), torch.float32)
    _launch(_fwd_launch, Lq, "BLOCK_M", B * H, Q=q, K=k, V=v, Out=o, LSE=lse,
            **_strides("q", q), **_strides("k", k, "bhnd"), **_strides("v", v, "bhnd"), **_strides("o", o),
            **_common(q, k, rule, scale))
    return o, lse


def _backward(q, k, v, o, lse, do, dlse, rule, scale, need_dq=True, need_dkdv=True):
    """dq, dk, dv from dO (and dLSE, or None) by FA2 recomputation from the saved lse; a gradient that
    is not needed is skipped (None)."""
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    common = _common(q, k, rule, scale)
    do = do.contiguous()
    delta = _new(q, (B, H, Lq), torch.float32)  # rowsum(dO * O) - dLSE
    pre_m = 64 if not INTERPRETED else INTERPRETER_BLOCKS[0]
    _bwd_preprocess[(triton.cdiv(Lq, pre_m), B * H)](
        o, do, dlse.contiguous() if dlse is not None else lse, delta,
        *o.stride(), *do.stride(), H, Lq,
        HEAD_DIM=D, BLOCK_D=common["BLOCK_D"], BLOCK_M=pre_m, HAS_DLSE=dlse is not None)
    inputs = dict(Q=q, K=k, V=v, DO=do, LSE=lse, DELTA=delta, **_strides("q", q), **_strides("k", k, "bhnd"),
                  **_strides("v", v, "bhnd"), **_strides("do", do), **common)
    dq = dk = dv = None
    if need_dkdv:
        dk = _new(k, k.shape, k.dtype)
        dv = _new(v, v.shape, v.dtype)  # same (contiguous) layout as dk: the kernel uses dk's strides
        _launch(_dkdv_launch, Lk, "BLOCK_N", B * H, DK=dk, DV=dv, **_strides("dk", dk, "bhnd"), **inputs)
    if need_dq:
        dq = _new(q, q.shape, q.dtype)
        _launch(_dq_launch, Lq, "BLOCK_M", B * H, DQ=dq, **_strides("dq", dq), **inputs)
    return dq, dk, dv


class _ChunkedAttentionFn(torch.autograd.Function):
    """Autograd wrapper: outputs (o, lse), both differentiable (lse's gradient folds into delta)."""

    @staticmethod
    def forward(ctx, q, k, v, rule, scale):
        o, lse = _forward(q, k, v, rule, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.rule, ctx.scale = rule, scale
        ctx.set_materialize_grads(False)  # None for an unused output: skip its work
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        if do is None:
            do = torch.zeros_like(o)
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        dq, dk, dv = _backward(q, k, v, o, lse, do, dlse, ctx.rule, ctx.scale,
                               need_dq=need_q, need_dkdv=need_k or need_v)
        return dq, dk if need_k else None, dv if need_v else None, None, None


def triton_chunked_attention(q, k, v, *, tokens_per_frame, frames_per_chunk, q_frame_offset, sink_frames,
                             recent_frames, scale, return_lse):
    """Triton backend of :func:`kernels.chunked_attention` (inputs assumed validated there)."""
    if not HAS_TRITON:
        raise RuntimeError("the Triton backend needs the `triton` package, which is not importable here")
    rule = (tokens_per_frame, frames_per_chunk, q_frame_offset, sink_frames, recent_frames)
    o, lse = _ChunkedAttentionFn.apply(q, k, v, rule, float(scale))
    return (o, lse) if return_lse else o
