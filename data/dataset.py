"""ClipDataset: fixed-length clips from a split folder of episodes, read lazily.

    ds = ClipDataset("datasets/memory_maze/training", n_frames=16, frame_skip=2)
    item = ds[123]   # video (T, C, H, W) float in [-1, 1], actions (T,) int64, pose (T, 3), episode, start

Opening a folder checks every episode's header once (no video is decoded) and caches the result in
``.arvdm_index.json`` inside the folder, keyed by each file's size and mtime, so re-opening a folder of
40,000 episodes reads one JSON file; only new or changed files are re-checked. A read-only folder keeps
the index in memory. Bad files are all reported in one error, unless ``skip_bad=True``.

Items are a pure function of the index (no RNG): with ``random_start=True`` the index space is every
valid (episode, start) pair, so a seeded sampler picks random clips and resumes exactly; with
``random_start=False`` the clips are the non-overlapping consecutive ones of each episode.
"""

from __future__ import annotations

import json
import os
import warnings
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset
from tqdm import tqdm

from .atomic import atomic_write
from .episodes import EpisodeError, open_video_memmap, read_actions_pose, read_frames, read_header
from .errors import DataError

INDEX_FILE = ".arvdm_index.json"
INDEX_VERSION = 1
# TECO folders name their splits train/ and test/; ours are training/ and validation/.
SPLIT_ALIASES = {"training": "train", "train": "training", "validation": "test", "test": "validation"}


class DatasetError(DataError):
    """A split folder is missing, empty, holds bad episodes, or cannot supply the requested clips."""


def resolve_split(path, split: str | None = None) -> Path:
    """The split folder `path[/split]`, accepting TECO's train/test for training/validation and back.

    ``resolve_split("dmlab", "training")`` finds ``dmlab/train`` when ``dmlab/training`` is absent.
    """
    path = Path(path) / split if split else Path(path)
    if path.is_dir():
        return path
    alias = SPLIT_ALIASES.get(path.name)
    if alias and (path.parent / alias).is_dir():
        return path.parent / alias
    also = f" (nor {path.parent / alias})" if alias else ""
    raise DatasetError(f"{path}: split folder does not exist{also}")


def list_episodes(split_dir: Path) -> list[Path]:
    """Episode files in a split folder, sorted by name: every NAME.mp4, and every NAME.npz without one.

    Hidden files (temp files of an interrupted write, the index) are skipped.
    """
    names = [n for n in os.listdir(split_dir) if not n.startswith(".")]
    mp4_stems = {n[:-4] for n in names if n.lower().endswith(".mp4")}
    episodes = [n for n in names if n.lower().endswith(".mp4")
                or (n.lower().endswith(".npz") and n[:-4] not in mp4_stems)]
    return [split_dir / n for n in sorted(episodes)]


def _stamp(path: Path) -> list[int]:
    """Size and mtime of an episode's file(s); a change means the cached header is stale."""
    files = [path, path.with_suffix(".npz")] if path.suffix.lower() == ".mp4" else [path]
    out = []
    for f in files:
        try:
            st = f.stat()
            out += [st.st_size, st.st_mtime_ns]
        except OSError:
            out += [-1, -1]
    return out


def _scan(path: Path) -> dict:
    """One index entry: the header fields, or the error that the header check raised."""
    try:
        h = read_header(path)
        return {"length": h.length, "height": h.height, "width": h.width, "has_pose": h.has_pose,
                "max_action": h.max_action, "error": None}
    except EpisodeError as e:
        return {"error": str(e)}


def build_index(split_dir: Path, progress: bool = True) -> tuple[list[Path], list[dict], bool]:
    """Header entries for every episode in `split_dir`, reusing the cached index where files are unchanged.

    Returns (paths, entries, persisted): persisted is False when the on-disk cache could not be updated.
    The cache is rewritten atomically when anything changed; if
    the folder is read-only the index lives in memory only.
    """
    paths = list_episodes(split_dir)
    cache_path = split_dir / INDEX_FILE
    cached: dict = {}
    try:
        body = json.loads(cache_path.read_text())
        if body.get("version") == INDEX_VERSION:
            cached = body.get("episodes", {})
    except (OSError, ValueError, AttributeError):
        cached = {}  # no cache yet, or a damaged one: rebuild

    entries, stale = [None] * len(paths), []
    for i, p in enumerate(paths):
        stamp = _stamp(p)
        hit = cached.get(p.name)
        # entries cached before empty episodes counted as bad (length 0, no error) are re-checked
        if hit is not None and hit.get("stamp") == stamp and (hit.get("error") or hit.get("length", 0) >= 1):
            entries[i] = hit
        else:
            stale.append((i, stamp))
    # Threads: header reads are file I/O and zlib, which release the GIL; on network storage the
    # latency of many small reads dominates, and overlapping them is what makes a first scan fast.
    with ThreadPoolExecutor(max_workers=min(16, 2 * (os.cpu_count() or 1))) as pool:
        scans = pool.map(_scan, [paths[i] for i, _ in stale])
        for (i, stamp), scan in tqdm(zip(stale, scans), total=len(stale), desc=f"indexing {split_dir.name}",
                                     unit="ep", leave=False, disable=not progress or len(stale) < 100):
            entries[i] = {**scan, "stamp": stamp}

    persisted = True
    if stale or len(cached) != len(paths):
        body = {"version": INDEX_VERSION, "episodes": {p.name: e for p, e in zip(paths, entries)}}
        try:
            atomic_write(cache_path, lambda tmp: tmp.write_text(json.dumps(body, separators=(",", ":"))))
        except OSError:
            persisted = False  # read-only folder (a shared data set): keep the index in memory
    return paths, entries, persisted


def to_float_video(video: torch.Tensor) -> torch.Tensor:
    """uint8 frames in [0, 255] -> float32 in [-1, 1] (on the tensor's device); float input passes through."""
    if video.dtype != torch.uint8:
        return video
    return video.float().div_(127.5).sub_(1.0)


class ClipDataset(Dataset):
    """Clips of `n_frames` frames (every `frame_skip`-th frame) from the episodes in `split_dir`.

    Args:
        split_dir: a split folder (``.../training``; TECO's ``train``/``test`` names are accepted too).
        n_frames: frames per clip T.
        frame_skip: take every k-th frame; a clip spans (n_frames - 1) * frame_skip + 1 raw frames.
        random_start: index every valid start (for random sampling) instead of consecutive clips.
        resize: if > 0, resize frames to resize x resize (bilinear, antialiased).
        skip_bad: drop bad episode files with a warning instead of raising.
        video_dtype: "float32" (the item's video in [-1, 1]) or "uint8" (the raw [0, 255] bytes as a (T, C, H, W)
            view, 4x less to collate and copy to the device; convert there with `to_float_video`). The
            float conversion is most of a stored clip's reading cost on the CPU.
        mmap: read stored (uncompressed) npz videos through a memory map, kept open per process for the
            last ``OPEN_EPISODES`` episodes with their actions and poses (no zip parsing per clip).
            Compressed npz and mp4 are read as before.

    Item: ``video`` float32 (T, C, H, W) in [-1, 1], ``actions`` int64 (T,), ``pose`` float32 (T, 3)
    (only when every episode has a pose), ``episode`` int (index into ``self.episodes``), ``start`` int
    (first raw frame). Actions are subsampled like the frames: actions[start::frame_skip].
    """

    def __init__(self, split_dir, n_frames: int, frame_skip: int = 1, random_start: bool = True,
                 resize: int = 0, skip_bad: bool = False, progress: bool = True, mmap: bool = True,
                 video_dtype: str = "float32"):
        if n_frames < 1:
            raise DatasetError(f"n_frames must be >= 1, got {n_frames}")
        if frame_skip < 1:
            raise DatasetError(f"frame_skip must be >= 1, got {frame_skip}")
        if resize < 0:
            raise DatasetError(f"resize must be >= 0, got {resize}")
        self.split_dir = resolve_split(split_dir)
        self.n_frames, self.frame_skip, self.random_start = n_frames, frame_skip, random_start
        if video_dtype not in ("float32", "uint8"):
            raise DatasetError(f"video_dtype must be 'float32' or 'uint8', got {video_dtype!r}")
        self.resize, self.mmap, self.video_dtype = resize, mmap, video_dtype
        self._open: OrderedDict[int, tuple] = OrderedDict()  # episode -> (video map | None, actions, pose)
        self.span = (n_frames - 1) * frame_skip + 1  # raw frames one clip covers

        # index_persisted: False when the folder is read-only and the index lives in memory only
        paths, entries, self.index_persisted = build_index(self.split_dir, progress)
        if not paths:
            raise DatasetError(f"{self.split_dir}: no episodes (*.npz, or *.mp4 + *.npz) in this folder")
        bad = [e["error"] for e in entries if e.get("error")]
        if bad:
            listing = "\n  ".join(bad)
            if not skip_bad:
                raise DatasetError(
                    f"{self.split_dir}: {len(bad)} of {len(paths)} episode files are bad (fix or remove them, "
                    f"or pass skip_bad=True / data.skip_bad_files=true to train without them):\n  {listing}")
            warnings.warn(f"{self.split_dir}: skipping {len(bad)} of {len(paths)} bad episode files:\n  {listing}",
                          stacklevel=2)
        good = [(p, e) for p, e in zip(paths, entries) if not e.get("error")]
        if not good:
            raise DatasetError(f"{self.split_dir}: every episode file is bad")

        self.episodes: list[str] = [str(p) for p, _ in good]
        self.lengths = np.array([e["length"] for _, e in good], dtype=np.int64)
        sizes = sorted({(e["height"], e["width"]) for _, e in good})
        if len(sizes) > 1 and not resize:
            raise DatasetError(f"{self.split_dir}: episodes have different frame sizes {sizes}; "
                               "pass resize=N (data.resize=N) to bring them to one size")
        self.frame_size = (resize, resize) if resize else sizes[0]
        self.has_pose = all(e["has_pose"] for _, e in good)
        self.num_actions = max(e["max_action"] for _, e in good) + 1  # compare with the model's num_actions

        if self.span > self.lengths.max():
            raise DatasetError(
                f"{self.split_dir}: a clip of {n_frames} frames with frame_skip {frame_skip} spans {self.span} "
                f"frames, longer than every episode (longest: {int(self.lengths.max())} frames)")
        if random_start:
            counts = np.maximum(self.lengths - self.span + 1, 0)
        else:
            counts = self.lengths // self.span
        self._ends = np.cumsum(counts)  # clips in episodes 0..e; cheap even for 40,000 episodes

    def __len__(self) -> int:
        return int(self._ends[-1])

    def locate(self, index: int) -> tuple[int, int]:
        """(episode, first raw frame) of clip `index`."""
        if not 0 <= index < len(self):
            raise IndexError(f"clip index {index} out of range for {len(self)} clips in {self.split_dir}")
        episode = int(np.searchsorted(self._ends, index, side="right"))
        within = index - (int(self._ends[episode - 1]) if episode else 0)
        return episode, within if self.random_start else within * self.span

    OPEN_EPISODES = 128  # memory maps (one file descriptor each) and small arrays kept per process

    def _episode(self, episode: int) -> tuple[np.memmap | None, np.ndarray, np.ndarray | None]:
        """(video memory map or None, actions, pose) of an episode, from a small per-process LRU."""
        if episode in self._open:
            self._open.move_to_end(episode)
            return self._open[episode]
        path = self.episodes[episode]
        entry = (open_video_memmap(path), *read_actions_pose(path))
        self._open[episode] = entry
        if len(self._open) > self.OPEN_EPISODES:
            self._open.popitem(last=False)
        return entry

    def __getstate__(self) -> dict:
        # DataLoader workers get the dataset pickled (spawn) or forked: open maps stay with their process.
        state = self.__dict__.copy()
        state["_open"] = OrderedDict()
        state.pop("_decoded", None)
        return state

    def __getitem__(self, index: int) -> dict:
        episode, start = self.locate(int(index))
        path = self.episodes[episode]
        stop = start + self.span
        if self.mmap:
            video_map, actions, pose = self._episode(episode)
        else:
            video_map, (actions, pose) = None, read_actions_pose(path)
        if video_map is not None:
            if stop > video_map.shape[0]:
                raise EpisodeError(path, f"frames {start}..{stop - 1} requested but 'video' has "
                                         f"{video_map.shape[0]} frames (file changed since it was indexed?)")
            frames = np.array(video_map[start:stop:self.frame_skip])  # (T, H, W, 3) uint8: copies the frames
        else:
            frames = np.array(read_frames(path, start, stop)[:: self.frame_skip])  # (T, H, W, 3) uint8, writable
        item = {"video": self._convert(frames),
                "actions": torch.from_numpy(actions[start:stop:self.frame_skip].copy()),
                "episode": episode, "start": start}
        if self.has_pose:
            item["pose"] = torch.from_numpy(pose[start:stop:self.frame_skip].copy())
        return item

    DECODED_BYTES = 256 * 2**20  # decoded videos of compressed episodes kept per process by `frames_at`

    def frames_at(self, episode: int, indices) -> torch.Tensor:
        """Frames of `episode` at raw frame `indices` (any order), converted like an item's video (T, C, H, W).

        For clips whose frames are not consecutive (memory chosen by pose, arvdm.training.pose_clips). A stored
        npz is read through its memory map; a compressed one (or mp4) is decoded whole once and kept in a small
        per-process LRU, so choosing a few frames of an episode costs one decode, not one per frame.
        """
        idx = np.asarray(indices, dtype=np.int64)
        video_map = self._episode(episode)[0] if self.mmap else None
        if video_map is not None:
            return self._convert(np.array(video_map[idx]))  # (T, H, W, 3) uint8 copy
        decoded = self.__dict__.setdefault("_decoded", OrderedDict())
        if episode in decoded:
            decoded.move_to_end(episode)
        else:
            decoded[episode] = read_frames(self.episodes[episode], 0, int(self.lengths[episode]))
            while len(decoded) > 1 and sum(v.nbytes for v in decoded.values()) > self.DECODED_BYTES:
                decoded.popitem(last=False)
        return self._convert(np.array(decoded[episode][idx]))

    def track(self, episode: int) -> tuple[np.ndarray, np.ndarray]:
        """Actions (T,) and poses (T, 3) of a whole episode (raw frames); raises when it has no poses."""
        if not self.has_pose:
            raise DatasetError(f"{self.split_dir}: episodes have no 'pose' array (needed for memory chosen by pose)")
        _, actions, pose = self._episode(episode) if self.mmap else (None, *read_actions_pose(self.episodes[episode]))
        return actions, pose

    def _convert(self, frames: np.ndarray) -> torch.Tensor:
        """(T, H, W, 3) uint8 frames -> the item's video (T, C, H, W): uint8 or float in [-1, 1], resized."""
        video = torch.from_numpy(frames).permute(0, 3, 1, 2)  # (T, C, H, W) uint8 view
        resize = self.resize and tuple(video.shape[-2:]) != (self.resize, self.resize)
        if self.video_dtype == "float32" or resize:
            video = to_float_video(video)  # (T, C, H, W) in [-1, 1]
        if resize:
            video = F.interpolate(video, size=(self.resize, self.resize), mode="bilinear",
                                  antialias=True, align_corners=False).clamp_(-1.0, 1.0)
            if self.video_dtype == "uint8":  # resized frames stored at 8 bits, as a data set made at that size
                video = video.add_(1.0).mul_(127.5).round_().to(torch.uint8)
        return video

    def __repr__(self) -> str:
        kind = "random-start" if self.random_start else "sequential"
        h, w = self.frame_size
        return (f"ClipDataset({self.split_dir}: {len(self.episodes)} episodes, {len(self):,} {kind} clips of "
                f"{self.n_frames} frames (frame_skip {self.frame_skip}), {h}x{w})")
