"""A run trained as several members (train.members, arvdm.training.members; the sampler's anchor over them).

train.py trains member 0 in the run folder and member k in RUN/members/k with seed + k; a killed run resumes to the
same weights; leftovers and unfinished members are refused naming the fix; the run's members join the anchor of
every sampler that takes one (with_anchor_runs(run=...)), not the plain sampler's.
"""

import shutil

import pytest
import torch
from test_training import TINY, assert_same, data, deterministic, weights  # noqa: F401 (fixtures)

import train as cli
from arvdm.config import ConfigError, SamplingError, apply_overrides, get_preset
from arvdm.model.checkpoint import (
    CheckpointError,
    checkpoint_dir,
    checkpoint_step,
    latest_checkpoint,
    load_training_state,
)
from arvdm.pipeline.anchor import AnchorEnsemble, with_anchor_runs
from arvdm.pipeline.runs import load_for_inference, member_folder, member_folders
from arvdm.training.loader import mix_seed
from arvdm.training.members import member_config, member_plan
from arvdm.training.objective import lr_factor
from arvdm.training.resume import Fork
from arvdm.training.trainer import Trainer


def argv(folder, run, *extra):
    sets = [*TINY, "train.cpu_ranks=1", "train.max_steps=2", "train.val_every=0", "train.ckpt_every=2",
            "train.members=2", "diffusion.anchor_sigma=1", *extra]
    return ["--preset", "tiny_time", "--data", str(folder), "--out", str(run), "--device", "cpu",
            *(a for s in sets for a in ("--set", s))]


def test_member_plan_gives_each_member_its_folder_seed_and_resume(tmp_path):
    cfg = apply_overrides(get_preset("tiny_time"), ["train.members=3", "train.seed=5"]).validate()
    plan = member_plan(cfg, tmp_path / "run", resume=False)
    assert [(m.index, m.folder, m.cfg.train.seed, m.cfg.train.members, m.resume) for m in plan] == [
        (0, str(tmp_path / "run"), 5, 3, False),
        (1, str(tmp_path / "run" / "members" / "1"), 6, 1, False),
        (2, str(tmp_path / "run" / "members" / "2"), 7, 1, False)]
    assert plan[0].cfg is cfg and cfg.train.seed == 5  # member 0 is the run's own config, left as it was
    assert member_config(cfg, 2).model == cfg.model  # only the seed and the member count differ
    assert [m.index for m in member_plan(cfg, tmp_path / "run", False, only=2)] == [2]
    for bad in (0, -1):
        with pytest.raises(ConfigError, match="train.members"):
            apply_overrides(get_preset("tiny_time"), [f"train.members={bad}"]).validate()


def test_members_train_resume_exactly_and_join_the_anchor(tmp_path, data, deterministic):  # noqa: F811
    run = tmp_path / "run"
    assert cli.main(argv(data, run)) == 0
    one = member_folder(run, 1)
    first, second = weights(latest_checkpoint(run)), weights(latest_checkpoint(one))
    assert any((first[k] - second[k]).abs().max() > 1e-4 for k in first)  # another seed: other weights
    model, cfg = load_for_inference(run)
    assert (cfg.train.members, load_for_inference(one)[1].train.seed) == (2, 1)
    # killed before member 1 finished: --resume leaves member 0 alone and trains member 1 again to the same weights
    for ckpt in (one / "checkpoints").iterdir():
        ckpt.rename(tmp_path / ckpt.name)
    assert cli.main(argv(data, run) + ["--resume"]) == 0
    assert_same(weights(latest_checkpoint(run)), first)
    assert_same(weights(latest_checkpoint(one)), second)
    assert cli.main(argv(data, run) + ["--resume"]) == 0  # every member finished: each loads and stops
    assert_same(weights(latest_checkpoint(one)), second)
    # the run's members join the anchor; the plain sampler draws from member 0 alone; explicit runs still need one
    ensemble = with_anchor_runs(model, (), 1.0, run=run)
    assert isinstance(ensemble, AnchorEnsemble) and len(ensemble.members) == 2
    assert_same(ensemble.members[1].state_dict(), load_for_inference(one)[0].state_dict())
    assert member_folders(latest_checkpoint(run), cfg) == (str(one),)  # from a checkpoint folder too
    assert with_anchor_runs(model, (), 0.0, run=run) is model
    with pytest.raises(SamplingError, match="needs an anchor"):
        with_anchor_runs(model, (str(one),), 0.0, run=run)


def test_a_finished_run_grows_by_a_member_that_the_sampler_then_uses(tmp_path, data, capsys):  # noqa: F811
    run = tmp_path / "run"
    assert cli.main(argv(data, run, "train.members=1")) == 0
    first = weights(latest_checkpoint(run))
    capsys.readouterr()
    # member 0 is finished: the resume trains member 1 alone and records the new count in member 0's checkpoint
    assert cli.main(argv(data, run, "train.members=1") + ["--resume", "--set", "train.members=2"]) == 0
    assert f"{run} has 2 member(s) now" in capsys.readouterr().err
    assert_same(weights(latest_checkpoint(run)), first)  # member 0's weights untouched
    model, cfg = load_for_inference(run)
    assert cfg.train.members == 2 and member_folders(run, cfg) == (str(member_folder(run, 1)),)
    assert len(with_anchor_runs(model, (), 1.0, run=run).members) == 2
    # and back: one member again, the sampler leaves member 1 out; already recorded: nothing rewritten or said
    assert cli.main(argv(data, run, "train.members=1") + ["--resume"]) == 0
    assert load_for_inference(run)[1].train.members == 1
    capsys.readouterr()
    assert cli.main(argv(data, run, "train.members=1") + ["--resume"]) == 0
    assert "member(s) now" not in capsys.readouterr().err


def test_leftover_and_unfinished_members_are_refused_naming_the_fix(tmp_path, data, capsys):  # noqa: F811
    run = tmp_path / "run"
    assert cli.main(argv(data, run, "train.members=1")) == 0
    cfg = load_for_inference(run)[1]
    cfg.train.members = 2
    with pytest.raises(CheckpointError, match=r"member 1 \(.*members/1\) has no complete checkpoint: finish it with "
                                              r"python train.py --out .* --resume"):
        member_folders(run, cfg)
    other = tmp_path / "other"
    assert cli.main(argv(data, member_folder(other, 1), "train.members=1")) == 0  # a leftover in other/members/1
    capsys.readouterr()
    assert cli.main(argv(data, other)) == 2
    err = capsys.readouterr().err
    assert "members/1 (member 1 of" in err and "already holds checkpoints" in err and "--resume" in err


def test_forked_member_starts_from_member_0s_checkpoint_and_resumes_exactly(tmp_path, data, deterministic):  # noqa: F811
    # fork at step 2 (not a checkpoint step: member 0 writes it anyway and keeps it past keep_checkpoints=1)
    fork_sets = ("train.max_steps=6", "train.ckpt_every=3", "train.keep_checkpoints=1", "train.member_fork=0.34",
                 "train.member_fork_lr_back=0.17",  # fork at step round(0.34 x 6) = 2, lr set back 1 step
                 "train.ema_posthoc=[0.1]", "train.ema_posthoc_every=3")  # a post-hoc snapshot at the fork too
    run = tmp_path / "run"
    assert cli.main(argv(data, run, *fork_sets)) == 0
    assert sorted(c.name for c in (run / "checkpoints").iterdir()) == ["step_0000002", "step_0000006"]
    one = member_folder(run, 1)
    final = weights(latest_checkpoint(one))
    assert any((final[k] - weights(latest_checkpoint(run))[k]).abs().max() > 1e-4 for k in final)  # its own noise
    shutil.rmtree(one / "checkpoints")  # member 1 lost
    cfg = load_for_inference(run)[1]
    plan = member_plan(cfg, run, resume=False)
    fork = plan[1].fork
    assert plan[0].fork is None and fork == Fork(checkpoint_dir(run, 2), 1)
    assert (plan[1].cfg.train.fork_steps(), plan[1].cfg.train.seed) == ((0, 0), 1)  # a run of its own, seed + 1
    # at the fork: member 0's step-2 weights, EMA, step and data position; its own noise; the lr of step 1
    start = Trainer(plan[1].cfg, tmp_path / "fresh", fork=fork)
    assert start.step == 2 and start.data_position() == load_training_state(fork.checkpoint)["data"]["position"]
    assert_same(start.model.state_dict(), weights(fork.checkpoint))
    assert_same(start.ema.model.state_dict(), weights(fork.checkpoint, "ema"))
    tc = plan[1].cfg.train
    assert [g["lr"] for g in start.optimizer.param_groups] == [tc.lr * lr_factor(1, tc.warmup_steps, tc.max_steps)] * 2
    assert torch.equal(start.generator.get_state(),
                       torch.Generator().manual_seed(mix_seed(1, "noise", 0)).get_state())
    # killed mid-fork (after step 3) and resumed: the member's final weights, bit for bit
    start.fit(stop_at=3)
    start.close()
    assert checkpoint_step(latest_checkpoint(tmp_path / "fresh")) == 3
    Trainer(plan[1].cfg, tmp_path / "fresh", resume=True).fit()
    assert_same(weights(latest_checkpoint(tmp_path / "fresh")), final)
    # --resume forks the lost member again from the kept checkpoint, to the same weights
    assert cli.main(argv(data, run, *fork_sets) + ["--resume"]) == 0
    assert_same(weights(latest_checkpoint(one)), final)
    # member 0's fork checkpoint gone: a clear error naming the switch and the fix
    shutil.rmtree(one / "checkpoints")
    shutil.rmtree(fork.checkpoint)
    with pytest.raises(CheckpointError,
                       match=r"member_fork: .*step_0000002 \(member 0's step-2 checkpoint.* is missing; train member"):
        fork.start(plan[1].cfg)


@pytest.mark.parametrize("sets, key", [
    (["train.members=2", "train.member_fork=1"], "train.member_fork"),  # before max_steps
    (["train.members=2", "train.member_fork=0.95"], "train.member_fork"),  # rounds to step 6 = max_steps
    (["train.members=2", "train.member_fork=0.01"], "train.member_fork"),  # rounds to step 0
    (["train.members=2", "train.member_fork=-0.5"], "train.member_fork"),
    (["train.members=2", "train.member_fork=\"late\""], "train.member_fork"),
    (["train.members=2", "train.member_fork=0.5", "train.member_fork_lr_back=0.6"], "train.member_fork_lr_back"),
    (["train.members=2", "train.member_fork=0.5", "train.member_fork_lr_back=-0.1"], "train.member_fork_lr_back"),
])
def test_bad_fork_settings_are_refused_naming_the_key(sets, key):
    with pytest.raises(ConfigError, match=key):
        apply_overrides(get_preset("tiny_time"), ["train.max_steps=6", *sets]).validate()


def test_anchor_members_train_at_level_k_and_member_0_as_before(tmp_path, data, monkeypatch):  # noqa: F811
    from arvdm.training import trainer as trainer_module
    seen, original = [], trainer_module.diffusion_forcing_loss

    def spy(*a, **kw):
        top = kw.get("top_levels")
        seen.append(None if top is None else bool(top.all()))
        return original(*a, **kw)

    monkeypatch.setattr(trainer_module, "diffusion_forcing_loss", spy)
    cfg = apply_overrides(get_preset("tiny_time"), ["train.members=3", "train.member_top_level_p=1"]).validate()
    plan = member_plan(cfg, tmp_path / "plan", resume=False)
    assert [m.cfg.train.top_level_p for m in plan] == [0.0, 1.0, 1.0]
    assert [m.cfg.train.member_top_level_p for m in plan] == [1.0, 0.0, 0.0]  # members are runs of their own
    assert cli.main(argv(data, tmp_path / "run", "train.member_top_level_p=1")) == 0
    assert seen == [None, None, True, True]  # member 0's two steps as without it, member 1's at level K


def test_the_tiny_preset_forks_at_step_875_and_one_member_turns_the_fork_off():
    cfg = get_preset("tiny").validate()
    assert (cfg.train.members, cfg.train.fork_steps(), cfg.train.member_top_level_p) == (2, (875, 0), 1.0)
    assert apply_overrides(get_preset("tiny"), ["train.max_steps=3"]).validate().train.fork_steps() == (2, 0)
    with pytest.raises(ConfigError, match=r"forks at step 2 of train.max_steps=2.*train.members=1"):
        apply_overrides(get_preset("tiny"), ["train.max_steps=2"]).validate()
    one = apply_overrides(get_preset("tiny"), ["train.max_steps=2", "train.members=1"]).validate()
    assert member_plan(one, "run", resume=False)[0].fork is None and len(member_plan(one, "run", False)) == 1
