"""Behaviour policies for the generators: sticky random, `revisit`, `look_around`, `wander` and the `mixed` draw.

A policy is driven one step at a time: ``action = policy.act(pose)``, with pose = (x, y, heading) of the
frame just observed. The scripted policies are written as Python generators (``pose = yield action``)
so that a multi-step plan — leave, turn round, come back, face the old way — reads top to bottom.

`revisit` makes views repeat at known time gaps, the probes of the memory-bottleneck evaluation:
an *excursion* starts at pose P0, walks outward for n steps along a random path through free cells,
then walks back through the recorded positions in reverse and finally turns to P0's heading, so the
frame at the return looks like the frame at departure. Gaps are drawn from 16..160 frames and clipped
to what is left of the episode. Returns are closed-loop (steered by the observed pose), because
Memory Maze's rolling-ball agent has momentum and an open-loop replay of the inverse actions drifts.
In Memory Maze the agent also turns fully on the spot (360 degrees, left or right at random, ~20 steps)
before leaving and again after coming back, and with probability `WAYPOINT_TURN_P` once at a cell on the
way out: every view of the second turn was seen during the first, so one excursion yields ~20 revisit
frames instead of one. `look_around` is the fixed evaluation episode (turn, ~24 steps out and back, turn,
then stand still); `wander` explores as a random agent does (runs of forward into walls, turns on the spot,
sticky random actions); `mixed` draws one of these per episode (`MIXTURES`).

Every policy records ``revisits`` (frame left, frame returned) of its finished excursions and ``turns``
[start, stop) frame ranges of its planned full turns (frame start and frame stop - 1 face the same way).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from .envs import (
    CRAFTER_DO,
    CRAFTER_MOVES,
    MM_FORWARD,
    MM_FORWARD_LEFT,
    MM_FORWARD_RIGHT,
    MM_LEFT,
    MM_NOOP,
    MM_RIGHT,
)

POLICIES = ("random", "revisit", "look_around", "wander", "mixed")
#: The policies each environment offers (look_around and wander steer Memory Maze's rolling ball).
ENV_POLICIES = {"memory_maze": POLICIES, "crafter": ("random", "revisit", "mixed")}
#: `mixed`: the policy of each episode, drawn with these probabilities — the planner's revisits beside the
#: behaviour of a random exploring agent (wall contact, turns on the spot, standing still).
MIXTURES = {"memory_maze": (("revisit", 0.5), ("wander", 0.5)),
            "crafter": (("revisit", 0.5), ("random", 0.5))}
MIN_GAP, MAX_GAP = 16, 160


def _wrap(angle: float) -> float:
    """Angle difference wrapped to (-pi, pi]."""
    return (angle + math.pi) % (2 * math.pi) - math.pi


def check_policy(name: str, env_name: str) -> None:
    """Raise ValueError naming the policy and the choices unless `env_name` offers policy `name`."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    offered = ENV_POLICIES.get(env_name, ())
    if name not in offered:
        raise ValueError(f"policy {name!r} is not available for {env_name!r}; choose one of {', '.join(offered)}")


def choose_policy(name: str, env_name: str, rng: np.random.Generator) -> str:
    """The concrete policy of one episode: `name` itself, or for 'mixed' one drawn from MIXTURES[env_name]."""
    check_policy(name, env_name)
    if name != "mixed":
        return name
    names, probs = zip(*MIXTURES[env_name])
    return names[int(rng.choice(len(names), p=probs))]


class Excursion(NamedTuple):
    """One planned out-and-back trip of a revisit policy."""

    out: int  # forward steps outward
    turn_before: bool = False  # a full turn on the spot before leaving
    turn_at_cell: int | None = None  # a full turn on reaching this cell of the way out (1 = the first)
    turn_after: bool = False  # a full turn after coming back


class _GeneratorPolicy:
    """Runs ``self._plan()``, a generator that receives poses and yields actions."""

    def __init__(self, env, rng: np.random.Generator, length: int):
        self.env, self.rng, self.length = env, rng, length
        self.t = 0  # index of the frame whose pose `act` receives (also inside `_plan`, holding that pose)
        self.revisits: list[tuple[int, int]] = []  # (frame left, frame returned) of finished excursions
        self.turns: list[tuple[int, int]] = []  # [start, stop) frames of finished full turns on the spot
        self._gen = None

    def act(self, pose: np.ndarray) -> int:
        if self._gen is None:
            self._gen = self._plan()
            next(self._gen)
        action = self._gen.send(np.asarray(pose, dtype=np.float64))
        self.t += 1
        return int(action)

    def _plan(self):
        raise NotImplementedError


class StickyRandomPolicy(_GeneratorPolicy):
    """Uniform random actions, each repeated with probability `stick` (smoother, more exploratory motion)."""

    def __init__(self, env, rng, length, stick: float = 0.75):
        super().__init__(env, rng, length)
        self.stick = stick

    def _plan(self):
        action = int(self.rng.integers(self.env.num_actions))
        yield
        while True:
            if self.rng.random() > self.stick:
                action = int(self.rng.integers(self.env.num_actions))
            yield action


class MemoryMazeWander(_GeneratorPolicy):
    """A random exploring agent, as in DMLab data: runs of forward (pushing on when a wall stops it), turns on
    the spot (a glance to more than a full turn), sticky random actions and short standstills."""

    SEGMENTS = (("forward", 0.35), ("turn", 0.3), ("sticky", 0.3), ("still", 0.05))  # (kind, probability)
    STICK = 0.75  # sticky segments repeat the last action with this probability

    def _plan(self):
        yield
        kinds, probs = zip(*self.SEGMENTS)
        while True:
            kind = kinds[int(self.rng.choice(len(kinds), p=probs))]
            if kind == "forward":  # 1-4 cells at full speed: corridors end in walls well within that
                actions = [MM_FORWARD] * int(self.rng.integers(4, 17))
            elif kind == "turn":  # 3..24 steps of ~18 degrees
                actions = [MM_LEFT if self.rng.random() < 0.5 else MM_RIGHT] * int(self.rng.integers(3, 25))
            elif kind == "still":
                actions = [MM_NOOP] * int(self.rng.integers(1, 5))
            else:
                actions = self._sticky(int(self.rng.integers(4, 17)))
            for action in actions:
                yield action

    def _sticky(self, n: int) -> list[int]:
        action, actions = int(self.rng.integers(self.env.num_actions)), []
        for _ in range(n):
            if self.rng.random() > self.STICK:
                action = int(self.rng.integers(self.env.num_actions))
            actions.append(action)
        return actions


class _RevisitPolicy(_GeneratorPolicy):
    """Excursions out and back; subclasses say how to walk out (`_outward`), back (`_return`), what counts
    as arrived (`_arrived`), what to do when no excursion fits (`_filler`) and may plan full turns on the
    spot (`_draw_excursion`, `_full_turn`)."""

    turn_cost = 0  # steps an excursion spends turning (round and back) beyond walking
    AWAY = 1.0  # cells an excursion must get from its start to count as a revisit
    MIN_OUT = 2  # outward steps of the shortest excursion
    TURN_STEPS = 0  # most steps of a full turn on the spot (none in 2D worlds)

    def _outward_steps(self, gap: int, spin_cost: int = 0) -> int:
        """Outward steps for a trip of about `gap` frames, clipped so that walking out and back (2x, plus 10%
        slack for corrections), `turn_cost` and `spin_cost` (full turns) fit in the rest of the episode."""
        remaining = self.length - 1 - self.t
        room = int((remaining - self.turn_cost - spin_cost) / 2.2)
        return min((gap - self.turn_cost) // 2, room)

    def _draw_excursion(self) -> Excursion:
        return Excursion(self._outward_steps(int(self.rng.integers(MIN_GAP, MAX_GAP + 1))))

    def _plan(self):
        pose = yield
        while True:
            trip = self._draw_excursion()
            if trip.out < self.MIN_OUT:  # too short an excursion (or too little episode left): filler step
                pose = yield self._filler(pose)
                continue
            start, t_leave = pose.copy(), self.t
            if trip.turn_before:
                pose = yield from self._full_turn(pose)
            trail = [pose[:2].copy()]
            pose = yield from self._outward(pose, trip.out, trail, trip.turn_at_cell,
                                            reserve=self.TURN_STEPS * trip.turn_after)
            pose = yield from self._return(pose, trail, start)
            went = max(math.hypot(*(p - start[:2])) for p in trail)
            # record only excursions that left (>= AWAY cells) and really came back to the departure pose
            if went >= self.AWAY and self._arrived(pose, start):
                self.revisits.append((t_leave, self.t))
            if trip.turn_after:
                pose = yield from self._full_turn(pose)

    def _full_turn(self, pose, trail=None):
        """A full turn on the spot (a generator, like `_outward`); only policies that plan turns have one."""
        raise NotImplementedError


class MemoryMazeRevisit(_RevisitPolicy):
    """Steer the rolling ball cell to cell through the maze layout, then back along the recorded trail, with
    full turns on the spot before leaving, after coming back and (sometimes) at a cell on the way out."""

    turn_cost = 28  # ~10 turn steps for 180 degrees, twice, plus braking and corners
    MIN_OUT = 5  # ~1 cell
    ARRIVE_TOL = 0.2  # cells (a cell is 2 m; full speed is ~0.25 cells per step)
    HEADING_TOL = 0.35  # radians; turns come in ~18 degree steps
    TURN_STEPS = 22  # most steps of a full turn: 20 of ~18 degrees (the first is ~14), plus one spare
    TURN_SLACK = 0.16  # radians: a turn ends once it has swept 360 degrees less half a step
    RETURN_SETTLE = 14  # steps a return may spend at the end stopping and turning to the old heading
    RETURN_RATIO = 1.8  # a way back takes up to this many times the way out (measured 1.2-2.1x, 24 steps out)
    BRAKE_STEPS = 4  # no-ops to stop rolling before a turn on the way out (the ball stops within ~3)
    WAYPOINT_TURN_P = 0.3  # probability that an excursion also turns fully at a cell on the way out

    def _draw_excursion(self) -> Excursion:
        """Gap, outward steps and turns of the next excursion; the turns' steps come out of the episode's
        budget, not out of the gap. When the turns do not fit (short episodes) the trip goes without them."""
        gap = int(self.rng.integers(MIN_GAP, MAX_GAP + 1))
        waypoint_turn = self.rng.random() < self.WAYPOINT_TURN_P
        # no turn before leaving when the last excursion just ended with one here: it would repeat its views
        before = not (self.turns and self.turns[-1][1] == self.t + 1)
        spins = (int(before) + 1) * self.TURN_STEPS + waypoint_turn * (self.TURN_STEPS + self.BRAKE_STEPS)
        out = self._outward_steps(gap, spins)
        if out < self.MIN_OUT:
            return Excursion(self._outward_steps(gap))
        # a cell within the first half of the way out (the ball crosses a cell in ~4-5 forward steps)
        at_cell = 1 + int(self.rng.integers(max(1, out // 10))) if waypoint_turn else None
        return Excursion(out, before, at_cell, True)

    def _full_turn(self, pose, trail=None):
        """Turn 360 degrees on the spot (left or right at random), recording its frames [start, stop)."""
        action = MM_LEFT if self.rng.random() < 0.5 else MM_RIGHT
        start, swept = self.t, 0.0
        for _ in range(self.TURN_STEPS):
            if abs(swept) >= 2 * math.pi - self.TURN_SLACK:
                break
            heading = pose[2]
            pose = yield action
            swept += _wrap(pose[2] - heading)
            if trail is not None:
                trail.append(pose[:2].copy())
        self.turns.append((start, self.t + 1))
        return pose

    def _brake(self, pose, trail):
        """No-ops until the ball stops rolling (at most BRAKE_STEPS)."""
        for _ in range(self.BRAKE_STEPS):
            prev, pose = pose, (yield MM_NOOP)
            trail.append(pose[:2].copy())
            if math.hypot(*(pose[:2] - prev[:2])) < 0.02:
                break
        return pose

    def _arrived(self, pose, start) -> bool:
        return (math.hypot(*(pose[:2] - start[:2])) < self.ARRIVE_TOL
                and abs(_wrap(pose[2] - start[2])) < self.HEADING_TOL)

    def _filler(self, pose):
        return MM_LEFT  # spin in place: a full turn also repeats views, ~20 frames apart

    def _steer(self, pose, target, tol):
        """One action toward `target` (x, y), or None when within `tol` cells."""
        d = target - pose[:2]
        if math.hypot(d[0], d[1]) < tol:
            return None
        err = _wrap(math.atan2(d[1], d[0]) - pose[2])
        if abs(err) > 0.6:  # far off: turn in place (about 18 degrees a step)
            return MM_LEFT if err > 0 else MM_RIGHT
        if abs(err) > 0.2:
            return MM_FORWARD_LEFT if err > 0 else MM_FORWARD_RIGHT
        return MM_FORWARD

    @staticmethod
    def _coast_to(pose, prev, start) -> bool:
        """Would the ball, left to coast, reach the start? (it rolls on ~1.3x its last step)"""
        speed = math.hypot(*(pose[:2] - prev[:2]))
        return math.hypot(*(start[:2] - pose[:2])) < 1.3 * speed + 0.05

    def _next_cell(self, cell, prev, heading):
        """A random free neighbour, preferring to keep going straight and not to double back.

        The first cell of an excursion (prev None) is usually the one the agent already faces, which saves
        turning on the way out and leaves more of the episode for walking.
        """
        options = [(cell[0] + dx, cell[1] + dy) for dx, dy in ((1, 0), (-1, 0), (0, 1), (0, -1))]
        options = [c for c in options if self.env.free(c)]
        forward = [c for c in options if c != prev]
        if not forward:
            return options[0] if options else None
        if prev is None:
            facing = min(forward, key=lambda c: abs(_wrap(math.atan2(c[1] - cell[1], c[0] - cell[0]) - heading)))
            if self.rng.random() < 0.8:
                return facing
        else:
            straight = (2 * cell[0] - prev[0], 2 * cell[1] - prev[1])
            if straight in forward and self.rng.random() < 0.6:
                return straight
        return forward[int(self.rng.integers(len(forward)))]

    def _outward(self, pose, n_out, trail, turn_at_cell=None, reserve=0):
        """Walk n_out forward steps (turning in place does not count, within 1.5 n_out + 12 steps); on
        reaching cell `turn_at_cell` of the way (1 = the first), brake and turn fully on the spot first.

        Turns at corners make the walk slower than its budget assumed, so it also stops in time to come back
        (RETURN_RATIO times as long, plus RETURN_SETTLE steps to stop and face the old way) and spend
        `reserve` more steps before the episode ends.
        """
        room = self.length - 1 - self.t - self.RETURN_SETTLE - reserve
        deadline = self.t + int(room / (1 + self.RETURN_RATIO))
        cell = (int(pose[0]), int(pose[1]))
        prev = None
        target = None
        walked = reached = 0
        for _ in range(n_out + n_out // 2 + 12):
            if walked >= n_out or self.t >= deadline:
                break
            if target is None or math.hypot(*(target - pose[:2])) < 0.3:
                if target is not None:
                    reached += 1
                    if reached == turn_at_cell:
                        t_stop = self.t
                        pose = yield from self._brake(pose, trail)
                        pose = yield from self._full_turn(pose, trail)
                        # the way back does not repeat the turn: only the walking needs a return's time
                        deadline += int((self.t - t_stop) * self.RETURN_RATIO / (1 + self.RETURN_RATIO))
                nxt = self._next_cell(cell, prev, pose[2])
                if nxt is None:
                    break
                prev, cell = cell, nxt
                target = np.array([cell[0] + 0.5, cell[1] + 0.5])
            action = self._steer(pose, target, 0.0)
            walked += action in (MM_FORWARD, MM_FORWARD_LEFT, MM_FORWARD_RIGHT)
            pose = yield action
            trail.append(pose[:2].copy())
        return pose

    def _return(self, pose, trail, start):
        # Waypoints: the trail in reverse, thinned to >= 0.5 cells apart, ending exactly at the start.
        waypoints = []
        for p in reversed(trail[:-1]):
            if not waypoints or math.hypot(*(p - waypoints[-1])) >= 0.5:
                waypoints.append(p)
        if not waypoints or math.hypot(*(waypoints[-1] - start[:2])) > 1e-6:
            waypoints.append(start[:2].copy())
        # The ball coasts ~1.3x its last step once forward commands stop: when that would carry it to the
        # start, coast (noop) instead of steering, and finish at rest within ARRIVE_TOL / 2 of the start.
        prev = pose
        near_start = False
        for w in waypoints[:-1]:
            for _ in range(40):  # give up on a waypoint after 40 steps (stuck on a wall corner)
                near_start = self._coast_to(pose, prev, start)
                action = None if near_start else self._steer(pose, w, 0.35)
                if action is None:
                    break
                prev, pose = pose, (yield action)
            if near_start:
                break
        for _ in range(40):
            dist = math.hypot(*(start[:2] - pose[:2]))
            speed = math.hypot(*(pose[:2] - prev[:2]))
            if dist < self.ARRIVE_TOL / 2 and speed < 0.02:
                break
            action = MM_NOOP if self._coast_to(pose, prev, start) else self._steer(pose, start[:2], 0.0)
            prev, pose = pose, (yield action)
        # At rest now: turn to the heading we left with (turning in place hardly moves the ball).
        for _ in range(14):
            err = _wrap(start[2] - pose[2])
            if abs(err) < 0.17:
                break
            pose = yield MM_LEFT if err > 0 else MM_RIGHT
        return pose


class MemoryMazeLookAround(MemoryMazeRevisit):
    """The look-around evaluation episode: a full turn on the spot, OUT_STEPS forward steps out along free
    cells, back to the start (closed loop) facing the first heading, a full turn again, then standing still.
    Every view of the second turn was seen during the first; `turns` holds the two turns' frame ranges (fewer
    when the episode ends first)."""

    OUT_STEPS = 24

    def _plan(self):
        pose = yield
        start = pose.copy()
        pose = yield from self._full_turn(pose)
        trail = [pose[:2].copy()]
        pose = yield from self._outward(pose, self.OUT_STEPS, trail, reserve=self.TURN_STEPS)
        pose = yield from self._return(pose, trail, start)
        if self._arrived(pose, start):
            self.revisits.append((0, self.t))
        pose = yield from self._full_turn(pose)
        while True:
            yield MM_NOOP


class CrafterRevisit(_RevisitPolicy):
    """Random walk over safe cells (never lava), then step back through the same cells in reverse."""

    turn_cost = 0
    AWAY = 2.0

    def _filler(self, pose):
        return 0  # noop

    def _arrived(self, pose, start) -> bool:
        return bool(np.array_equal(pose[:2], start[:2]))

    def _outward(self, pose, n_out, trail, turn_at_cell=None, reserve=0):
        del turn_at_cell, reserve  # a 2D top-down view: turning on the spot shows nothing new
        heading = None
        for _ in range(n_out):
            cell = pose[:2].astype(int)
            moves = [a for a, d in CRAFTER_MOVES.items() if self.env.free(cell + np.array(d))]
            if heading is not None and len(moves) > 1:  # do not double back unless in a dead end
                back = tuple(-v for v in CRAFTER_MOVES[heading])
                moves = [a for a in moves if CRAFTER_MOVES[a] != back]
            if not moves:
                pose = yield 0
                continue
            if heading not in moves or self.rng.random() > 0.7:
                heading = moves[int(self.rng.integers(len(moves)))]
            pose = yield heading
            here = [tuple(p) for p in trail]
            if tuple(pose[:2]) in here:  # walked in a loop: cut it, so the way back is loop-free
                del trail[here.index(tuple(pose[:2])) + 1:]
            else:
                trail.append(pose[:2].copy())
        return pose

    def _return(self, pose, trail, start):
        for target in reversed(trail[:-1]):
            for _ in range(12):
                delta = tuple(int(v) for v in target - pose[:2])
                action = next((a for a, d in CRAFTER_MOVES.items() if d == delta), None)
                if action is None:  # off the trail (should not happen): give up this return
                    return pose
                facing = (round(math.cos(pose[2])), round(math.sin(pose[2])))
                if self.env.occupied(target) and facing == delta:
                    action = CRAFTER_DO  # a cow or zombie in the way, and we face it: hit it
                pose = yield action
                if np.array_equal(pose[:2], target):
                    break
        return pose


_CLASSES = {("memory_maze", "random"): StickyRandomPolicy, ("crafter", "random"): StickyRandomPolicy,
            ("memory_maze", "revisit"): MemoryMazeRevisit, ("crafter", "revisit"): CrafterRevisit,
            ("memory_maze", "look_around"): MemoryMazeLookAround, ("memory_maze", "wander"): MemoryMazeWander}


def make_policy(name: str, env, rng: np.random.Generator, length: int):
    """The named policy for `env`, planning for an episode of `length` frames ('mixed': `choose_policy` first)."""
    check_policy(name, env.name)
    if name == "mixed":
        raise ValueError("policy 'mixed' draws a policy per episode: pass the one choose_policy() drew")
    return _CLASSES[(env.name, name)](env, rng, length)
