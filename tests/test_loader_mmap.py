"""The memory-mapped episode store: same clips as the zip reader, bounded open maps, workers start clean."""

from __future__ import annotations

import pickle

import numpy as np
import torch

from data.dataset import ClipDataset
from data.episodes import open_video_memmap, write_episode


def _write(root, compress, n=3, length=20, seed=0):
    rng = np.random.default_rng(seed)
    for e in range(n):
        write_episode(root / f"ep{e}.npz", rng.integers(0, 256, (length, 8, 8, 3), dtype=np.uint8),
                      rng.integers(0, 6, length), rng.normal(size=(length, 3)).astype(np.float32),
                      compress=compress)
    return root


def test_memmap_clips_equal_zip_reads(tmp_path):
    stored = _write(tmp_path / "stored", compress=False)
    packed = _write(tmp_path / "packed", compress=True)
    assert isinstance(open_video_memmap(stored / "ep1.npz"), np.memmap)
    assert open_video_memmap(packed / "ep1.npz") is None  # deflated bytes cannot be mapped
    mapped = ClipDataset(stored, n_frames=5, frame_skip=2, progress=False)
    plain = ClipDataset(stored, n_frames=5, frame_skip=2, progress=False, mmap=False)
    zipped = ClipDataset(packed, n_frames=5, frame_skip=2, progress=False)
    for i in [0, 7, len(mapped) - 1, 3, 7]:
        a, b, c = mapped[i], plain[i], zipped[i]
        for key in ("video", "actions", "pose"):
            assert torch.equal(a[key], b[key]) and torch.equal(a[key], c[key]), (i, key)
    assert mapped._open and all(isinstance(v[0], np.memmap) for v in mapped._open.values())
    a = mapped[4]["video"]
    a += 1  # items own their memory: writing one must not touch the map (which is read-only anyway)
    assert torch.equal(mapped[4]["video"], plain[4]["video"])


def test_open_maps_are_bounded_and_not_pickled(tmp_path, monkeypatch):
    ds = ClipDataset(_write(tmp_path / "s", compress=False, n=4), n_frames=4, progress=False)
    monkeypatch.setattr(ClipDataset, "OPEN_EPISODES", 2)
    for i in range(len(ds)):
        ds[i]
    assert len(ds._open) == 2 and list(ds._open) == [2, 3]  # the two most recently read episodes
    clone = pickle.loads(pickle.dumps(ds))
    assert len(clone._open) == 0 and torch.equal(clone[0]["video"], ds[0]["video"])


def test_uint8_clips_convert_to_the_float_clips(tmp_path):
    from data.dataset import to_float_video

    root = _write(tmp_path / "s", compress=False)
    f32 = ClipDataset(root, n_frames=4, progress=False)
    u8 = ClipDataset(root, n_frames=4, progress=False, video_dtype="uint8")
    for i in (0, 9):
        raw = u8[i]["video"]
        assert raw.dtype == torch.uint8 and raw.shape == f32[i]["video"].shape
        assert torch.equal(to_float_video(raw), f32[i]["video"])
    # resized clips come back as 8-bit frames of the resized float clip
    r32 = ClipDataset(root, n_frames=4, progress=False, resize=4)
    r8 = ClipDataset(root, n_frames=4, progress=False, resize=4, video_dtype="uint8")
    assert r8[3]["video"].dtype == torch.uint8
    assert (to_float_video(r8[3]["video"]) - r32[3]["video"]).abs().max() <= 1 / 127.5 + 1e-6
