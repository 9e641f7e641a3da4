"""Episode files, the clip loader and the preview on hand-made TECO-layout fixtures (no environments).

Frames are built so that every pixel encodes its frame index, so a clip can be checked exactly against
the raw array sliced by hand.
"""

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from data import dataset as dataset_mod
from data.dataset import ClipDataset, DatasetError, resolve_split
from data.episodes import EpisodeError, load_episode, read_frames, read_header, write_episode
from data.generate import GenerateError
from data.generate import main as generate_main
from data.preview import main as preview_main

REPO = Path(__file__).resolve().parents[1]


def make_arrays(T=20, H=16, W=16, seed=0, pose=True):
    """video[t] = a fixed random image + 3t (mod 256): frames differ from each other and are identifiable."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, size=(1, H, W, 3))
    video = ((base + 3 * np.arange(T)[:, None, None, None]) % 256).astype(np.uint8)
    actions = rng.integers(0, 6, size=T).astype(np.int64)
    p = rng.normal(size=(T, 3)).astype(np.float32) if pose else None
    return video, actions, p


def to_clip(video_uint8):
    """Reference conversion: (T, H, W, 3) uint8 -> (T, 3, H, W) float in [-1, 1]."""
    return torch.from_numpy(video_uint8.astype(np.float32)).permute(0, 3, 1, 2) / 127.5 - 1.0


# ------------------------------------------------------------------------------------------------
# episodes.py
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("compress", [True, False])
def test_write_load_roundtrip_and_partial_reads(tmp_path, compress):
    video, actions, pose = make_arrays(T=20)
    path = write_episode(tmp_path / "ep.npz", video, actions, pose, compress=compress)
    ep = load_episode(path)
    assert ep.video.dtype == np.uint8 and ep.actions.dtype == np.int64 and ep.pose.dtype == np.float32
    np.testing.assert_array_equal(ep.video, video)
    np.testing.assert_array_equal(ep.actions, actions)
    np.testing.assert_array_equal(ep.pose, pose)
    np.testing.assert_array_equal(read_frames(path, 7, 13), video[7:13])
    np.testing.assert_array_equal(read_frames(path, 0, 1), video[:1])
    np.testing.assert_array_equal(read_frames(path, 19, 20), video[19:])
    h = read_header(path)
    assert (h.length, h.height, h.width, h.has_pose, h.max_action) == (20, 16, 16, True, int(actions.max()))
    # np.load reads our files too (they are ordinary npz archives)
    with np.load(path) as z:
        np.testing.assert_array_equal(z["video"], video)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temp file left behind"


def test_same_arrays_same_bytes(tmp_path):
    video, actions, pose = make_arrays()
    a = write_episode(tmp_path / "a.npz", video, actions, pose)
    b = write_episode(tmp_path / "b.npz", video, actions, pose)
    assert a.read_bytes() == b.read_bytes()  # no timestamps inside: reruns reproduce files exactly


def test_teco_dmlab_layout_loads_without_conversion(tmp_path):
    """A folder as TECO ships it: dmlab/train/*.npz written by plain np.savez, int32 actions, no pose."""
    root = tmp_path / "dmlab"
    (root / "train").mkdir(parents=True)
    (root / "test").mkdir()
    raws = []
    for i in range(3):
        video, actions, _ = make_arrays(T=30, H=64, W=64, seed=i, pose=False)
        np.savez(root / "train" / f"{i}.npz", video=video, actions=actions.astype(np.int32))
        raws.append((video, actions))
    np.savez(root / "test" / "0.npz", video=raws[0][0], actions=raws[0][1].astype(np.int32))
    assert resolve_split(root, "training") == root / "train"
    assert resolve_split(root, "validation") == root / "test"
    ds = ClipDataset(root / "training", n_frames=8)  # alias: training -> train
    assert len(ds) == 3 * (30 - 8 + 1)
    item = ds[len(ds) - 1]
    assert "pose" not in item and item["episode"] == 2 and item["start"] == 22
    torch.testing.assert_close(item["video"], to_clip(raws[2][0][22:30]))
    np.testing.assert_array_equal(item["actions"].numpy(), raws[2][1][22:30])
    assert item["actions"].dtype == torch.int64
    assert len(ClipDataset(root / "validation", n_frames=8)) == 23


def test_teco_minecraft_layout_mp4_plus_npz(tmp_path):
    """NAME.mp4 (written by imageio, default yuv420p H.264) + NAME.npz with actions, as in TECO Minecraft."""
    import imageio.v2 as iio

    split = tmp_path / "minecraft" / "train"
    split.mkdir(parents=True)
    T, H, W = 24, 32, 48
    # smooth content so lossy H.264 stays close: a moving gradient
    yy, xx = np.mgrid[0:H, 0:W]
    video = np.stack([np.stack([(xx * 5 + t * 4) % 256, yy * 7 % 256, (xx + yy + t * 9) % 256], -1)
                      for t in range(T)]).astype(np.uint8)
    actions = (np.arange(T) % 4).astype(np.int64)
    iio.mimwrite(split / "ep0.mp4", list(video), fps=20, macro_block_size=16)
    np.savez(split / "ep0.npz", actions=actions)
    h = read_header(split / "ep0.mp4")
    assert (h.length, h.height, h.width, h.format, h.has_pose) == (T, H, W, "mp4", False)
    ep = load_episode(split / "ep0.mp4")
    assert ep.video.shape == (T, H, W, 3)
    assert np.abs(ep.video.astype(int) - video).mean() < 12  # lossy codec, but the same pictures
    ds = ClipDataset(split, n_frames=6, frame_skip=2)
    item = ds[3]
    assert item["video"].shape == (6, 3, H, W) and item["start"] == 3
    np.testing.assert_array_equal(item["actions"].numpy(), actions[3:14:2])
    # our own mp4 writer: same layout, near-lossless
    write_episode(tmp_path / "ours.mp4", video, actions, None)
    assert np.abs(load_episode(tmp_path / "ours.mp4").video.astype(int) - video).mean() < 3


# ------------------------------------------------------------------------------------------------
# bad input: every problem named, with the file
# ------------------------------------------------------------------------------------------------

def _bad_files(folder: Path) -> dict[str, str]:
    """Write one file per problem; returns {file name: words its error must contain}."""
    folder.mkdir(parents=True, exist_ok=True)
    video, actions, pose = make_arrays(T=12)
    good = write_episode(folder / "good.npz", video, actions, pose)
    data = good.read_bytes()
    (folder / "truncated.npz").write_bytes(data[: len(data) // 2])
    (folder / "text.npz").write_text("this is not an archive\n")
    (folder / "empty.npz").write_bytes(b"")
    np.savez(folder / "novideo.npz", actions=actions)
    np.savez(folder / "floatvideo.npz", video=video.astype(np.float32), actions=actions)
    np.savez(folder / "gray.npz", video=video[..., 0], actions=actions)
    np.savez(folder / "mismatch.npz", video=video, actions=actions[:-1])
    np.savez(folder / "floatactions.npz", video=video, actions=actions.astype(np.float32))
    np.savez(folder / "badpose.npz", video=video, actions=actions, pose=pose[:, :2])
    np.savez(folder / "negative.npz", video=video, actions=actions - 10)
    (folder / "orphan.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42")  # mp4 without its actions npz
    return {"truncated.npz": "truncated", "text.npz": "not an npz", "empty.npz": "empty",
            "novideo.npz": "missing key 'video'", "floatvideo.npz": "dtype float32, expected uint8",
            "gray.npz": "expected (T, H, W, 3)", "mismatch.npz": "length mismatch",
            "floatactions.npz": "'actions' has dtype float32", "badpose.npz": "'pose' has shape (12, 2)",
            "negative.npz": "negative", "orphan.mp4": "missing its actions file orphan.npz"}


def test_each_bad_file_raises_episode_error_naming_it(tmp_path):
    expected = _bad_files(tmp_path)
    for name, words in expected.items():
        for fn in (read_header, load_episode):
            with pytest.raises(EpisodeError) as err:
                fn(tmp_path / name)
            assert str(err.value).startswith(str(tmp_path / name)), str(err.value)
            assert words in str(err.value), str(err.value)
    with pytest.raises(EpisodeError, match="does not exist"):
        read_header(tmp_path / "absent.npz")
    with pytest.raises(EpisodeError, match="cannot write"):
        write_episode(tmp_path / "x.npz", np.zeros((3, 4, 4, 3), np.float32), np.zeros(3, int))
    assert not (tmp_path / "x.npz").exists()


def test_corrupt_video_bytes_fail_on_read_with_file_name(tmp_path):
    """A flipped byte inside compressed video data passes the cheap header check but not the read."""
    video, actions, _ = make_arrays(T=40, H=32, W=32)
    path = write_episode(tmp_path / "ep.npz", video, actions)
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo("video.npy")
    raw = bytearray(path.read_bytes())
    middle = info.header_offset + 60 + info.compress_size // 2
    raw[middle : middle + 8] = b"\xff" * 8
    path.write_bytes(bytes(raw))
    read_header(path)  # directory and .npy header intact
    with pytest.raises(EpisodeError, match=str(path)):
        load_episode(path)


def test_folder_reports_all_bad_files_at_once_or_skips_them(tmp_path):
    expected = _bad_files(tmp_path / "split")
    with pytest.raises(DatasetError) as err:
        ClipDataset(tmp_path / "split", n_frames=4)
    message = str(err.value)
    assert f"{len(expected)} of {len(expected) + 1} episode files are bad" in message
    for name in expected:
        assert name in message
    with pytest.warns(UserWarning, match=f"skipping {len(expected)} of {len(expected) + 1}"):
        ds = ClipDataset(tmp_path / "split", n_frames=4, skip_bad=True)
    assert [Path(p).name for p in ds.episodes] == ["good.npz"] and len(ds) == 12 - 4 + 1


def test_folder_errors(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        ClipDataset(tmp_path / "nowhere", n_frames=4)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="no episodes"):
        ClipDataset(tmp_path / "empty", n_frames=4)
    for i, T in enumerate((10, 14)):
        write_episode(tmp_path / "short" / f"{i}.npz", *make_arrays(T=T))
    with pytest.raises(DatasetError, match=r"spans 15 frames, longer than every episode \(longest: 14"):
        ClipDataset(tmp_path / "short", n_frames=8, frame_skip=2)
    write_episode(tmp_path / "sizes" / "a.npz", *make_arrays(H=16, W=16))
    write_episode(tmp_path / "sizes" / "b.npz", *make_arrays(H=8, W=8))
    with pytest.raises(DatasetError, match="different frame sizes"):
        ClipDataset(tmp_path / "sizes", n_frames=4)
    assert ClipDataset(tmp_path / "sizes", n_frames=4, resize=12)[0]["video"].shape == (4, 3, 12, 12)


# ------------------------------------------------------------------------------------------------
# dataset.py
# ------------------------------------------------------------------------------------------------

@pytest.fixture
def split(tmp_path):
    """Three episodes of lengths 20, 9 (too short for most clips) and 31."""
    raws = []
    for i, T in enumerate((20, 9, 31)):
        video, actions, pose = make_arrays(T=T, seed=i)
        write_episode(tmp_path / "training" / f"ep_{i:06d}.npz", video, actions, pose, compress=bool(i % 2))
        raws.append((video, actions, pose))
    return tmp_path / "training", raws


@pytest.mark.parametrize("n_frames,skip", [(5, 1), (4, 3), (1, 1)])
def test_random_start_clips_equal_hand_sliced_arrays(split, n_frames, skip):
    folder, raws = split
    ds = ClipDataset(folder, n_frames=n_frames, frame_skip=skip)
    span = (n_frames - 1) * skip + 1
    assert len(ds) == sum(max(len(v) - span + 1, 0) for v, _, _ in raws)
    seen = set()
    for i in range(len(ds)):
        item = ds[i]
        e, s = item["episode"], item["start"]
        video, actions, pose = raws[e]
        assert 0 <= s and s + span <= len(video)
        assert item["video"].dtype == torch.float32 and item["video"].shape == (n_frames, 3, 16, 16)
        assert -1.0 <= item["video"].min() and item["video"].max() <= 1.0
        torch.testing.assert_close(item["video"], to_clip(video[s : s + span : skip]), rtol=0, atol=1e-6)
        np.testing.assert_array_equal(item["actions"].numpy(), actions[s : s + span : skip])
        np.testing.assert_array_equal(item["pose"].numpy(), pose[s : s + span : skip])
        seen.add((e, s))
    assert len(seen) == len(ds)  # every (episode, start) exactly once


def test_sequential_clips_are_consecutive_and_non_overlapping(split):
    folder, raws = split
    ds = ClipDataset(folder, n_frames=4, frame_skip=2, random_start=False)  # span 7
    assert len(ds) == 20 // 7 + 9 // 7 + 31 // 7
    locs = [ds.locate(i) for i in range(len(ds))]
    assert locs[:3] == [(0, 0), (0, 7), (1, 0)] and locs[-1] == (2, 21)
    item = ds[len(ds) - 1]
    torch.testing.assert_close(item["video"], to_clip(raws[2][0][21:28:2]), rtol=0, atol=1e-6)
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_items_are_deterministic_and_batch(split):
    folder, _ = split
    a, b = ClipDataset(folder, n_frames=6), ClipDataset(folder, n_frames=6)
    for i in (0, 7, len(a) - 1):
        torch.testing.assert_close(a[i]["video"], b[i]["video"], rtol=0, atol=0)
    loader = torch.utils.data.DataLoader(a, batch_size=4, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    batch = next(iter(loader))
    assert batch["video"].shape == (4, 6, 3, 16, 16) and batch["actions"].shape == (4, 6)
    assert batch["pose"].shape == (4, 6, 3)


def test_resize_is_antialiased_and_in_range(split, tmp_path):
    folder, _ = split
    item = ClipDataset(folder, n_frames=3, resize=8)[0]
    assert item["video"].shape == (3, 3, 8, 8)
    assert -1.0 <= item["video"].min() and item["video"].max() <= 1.0
    # Stripes +1 -1 -1 +1 (period 4) shrunk 16 -> 4: plain sampling at 4i+1.5 aliases to -1 everywhere;
    # the antialiased triangle filter (weights 1,3,5,7,7,5,3,1 / 32 over 8 pixels) gives exactly 0 inside.
    stripes = np.tile(np.array([255, 0, 0, 255], np.uint8), 4)  # (16,)
    video = np.broadcast_to(stripes[None, None, :, None], (5, 16, 16, 3)).copy()
    write_episode(tmp_path / "stripes" / "s.npz", video, np.zeros(5, np.int64))
    small = ClipDataset(tmp_path / "stripes", n_frames=2, resize=4)[0]["video"]  # (2, 3, 4, 4)
    torch.testing.assert_close(small[..., 1:3], torch.zeros(2, 3, 4, 2), rtol=0, atol=1e-5)
    assert small.abs().max() < 0.5


def test_index_is_cached_and_refreshed_per_file(split, monkeypatch):
    folder, _ = split
    ClipDataset(folder, n_frames=4)
    index = json.loads((folder / dataset_mod.INDEX_FILE).read_text())
    assert sorted(index["episodes"]) == ["ep_000000.npz", "ep_000001.npz", "ep_000002.npz"]
    scanned = []
    real = dataset_mod.read_header
    monkeypatch.setattr(dataset_mod, "read_header", lambda p: scanned.append(Path(p).name) or real(p))
    ds = ClipDataset(folder, n_frames=4)
    assert scanned == [] and ds.index_persisted  # unchanged folder: no file opened
    write_episode(folder / "ep_000001.npz", *make_arrays(T=40, seed=9))  # replaced by a longer episode
    ds = ClipDataset(folder, n_frames=4)
    assert scanned == ["ep_000001.npz"] and ds.lengths.tolist() == [20, 40, 31]


def test_read_only_folder_keeps_index_in_memory(split, monkeypatch):
    folder, _ = split

    def refuse(*args, **kwargs):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(dataset_mod, "atomic_write", refuse)
    ds = ClipDataset(folder, n_frames=4)
    assert not ds.index_persisted and len(ds) == 17 + 6 + 28
    assert not (folder / dataset_mod.INDEX_FILE).exists()


def test_index_of_many_episodes_uses_cumsum(tmp_path):
    """300 episodes of varied length: index arithmetic matches a brute-force enumeration."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 12, size=300)
    for i, T in enumerate(lengths):
        write_episode(tmp_path / f"{i:04d}.npz", np.zeros((T, 2, 2, 3), np.uint8), np.zeros(T, np.int64),
                      compress=False)
    ds = ClipDataset(tmp_path, n_frames=3, frame_skip=2)  # span 5
    brute = [(e, s) for e, T in enumerate(lengths) for s in range(T - 5 + 1)]
    assert len(ds) == len(brute)
    for i in rng.integers(0, len(ds), size=50):
        assert ds.locate(int(i)) == brute[i]


# ------------------------------------------------------------------------------------------------
# CLIs: one-line errors, non-zero exit
# ------------------------------------------------------------------------------------------------

def test_preview_writes_png_and_gif(split, tmp_path):
    folder, _ = split
    out = tmp_path / "look"
    assert preview_main([str(folder.parent), "--out", str(out), "--episodes", "2", "--gif-frames", "6"]) == 0
    from PIL import Image

    with Image.open(out / "preview.png") as png:
        assert png.size[0] > 200 and png.size[1] > 100
    with Image.open(out / "preview.gif") as gif:
        assert gif.n_frames == 6
        assert gif.size == (2 * (16 + 2) * 2, 16 * 2)  # two episodes side by side, scaled x2


def test_cli_user_errors_exit_nonzero_with_one_line(tmp_path, capsys):
    assert preview_main([str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'missing'}: folder does not exist"
    assert generate_main(["memory_maze", "--out", str(tmp_path / "o"), "--length", "5000"]) == 2
    assert "1001 frames" in capsys.readouterr().err
    assert generate_main(["crafter", "--out", str(tmp_path / "o"), "--episodes", "0"]) == 2
    assert "--episodes must be >= 1" in capsys.readouterr().err
    teco = tmp_path / "teco"
    write_episode(teco / "train" / "0.npz", *make_arrays())
    assert generate_main(["crafter", "--out", str(teco), "--episodes", "2"]) == 2
    assert "did not write" in capsys.readouterr().err
    with pytest.raises(GenerateError, match="--workers"):
        from data.generate import generate

        generate(tmp_path / "w", "crafter", 2, 10, workers=0)


def test_cli_subprocess_has_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "data.generate", "crafter", "--out", str(tmp_path),
                           "--episodes", "-3"], cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: --episodes must be >= 1, got -3"]


def test_storage_compression_is_not_part_of_a_data_sets_identity(tmp_path):
    """A folder written with or without npz compression (or before it was recorded) is the same data set;
    a different seed is not."""
    import json

    from data.generate import MANIFEST, GenerateError, GenerateSpec, _check_root

    spec = GenerateSpec("crafter", 4, 40, 16, 0, "revisit", True)
    (tmp_path / MANIFEST).write_text(json.dumps({"env": "crafter", "episodes": 4, "length": 40, "size": 16,
                                                 "seed": 0, "policy": "revisit"}))
    _check_root(tmp_path, spec)  # no error
    _check_root(tmp_path, GenerateSpec("crafter", 4, 40, 16, 0, "revisit", False))
    with pytest.raises(GenerateError, match="seed=0"):
        _check_root(tmp_path, GenerateSpec("crafter", 4, 40, 16, 1, "revisit", True))


def test_atomic_write_json_keeps_the_old_file_when_the_object_cannot_be_written(tmp_path):
    """The report writer every CLI uses: indented JSON and a newline; an object json cannot encode raises before the
    rename, so the previous file stays whole and no temp file is left."""
    import json

    from data.atomic import atomic_write_json

    path = atomic_write_json(tmp_path / "r.json", {"a": [1, 2]})
    assert path.read_text() == '{\n "a": [\n  1,\n  2\n ]\n}\n' and json.loads(path.read_text()) == {"a": [1, 2]}
    with pytest.raises(TypeError):
        atomic_write_json(path, {"a": object()})
    assert json.loads(path.read_text()) == {"a": [1, 2]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]
    assert json.loads(atomic_write_json(path, {"p": tmp_path}, default=str).read_text()) == {"p": str(tmp_path)}
