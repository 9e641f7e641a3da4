"""Gradient accumulation is exact; torch.compile'd training and sampling agree with eager."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from test_training import tiny_cfg, write_episodes

import arvdm.training.trainer as trainer_module
from arvdm.training.loader import collate
from arvdm.training.objective import diffusion_forcing_loss
from arvdm.training.trainer import Trainer


@pytest.fixture
def data(tmp_path):
    return write_episodes(tmp_path / "data", n_train=4, length=12)


def _clips(trainer, n):
    items = [trainer.train_ds[i] for i in range(n)]
    return collate(items)


def _per_clip_loss(model, diffusion, video, actions, memory_length, num_levels, generator, autocast,
                   weight="uniform", gamma=5.0, **levers):
    """The real loss, applied clip by clip with noise seeded by the clip's content, so a clip draws the same
    levels and noise whichever micro-batch it lands in (the real one draws from one stream per batch)."""
    totals, counts = [], []
    for i in range(video.shape[0]):
        g = torch.Generator().manual_seed(int(actions[i].sum()) * 1000 + int(video[i, 0, 0, 0, 0] * 1000))
        t, c = real_loss(model, diffusion, video[i:i + 1], actions[i:i + 1], memory_length, num_levels, g,
                         autocast, weight, gamma, **levers)
        totals.append(t)
        counts.append(c)
    return torch.stack(totals).sum(), torch.stack(counts).sum()


real_loss = diffusion_forcing_loss


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_grad_accum_equals_one_big_batch(tmp_path, data, monkeypatch):
    monkeypatch.setattr(trainer_module, "diffusion_forcing_loss", _per_clip_loss)  # what train_step calls
    # K = 4 levels: level 0 (clean, not counted) is drawn often, so micro-batches count different frames.
    common = ["diffusion.num_levels=4", "train.grad_clip=0"]
    big = Trainer(tiny_cfg(data, "train.batch_size=4", *common), tmp_path / "big", device="cpu")
    acc = Trainer(tiny_cfg(data, "train.batch_size=2", "train.grad_accum=2", *common), tmp_path / "acc",
                  device="cpu")
    assert acc.global_batch == big.global_batch == 4
    batch = _clips(big, 4)
    halves = [{k: v[:2] for k, v in batch.items()}, {k: v[2:] for k, v in batch.items()}]

    loss_big, _ = big.train_step(batch)
    loss_acc, _ = acc.train_step(halves)
    torch.testing.assert_close(loss_acc, loss_big, rtol=1e-5, atol=1e-7)
    g_big, g_acc = _grads(big.model), _grads(acc.model)
    assert g_big.keys() == g_acc.keys() and len(g_big) > 0
    for n in g_big:
        torch.testing.assert_close(g_acc[n], g_big[n], rtol=1e-4, atol=1e-7, msg=n)
    for (n, p), q in zip(big.model.named_parameters(), acc.model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=n)

    # Not vacuous: the two halves count different numbers of frames, so a mean of the two micro-batch
    # means (naive accumulation) is another number.
    parts = [_per_clip_loss(big.model, big.diffusion, *big._to_device(h), big.m, big.K, None, big.autocast)
             for h in halves]
    assert parts[0][1] != parts[1][1]
    naive = ((parts[0][0] / parts[0][1] + parts[1][0] / parts[1][1]) / 2).detach()
    assert abs(float(naive) - float(loss_big)) > 1e-4


def test_fit_consumes_grad_accum_micro_batches_per_step(tmp_path, data):
    t = Trainer(tiny_cfg(data, "train.grad_accum=3", "train.max_steps=2", "train.val_every=0",
                         "train.ckpt_every=2"), tmp_path / "run", device="cpu")
    seen = []
    step = t.train_step
    t.train_step = lambda mbs: (seen.append(len(mbs)), step(mbs))[1]
    t.fit()
    assert seen == [3, 3] and t.data_position() == 2 * 3 * 2  # steps x micro-batches x batch_size


def _aot_eager(monkeypatch):
    """inductor's C++ codegen takes minutes on a 2-core CPU; aot_eager traces the same graphs (dynamo +
    AOT autograd) without code generation. The slow test below runs inductor."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_training_step_matches_eager(tmp_path, data, monkeypatch, backend):
    if backend == "aot_eager":
        _aot_eager(monkeypatch)
    torch._dynamo.reset()
    # with the last frame moved along the actions (model.action_advection, on in `tiny`): inductor once failed on
    # its replicate pad's backward
    advect = ("model.last_frame_input=true", "model.action_advection=2")
    eager = Trainer(tiny_cfg(data, *advect), tmp_path / "eager", device="cpu")
    comp = Trainer(tiny_cfg(data, *advect, "train.compile=true"), tmp_path / "comp", device="cpu")
    assert comp.net is not comp.model and hasattr(comp.net, "_orig_mod")
    batch = _clips(eager, 2)
    for _ in range(2):  # the same generator seeds: the same levels and noise in both
        le, _ = eager.train_step(batch)
        lc, _ = comp.train_step(batch)
        torch.testing.assert_close(lc, le, rtol=1e-4, atol=1e-6)
    # Adam's first steps move a weight by about +-lr whatever its gradient's size: a zero-initialised conv
    # whose gradient is ~1e-9 in one graph and ~-1e-9 in the other (inductor fuses and reorders float sums)
    # lands 2 lr apart. The losses above agree to 1e-4; the weights must agree to that bound.
    atol = 1e-6 if backend == "aot_eager" else 2.5 * eager.cfg.train.lr
    for (n, p), q in zip(eager.model.named_parameters(), comp.model.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=atol, msg=n)


@pytest.mark.parametrize("use_cache", [True, False])
def test_compiled_rollout_matches_eager(monkeypatch, use_cache):
    from test_model import make

    from arvdm.model.diffusion import PerFrameDiffusion
    from arvdm.pipeline.rollout import rollout
    from arvdm.sampling import compile_for_sampling
    from arvdm.schedules.presets import fifo

    _aot_eager(monkeypatch)
    torch._dynamo.reset()
    model = make("memory.retention=last", "memory.length=4")  # the cache fills, then slides
    diffusion = PerFrameDiffusion(model.cfg.diffusion)
    sched = fifo(4, model.cfg.diffusion.num_levels)
    ctx, ctx_a, acts = torch.rand(1, 2, 3, 16, 16) * 2 - 1, torch.zeros(1, 2).long(), torch.ones(1, 10).long()

    def run(m):
        return rollout(m, diffusion, sched, ctx, ctx_a, acts, 10, generator=torch.Generator().manual_seed(0),
                       use_cache=use_cache, progress=False)
    eager = run(model)
    compiled = run(compile_for_sampling(model))
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)
    assert eager.abs().mean() > 0.1  # real frames, not zeros


@pytest.mark.parametrize("bf16, native, expected", [(True, True, torch.bfloat16), (True, False, torch.float32),
                                                    (False, True, torch.float32)])
def test_bf16_autocast_only_where_the_device_has_it(tmp_path, data, monkeypatch, bf16, native, expected):
    """train.bf16 autocasts the network on a device with native bf16 (CUDA, a CPU with AVX512-BF16/AMX: 1.45x
    faster steps on the tiny preset); on a CPU without it bf16 is emulated and slower, so training stays fp32."""
    monkeypatch.setattr(trainer_module, "native_bf16", lambda device: native)
    t = Trainer(tiny_cfg(data, f"train.bf16={str(bf16).lower()}"), tmp_path / "run", device="cpu")
    seen = []
    linear = next(mod for mod in t.model.blocks.modules() if isinstance(mod, torch.nn.Linear))
    linear.register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
    t.train_step(_clips(t, 2))
    assert seen and set(seen) == {expected}
    assert all(p.dtype == torch.float32 for p in t.model.parameters())  # weights, Adam and the EMA stay fp32


def test_bf16_step_is_close_to_fp32_but_not_equal(tmp_path, data, monkeypatch):
    """Where bf16 is native (forced here, so the test runs on any CPU), one step's loss agrees with fp32 to bf16's
    precision and differs from it: the autocast really changed the arithmetic, and only by rounding."""
    monkeypatch.setattr(trainer_module, "native_bf16", lambda device: True)
    fp32 = Trainer(tiny_cfg(data, "train.bf16=false"), tmp_path / "fp32", device="cpu")
    bf16 = Trainer(tiny_cfg(data, "train.bf16=true"), tmp_path / "bf16", device="cpu")
    batch = _clips(fp32, 2)
    for _ in range(2):  # the first step's loss is the same in both: the output layer starts at zero
        l32, _ = fp32.train_step(batch)
        l16, _ = bf16.train_step(batch)
    assert float(l16) != float(l32)
    torch.testing.assert_close(l16, l32, rtol=3e-2, atol=1e-4)


def test_cpu_bf16_autocast_takes_the_math_attention_path():
    """On the CPU, bf16 attention runs on PyTorch's math path (its flash kernel is slower in bf16 than in fp32
    at these lengths): the profiler must see no flash-attention op inside `bf16_autocast`, and see one outside."""
    from torch.profiler import ProfilerActivity, profile

    from arvdm.runtime import bf16_autocast

    q = torch.randn(2, 2, 16, 8, dtype=torch.bfloat16)

    def ops(ctx):
        with profile(activities=[ProfilerActivity.CPU]) as prof, ctx:
            out = torch.nn.functional.scaled_dot_product_attention(q, q, q)
        return out, {e.key for e in prof.key_averages()}

    out, inside = ops(bf16_autocast("cpu"))
    _, outside = ops(contextlib.nullcontext())
    assert not any("flash" in k for k in inside) and any("flash" in k for k in outside)
    torch.testing.assert_close(out.float(), torch.nn.functional.scaled_dot_product_attention(
        q.float(), q.float(), q.float()), rtol=2e-2, atol=2e-2)


def test_native_bf16_asks_onednn_on_the_cpu_and_says_no_when_it_cannot_ask(monkeypatch):
    import types

    from arvdm.runtime import native_bf16

    assert native_bf16("cuda") is True
    assert native_bf16("cpu") is bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    monkeypatch.setattr(torch.ops, "mkldnn", types.SimpleNamespace())  # a torch without the (private) query
    assert native_bf16("cpu") is False
