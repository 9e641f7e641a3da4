"""Rollout: model calls follow the schedule's rows, commits are in order, cached == recomputing, the eta
default, pluggable row runners, the model protocol."""

import pytest
import torch

from arvdm.config import Config, DiffusionConfig, SamplingError
from arvdm.model.denoiser import Denoiser
from arvdm.model.diffusion import PerFrameDiffusion
from arvdm.pipeline import PlainRows, RolloutContext, RolloutModel
from arvdm.pipeline.rollout import episode_generators, rollout
from arvdm.schedules.presets import chunked, fifo, from_matrix, pyramid

K = 100
DIFF = PerFrameDiffusion(DiffusionConfig(num_levels=K))


class StubModel:
    """A causal stand-in for `Denoiser` with the same API and a hand-written memory.

    v is a fixed function of the window, its levels and actions, the mean of the remembered past frames and
    the window's absolute start. The cached path keeps its own list of committed frames and applies the
    retention by hand ("all" or "last m"), independently of the `memory` package the pipeline uses for the
    uncached path, so agreement between the two paths checks the pipeline's bookkeeping.
    """

    def __init__(self, retention="all", length=8, frames_per_chunk=1):
        self.cfg = Config()
        self.cfg.memory.retention, self.cfg.memory.length = retention, length
        self.cfg.model.frames_per_chunk = frames_per_chunk
        self.frames_per_chunk = frames_per_chunk
        self.calls, self.commits = [], []

    def check_schedule(self, delta, window):
        if delta % self.frames_per_chunk:
            raise ValueError(f"stub: delta={delta} not a multiple of {self.frames_per_chunk}")

    def init_state(self, batch_size):
        return {"frames": [], "actions": []}

    def commit(self, state, frames, actions):
        self.commits.append((frames.clone(), actions.clone()))
        state["frames"].append(frames.clone())
        state["actions"].append(actions.clone())

    def __call__(self, x, levels, actions, memory=None, state=None):
        assert (memory is None) or (state is None)
        if state is not None:
            past = torch.cat(state["frames"], 1) if state["frames"] else x[:, :0]
            start = past.shape[1]
            if self.cfg.memory.retention == "last":
                past = past[:, max(0, start - self.cfg.memory.length):]
            mode = "state"
        else:
            past = memory.frames if memory is not None else x[:, :0]
            start = memory.window_start if memory is not None else 0
            mode = "memory"
        self.calls.append({"mode": mode, "levels": levels.clone(), "actions": actions.clone(),
                           "n_past": past.shape[1], "start": start})
        mem = past.mean(1, keepdim=True) if past.shape[1] else torch.zeros_like(x[:, :1])  # (B,1,C,H,W)
        lv = levels.to(x.dtype)[..., None, None, None] / K
        act = actions.to(x.dtype)[..., None, None, None]
        return 0.8 * x - 0.5 * mem + 0.3 * lv + 0.01 * act + 0.002 * start  # (B,w,C,H,W)


def inputs(b=2, n_ctx=2, n_frames=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    ctx = torch.rand(b, n_ctx, 1, 4, 4, generator=g) * 2 - 1
    ctx_act = torch.randint(0, 5, (b, n_ctx), generator=g)
    act = torch.randint(0, 5, (b, n_frames), generator=g)
    return ctx, ctx_act, act


def run(model, sched, n_frames=7, seed=0, **kw):
    ctx, ctx_act, act = inputs(n_frames=n_frames)
    kw.setdefault("progress", False)
    kw.setdefault("eta", 0.0)  # DDIM unless a test asks: these tests check the bookkeeping, not the noise
    return rollout(model, DIFF, sched, ctx, ctx_act, act, n_frames, generator=torch.Generator().manual_seed(seed),
                   **kw)


SCHEDULES = {
    "chunked": chunked(3, K, 4),
    "fifo": fifo(3, K, 2),
    "pyramid": pyramid(3, K, 3, stagger=1),
    "custom": from_matrix([[50, 50, 100, 100], [25, 25, 75, 75], [0, 0, 50, 50]], 2, K),
}


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("n_frames", [1, 7])
def test_model_calls_follow_the_schedule_rows(name, n_frames):
    sched, model = SCHEDULES[name], StubModel()
    out = run(model, sched, n_frames=n_frames)
    assert out.shape == (2, n_frames, 1, 4, 4)
    n_ar = -(-n_frames // sched.delta)
    init, S = sched.init_matrix().tolist(), sched.matrix.tolist()
    expected = init[:-1] + S[:-1] * n_ar  # the levels each call starts from, in order
    assert len(model.calls) == sched.init_steps + n_ar * sched.num_steps == len(expected)
    for call, row in zip(model.calls, expected):
        assert call["levels"].tolist() == [row, row]  # (B, w): every batch element at the schedule's row
        assert call["levels"].dtype == torch.int64


def test_calls_per_ar_step_and_window_position():
    sched, model = fifo(3, K, 2), StubModel()
    run(model, sched, n_frames=5)
    init_calls, ar_calls = model.calls[:sched.init_steps], model.calls[sched.init_steps:]
    assert len(ar_calls) == 5 * sched.num_steps
    assert all(c["start"] == 2 for c in init_calls)  # 2 context frames committed before the window
    # M = 2 calls per AR step, each AR step one frame further
    assert [c["start"] for c in ar_calls] == [2 + a for a in range(5) for _ in range(2)]


@pytest.mark.parametrize("name", ["chunked", "fifo", "custom"])
def test_frames_committed_in_order_with_their_actions(name):
    sched, model = SCHEDULES[name], StubModel()
    ctx, ctx_act, act = inputs(n_frames=7)
    out = run(model, sched, n_frames=7)  # 7 is not a multiple of delta = 3 (chunked) or 2 (custom)
    frames = torch.cat([f for f, _ in model.commits], 1)
    acts = torch.cat([a for _, a in model.commits], 1)
    n_ar, d = -(-7 // sched.delta), sched.delta
    # context, then every AR step's finished frames but the last step's (nothing reads them again)
    assert [f.shape[1] for f, _ in model.commits] == [2] + [d] * (n_ar - 1)
    assert torch.equal(frames, torch.cat([ctx, out[:, :(n_ar - 1) * d]], 1))
    assert torch.equal(acts, torch.cat([ctx_act, act[:, :(n_ar - 1) * d]], 1))


@pytest.mark.parametrize("name", ["chunked", "fifo"])
def test_window_actions_are_padded_with_the_last_action(name):
    sched, model = SCHEDULES[name], StubModel()
    _, _, act = inputs(n_frames=7)
    run(model, sched, n_frames=7)
    w, d = sched.window, sched.delta
    padded = torch.cat([act, act[:, -1:].repeat(1, 20)], 1)
    ar_calls = model.calls[sched.init_steps:]
    for i, c in enumerate(ar_calls):
        off = (i // sched.num_steps) * d
        assert torch.equal(c["actions"], padded[:, off:off + w])
    assert (ar_calls[-1]["actions"][:, -1] == act[:, -1]).all()  # past the end: last action repeated
    assert ar_calls[-1]["actions"].shape[1] + (len(ar_calls) // sched.num_steps - 1) * d > 7


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("retention, eta", [("all", 0.0), ("last", 0.0), ("last", 0.7)])
def test_cached_and_uncached_agree_for_the_stub(name, retention, eta):
    sched = SCHEDULES[name]
    cached, recomputed = StubModel(retention, length=3), StubModel(retention, length=3)
    a = run(cached, sched, eta=eta, use_cache=True)
    b = run(recomputed, sched, eta=eta, use_cache=False)
    assert {c["mode"] for c in cached.calls} == {"state"} and {c["mode"] for c in recomputed.calls} == {"memory"}
    assert [c["n_past"] for c in cached.calls] == [c["n_past"] for c in recomputed.calls]
    assert [c["start"] for c in cached.calls] == [c["start"] for c in recomputed.calls]
    if retention == "last":
        assert max(c["n_past"] for c in recomputed.calls) == 3
    torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_deterministic_given_the_generator_and_eta_draws_noise():
    sched = SCHEDULES["fifo"]
    a, b = run(StubModel(), sched, seed=1, eta=0.5), run(StubModel(), sched, seed=1, eta=0.5)
    assert torch.equal(a, b)
    assert not torch.allclose(a, run(StubModel(), sched, seed=2, eta=0.5))
    assert not torch.allclose(a, run(StubModel(), sched, seed=1, eta=0.0))


def test_per_sample_generators_make_a_sample_independent_of_its_batch():
    """One generator per sample (episode_generators): a sample rolled out alone equals the same sample inside a
    batch, for every kind of draw (the initial window, entering frames, eta > 0 steps, noisy-context commits)."""
    model, sched = tiny_denoiser(), fifo(4, K, 1).with_context_level(20)
    g = torch.Generator().manual_seed(0)
    ctx = torch.rand(3, 2, 3, 16, 16, generator=g) * 2 - 1
    ctx_act, act = torch.randint(0, 6, (3, 2), generator=g), torch.randint(0, 6, (3, 5), generator=g)

    def go(idx, **kw):
        return rollout(model, DIFF, sched, ctx[idx], ctx_act[idx], act[idx], 5, eta=0.5, progress=False, **kw)

    batch = go(slice(0, 3), generator=episode_generators(7, range(3)))  # (3, 5, 3, 16, 16)
    alone = torch.cat([go(slice(e, e + 1), generator=episode_generators(7, [e])) for e in range(3)])
    torch.testing.assert_close(batch, alone, rtol=0, atol=1e-5)
    pair = go(slice(1, 3), generator=episode_generators(7, [1, 2]))  # a batch that starts at episode 1
    torch.testing.assert_close(pair, batch[1:], rtol=0, atol=1e-5)
    # one generator for the batch draws the samples' noise interleaved: episode 1 alone is then another sample
    shared = go(slice(0, 3), generator=torch.Generator().manual_seed(7))
    assert (shared[1:2] - go(slice(1, 2), generator=torch.Generator().manual_seed(7))).abs().max() > 1e-2
    assert (episode_generators(7, [1])[0].initial_seed() != episode_generators(8, [1])[0].initial_seed())
    with pytest.raises(SamplingError, match="2 per-sample generators for a batch of 3"):
        go(slice(0, 3), generator=episode_generators(7, range(2)))


def test_return_intermediate_records_every_call():
    sched, model = SCHEDULES["fifo"], StubModel()
    out, steps = run(model, sched, n_frames=4, return_intermediate=True)
    assert len(steps) == len(model.calls) == sched.num_calls(4)
    assert [s.stage for s in steps[:sched.init_steps]] == ["init"] * sched.init_steps
    for s, c in zip(steps, model.calls):
        assert torch.equal(s.levels_from.expand(2, -1), c["levels"])
    assert steps[-1].levels_to.tolist() == sched.t_out.tolist() and steps[-1].frame_offset == 3
    assert torch.equal(steps[-1].x[:, 0], out[:, 3])  # the last emitted frame is the window's first
    assert steps[0].x0.shape == (2, 3, 1, 4, 4)


def test_bad_inputs_raise():
    model, sched = StubModel(frames_per_chunk=2), SCHEDULES["custom"]  # delta 2: servable
    ctx, ctx_act, act = inputs(n_ctx=3)
    with pytest.raises(ValueError, match="multiple of model.frames_per_chunk=2"):
        rollout(model, DIFF, sched, ctx, ctx_act, act, 7, progress=False)
    with pytest.raises(ValueError, match="not a multiple of 2"):  # the model's own refusal
        rollout(model, DIFF, SCHEDULES["fifo"], ctx[:, :2], ctx_act[:, :2], act, 7, progress=False)
    with pytest.raises(ValueError, match=r"actions must be \(B, >= n_frames\)"):
        rollout(StubModel(), DIFF, sched, ctx, ctx_act, act, 8, progress=False)
    with pytest.raises(ValueError, match="K=1000 levels but the diffusion has num_levels=100"):
        rollout(StubModel(), DIFF, fifo(3, 1000), ctx, ctx_act, act, 7, progress=False)
    with pytest.raises(ValueError, match=r"context_actions must be \(B, C\)"):
        rollout(StubModel(), DIFF, sched, ctx, ctx_act[:, :1], act, 7, progress=False)


def test_no_context_and_progress_bar(capsys):
    sched, model = SCHEDULES["chunked"], StubModel()
    ctx, ctx_act, act = inputs(n_ctx=0, n_frames=4)
    out = rollout(model, DIFF, sched, ctx, ctx_act, act, 4, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 4, 1, 4, 4) and model.calls[0]["n_past"] == 0
    assert "rollout (chunked)" in capsys.readouterr().err


def test_eta_none_is_the_diffusions_own_and_is_checked():
    sched = SCHEDULES["fifo"]
    diff = PerFrameDiffusion(DiffusionConfig(num_levels=K, eta=0.3))
    ctx, ctx_act, act = inputs()

    def go(diffusion, **kw):
        return rollout(StubModel(), diffusion, sched, ctx, ctx_act, act, 7, generator=torch.Generator().manual_seed(0),
                       progress=False, **kw)

    assert torch.equal(go(diff), go(diff, eta=0.3))  # None = diffusion.cfg.eta
    assert DIFF.cfg.eta == 1.0 and torch.equal(go(DIFF), go(DIFF, eta=1.0))
    assert not torch.equal(go(DIFF), go(DIFF, eta=0.0))
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(SamplingError, match=r"rollout eta must be in \[0, 1\]"):
            go(DIFF, eta=bad)


class RecordingRows(PlainRows):
    """A row runner that logs what the rollout tells it and runs the rows plainly."""

    def __init__(self):
        self.events = []

    def start(self, rollout: RolloutContext) -> None:
        self.events.append(("start", rollout.eta, rollout.batch_size, rollout.state is not None))
        super().start(rollout)

    def run_rows(self, x, rows, win_actions, stage, ar_step, frame_offset):
        self.events.append(("rows", stage, ar_step, frame_offset, rows.shape[0] - 1))
        return super().run_rows(x, rows, win_actions, stage, ar_step, frame_offset)

    def commit(self, frames, actions):
        self.events.append(("commit", frames.shape[1]))

    def shift(self, delta):
        self.events.append(("shift", delta))


@pytest.mark.parametrize("use_cache", [True, False])
def test_a_row_runner_is_driven_in_order_and_plain_rows_are_the_default(use_cache):
    sched = SCHEDULES["chunked"]  # delta 3: 7 frames take 3 AR steps
    runner = RecordingRows()
    out = run(StubModel(), sched, eta=0.5, use_cache=use_cache, rows=runner)
    assert torch.equal(out, run(StubModel(), sched, eta=0.5, use_cache=use_cache))
    m, mi = sched.num_steps, sched.init_steps
    assert runner.events == [("start", 0.5, 2, use_cache), ("commit", 2), ("rows", "init", -1, 0, mi),
                             ("rows", "ar", 0, 0, m), ("commit", 3), ("shift", 3),
                             ("rows", "ar", 1, 3, m), ("commit", 3), ("shift", 3), ("rows", "ar", 2, 6, m)]


def test_models_satisfy_the_rollout_protocol():
    assert isinstance(StubModel(), RolloutModel)
    assert isinstance(tiny_denoiser(), RolloutModel)


# -- the real denoiser -------------------------------------------------------------------------------------
def tiny_denoiser(temporal_attention="factorized", frames_per_chunk=1):
    cfg = Config()
    m = cfg.model
    m.image_size, m.patch_size, m.dim, m.depth, m.heads, m.num_actions = 16, 4, 32, 2, 4, 6
    m.temporal_attention, m.frames_per_chunk = temporal_attention, frames_per_chunk
    cfg.memory.retention, cfg.memory.structure = "all", "prepend"
    cfg.diffusion.num_levels = K
    torch.manual_seed(0)
    model = Denoiser(cfg).eval()
    # The output layer and the AdaLN gates start at zero (v = 0 whatever the memory): randomise every
    # weight so that the past actually changes the prediction.
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model


@pytest.mark.parametrize("sched, form, chunk", [
    (chunked(4, K, 3), "factorized", 1),
    (fifo(4, K, 1), "factorized", 1),
    (fifo(4, K, 1), "full", 1),
    (from_matrix([[50, 50, 100, 100], [0, 0, 50, 50]], 2, K), "factorized", 2),
], ids=["chunked", "fifo", "fifo-full", "delta2-chunk2"])
def test_real_denoiser_kv_cached_rollout_equals_recomputing(sched, form, chunk):
    model = tiny_denoiser(form, chunk)
    g = torch.Generator().manual_seed(0)
    ctx = torch.rand(1, 2, 3, 16, 16, generator=g) * 2 - 1
    ctx_act, act = torch.randint(0, 6, (1, 2), generator=g), torch.randint(0, 6, (1, 6), generator=g)

    def go(use_cache, context=ctx):
        return rollout(model, DIFF, sched, context, ctx_act, act, 6, eta=0.3, use_cache=use_cache,
                       generator=torch.Generator().manual_seed(1), progress=False)

    cached, recomputed = go(True), go(False)
    assert cached.dtype == torch.float32 and cached.shape == (1, 6, 3, 16, 16)
    assert (cached - recomputed).abs().max() < 1e-4
    # and the comparison is not vacuous: the past does change what is generated
    assert (go(True, -ctx) - cached).abs().max() > 1e-2
