"""Episodes on disk (TECO layout), the clip loader, and generators driving Memory Maze and Crafter.

Modules (import what you need; importing ``data`` itself loads nothing heavy):

* ``data.episodes``  Episode, load_episode, write_episode, read_header, read_extra, read_turns, read_policy,
  EpisodeError
* ``data.dataset``   ClipDataset, resolve_split, DatasetError
* ``data.generate``  ensure_dataset, generate, GenerateError; CLI ``python -m data.generate``
* ``data.preview``   CLI ``python -m data.preview``
* ``data.envs``, ``data.policies``  the environment wrappers and the policies (random, revisit, look_around,
  wander, mixed)
* ``data.mirror``    mirror_clip, mirror_permutation, mirror_poses, MEMORY_MAZE_MIRROR: a clip's left-right mirror image
"""
