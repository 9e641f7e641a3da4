"""Candidate selection (rollout(candidates=N), sample.py --candidates N): minimum-Bayes-risk choice per AR step.

N = 1 is the plain rollout bit for bit; one AR step of N candidates returns, per sample, the medoid of the N plain
rollouts drawn from `candidate_generators`; N candidates that draw the same noise give the plain rollout through
every commit (cached or recomputed memory, noisy context, pose-aware memory); the medoid on known values; refusals.
"""

import sys

import pytest
import torch
from test_noisy_context import B, K, clip, make, poses

import sample
from arvdm.config import SamplingError
from arvdm.model.diffusion import PerFrameDiffusion
from arvdm.pipeline.rollout import candidate_generators, episode_generators, medoid, rollout
from arvdm.sample_settings import SampleSettings
from arvdm.schedules.presets import chunked, fifo
from arvdm.speculative.rows import SpeculativeRows, make_speculation


def go(model, sched, n_frames, generator, extra=None, **kw):
    ctx, ctx_a = clip(2, seed=3)
    _, act = clip(n_frames, seed=4)
    kw.setdefault("eta", 1.0)
    return rollout(model, PerFrameDiffusion(model.cfg.diffusion), sched, ctx, ctx_a, act, n_frames, progress=False,
                   generator=generator, **(extra or {}), **kw)


def test_medoid_on_known_values():
    """(B, N, ...) -> the candidate with the least summed squared distance to the others; ties -> lowest index."""
    c = torch.tensor([[0.0, 1.0, 10.0], [5.0, -1.0, 0.0], [2.0, 2.0, 7.0], [3.0, 3.0, 3.0]]).view(4, 3, 1, 1)
    # sums: [0+1+100, 1+0+81, 100+81+0] | [36+25, 36+1, 25+1] | [0+0+25, 25, 50] | all 0
    assert medoid(c).tolist() == [1, 2, 0, 0]
    frames = torch.stack([torch.zeros(2, 3, 4, 4), torch.ones(2, 3, 4, 4), torch.full((2, 3, 4, 4), 0.4)])[None]
    assert medoid(frames).tolist() == [2]  # whole frames: the one in the middle


def test_one_candidate_is_the_plain_rollout():
    model, sched = make(), fifo(4, K, 2)
    plain = go(model, sched, 5, episode_generators(0, range(B)))
    one = go(model, sched, 5, episode_generators(0, range(B)), candidates=1)
    assert torch.equal(plain, one)


@pytest.mark.parametrize("sched", [fifo(4, K, 2), chunked(4, K, 2)], ids=["fifo", "chunked"])
def test_one_ar_step_returns_the_medoid_of_the_candidates_plain_rollouts(sched):
    """Before the first choice the N candidates are N independent plain rollouts (candidate 0 from the sample's own
    generator, j from candidate_generators); the first Δ frames out are each sample's medoid of them."""
    model, n = make(), 3
    delta = sched.delta
    gens = candidate_generators(episode_generators(7, range(B)), n, B)  # sample-major: i*N + j
    alone = torch.stack([go(model, sched, delta, [gens[i * n + j] for i in range(B)]) for j in range(n)], dim=1)
    expected_idx = medoid(alone)  # (B,)
    assert expected_idx.tolist() != [0] * B  # the choice is not just candidate 0 (else the test could not fail)
    got = go(model, sched, delta, episode_generators(7, range(B)), candidates=n)
    torch.testing.assert_close(got, alone[torch.arange(B), expected_idx], atol=1e-5, rtol=0)


@pytest.mark.parametrize("overrides,use_cache,level", [
    ((), True, 0), ((), False, 0), ((), True, 15),
    (("memory.structure=prepend", "memory.select=pose", "memory.pose_frames=2"), True, 15),
    (("memory.structure=cross_attention",), False, 15),
], ids=["cached", "recomputed", "noisy-context", "pose", "cross-recomputed"])
def test_candidates_that_draw_the_same_noise_are_the_plain_rollout(monkeypatch, overrides, use_cache, level):
    """N copies of every sample's generator: every candidate draws the same noise, the choice keeps candidate 0 and
    the N states stay identical through the commits, so the rollout is the plain one frame for frame. A mistake in
    the layout (sample-major rows, the window copied back, the commits) would mix samples or frames."""
    model, sched, n, n_frames = make(*overrides), fifo(4, K, 2).with_context_level(level), 3, 7
    extra = {"poses": poses(2 + n_frames, seed=5)} if model.pose_aware else {}

    def same_seed(generator, n_candidates, batch_size):
        return [torch.Generator().manual_seed(g.initial_seed()) for g in generator for _ in range(n_candidates)]

    plain = go(model, sched, n_frames, episode_generators(3, range(B)), extra, use_cache=use_cache)
    monkeypatch.setattr(sys.modules["arvdm.pipeline.rollout"], "candidate_generators", same_seed)
    copies = go(model, sched, n_frames, episode_generators(3, range(B)), extra, use_cache=use_cache, candidates=n)
    torch.testing.assert_close(copies, plain, atol=1e-5, rtol=0)
    monkeypatch.undo()
    chosen = go(model, sched, n_frames, episode_generators(3, range(B)), extra, use_cache=use_cache, candidates=n)
    assert (chosen - plain).abs().max() > 1e-2  # with their own noise the candidates do differ


def test_bad_candidates_are_refused_naming_the_argument():
    model, sched = make(), fifo(4, K, 2)
    for bad in (0, -1, 2.0, True, "3"):
        with pytest.raises(SamplingError, match="candidates"):
            go(model, sched, 2, None, candidates=bad)
    spec = make_speculation("fixed:2", (1, 2), seed=0)
    with pytest.raises(SamplingError, match="plain row runner"):
        go(model, sched, 2, None, candidates=2, rows=SpeculativeRows(spec))
    with pytest.raises(SamplingError, match="plain row runner"):
        go(model, sched, 2, None, candidates=2, return_intermediate=True)
    with pytest.raises(SamplingError, match="neighbouring sample"):
        go(model, sched, 2, None, candidates=2, memory_select="other")
    with pytest.raises(SamplingError, match="generators for a batch"):
        go(model, sched, 2, episode_generators(0, range(B + 1)), candidates=2)


def test_sample_settings_and_cli_refuse_bad_candidates(tmp_path, capsys):
    for bad in (0, -2, 1.5):
        with pytest.raises(SamplingError, match="--candidates"):
            SampleSettings(candidates=bad).validate()
    with pytest.raises(SamplingError, match="--candidates 2 cannot go with --speculate"):
        SampleSettings(candidates=2, speculate="ucb").validate()
    with pytest.raises(SamplingError, match="--memory-select other"):
        SampleSettings(candidates=2, memory_select="other").validate()
    assert sample.main(["--run", str(tmp_path), "--candidates", "0"]) == 2
    assert "--candidates must be an integer >= 1" in capsys.readouterr().err
