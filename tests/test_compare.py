"""python -m arvdm.evaluation.compare: two rollouts of the same episodes, A - B by span and on the revisit probes,
against known values; folders that cannot be compared are refused."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from arvdm.evaluation.compare import RolloutFileError, compare_rollouts, format_comparison, main
from arvdm.evaluation.metrics import write_metrics_csv

EPISODES, CONTEXT, T, SIZE = 3, 4, 40, 8
RETURNS = (12, 20, 28, 36)  # frames showing the view of frame 1 again: 4 events per episode, 12 in all


def real_video(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    real = rng.integers(50, 200, (EPISODES, T, SIZE, SIZE, 3), dtype=np.uint8)
    for r in RETURNS:
        real[:, r] = real[:, 1]
    return real


def write_rollout(folder, real: np.ndarray, offset: int, with_eval: bool = True) -> None:
    """A sample.py folder whose generated frames are the truth + offset (every frame, returns included)."""
    folder.mkdir(parents=True)
    fake = real.copy()
    fake[:, CONTEXT:] += np.uint8(offset)
    np.savez(folder / "rollout.npz", real=real, fake=fake)
    if with_eval:
        (folder / "eval.json").write_text(json.dumps({"n_generated": T - CONTEXT}))
    else:  # metrics.csv only: one row per generated frame, as sample.py writes it without --eval
        write_metrics_csv(folder / "metrics.csv", torch.zeros(T - CONTEXT), torch.zeros(T - CONTEXT))


def test_a_minus_b_is_the_known_difference_by_span_and_on_revisits(tmp_path):
    real = real_video()
    write_rollout(tmp_path / "a", real, 10)
    write_rollout(tmp_path / "b", real, 20, with_eval=False)
    r = compare_rollouts(tmp_path / "a", tmp_path / "b", n_boot=200)
    known = 20 * math.log10(20 / 10)  # a uniform error half as large: +6.02 dB on every frame
    assert (r["context"], r["generated"], r["episodes"]) == (CONTEXT, T - CONTEXT, EPISODES)
    assert [s["span"] for s in r["spans"]] == ["first 1", "first 4", "5-16", "17-64"]  # 36 generated: no 65-120
    assert r["spans"][-1]["end"] == T - CONTEXT
    for s in r["spans"]:
        d = s["a_minus_b"]
        assert d["mean"] == pytest.approx(known, abs=1e-4) and d["hi"] - d["lo"] < 1e-6
        assert s["a"] - s["b"] == pytest.approx(known, abs=1e-4)
    # sharpness: an offset keeps every edge (ratio 1); a flat gray rollout has none (ratio 0)
    assert all(s["gradient_ratio_a"] == pytest.approx(1.0, abs=1e-6) for s in r["spans"])
    rv = r["revisits"]
    assert (rv["probes"], rv["events"]) == (len(RETURNS) * EPISODES, len(RETURNS) * EPISODES)
    assert rv["a_minus_b"]["mean"] == pytest.approx(known, abs=1e-4)
    # every return shows frame 1's view, which a context frame shows: the whole set is in the context part
    ctx, gen = rv["by_source"]["context"], rv["by_source"]["generated"]
    assert (ctx["probes"], ctx["events"], ctx["too_few"]) == (12, 12, False)
    assert ctx["a_minus_b"]["mean"] == pytest.approx(known, abs=1e-4)
    assert (gen["probes"], gen["too_few"]) == (0, True) and "a_minus_b" not in gen
    # B against A: the sign flips
    assert compare_rollouts(tmp_path / "b", tmp_path / "a", n_boot=200)["spans"][0]["a_minus_b"]["mean"] == \
        pytest.approx(-known, abs=1e-4)


def test_without_b_a_and_its_baselines_come_alone(tmp_path):
    """compare_rollouts(a, None): A's spans, baselines and sharpness as a comparison with any B gives them, and
    nothing of a B (no bootstrap of A − A, no revisit probes)."""
    real = real_video()
    write_rollout(tmp_path / "a", real, 10)
    write_rollout(tmp_path / "b", real, 20)
    alone, pair = compare_rollouts(tmp_path / "a", None, n_boot=200), compare_rollouts(tmp_path / "a", tmp_path / "b",
                                                                                       n_boot=200)
    assert alone["b"] is None and alone["revisits"] is None and pair["revisits"] is not None
    for x, y in zip(alone["spans"], pair["spans"]):
        assert x["a_minus_b"] is None and "b" not in x and "gradient_ratio_b" not in x
        assert {k: x[k] for k in x if k != "a_minus_b"} == {k: y[k] for k in x if k != "a_minus_b"}
    assert alone["spans"][0]["a"] == pytest.approx(20 * math.log10(255 / 10), abs=1e-4)  # a known value


def test_revisits_split_by_whether_a_context_frame_shows_the_view(tmp_path):
    """Returns to generated frame 8 (4 per episode, 12 events) and one return per episode to context frame 1 (3
    events, too few to read): each part is paired on its own probes."""
    rng = np.random.default_rng(3)
    real = rng.integers(50, 200, (EPISODES, T, SIZE, SIZE, 3), dtype=np.uint8)
    for r in (16, 24, 32, 39):
        real[:, r] = real[:, 8]
    real[:, 12] = real[:, 1]
    write_rollout(tmp_path / "a", real, 10)
    write_rollout(tmp_path / "b", real, 20)
    rv = compare_rollouts(tmp_path / "a", tmp_path / "b", n_boot=200)["revisits"]
    ctx, gen = rv["by_source"]["context"], rv["by_source"]["generated"]
    assert (rv["probes"], gen["probes"], gen["events"], ctx["probes"], ctx["events"]) == (15, 12, 12, 3, 3)
    assert gen["a_minus_b"]["mean"] == pytest.approx(20 * math.log10(2), abs=1e-4) and ctx["too_few"]
    assert "only drawn frames do (12 probes, 12 events)" in format_comparison(
        compare_rollouts(tmp_path / "a", tmp_path / "b", n_boot=200))


def test_a_flat_rollout_has_no_sharpness(tmp_path):
    real = real_video()
    write_rollout(tmp_path / "a", real, 10)
    flat = tmp_path / "flat"
    write_rollout(flat, real, 0)
    z = dict(np.load(flat / "rollout.npz"))
    z["fake"][:, CONTEXT:] = 128
    np.savez(flat / "rollout.npz", **z)
    r = compare_rollouts(tmp_path / "a", flat, n_boot=200, revisits=False)
    assert all(s["gradient_ratio_b"] == 0.0 for s in r["spans"]) and r["revisits"] is None


def test_cli_prints_writes_json_and_refuses_what_cannot_be_compared(tmp_path, capsys):
    real = real_video()
    write_rollout(tmp_path / "a", real, 10)
    write_rollout(tmp_path / "b", real, 20)
    write_rollout(tmp_path / "other", real_video(seed=1), 20)  # other episodes
    assert main([str(tmp_path / "a"), str(tmp_path / "b"), "--json", str(tmp_path / "c.json"), "--boot", "200"]) == 0
    out = capsys.readouterr().out
    assert "17-64" in out and "+6.02 [+6.02, +6.02]" in out and "revisits (12 probes, 12 events" in out
    assert "1.00 / 1.00" in out  # sharpness A / B: both the truth's edges
    assert json.loads((tmp_path / "c.json").read_text())["spans"][1]["span"] == "first 4"
    assert main([str(tmp_path / "a"), str(tmp_path / "other")]) == 2
    assert "do not roll out the same ground truth" in capsys.readouterr().err
    assert main([str(tmp_path / "a"), str(tmp_path / "missing")]) == 2
    assert "rollout.npz: unreadable" in capsys.readouterr().err
    with pytest.raises(RolloutFileError, match="neither eval.json nor metrics.csv"):
        (tmp_path / "a" / "eval.json").unlink()
        compare_rollouts(tmp_path / "a", tmp_path / "b")
    assert main([str(tmp_path / "b"), str(tmp_path / "b"), "--recent", "0"]) == 2
