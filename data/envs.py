"""Thin, seedable wrappers over the two real environments the generators drive.

Both expose the same small interface so generators and policies do not care which one runs:

    env = make_env("memory_maze", size=64)
    frame, pose = env.reset(seed)            # frame (H, W, 3) uint8, pose (3,) = (x, y, heading radians)
    frame, pose, done = env.step(action)
    env.close()

* Memory Maze (the DMLab stand-in): 3D mazes from ``memory_maze.tasks.memory_maze_9x9``; pose from the
  global observables ``agent_pos`` (maze cells) and ``agent_dir`` (unit vector). Building the environment
  costs seconds, so one instance is reused across episodes: ``reset(seed)`` re-seeds the maze generator
  and the episode RNG, which makes an episode a function of its seed alone (not of what ran before).
* Crafter (the Minecraft stand-in): 2D world, pose from ``player_pos`` and the player's facing.

Imports of the environment packages are deferred to ``make_env`` so that importing ``data`` stays light.
"""

from __future__ import annotations

import contextlib
import io
import os
import warnings

import numpy as np

from .errors import DataError

ENV_NAMES = ("memory_maze", "crafter")

# Memory Maze: 0 noop, 1 forward, 2 turn left (+heading), 3 turn right, 4 forward+left, 5 forward+right.
MM_NOOP, MM_FORWARD, MM_LEFT, MM_RIGHT, MM_FORWARD_LEFT, MM_FORWARD_RIGHT = range(6)
# Longest episode each environment runs: memory_maze_9x9 ends after 250 s at 4 Hz = 1000 steps, crafter
# after its default 10,000 steps (+1 for the reset frame).
MAX_FRAMES = {"memory_maze": 1001, "crafter": 10001}
# Crafter: 0 noop, 1 left (-x), 2 right (+x), 3 up (-y), 4 down (+y), 5 do, ... (17 actions)
CRAFTER_MOVES = {1: (-1, 0), 2: (1, 0), 3: (0, -1), 4: (0, 1)}
CRAFTER_DO = 5  # interact with / hit what the player faces


class EnvUnavailable(DataError, RuntimeError):
    """An environment package is not installed or cannot render on this machine."""


@contextlib.contextmanager
def _quiet_import():
    """Silence import-time noise: gym prints a deprecation banner to stderr, dm_control warns."""
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def _seed32(seed: int, salt: int) -> int:
    """A 31-bit seed derived from (seed, salt): independent streams for maze layout and episode RNG."""
    return int(np.random.SeedSequence([seed, salt]).generate_state(1)[0] % (2**31 - 1))


def _load_triton_before_osmesa() -> None:
    """libOSMesa (llvmpipe) and Triton both carry LLVM; loading Triton's library after OSMesa segfaults the
    process (seen with Debian's libosmesa6 and triton 3.8), the other order is fine. So when Triton is
    installed, load it first — it is what the model's attention kernels import later in the same process."""
    with contextlib.suppress(ImportError):
        import triton  # noqa: F401


class MemoryMazeEnv:
    """memory_maze_9x9 with global observables; one dm_control environment reused across episodes."""

    name = "memory_maze"
    num_actions = 6

    def __init__(self, size: int = 64):
        # Software rendering on a CPU machine; must be set before mujoco/dm_control are imported.
        os.environ.setdefault("MUJOCO_GL", "osmesa")
        os.environ.setdefault("PYOPENGL_PLATFORM", "osmesa")
        _load_triton_before_osmesa()
        try:
            with _quiet_import():
                from memory_maze import tasks
        except ImportError as e:
            raise EnvUnavailable(f"memory_maze cannot be imported ({e}); install the envs extra: "
                                 "pip install -e '.[envs]' (needs gym, mujoco<4, dm_control 1.0.x)") from e
        self.size = size
        self._tasks = tasks
        self._env = None
        self._can_reseed: bool | None = None
        self.layout: np.ndarray | None = None  # (rows=y, cols=x) 1 = free cell, maze coords

    def _build(self, seed: int):
        if self._env is not None:
            self._env.close()
        try:
            # target_color_in_image=False: no coloured frame around the image announcing the current
            # target (it changes when a target is touched, which would make revisited views differ).
            self._env = self._tasks.memory_maze_9x9(global_observables=True, seed=seed,
                                                    camera_resolution=self.size, target_color_in_image=False)
        except Exception as e:  # PyOpenGL/MuJoCo failures surface as many types
            raise EnvUnavailable(f"memory_maze failed to build ({type(e).__name__}: {e}); on a CPU machine "
                                 "install Debian's libosmesa6 and keep MUJOCO_GL=osmesa") from e

    def _reseed(self, seed: int) -> bool:
        """Point the reused environment's maze generator and RNG at `seed`; False if internals differ.

        memory-maze seeds its labmaze generator once at build time and then advances it per episode, so
        without this an episode would depend on how many episodes this process generated before it.
        """
        try:
            from labmaze import defaults
            from labmaze.cc.python import _random_maze

            base = self._env
            while hasattr(base, "env") or hasattr(base, "_env"):  # unwrap observation/action wrappers
                base = getattr(base, "env", None) or base._env
            maze = base._task._maze_arena._maze
            base._random_state.seed(_seed32(seed, 1))
            maze._native_maze = _random_maze.RandomMaze(
                height=maze._height, width=maze._width, max_rooms=maze._max_rooms,
                room_min_size=maze._room_min_size, room_max_size=maze._room_max_size,
                retry_count=defaults.RETRY_COUNT, extra_connection_probability=defaults.EXTRA_CONNECTION_PROBABILITY,
                max_variations=maze._max_variations, has_doors=defaults.HAS_DOORS,
                simplify=True,  # what memory_maze's MazeWithTargetsArena passes
                spawns_per_room=maze._spawns_per_room, spawn_token=maze._spawn_token,
                objects_per_room=maze._objects_per_room, object_token=maze._object_token,
                random_seed=_seed32(seed, 2))
            return True
        except (AttributeError, ImportError, TypeError):
            return False

    def reset(self, seed: int):
        if self._env is None:
            self._build(_seed32(seed, 0))
        if self._can_reseed is None or self._can_reseed:
            self._can_reseed = self._reseed(seed)
        if not self._can_reseed:  # unknown memory-maze internals: rebuild per episode (slower, still seeded)
            self._build(_seed32(seed, 0))
        ts = self._env.reset()
        self.layout = np.asarray(ts.observation["maze_layout"])
        return self._obs(ts)

    def step(self, action: int):
        ts = self._env.step(int(action))
        frame, pose = self._obs(ts)
        return frame, pose, bool(ts.last())

    @staticmethod
    def _obs(ts):
        o = ts.observation
        x, y = o["agent_pos"]
        dx, dy = o["agent_dir"]
        pose = np.array([x, y, np.arctan2(dy, dx)], dtype=np.float32)
        return np.asarray(o["image"], dtype=np.uint8), pose

    def free(self, cell) -> bool:
        """Is grid cell (x, y) a corridor/room (not a wall, inside the maze)?"""
        x, y = int(cell[0]), int(cell[1])
        rows, cols = self.layout.shape
        return 0 <= x < cols and 0 <= y < rows and bool(self.layout[y, x])

    def close(self):
        if self._env is not None:
            self._env.close()
            self._env = None


class _OrderedSet(dict):
    """A set that iterates in insertion order (a dict with None values), for crafter's chunk lists."""

    def add(self, item):
        self[item] = None

    def remove(self, item):
        del self[item]


def _make_crafter_deterministic(world) -> None:
    """Crafter keeps each chunk's creatures in a `set` of objects, hashed by memory address, and picks
    the creature to despawn by index into that set's iteration order — so the same seed gives different
    episodes from run to run. Swap this instance's chunk sets for insertion-ordered ones after every
    world reset; the game logic is unchanged, only the iteration order becomes reproducible."""
    import collections

    original_reset = world.reset

    def reset(seed=None):
        original_reset(seed)
        world._chunks = collections.defaultdict(_OrderedSet)

    world.reset = reset
    world._chunks = collections.defaultdict(_OrderedSet)


class CrafterEnv:
    """crafter.Env; a fresh (cheap) instance per episode, seeded, so episodes depend on their seed only.

    With ``sustain=True`` (the generators' setting) the player's food, drink, energy and health are
    topped up before every step. Otherwise a scripted or random agent dies of thirst after ~200 steps
    (TECO's Minecraft episodes are 300 frames) or falls asleep (black frames); the survival game is not
    what a video model should learn here. The status bar then stays full, except for a frame after a
    zombie's hit. With ``day_only=True`` (also the default) the light stays at full daylight: crafter's
    night darkens frames and overlays random noise from around step 150 to 270 of every 300, which no
    model can predict and which makes revisited places look different.
    """

    name = "crafter"
    num_actions = 17

    def __init__(self, size: int = 64, sustain: bool = True, day_only: bool = True):
        try:
            with _quiet_import():
                import crafter
        except ImportError as e:
            raise EnvUnavailable(f"crafter cannot be imported ({e}); pip install -e '.[envs]'") from e
        self._crafter = crafter
        self.size = size
        self.sustain, self.day_only = sustain, day_only
        self._env = None

    def reset(self, seed: int):
        self._env = self._crafter.Env(size=(self.size, self.size), seed=_seed32(seed, 0))
        world = self._env._world
        _make_crafter_deterministic(world)
        if self.day_only:  # crafter.Env._update_time sets world.daylight from the step count
            self._env._update_time = lambda: setattr(world, "daylight", 1.0)
        frame = self._env.reset()
        return np.asarray(frame, dtype=np.uint8), self._pose(self._env._player.pos)

    def step(self, action: int):
        if self.sustain:
            player = self._env._player
            for stat in ("health", "food", "drink", "energy"):
                player.inventory[stat] = self._crafter.constants.items[stat]["max"]
            player._hunger = player._thirst = player._fatigue = 0  # no decrement due this step
        frame, _reward, done, info = self._env.step(int(action))
        return np.asarray(frame, dtype=np.uint8), self._pose(info["player_pos"]), bool(done)

    def _pose(self, pos):
        fx, fy = self._env._player.facing
        return np.array([pos[0], pos[1], np.arctan2(fy, fx)], dtype=np.float32)

    def free(self, cell) -> bool:
        """Can the player step onto grid cell (x, y) safely (grass/sand/path, no object; never lava)?"""
        material, obj = self._env._world[np.asarray(cell, dtype=int)]
        return obj is None and material in ("grass", "sand", "path")

    def occupied(self, cell) -> bool:
        """Is a creature (cow, zombie, ...) standing on grid cell (x, y)?"""
        return self._env._world[np.asarray(cell, dtype=int)][1] is not None

    def close(self):
        self._env = None


def make_env(name: str, size: int = 64):
    """Build the named environment ('memory_maze' or 'crafter') rendering size x size frames."""
    if name == "memory_maze":
        return MemoryMazeEnv(size)
    if name == "crafter":
        return CrafterEnv(size)
    raise ValueError(f"unknown environment {name!r}; choose one of {ENV_NAMES}")
