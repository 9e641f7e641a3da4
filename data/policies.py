"""Behaviour policies for the generators: sticky random actions, and `revisit` trajectories.

A policy is driven one step at a time: ``action = policy.act(pose)``, with pose = (x, y, heading) of the
frame just observed. The scripted policies are written as Python generators (``pose = yield action``)
so that a multi-step plan — leave, turn round, come back, face the old way — reads top to bottom.

`revisit` makes views repeat at known time gaps, the probes of the memory-bottleneck evaluation:
an *excursion* starts at pose P0, walks outward for n steps along a random path through free cells,
then walks back through the recorded positions in reverse and finally turns to P0's heading, so the
frame at the return looks like the frame at departure. Gaps are drawn from 16..160 frames and clipped
to what is left of the episode. Returns are closed-loop (steered by the observed pose), because
Memory Maze's rolling-ball agent has momentum and an open-loop replay of the inverse actions drifts.
"""

from __future__ import annotations

import math

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

POLICIES = ("random", "revisit")
MIN_GAP, MAX_GAP = 16, 160


def _wrap(angle: float) -> float:
    """Angle difference wrapped to (-pi, pi]."""
    return (angle + math.pi) % (2 * math.pi) - math.pi


class _GeneratorPolicy:
    """Runs ``self._plan()``, a generator that receives poses and yields actions."""

    def __init__(self, env, rng: np.random.Generator, length: int):
        self.env, self.rng, self.length = env, rng, length
        self.t = 0  # index of the frame whose pose `act` receives
        self.revisits: list[tuple[int, int]] = []  # (frame left, frame returned) of finished excursions
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


class _RevisitPolicy(_GeneratorPolicy):
    """Excursions out and back; subclasses say how to walk out (`_outward`), back (`_return`), what counts
    as arrived (`_arrived`) and what to do when no excursion fits (`_filler`)."""

    turn_cost = 0  # steps an excursion spends turning (round and back) beyond walking
    AWAY = 1.0  # cells an excursion must get from its start to count as a revisit
    MIN_OUT = 2  # outward steps of the shortest excursion

    def _draw_outward_steps(self) -> int:
        remaining = self.length - 1 - self.t
        gap = int(self.rng.integers(MIN_GAP, MAX_GAP + 1))
        # Walking back takes about as long as walking out, plus turning; keep 10% slack for corrections.
        room = int((remaining - self.turn_cost) / 2.2)
        return min((gap - self.turn_cost) // 2, room)

    def _plan(self):
        pose = yield
        while True:
            n_out = self._draw_outward_steps()
            if n_out < self.MIN_OUT:  # too short an excursion (or too little episode left): filler step
                pose = yield self._filler(pose)
                continue
            start, t_leave = pose.copy(), self.t
            trail = [pose[:2].copy()]
            pose = yield from self._outward(pose, n_out, trail)
            pose = yield from self._return(pose, trail, start)
            went = max(math.hypot(*(p - start[:2])) for p in trail)
            # record only excursions that left (>= AWAY cells) and really came back to the departure pose
            if went >= self.AWAY and self._arrived(pose, start):
                self.revisits.append((t_leave, self.t))


class MemoryMazeRevisit(_RevisitPolicy):
    """Steer the rolling ball cell to cell through the maze layout, then back along the recorded trail."""

    turn_cost = 28  # ~10 turn steps for 180 degrees, twice, plus braking and corners
    MIN_OUT = 5  # ~1 cell
    ARRIVE_TOL = 0.2  # cells (a cell is 2 m; full speed is ~0.25 cells per step)
    HEADING_TOL = 0.35  # radians; turns come in ~18 degree steps

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

    def _outward(self, pose, n_out, trail):
        """Walk n_out forward steps (turning in place does not count, within 1.5 n_out + 12 steps)."""
        cell = (int(pose[0]), int(pose[1]))
        prev = None
        target = None
        walked = 0
        for _ in range(n_out + n_out // 2 + 12):
            if walked >= n_out:
                break
            if target is None or math.hypot(*(target - pose[:2])) < 0.3:
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


class CrafterRevisit(_RevisitPolicy):
    """Random walk over safe cells (never lava), then step back through the same cells in reverse."""

    turn_cost = 0
    AWAY = 2.0

    def _filler(self, pose):
        return 0  # noop

    def _arrived(self, pose, start) -> bool:
        return bool(np.array_equal(pose[:2], start[:2]))

    def _outward(self, pose, n_out, trail):
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


def make_policy(name: str, env, rng: np.random.Generator, length: int):
    """The named policy ('random' or 'revisit') for `env`, planning for an episode of `length` frames."""
    if name == "random":
        return StickyRandomPolicy(env, rng, length)
    if name == "revisit":
        return {"memory_maze": MemoryMazeRevisit, "crafter": CrafterRevisit}[env.name](env, rng, length)
    raise ValueError(f"unknown policy {name!r}; choose one of {POLICIES}")
