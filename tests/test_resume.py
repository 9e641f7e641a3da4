"""arvdm.training.resume: the checks and generator states an exact resume rests on (the end-to-end kill-and-resume
runs are in test_training.py)."""

from pathlib import Path

import pytest
import torch

from arvdm.config import ConfigError, apply_overrides, get_preset
from arvdm.training.distributed import DistInfo
from arvdm.training.resume import check_resumable, restore_rng, rng_states, warn_if_data_differs


def test_restored_generators_draw_what_the_saved_ones_would_have():
    g = torch.Generator().manual_seed(3)
    torch.randn(5, generator=g)
    info = DistInfo()
    saved = rng_states(g, torch.device("cpu"), info)
    expected_noise, expected_torch = torch.randn(4, generator=g), torch.randn(4)
    torch.randn(7, generator=g), torch.randn(7)  # move both on
    restore_rng(saved, g, torch.device("cpu"), info)
    assert torch.equal(torch.randn(4, generator=g), expected_noise)
    assert torch.equal(torch.randn(4), expected_torch)


def test_generators_saved_by_another_rank_count_are_left_alone():
    g = torch.Generator().manual_seed(3)
    two_ranks = rng_states(g, torch.device("cpu"), DistInfo()) * 2  # a checkpoint written by 2 ranks
    torch.randn(3, generator=g)
    state = g.get_state()
    restore_rng(two_ranks, g, torch.device("cpu"), DistInfo())  # this run has one
    assert torch.equal(g.get_state(), state)


def test_a_config_that_changes_the_weights_is_refused_by_name():
    saved = get_preset("tiny")
    check_resumable(saved, get_preset("tiny"), Path("ckpt"))  # the same config resumes
    check_resumable(saved, apply_overrides(get_preset("tiny"), ["train.lr=1e-3"]), Path("ckpt"))  # training may change
    with pytest.raises(ConfigError, match=r"model\.dim: checkpoint 128, now 64"):
        check_resumable(saved, apply_overrides(get_preset("tiny"), ["model.dim=64"]), Path("ckpt"))


def test_another_data_layout_warns_and_the_same_is_silent(capsys):
    saved = {"dataset_len": 100, "world_size": 2, "batch_size": 8, "position": 16}
    warn_if_data_differs(saved, {"dataset_len": 100, "world_size": 2, "batch_size": 8}, Path("ckpt"))
    assert capsys.readouterr().err == ""
    warn_if_data_differs(saved, {"dataset_len": 100, "world_size": 1, "batch_size": 8}, Path("ckpt"))
    assert "will not match an unbroken run" in capsys.readouterr().err
