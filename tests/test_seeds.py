"""python -m arvdm.evaluation.seeds: a change measured on several training seeds, A - B per seed and over seeds,
against known values; folders that cannot be compared are refused with a clear error."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from arvdm.evaluation.compare import RolloutFileError, compare_rollouts
from arvdm.evaluation.seeds import T_975, compare_seeds, format_seeds, main, over_seeds

EPISODES, CONTEXT, T, SIZE = 3, 4, 24, 8


def real_video(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(50, 200, (EPISODES, T, SIZE, SIZE, 3), dtype=np.uint8)


def write_rollout(folder, real: np.ndarray, offset: int) -> None:
    """A sample.py folder whose generated frames are the truth + offset."""
    folder.mkdir(parents=True)
    fake = real.copy()
    fake[:, CONTEXT:] += np.uint8(offset)
    np.savez(folder / "rollout.npz", real=real, fake=fake)
    (folder / "eval.json").write_text(json.dumps({"n_generated": T - CONTEXT}))


#: (A's offset, B's offset) per training seed: A - B = 20 log10(b / a) dB on every frame of that seed's episodes
OFFSETS = ((10, 20), (10, 15), (8, 20))


@pytest.fixture
def three_seeds(tmp_path):
    a, b = [], []
    for i, (oa, ob) in enumerate(OFFSETS):
        real = real_video(i)  # each seed its own episodes: pairs need not share them
        write_rollout(tmp_path / f"a{i}", real, oa)
        write_rollout(tmp_path / f"b{i}", real, ob)
        a.append(tmp_path / f"a{i}")
        b.append(tmp_path / f"b{i}")
    return a, b


def test_over_seeds_is_the_mean_with_a_student_t_interval():
    d = over_seeds([1.0, 2.0, 3.0])
    half = 4.303 * 1.0 / math.sqrt(3)  # t(0.975, 2 df) x sd / sqrt(n)
    assert (d["mean"], d["seeds"], d["above_0"], d["below_0"]) == (2.0, 3, 3, 0)
    assert d["lo"] == pytest.approx(2.0 - half) and d["hi"] == pytest.approx(2.0 + half)
    one = over_seeds([-0.5])
    assert (one["mean"], one["lo"], one["hi"], one["below_0"]) == (-0.5, None, None, 1)
    # two seeds that agree by chance: the interval is floored by each seed's own standard error
    floored = over_seeds([1.0, 1.0], standard_errors=[0.5, 0.5])
    assert floored["hi"] - 1.0 == pytest.approx(12.706 * 0.5 / math.sqrt(2))
    assert over_seeds([1.0, 1.0])["hi"] == pytest.approx(1.0)  # without them: no spread, no width
    assert (T_975[0], T_975[1], T_975[29]) == (12.706, 4.303, 2.042)
    for bad in ([], [1.0, float("nan")]):
        with pytest.raises(ValueError, match="one finite value per seed"):
            over_seeds(bad)


def test_a_minus_b_per_seed_and_over_seeds_are_the_known_differences(three_seeds):
    a, b = three_seeds
    r = compare_seeds(a, b, n_boot=200)
    known = [20 * math.log10(ob / oa) for oa, ob in OFFSETS]  # +6.02, +3.52, +7.96 dB
    assert r["seeds"] == 3 and [s["span"] for s in r["spans"]] == ["first 1", "first 4", "5-16", "17-64"]
    sd = float(np.std(known, ddof=1))
    for row in r["spans"]:
        d = row["a_minus_b"]
        assert d["by_seed"] == pytest.approx(known, abs=1e-4)
        assert d["mean"] == pytest.approx(np.mean(known), abs=1e-4)
        assert d["hi"] - d["mean"] == pytest.approx(4.303 * sd / math.sqrt(3), abs=1e-3)
        assert (d["seeds_above_0"], d["seeds_below_0"], d["above_0"]) == (3, 0, 3)
        # each side against its baselines, per seed exactly as compare_rollouts reads that seed
        for i in range(3):
            one = next(s for s in compare_rollouts(a[i], b[i], n_boot=200, revisits=False)["spans"]
                       if s["span"] == row["span"])
            assert row["a_minus_context_mean"]["by_seed"][i] == pytest.approx(one["a"] - one["context_mean"])
            assert row["b_minus_copy_last"]["by_seed"][i] == pytest.approx(one["b"] - one["copy_last"])
        assert row["gradient_ratio_a"] == pytest.approx([1.0] * 3, abs=1e-6)  # an offset keeps every edge
    text = format_seeds(r)
    assert "3 training seeds" in text and "2 degrees of freedom" in text and "3 above 0, 0 below" in text
    # B against A: every sign flips
    assert compare_seeds(b, a, n_boot=200)["spans"][0]["a_minus_b"]["mean"] == pytest.approx(-np.mean(known), 1e-4)


def test_a_alone_reads_its_baselines_over_seeds(three_seeds):
    a, _ = three_seeds
    r = compare_seeds(a, n_boot=200)
    assert r["b"] is None and r["revisits"] is None
    for row in r["spans"]:
        assert row["a_minus_b"] is None and "b_minus_context_mean" not in row
        assert len(row["a_minus_copy_last"]["by_seed"]) == 3
    assert "B =" not in format_seeds(r)


def test_cli_writes_json_and_plot_and_refuses_bad_input(three_seeds, tmp_path, capsys):
    a, b = three_seeds
    out_json, out_png = tmp_path / "seeds.json", tmp_path / "seeds.png"
    assert main(["--a", *map(str, a), "--b", *map(str, b), "--boot", "200", "--no-revisits",
                 "--json", str(out_json), "--plot", str(out_png)]) == 0
    saved = json.loads(out_json.read_text())
    assert saved["spans"][0]["a_minus_b"]["mean"] == pytest.approx(
        np.mean([20 * math.log10(ob / oa) for oa, ob in OFFSETS]), abs=1e-4)
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "frames 17-64" in capsys.readouterr().out
    # one pair per seed
    assert main(["--a", str(a[0]), str(a[1]), "--b", str(b[0])]) == 2
    assert "--a has 2 folders, --b 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="2 A folders but 1 B folders"):
        compare_seeds(a[:2], b[:1])
    # a pair whose two sides show other episodes
    assert main(["--a", str(a[0]), "--b", str(b[1]), "--no-revisits"]) == 2
    assert "same ground truth" in capsys.readouterr().err
    with pytest.raises(RolloutFileError):
        compare_seeds([a[0]], [b[1]], revisits=False)
    # a missing folder: named, exit 2, no output files
    assert main(["--a", str(tmp_path / "nowhere"), "--json", str(tmp_path / "x.json")]) == 2
    assert "nowhere" in capsys.readouterr().err and not (tmp_path / "x.json").exists()


def test_grid_pooled_pairs_carry_the_interval_over_seeds():
    """arvdm.experiments.paired.pool_pairs (the grid report's "Seeds pooled" table) uses the same interval."""
    from arvdm.experiments.paired import POOLED_PAIR_COLUMNS, pool_pairs

    table = [{"config": "pose - time", "seed": s, "difference": d, "lo": d - 0.1, "hi": d + 0.1, "first4_diff": 0.0,
              "f17_64_diff": 0.0} for s, d in (("s0", 1.0), ("s1", 2.0), ("s2", 3.0))]
    table.append({"config": "one seed", "seed": "s0", "difference": 0.5, "lo": -0.1, "hi": 1.1, "first4_diff": 0.0,
                  "f17_64_diff": 0.0})
    rows = {r["config"]: r for r in pool_pairs(table)}
    three = rows["pose - time"]
    half = 4.303 / math.sqrt(3)  # sd 1 over three seeds; the seeds' own errors (0.05) are smaller
    assert three["difference"] == pytest.approx(2.0)
    assert (three["difference_lo"], three["difference_hi"]) == (pytest.approx(2.0 - half), pytest.approx(2.0 + half))
    assert three["intervals_above_0"] == "3 of 3"
    assert rows["one seed"]["difference_lo"] is None and rows["one seed"]["intervals_above_0"] == "0 of 1"
    assert {"difference_lo", "difference_hi"} <= set(POOLED_PAIR_COLUMNS)
