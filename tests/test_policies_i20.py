"""Policies of issues 20 and 21: full turns on the spot in `revisit`, the `look_around` evaluation episode,
the `wander` random agent and the per-episode `mixed` draw, driven for real in Memory Maze (16 px, short).

Episode files, `read_turns` / `read_policy` and the policy-name checks run without an environment.
"""

import importlib.util
import math

import numpy as np
import pytest

from data.episodes import EpisodeError, read_extra, read_policy, read_turns, write_episode
from data.generate import GenerateError, GenerateSpec, _mixture_rng, generate
from data.generate import main as generate_main
from data.policies import MIXTURES, POLICIES, check_policy, choose_policy, make_policy

HAS_MM = importlib.util.find_spec("memory_maze") is not None  # find_spec: see tests/test_data_generate.py
needs_mm = pytest.mark.skipif(not HAS_MM, reason="memory_maze is not installed")
POS_TOL, HEADING_TOL = 0.5, math.radians(20)  # a revisit: arvdm.evaluation.revisits' defaults


def _wrap(a):
    return (a + np.pi) % (2 * np.pi) - np.pi


def _sweep(pose, start, stop):
    """Signed heading swept over frames [start, stop) (radians), summing the wrapped per-step changes."""
    return float(np.sum(_wrap(np.diff(pose[start:stop, 2].astype(np.float64)))))


def _views_seen(pose, turn, seen_in):
    """For each frame of `turn`: is some frame of `seen_in` within the revisit tolerances of it?"""
    a = pose[turn[0]:turn[1]].astype(np.float64)  # (n, 3)
    b = pose[seen_in[0]:seen_in[1]].astype(np.float64)  # (m, 3)
    dist = np.hypot(*(a[:, None, :2] - b[None, :, :2]).transpose(2, 0, 1))  # (n, m)
    dh = np.abs(_wrap(a[:, None, 2] - b[None, :, 2]))  # (n, m)
    return ((dist <= POS_TOL) & (dh <= HEADING_TOL)).any(axis=1)  # (n,)


def _load(path):
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


# ------------------------------------------------------------------------------------------------
# no environment
# ------------------------------------------------------------------------------------------------

def test_bad_policy_names_give_clear_errors(tmp_path, capsys):
    with pytest.raises(GenerateError, match="unknown policy 'spin'; choose one of random, revisit, look_around"):
        GenerateSpec("memory_maze", 2, 16, policy="spin").validate()
    with pytest.raises(GenerateError, match="policy 'look_around' is not available for crafter"):
        GenerateSpec("crafter", 2, 16, policy="look_around").validate()
    with pytest.raises(ValueError, match="policy 'wander' is not available for 'crafter'"):
        check_policy("wander", "crafter")
    with pytest.raises(ValueError, match="unknown policy 'Revisit'"):
        choose_policy("Revisit", "memory_maze", np.random.default_rng(0))

    class _Env:
        name = "memory_maze"

    with pytest.raises(ValueError, match="'mixed' draws a policy per episode"):
        make_policy("mixed", _Env(), np.random.default_rng(0), 16)
    with pytest.raises(SystemExit):  # argparse: exit status 2 and the choices on stderr
        generate_main(["memory_maze", "--out", str(tmp_path / "o"), "--policy", "spin"])
    assert "invalid choice: 'spin'" in capsys.readouterr().err
    assert generate_main(["crafter", "--out", str(tmp_path / "o"), "--policy", "wander"]) == 2
    assert "not available for crafter" in capsys.readouterr().err


def test_mixed_draws_each_policy_in_its_proportion_per_seed_and_index():
    for env_name, mixture in MIXTURES.items():
        assert set(dict(mixture)) <= set(POLICIES) - {"mixed"} and math.isclose(sum(dict(mixture).values()), 1)
        drawn = [choose_policy("mixed", env_name, _mixture_rng(0, i)) for i in range(400)]
        again = [choose_policy("mixed", env_name, _mixture_rng(0, i)) for i in range(400)]
        assert drawn == again  # a function of (seed, index)
        for name, share in mixture:  # binomial sd at n=400, p=0.5: 0.025
            assert abs(drawn.count(name) / len(drawn) - share) < 0.08, (env_name, name, drawn.count(name))
        other_seed = [choose_policy("mixed", env_name, _mixture_rng(1, i)) for i in range(400)]
        assert other_seed != drawn
    assert choose_policy("revisit", "crafter", _mixture_rng(0, 0)) == "revisit"  # not mixed: itself


def test_turns_and_policy_arrays_read_back_and_are_optional(tmp_path):
    video = np.zeros((6, 16, 16, 3), np.uint8)
    actions = np.zeros(6, np.int64)
    with_extras = write_episode(tmp_path / "a.npz", video, actions, extra={
        "turns": np.array([[0, 3], [3, 6]], np.int64), "policy": np.array(["look_around"])})
    np.testing.assert_array_equal(read_turns(with_extras), [[0, 3], [3, 6]])
    assert read_turns(with_extras).dtype == np.int64
    assert read_policy(with_extras) == "look_around"
    plain = write_episode(tmp_path / "b.npz", video, actions)  # real data: no extras
    assert read_turns(plain).shape == (0, 2) and read_policy(plain) is None and read_extra(plain, "x") is None
    bad = write_episode(tmp_path / "c.npz", video, actions, extra={"turns": np.zeros(4), "policy": np.array(3)})
    with pytest.raises(EpisodeError, match="c.npz: 'turns' has dtype float64 shape \\(4,\\), expected int"):
        read_turns(bad)
    with pytest.raises(EpisodeError, match="c.npz: 'policy' has dtype int64 .* expected one string"):
        read_policy(bad)


# ------------------------------------------------------------------------------------------------
# Memory Maze, driven for real
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def look_root(tmp_path_factory):
    return generate(tmp_path_factory.mktemp("look"), "memory_maze", episodes=1, length=128, size=16, seed=3,
                    policy="look_around", progress=False)


@pytest.fixture(scope="module")
def revisit_root(tmp_path_factory):
    return generate(tmp_path_factory.mktemp("rev"), "memory_maze", episodes=1, length=128, size=16, seed=0,
                    policy="revisit", progress=False)


@needs_mm
def test_look_around_turns_fully_walks_out_and_comes_back(look_root):
    path = look_root / "training" / "ep_000000.npz"
    ep = _load(path)
    pose = ep["pose"]
    assert read_policy(path) == "look_around"
    turns = read_turns(path)
    assert turns.shape == (2, 2), turns  # both turns fit in 128 frames
    (a1, b1), (a2, b2) = turns
    assert a1 == 0 and b1 <= a2 and b2 <= 128
    for start, stop in turns:
        assert 19 <= stop - start <= 22  # ~20 steps of ~18 degrees
        assert math.radians(350) <= abs(_sweep(pose, start, stop)) <= math.radians(380)
        assert np.hypot(*(pose[start:stop, :2] - pose[start, :2]).T).max() < 0.05  # on the spot
        assert set(ep["actions"][start + 1:stop]) <= {2, 3}  # left or right only
    between = np.hypot(*(pose[b1:a2, :2] - pose[0, :2]).T)  # (frames,) distance from the start
    assert between.max() > 2.0  # it really left (several cells)
    assert np.hypot(*(pose[a2, :2] - pose[0, :2])) < 0.2  # and came back to the start
    assert _views_seen(pose, turns[1], turns[0]).all()  # every view of the second turn was seen in the first
    assert not _views_seen(pose, turns[1], (b1 + 4, a2 - 4)).all()  # ... and not all on the way (needs memory)
    assert np.hypot(*np.diff(pose[b2:, :2], axis=0).T).max() < 0.02  # then it stands still


@needs_mm
def test_revisit_excursions_turn_before_leaving_and_after_coming_back(revisit_root):
    path = revisit_root / "training" / "ep_000000.npz"
    ep = _load(path)
    pose, revisits, turns = ep["pose"], ep["revisits"], read_turns(path)
    assert read_policy(path) == "revisit" and len(revisits) >= 1, revisits
    starts = {int(a): (int(a), int(b)) for a, b in turns}
    for left, back in revisits:
        first, second = starts[left], starts[back]  # a turn at departure and one at the return
        for start, stop in (first, second):
            assert abs(_sweep(pose, start, stop)) >= math.radians(350)
        assert _views_seen(pose, second, first).mean() >= 0.9
        # the turns give many revisit frames: second-turn frames matching first-turn frames > 8 frames back
        assert second[0] - first[1] > 8 and second[1] - second[0] >= 19


@needs_mm
def test_mixed_records_the_drawn_policy_and_is_reproducible(tmp_path):
    seed = next(s for s in range(50) if {choose_policy("mixed", "memory_maze", _mixture_rng(s, i))
                                         for i in (0, 1)} == {"revisit", "wander"})
    root = generate(tmp_path / "mix", "memory_maze", episodes=2, length=40, size=16, seed=seed, policy="mixed",
                    progress=False)
    paths = [root / "training" / "ep_000000.npz", root / "validation" / "ep_000001.npz"]
    names = [read_policy(p) for p in paths]
    assert names == [choose_policy("mixed", "memory_maze", _mixture_rng(seed, i)) for i in (0, 1)]
    wander = _load(paths[names.index("wander")])
    assert wander["revisits"].shape == (0, 2) and wander["turns"].shape == (0, 2)
    # a wander episode is made of runs: long stretches of one action (forward, a turn, ...)
    a = wander["actions"][1:]
    assert np.mean(a[1:] == a[:-1]) > 0.6
    original = [p.read_bytes() for p in paths]
    paths[1].unlink()  # regenerate episode 1 alone: same bytes (a function of (seed, index))
    generate(root, "memory_maze", episodes=2, length=40, size=16, seed=seed, policy="mixed", progress=False)
    assert [p.read_bytes() for p in paths] == original
