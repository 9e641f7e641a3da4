"""Scheduling matrices: presets against hand-written matrices, every condition's violation, files, plots."""

import json

import numpy as np
import pytest
import torch

from arvdm.schedules import (
    ARSchedule,
    ScheduleError,
    chunked,
    fifo,
    from_matrix,
    get_schedule,
    load_schedule,
    pyramid,
)
from arvdm.schedules.plots import main, plot_schedule

K = 1000


# -- presets vs hand-written matrices -------------------------------------------------------------------
def test_chunked_matrix():
    s = chunked(3, K, 4)
    assert s.matrix.tolist() == [[1000] * 3, [750] * 3, [500] * 3, [250] * 3, [0] * 3]
    assert (s.delta, s.window, s.num_steps, s.num_levels, s.init_steps) == (3, 3, 4, K, 0)
    assert s.init_matrix().tolist() == [[1000] * 3]  # t^I is all K: no initialization stage


def test_fifo_matrix_and_init():
    s = fifo(4, K)
    assert s.matrix.tolist() == [[250, 500, 750, 1000], [0, 250, 500, 750]]
    assert (s.delta, s.num_steps, s.init_steps) == (1, 1, 3)
    assert s.init_matrix().tolist() == [[1000] * 4, [750, 750, 750, 1000], [500, 500, 750, 1000],
                                        [250, 500, 750, 1000]]


def test_fifo_two_steps_per_shift_rounds_half_up():
    # S[m][j] = round(10 (j + 1 - m/2) / 3): 3.33 6.67 10 / 1.67 5 8.33 / 0 3.33 6.67
    s = fifo(3, 10, 2)
    assert s.matrix.tolist() == [[3, 7, 10], [2, 5, 8], [0, 3, 7]]
    # half up, exactly: K=4, w=8 gives (j+1)/2 -> 0.5 rounds to 1, 1.5 to 2
    assert fifo(8, 4).t_in.tolist() == [1, 1, 2, 2, 3, 3, 4, 4]


def test_pyramid_matrix():
    s = pyramid(3, K, 4, stagger=1)
    assert s.matrix.tolist() == [
        [1000, 1000, 1000],
        [750, 1000, 1000],
        [500, 750, 1000],
        [250, 500, 750],
        [0, 250, 500],
        [0, 0, 250],
        [0, 0, 0],
    ]
    assert (s.delta, s.num_steps, s.init_steps) == (3, 6, 0)
    assert pyramid(3, 10, 4, stagger=2).matrix[:, 2].tolist() == [10, 10, 10, 10, 10, 8, 5, 3, 0]


def test_pyramid_without_stagger_is_chunked():
    assert pyramid(4, K, 5, stagger=0) == chunked(4, K, 5)
    assert pyramid(4, K, 5, stagger=1) != chunked(4, K, 5)


@pytest.mark.parametrize("w", [1, 2, 5, 8])
@pytest.mark.parametrize("steps", [1, 3, 8])
def test_every_preset_is_valid_and_init_reaches_t_in(w, steps):
    for s in (chunked(w, K, steps), fifo(w, K, steps), pyramid(w, K, steps, stagger=1),
              pyramid(w, K, steps, stagger=steps)):
        init = s.init_matrix()
        assert (init[0] == K).all() and (init[-1] == s.t_in).all()
        assert (np.diff(init, axis=0) <= 0).all()  # columns non-increasing
        assert init.shape[0] == s.init_steps + 1


def test_get_schedule_steps_mean_steps_per_frame():
    assert get_schedule("chunked", 4, K, 8).num_steps == 8
    assert get_schedule("fifo", 4, K, 8).num_steps == 2  # 4 shifts x 2 calls = 8 per frame
    assert get_schedule("fifo", 4, K, 9).num_steps == 3  # rounded up to a multiple of w
    assert get_schedule("pyramid", 4, K, 8, stagger=2).num_steps == 8 + 3 * 2
    with pytest.raises(ScheduleError, match="unknown schedule 'zigzag'"):
        get_schedule("zigzag", 4, K, 8)


def test_degenerate_preset_refused():
    with pytest.raises(ScheduleError, match="rows 0 and 1 are identical") as e:
        chunked(2, 4, 16)  # 16 steps over 4 levels: most calls would change nothing
    assert e.value.condition == "degenerate"
    with pytest.raises(ScheduleError, match="identical"):
        pyramid(3, K, 2, stagger=3)  # gaps between frames' ramps


# -- user matrices ----------------------------------------------------------------------------------------
CUSTOM = [[500, 500, 1000, 1000], [250, 250, 750, 750], [0, 0, 500, 500]]  # Δ = 2, two frames per chunk


def test_custom_matrix_accepted_from_list_numpy_torch():
    a = from_matrix(CUSTOM, 2, K)
    b = from_matrix(np.array(CUSTOM), 2, K)
    c = from_matrix(torch.tensor(CUSTOM), 2, K)
    assert a == b == c and a.matrix.dtype == np.int64
    # default init: the fastest column drops 500 in 2 calls; from K to min t^I = 500 at that rate: 2 calls
    assert a.init_steps == 2
    assert a.init_matrix().tolist() == [[1000] * 4, [750, 750, 1000, 1000], [500, 500, 1000, 1000]]
    assert from_matrix(CUSTOM, 2, K, init_steps=5).init_matrix().shape == (6, 4)


def test_schedule_is_immutable():
    s = fifo(4, K)
    with pytest.raises(AttributeError):
        s.delta = 2
    with pytest.raises(ValueError):
        s.matrix[0, 0] = 1


@pytest.mark.parametrize("matrix, delta, condition, words", [
    ([[10, 10, 10]], 1, "shape", ["got shape (1, 3)"]),
    ([[[10]], [[0]]], 1, "shape", ["2-D"]),
    ([[10, 10], [0]], 1, "shape", ["rectangular"]),
    ([[10, 10], [0, 0.5]], 2, "integer", ["matrix[1][1] = 0.5"]),
    ([[11, 10], [0, 0]], 2, "range", ["matrix[0][0] = 11", "0..K=10"]),
    ([[10, 10], [0, -1]], 2, "range", ["matrix[1][1] = -1"]),
    ([[10, 10], [0, 0]], 0, "delta", ["delta=0", "w=2"]),
    ([[10, 10], [0, 0]], 3, "delta", ["delta=3"]),
    ([[5, 10], [6, 10], [0, 5]], 1, "column monotonicity", ["column 0", "row 0 -> row 1", "5 -> 6"]),
    ([[10, 10], [6, 3], [0, 0]], 2, "monotonicity", ["row 1", "column 0 -> column 1", "6 -> 3"]),
    ([[10, 10], [1, 1]], 2, "0-T boundary", ["t^O", "column 0 is 1"]),
    ([[10, 10], [0, 1]], 2, "0-T boundary", ["t^O", "column 1 is 1"]),
    ([[5, 9], [0, 5]], 1, "0-T boundary", ["t^I", "column 1 is 9"]),
    ([[5, 10], [0, 4]], 1, "circularity", ["t^O[1] (row 1, column 1) = 4", "t^I[0] (row 0, column 0) = 5"]),
])
def test_each_violation_is_named(matrix, delta, condition, words):
    with pytest.raises(ScheduleError) as e:
        ARSchedule(matrix, delta, 10)
    assert e.value.condition == condition
    assert str(e.value).startswith(condition + ":")
    for w in words:
        assert w in str(e.value)


def test_init_steps_conditions():
    with pytest.raises(ScheduleError, match="init_steps must be 0") as e:
        ARSchedule(chunked(2, K, 2).matrix, 2, K, init_steps=3)
    assert e.value.condition == "init_steps"
    with pytest.raises(ScheduleError, match="column 0 is 250"):
        ARSchedule(fifo(4, K).matrix, 1, K, init_steps=0)


# -- files -----------------------------------------------------------------------------------------------
def test_json_round_trip(tmp_path):
    s = pyramid(4, K, 4, stagger=1)
    path = s.save(tmp_path / "sub" / "pyr.json")
    assert [p.name for p in path.parent.iterdir()] == ["pyr.json"]  # no temp file left behind
    d = json.loads(path.read_text())
    assert d["delta"] == 4 and d["num_levels"] == K and d["matrix"] == s.matrix.tolist()
    t = load_schedule(path)
    assert t == s and t.name == "pyramid"
    assert get_schedule(str(path), 4, K) == s


def test_json_minimal_user_file(tmp_path):
    p = tmp_path / "mine.json"
    p.write_text(json.dumps({"delta": 2, "num_levels": K, "matrix": CUSTOM, "init_steps": 4}))
    s = load_schedule(p)
    assert s.matrix.tolist() == CUSTOM and s.init_steps == 4 and s.name == "mine"


def test_npy_and_csv_files(tmp_path):
    np.save(tmp_path / "f.npy", np.array(CUSTOM))
    assert load_schedule(tmp_path / "f.npy", delta=2, num_levels=K) == from_matrix(CUSTOM, 2, K)
    csv = tmp_path / "f.csv"
    csv.write_text("# delta=2 num_levels=1000\n" + "\n".join(",".join(map(str, r)) for r in CUSTOM) + "\n")
    assert load_schedule(csv) == from_matrix(CUSTOM, 2, K)
    txt = tmp_path / "f.txt"
    txt.write_text("\n".join(" ".join(map(str, r)) for r in fifo(3, 10).matrix.tolist()))
    assert load_schedule(txt, delta=1, num_levels=10) == fifo(3, 10)


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(ScheduleError, match=r"f\.npy: delta is missing"):
        np.save(tmp_path / "f.npy", np.array(CUSTOM))
        load_schedule(tmp_path / "f.npy", num_levels=K)
    csv = tmp_path / "c.csv"
    csv.write_text("# delta=2 num_levels=1000\n500,500,1000,1000\n0,0,500,500\n")
    with pytest.raises(ScheduleError, match=r"c\.csv: the file says delta=2 but delta=1"):
        load_schedule(csv, delta=1)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"delta": 1, "num_levels": 10, "matrix": [[5, 10], [0, 4]]}))
    with pytest.raises(ScheduleError, match=r"bad\.json: .*t\^O\[1\]") as e:
        load_schedule(bad)
    assert e.value.condition == "circularity"
    ok = fifo(3, 10).save(tmp_path / "ok.json")
    with pytest.raises(ScheduleError, match="has K=10 levels but the model uses num_levels=1000"):
        get_schedule(ok, 3, K)
    with pytest.raises(ScheduleError, match="3-frame window but the model uses window=4"):
        get_schedule(str(tmp_path / "ok.json"), 4, 10)
    with pytest.raises(ScheduleError, match="unknown schedule file type"):
        (tmp_path / "x.yaml").write_text("")
        load_schedule(tmp_path / "x.yaml")
    with pytest.raises(ScheduleError, match="use a .json file name"):
        fifo(3, 10).save(tmp_path / "x.npy")


# -- rollout bookkeeping and plots -------------------------------------------------------------------------
def test_transitions_and_timeline():
    s = fifo(3, 10)  # S = [[3, 7, 10], [0, 3, 7]], init: [10,10,10] -> [7,7,10] -> [3,7,10]
    tr = list(s.transitions(n_frames=2))
    assert len(tr) == s.num_calls(2) == 2 + 2 * 1
    assert [(t.stage, t.ar_step, t.frame_offset) for t in tr] == [("init", -1, 0), ("init", -1, 0),
                                                                    ("ar", 0, 0), ("ar", 1, 1)]
    assert tr[1].levels_from.tolist() == [7, 7, 10] and tr[1].levels_to.tolist() == [3, 7, 10]
    tl = s.timeline(2)  # (5 states, 4 frames): nan = not yet in window, -1 = committed
    expected = [[10, 10, 10, np.nan], [7, 7, 10, np.nan], [3, 7, 10, np.nan], [-1, 3, 7, 10], [-1, 0, 3, 7]]
    np.testing.assert_array_equal(tl, np.array(expected, dtype=float))


def test_plots_write_png(tmp_path):
    p = tmp_path / "one.png"
    fig = plot_schedule(fifo(4, K, 2), p, n_frames=6)
    assert len(fig.axes) == 3  # matrix, timeline, colour bar
    assert fig.axes[1].images[0].get_array().shape == fifo(4, K, 2).timeline(6).shape
    # python -m arvdm.schedules --plot ... draws the three presets
    assert main(["--plot", str(tmp_path / "cli.png"), "--window", "3", "--steps", "3"]) == 0
    for f in (p, tmp_path / "cli.png"):
        assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f.stat().st_size > 10_000
