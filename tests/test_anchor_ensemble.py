"""The anchor of several runs (arvdm.pipeline.anchor.AnchorEnsemble, sample.py --anchor-runs).

At a frame's level-K call v is the members' mean, at every other call the sampled run's own; a run paired with
itself samples exactly as it does alone; each member keeps its own past, so the cached and recomputing paths
agree; members of another configuration and settings that leave nothing to anchor are refused naming the flag.
"""

import pytest
import torch
from test_anchor import go
from test_noisy_context import B, K, make

from arvdm.config import SamplingError
from arvdm.pipeline.anchor import AnchorEnsemble
from arvdm.pipeline.rollout import episode_generators
from arvdm.sample_settings import SampleSettings
from arvdm.schedules.presets import chunked, fifo


class Counted(torch.nn.Module):
    """A member that counts its calls (a test stub of the rollout-model protocol around a real denoiser)."""

    def __init__(self, model):
        super().__init__()
        self.model, self.cfg, self.frames_per_chunk, self.calls = model, model.cfg, model.frames_per_chunk, 0

    def check_schedule(self, delta, window):
        self.model.check_schedule(delta, window)

    def init_state(self, *args, **kwargs):
        return self.model.init_state(*args, **kwargs)

    def commit(self, *args, **kwargs):
        self.model.commit(*args, **kwargs)

    def forward(self, *args, **kwargs):
        self.calls += 1
        return self.model(*args, **kwargs)


def test_v_is_the_members_mean_at_level_k_and_the_first_members_elsewhere():
    first, second = make(seed=0), make(seed=5)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, 3, 3, 16, 16, generator=g)  # (B, w, C, H, W)
    actions = torch.randint(0, 5, (B, 3), generator=g)
    levels = torch.tensor([[K, 40, K], [60, K, 10]])  # frames entering at K beside frames further down
    counted = Counted(second)
    ens = AnchorEnsemble(first, [counted])
    with torch.no_grad():
        v0, v1, v = first(x, levels, actions), second(x, levels, actions), ens(x, levels, actions)
    top = levels == K
    assert (v0 - v1).abs().max() > 1e-2  # two different members
    torch.testing.assert_close(v[top], (v0[top] + v1[top]) / 2, atol=1e-6, rtol=0)
    assert torch.equal(v[~top], v0[~top])
    assert counted.calls == 1
    with torch.no_grad():  # no frame at level K: the sampled run alone, the other member not called
        low = torch.tensor([[90, 40, 5]] * B)
        assert torch.equal(ens(x, low, actions), first(x, low, actions))
    assert counted.calls == 1


@pytest.mark.parametrize("use_cache", [True, False], ids=["cached", "recomputed"])
@pytest.mark.parametrize("schedule", ["chunked", "fifo"])
def test_a_run_anchored_with_itself_samples_exactly_as_alone(use_cache, schedule):
    model = make()
    sched = chunked(2, K, 3) if schedule == "chunked" else fifo(2, K, 2)
    alone = go(model, sched, 5, episode_generators(1, range(B)), use_cache=use_cache, anchor_sigma=1.0)
    twice = go(AnchorEnsemble(model, [model]), sched, 5, episode_generators(1, range(B)), use_cache=use_cache,
               anchor_sigma=1.0)
    assert torch.equal(alone, twice)


def test_each_member_keeps_its_own_past_so_cached_and_recomputed_agree():
    """FIFO: a frame enters at K in every AR step's first call, so the second member is called with its own KV
    caches (cached) or the shared bank (recomputed) all along; with the whole past kept both paths agree."""
    first, second = make("memory.retention=all", seed=0), make("memory.retention=all", seed=5)
    sched = fifo(4, K, 1).with_context_level(15)  # committed frames noised: every member sees the same draw
    runs = {c: go(AnchorEnsemble(first, [second]), sched, 9, episode_generators(1, range(B)), use_cache=c,
                  anchor_sigma=1.0) for c in (True, False)}
    assert (runs[True] - runs[False]).abs().max() < 1e-5
    alone = go(first, sched, 9, episode_generators(1, range(B)), anchor_sigma=1.0)
    assert (runs[True] - alone).abs().max() > 1e-2  # the second member moved the anchor


def test_members_of_another_configuration_and_empty_ensembles_are_refused():
    model = make()
    with pytest.raises(SamplingError, match=r"--anchor-runs runs/b: memory\.length is 3 but the sampled run's is 4"):
        AnchorEnsemble(model, [make("memory.length=3")], names=["runs/b"])
    with pytest.raises(SamplingError, match="--anchor-runs: give at least one other run"):
        AnchorEnsemble(model, [])
    AnchorEnsemble(model, [make("train.seed=3", seed=3)])  # another training seed of the same config: fine


def test_settings_that_leave_nothing_to_anchor_are_refused(tmp_path):
    with pytest.raises(SamplingError, match="--anchor-runs a,b needs an anchor"):
        SampleSettings(anchor_runs=("a", "b"), anchor_sigma=0.0).validate()
    with pytest.raises(SamplingError, match="cannot go with --speculate"):
        SampleSettings(anchor_runs=(str(tmp_path),), speculate="ucb").validate()
    with pytest.raises(SamplingError, match="--anchor-runs: nowhere: no such run folder"):
        SampleSettings(anchor_runs=("nowhere",)).validate()
    SampleSettings(anchor_runs=(str(tmp_path),)).validate()  # σ None = the run's: checked once the run is known
    cfg = make().cfg  # the test model's run has no anchor (diffusion.anchor_sigma 0)
    with pytest.raises(SamplingError, match="needs an anchor"):
        SampleSettings(anchor_runs=(str(tmp_path),)).with_run_defaults(cfg)


def test_the_flag_is_parsed_the_same_way_by_sample_py_and_the_experiments():
    import argparse

    from arvdm.pipeline.anchor import add_anchor_flags
    from arvdm.setting_checks import parse_anchor_runs
    assert parse_anchor_runs("runs/a, runs/b,") == ("runs/a", "runs/b") and parse_anchor_runs("") == ()
    p = argparse.ArgumentParser()
    add_anchor_flags(p)
    assert p.parse_args(["--anchor-runs", "runs/a,runs/b"]).anchor_runs == ("runs/a", "runs/b")
    assert p.parse_args([]).anchor_runs == ()


def test_with_anchor_runs_is_the_model_itself_without_runs_and_refuses_without_an_anchor(tmp_path):
    from arvdm.pipeline.anchor import with_anchor_runs
    model = make()
    assert with_anchor_runs(model, (), 0.0) is model
    with pytest.raises(SamplingError, match="--anchor-runs a needs an anchor"):
        with_anchor_runs(model, ("a",), 0.0)
    with pytest.raises(SamplingError, match=f"--anchor-runs {tmp_path}: "):  # no checkpoint there
        with_anchor_runs(model, (str(tmp_path),), 1.0)
