"""sample.py --speculate: exact output through the CLI, the files it writes, and bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest

import sample
from arvdm.config import apply_overrides, get_preset
from arvdm.training.trainer import Trainer

TINY = ["model.image_size=16", "data.resize=0", "model.patch_size=4", "model.dim=48", "model.depth=2", "model.heads=2",
        "memory.length=4", "train.window=4", "train.batch_size=2", "train.max_steps=2", "train.ckpt_every=2",
        "train.val_every=1000", "train.sample_every=0", "train.warmup_steps=1", "diffusion.num_levels=100"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("speculate")
    rng = np.random.default_rng(0)
    for split in ("training", "validation"):
        (root / "data" / split).mkdir(parents=True)
        for i in range(2):
            np.savez(root / "data" / split / f"ep_{i:06d}.npz", actions=rng.integers(0, 6, 24),
                     video=rng.integers(0, 256, (24, 16, 16, 3), dtype=np.uint8))
    cfg = apply_overrides(get_preset("tiny_time"), TINY + [f"data.path={root / 'data'}"]).validate()
    Trainer(cfg, root / "run").fit()
    return root / "run"


def _sample(run_dir, out, *extra):
    return sample.main(["--run", str(run_dir), "--frames", "8", "--context", "4", "--episodes", "2", "--steps", "4",
                        "--eta", "1", "--out", str(out), *extra])


def test_speculate_cli_is_exact_and_writes_its_report(run, tmp_path, capsys):
    assert _sample(run, tmp_path / "plain") == 0
    plain = np.load(tmp_path / "plain" / "rollout.npz")["fake"]
    # the draft is the same run loaded again (its own model and state): every drafted row is accepted and the
    # frames equal plain sampling's bit for bit
    assert _sample(run, tmp_path / "same", "--speculate", "fixed:3", "--draft", str(run)) == 0
    np.testing.assert_array_equal(np.load(tmp_path / "same" / "rollout.npz")["fake"], plain)
    rep = json.loads((tmp_path / "same" / "speculation.json").read_text())["rollouts"][0]
    assert rep["acceptance"] == 1.0 and rep["target_rounds"] < rep["rows"]
    capsys.readouterr()
    assert _sample(run, tmp_path / "ucb", "--speculate", "ucb", "--lookaheads", "2,4", "--level-bins", "2") == 0
    printed = capsys.readouterr().out
    assert "target rounds for" in printed and "frames/s" in printed
    rep = json.loads((tmp_path / "ucb" / "speculation.json").read_text())["rollouts"][0]
    assert rep["arms"] == ["L=1 none", "L=2 frozen", "L=4 frozen"]
    # round robin per level bin: rows at levels 100, 75 are bin 1 (arms 0, 1), then bin 0 starts over at arm 0
    assert len(rep["arm_per_round"]) == rep["target_rounds"] and rep["arm_per_round"][:3] == [0, 1, 0]
    assert (tmp_path / "ucb" / "speculation_arms.png").stat().st_size > 0
    assert set(rep["regret"]) >= {"best_arm", "regret"}


def test_speculate_bad_input_exits_2(run, tmp_path, capsys):
    assert sample.main(["--run", str(run), "--speculate", "ucb", "--eta", "0", "--out", str(tmp_path / "a")]) == 2
    assert "needs --eta > 0" in capsys.readouterr().err
    assert _sample(run, tmp_path / "a", "--speculate", "ucb", "--lookaheads", "2,x") == 2
    assert _sample(run, tmp_path / "b", "--speculate", "sometimes") == 2
    assert "expected ucb, exp3 or fixed:L" in capsys.readouterr().err
    assert _sample(run, tmp_path / "c", "--speculate", "ucb", "--draft", str(tmp_path / "missing")) == 2
