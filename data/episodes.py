"""Episode files: the on-disk format, cheap header checks, full loads and atomic writes.

Two layouts, both TECO's, so real data drops in without conversion:

* DMLab-style: one ``NAME.npz`` per episode holding ``video`` uint8 (T, H, W, 3), ``actions`` int (T,)
  and optionally ``pose`` float (T, 3) = (x, y, heading in radians).
* Minecraft-style: ``NAME.mp4`` (the frames) + ``NAME.npz`` holding ``actions`` (and optionally ``pose``).

Action convention of the generators in this package: ``actions[t]`` is the action that led from frame
t-1 to frame t, and ``actions[0]`` is 0 (no-op; nothing happened before the first frame).

``read_header`` checks a file without decoding its video (zip directory + the ``.npy`` headers for npz,
the MP4 sample table for mp4), so a folder of 40,000 episodes can be indexed in seconds. Every problem
is raised as ``EpisodeError`` whose message starts with the file's path.
"""

from __future__ import annotations

import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from .atomic import atomic_write
from .errors import DataError

EPISODE_SUFFIXES = (".npz", ".mp4")
_ZIP_MAGIC = b"PK\x03\x04"
_ZIP_EPOCH = (1980, 1, 1, 0, 0, 0)  # fixed member timestamps: same arrays -> same bytes


class EpisodeError(DataError):
    """An episode file is missing, truncated, not an npz/mp4, or holds arrays of the wrong key/dtype/shape."""

    def __init__(self, path, problem: str):
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


@dataclass
class Episode:
    """One episode in memory. T frames; ``pose`` is (x, y, heading radians) per frame, or None."""

    video: np.ndarray  # (T, H, W, 3) uint8
    actions: np.ndarray  # (T,) int64
    pose: np.ndarray | None  # (T, 3) float32 or None
    path: str | None = None

    def __len__(self) -> int:
        return int(self.video.shape[0])


@dataclass
class EpisodeHeader:
    """What ``read_header`` learns about an episode without decoding its video."""

    path: str
    length: int  # T
    height: int
    width: int
    has_pose: bool
    max_action: int  # largest action id (-1 for an empty episode); lets a loader check num_actions
    format: str  # "npz" or "mp4"


# ------------------------------------------------------------------------------------------------
# npz internals: members, .npy headers, deterministic writing
# ------------------------------------------------------------------------------------------------

@dataclass
class _NpyMember:
    """Where one array lives inside an npz, read from the zip directory and the .npy header only."""

    name: str
    shape: tuple
    dtype: np.dtype
    fortran_order: bool
    compressed: bool
    data_offset: int | None  # absolute file offset of the raw array bytes (stored members only)


def _open_zip(path: Path) -> zipfile.ZipFile:
    """Open an npz's zip directory, turning every failure into a precise EpisodeError."""
    if not path.exists():
        raise EpisodeError(path, "file does not exist")
    size = path.stat().st_size
    if size == 0:
        raise EpisodeError(path, "file is empty (0 bytes)")
    with open(path, "rb") as f:
        magic = f.read(4)
    try:
        return zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        if magic == _ZIP_MAGIC:
            # Starts like a zip but the central directory (written last) is gone: cut short on copy/write.
            raise EpisodeError(path, f"truncated or corrupt npz ({size} bytes; zip directory unreadable: {e})")
        raise EpisodeError(path, "not an npz file (no zip signature; expected a numpy .npz archive)")


def _read_npy_header(fileobj: BinaryIO, path: Path, member: str) -> tuple:
    try:
        version = np.lib.format.read_magic(fileobj)
        if version == (1, 0):
            return np.lib.format.read_array_header_1_0(fileobj)
        return np.lib.format.read_array_header_2_0(fileobj)
    except (ValueError, EOFError, zlib.error, zipfile.BadZipFile, OSError) as e:
        raise EpisodeError(path, f"member {member!r} is not a valid .npy array ({e})")


def _npz_members(path: Path, zf: zipfile.ZipFile) -> dict[str, _NpyMember]:
    """Read every member's .npy header (decompressing only its first bytes), check sizes add up."""
    members = {}
    for info in zf.infolist():
        if not info.filename.endswith(".npy"):
            continue
        key = info.filename[: -len(".npy")]
        try:
            with zf.open(info) as f:
                shape, fortran, dtype = _read_npy_header(f, path, key)
                header_len = f.tell()
        except (zipfile.BadZipFile, zlib.error, OSError, EOFError) as e:
            raise EpisodeError(path, f"member {key!r} is unreadable (truncated or corrupt: {e})")
        if dtype.hasobject:
            raise EpisodeError(path, f"{key!r} holds Python objects (dtype {dtype}); refusing to unpickle")
        expected = header_len + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if info.file_size != expected:
            raise EpisodeError(path, f"{key!r} is truncated: header says shape {shape} {dtype} "
                                     f"({expected} bytes) but the member holds {info.file_size} bytes")
        data_offset = None
        compressed = info.compress_type != zipfile.ZIP_STORED
        if not compressed:
            # Local file header: 30 fixed bytes, then name and extra field (lengths at bytes 26..29).
            with open(path, "rb") as raw:
                raw.seek(info.header_offset)
                local = raw.read(30)
            if len(local) < 30 or local[:4] != _ZIP_MAGIC:
                raise EpisodeError(path, f"member {key!r} has a corrupt local zip header")
            name_len, extra_len = struct.unpack("<HH", local[26:30])
            data_offset = info.header_offset + 30 + name_len + extra_len + header_len
        members[key] = _NpyMember(key, tuple(shape), dtype, fortran, compressed, data_offset)
    return members


def _write_npz(path: Path, arrays: dict[str, np.ndarray], compress: bool) -> None:
    """np.savez(_compressed) with fixed member timestamps, so identical arrays give identical bytes."""
    method = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
    with zipfile.ZipFile(path, "w", compression=method, allowZip64=True) as zf:
        for key, arr in arrays.items():
            info = zipfile.ZipInfo(f"{key}.npy", date_time=_ZIP_EPOCH)
            info.compress_type = method
            info.external_attr = 0o644 << 16
            with zf.open(info, "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.ascontiguousarray(arr), allow_pickle=False)


# ------------------------------------------------------------------------------------------------
# mp4 internals: frame count and size from the container (PyAV), decoding through imageio-ffmpeg
# ------------------------------------------------------------------------------------------------


def _mp4_count_frames(path: Path) -> tuple[int, int, int]:
    """(frames, height, width) of an mp4's first video stream, without decoding a frame.

    PyAV reads the count from the container's sample table (``stream.frames``); when the container does
    not state it (0), the stream's packets are counted instead (demuxing only, still no decoding).
    """
    import av

    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise EpisodeError(path, "not a readable video (no video stream)")
            stream = container.streams.video[0]
            n = stream.frames or sum(1 for packet in container.demux(stream) if packet.size)
            return int(n), int(stream.codec_context.height), int(stream.codec_context.width)
    except av.FFmpegError as e:  # not an mp4, truncated, unknown codec, ...
        raise EpisodeError(path, f"not a readable video ({type(e).__name__}: {e})") from None


def _mp4_read_frames(path: Path, start: int, stop: int) -> np.ndarray:
    """Decode frames [start, stop) of an mp4 -> (stop-start, H, W, 3) uint8."""
    import imageio.v2 as iio

    frames = []
    try:
        with iio.get_reader(str(path), "ffmpeg") as reader:
            for i, frame in enumerate(reader):
                if i >= stop:
                    break
                if i >= start:
                    frames.append(np.asarray(frame)[..., :3])
    except Exception as e:  # noqa: BLE001 -- as above: any decoder failure is a bad file
        raise EpisodeError(path, f"video decode failed ({type(e).__name__}: {e})")
    if len(frames) != stop - start:
        raise EpisodeError(path, f"video ended after {start + len(frames)} frames; needed frames "
                                 f"{start}..{stop - 1} (file truncated or header frame count wrong)")
    return np.stack(frames)


def _companion_npz(mp4: Path) -> Path:
    return mp4.with_suffix(".npz")


# ------------------------------------------------------------------------------------------------
# public API
# ------------------------------------------------------------------------------------------------

def _check_arrays_meta(path: Path, members: dict[str, _NpyMember], need_video: bool) -> None:
    """Key / dtype / shape / length checks shared by the npz and mp4+npz layouts (headers only)."""
    required = ("video", "actions") if need_video else ("actions",)
    for key in required:
        if key not in members:
            raise EpisodeError(path, f"missing key {key!r} (has: {sorted(members) or 'nothing'})")
    if need_video:
        v = members["video"]
        if v.dtype != np.uint8:
            raise EpisodeError(path, f"'video' has dtype {v.dtype}, expected uint8")
        if len(v.shape) != 4 or v.shape[-1] != 3:
            raise EpisodeError(path, f"'video' has shape {v.shape}, expected (T, H, W, 3)")
    a = members["actions"]
    if not np.issubdtype(a.dtype, np.integer):
        raise EpisodeError(path, f"'actions' has dtype {a.dtype}, expected an integer type")
    if len(a.shape) != 1:
        raise EpisodeError(path, f"'actions' has shape {a.shape}, expected (T,)")
    if "pose" in members:
        p = members["pose"]
        if not np.issubdtype(p.dtype, np.floating):
            raise EpisodeError(path, f"'pose' has dtype {p.dtype}, expected a float type")
        if len(p.shape) != 2 or p.shape[1] != 3 or p.shape[0] != a.shape[0]:
            raise EpisodeError(path, f"'pose' has shape {p.shape}, expected ({a.shape[0]}, 3) = (x, y, heading)")


def _check_actions_values(path: Path, actions: np.ndarray) -> int:
    if actions.size and actions.min() < 0:
        raise EpisodeError(path, f"'actions' has negative values (min {int(actions.min())})")
    return int(actions.max()) if actions.size else -1


def _load_small(path: Path, zf: zipfile.ZipFile, key: str) -> np.ndarray:
    try:
        with zf.open(f"{key}.npy") as f:
            return np.lib.format.read_array(f, allow_pickle=False)
    except (zipfile.BadZipFile, zlib.error, ValueError, OSError, EOFError) as e:
        raise EpisodeError(path, f"{key!r} is unreadable (truncated or corrupt: {e})")


def _check_not_empty(path: Path, n_frames: int) -> None:
    # A 0-frame episode is well-formed arrays but no data: every reader (clips, previews) needs >= 1 frame.
    if n_frames < 1:
        raise EpisodeError(path, "episode is empty (0 frames); remove the file or regenerate it")


def read_header(path) -> EpisodeHeader:
    """Check one episode cheaply (no video decode) and return its length, frame size and whether it has pose.

    npz: zip directory + .npy headers (shape/dtype/size) + the small actions array.
    mp4: the same-stem .npz (actions, pose) + the MP4 sample table for frame count and size.
    Raises EpisodeError naming the file and the problem.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".npz":
        with _open_zip(path) as zf:
            members = _npz_members(path, zf)
            _check_arrays_meta(path, members, need_video=True)
            v, a = members["video"], members["actions"]
            if v.shape[0] != a.shape[0]:
                raise EpisodeError(path, f"length mismatch: 'video' has {v.shape[0]} frames but "
                                         f"'actions' has {a.shape[0]} entries")
            max_action = _check_actions_values(path, _load_small(path, zf, "actions"))
        _check_not_empty(path, v.shape[0])
        return EpisodeHeader(str(path), v.shape[0], v.shape[1], v.shape[2], "pose" in members, max_action, "npz")
    if suffix == ".mp4":
        if not path.exists():
            raise EpisodeError(path, "file does not exist")
        side = _companion_npz(path)
        if not side.exists():
            raise EpisodeError(path, f"missing its actions file {side.name} (Minecraft layout: NAME.mp4 + NAME.npz)")
        with _open_zip(side) as zf:
            members = _npz_members(side, zf)
            _check_arrays_meta(side, members, need_video=False)
            max_action = _check_actions_values(side, _load_small(side, zf, "actions"))
        n_frames, height, width = _mp4_count_frames(path)
        n_actions = members["actions"].shape[0]
        if n_frames != n_actions:
            raise EpisodeError(path, f"length mismatch: video has {n_frames} frames but {side.name} "
                                     f"'actions' has {n_actions} entries")
        _check_not_empty(path, n_frames)
        return EpisodeHeader(str(path), n_frames, height, width, "pose" in members, max_action, "mp4")
    raise EpisodeError(path, f"unsupported episode file type {suffix!r} (expected .npz or .mp4)")


def read_frames(path, start: int, stop: int) -> np.ndarray:
    """Frames [start, stop) of an episode as (stop-start, H, W, 3) uint8, reading as little as possible.

    Stored (uncompressed) npz members are read with one seek; compressed ones are decompressed only up to
    ``stop``; mp4 is decoded up to ``stop``.
    """
    path = Path(path)
    if path.suffix.lower() == ".mp4":
        return _mp4_read_frames(path, start, stop)
    with _open_zip(path) as zf:
        members = _npz_members(path, zf)
        if "video" not in members:
            raise EpisodeError(path, f"missing key 'video' (has: {sorted(members)})")
        v = members["video"]
        if not 0 <= start <= stop <= v.shape[0]:
            raise EpisodeError(path, f"frames {start}..{stop - 1} requested but 'video' has {v.shape[0]} frames")
        frame_shape = v.shape[1:]
        frame_bytes = int(np.prod(frame_shape)) * v.dtype.itemsize
        n = stop - start
        if v.fortran_order:  # rare (np.save never writes it for C arrays); read whole, slice
            return np.ascontiguousarray(_load_small(path, zf, "video")[start:stop])
        try:
            if not v.compressed:
                with open(path, "rb") as f:
                    f.seek(v.data_offset + start * frame_bytes)
                    buf = f.read(n * frame_bytes)
            else:
                with zf.open("video.npy") as f:
                    _read_npy_header(f, path, "video")
                    f.seek(f.tell() + start * frame_bytes)  # decompresses forward, no full load
                    buf = f.read(n * frame_bytes)
        except (zipfile.BadZipFile, zlib.error, OSError, EOFError) as e:
            raise EpisodeError(path, f"'video' is unreadable (truncated or corrupt: {e})")
        if len(buf) != n * frame_bytes:
            raise EpisodeError(path, f"'video' is truncated: needed {n * frame_bytes} bytes at frame {start}, "
                                     f"got {len(buf)}")
        return np.frombuffer(buf, dtype=v.dtype).reshape((n,) + frame_shape)


def open_video_memmap(path) -> np.memmap | None:
    """A read-only memory map of an episode's ``video`` (T, H, W, 3) uint8, or None when it cannot be mapped.

    Only stored (uncompressed, ``write_episode(..., compress=False)`` / ``data.generate --no-compress``) npz
    members can be mapped: their bytes sit contiguously in the file. Slicing the map reads just those
    frames, through the OS page cache, with no zip parsing per read. Compressed members and mp4 give None.
    """
    path = Path(path)
    if path.suffix.lower() != ".npz":
        return None
    with _open_zip(path) as zf:
        v = _npz_members(path, zf).get("video")
    if v is None or v.compressed or v.fortran_order:
        return None
    return np.memmap(path, dtype=v.dtype, mode="r", offset=v.data_offset, shape=v.shape)


def read_actions_pose(path) -> tuple[np.ndarray, np.ndarray | None]:
    """The small arrays of an episode: actions (T,) int64 and pose (T, 3) float32 or None."""
    path = Path(path)
    side = _companion_npz(path) if path.suffix.lower() == ".mp4" else path
    with _open_zip(side) as zf:
        names = {n[: -len(".npy")] for n in zf.namelist() if n.endswith(".npy")}
        if "actions" not in names:
            raise EpisodeError(side, f"missing key 'actions' (has: {sorted(names)})")
        actions = _load_small(side, zf, "actions").astype(np.int64)
        pose = _load_small(side, zf, "pose").astype(np.float32) if "pose" in names else None
    return actions, pose


def read_extra(path, key: str) -> np.ndarray | None:
    """An extra array of an episode (e.g. the generators' ``revisits``, ``turns``, ``policy``), or None."""
    path = Path(path)
    side = _companion_npz(path) if path.suffix.lower() == ".mp4" else path
    with _open_zip(side) as zf:
        return _load_small(side, zf, key) if f"{key}.npy" in zf.namelist() else None


def read_turns(path) -> np.ndarray:
    """The [start, stop) frame ranges (J, 2) int64 of an episode's full turns on the spot (none: (0, 2))."""
    turns = read_extra(path, "turns")
    if turns is None:
        return np.zeros((0, 2), dtype=np.int64)
    if not np.issubdtype(turns.dtype, np.integer) or turns.ndim != 2 or turns.shape[1] != 2:
        raise EpisodeError(path, f"'turns' has dtype {turns.dtype} shape {turns.shape}, expected int (J, 2)")
    return turns.astype(np.int64)


def read_policy(path) -> str | None:
    """The name of the policy that generated an episode (its ``policy`` array), or None when not recorded."""
    policy = read_extra(path, "policy")
    if policy is None:
        return None
    if policy.dtype.kind != "U" or policy.size != 1:
        raise EpisodeError(path, f"'policy' has dtype {policy.dtype} shape {policy.shape}, expected one string (1,)")
    return str(policy.reshape(()))


def load_episode(path) -> Episode:
    """Load a whole episode (npz, or mp4 + same-stem npz), fully checked; raises EpisodeError."""
    header = read_header(path)
    video = read_frames(path, 0, header.length)
    actions, pose = read_actions_pose(path)
    return Episode(video=np.ascontiguousarray(video), actions=actions, pose=pose, path=str(path))


def _validate_for_write(path: Path, video, actions, pose):
    video = np.asarray(video)
    actions = np.asarray(actions)
    if video.dtype != np.uint8 or video.ndim != 4 or video.shape[-1] != 3:
        raise EpisodeError(path, f"cannot write: video must be uint8 (T, H, W, 3), got {video.dtype} {video.shape}")
    if not np.issubdtype(actions.dtype, np.integer) or actions.shape != (video.shape[0],):
        raise EpisodeError(path, f"cannot write: actions must be int ({video.shape[0]},), "
                                 f"got {actions.dtype} {actions.shape}")
    if pose is not None:
        pose = np.asarray(pose, dtype=np.float32)
        if pose.shape != (video.shape[0], 3):
            raise EpisodeError(path, f"cannot write: pose must be ({video.shape[0]}, 3), got {pose.shape}")
    return video, actions.astype(np.int64), pose


def write_episode(path, video, actions, pose=None, *, extra: dict | None = None, compress: bool = True) -> Path:
    """Write an episode atomically (temp file in the same folder, fsync, rename).

    ``path`` ending in .npz: DMLab layout (video, actions[, pose] in one file; ``compress`` picks deflate
    or stored members — stored ones are read back with a single seek). Identical arrays give identical
    bytes. ``path`` ending in .mp4: Minecraft layout, an H.264 video (near-lossless, crf 12) plus ``NAME.npz`` with
    actions[, pose]; the npz is renamed into place first and the mp4 last, so the mp4 marks completion.
    ``extra``: more named arrays stored in the npz (e.g. the generators' ``revisits``); loaders ignore them,
    ``read_extra`` reads one back.
    """
    path = Path(path)
    video, actions, pose = _validate_for_write(path, video, actions, pose)
    small = {"actions": actions} | ({"pose": pose} if pose is not None else {})
    for key, value in (extra or {}).items():
        if key in ("video", "actions", "pose"):
            raise EpisodeError(path, f"cannot write: extra array {key!r} clashes with a standard key")
        small[key] = np.asarray(value)
    if path.suffix.lower() == ".npz":
        atomic_write(path, lambda tmp: _write_npz(tmp, {"video": video} | small, compress))
    elif path.suffix.lower() == ".mp4":
        import imageio_ffmpeg

        def write_mp4(tmp: Path) -> None:
            # Near-lossless H.264 (crf 12, yuv444p keeps colour); "-f mp4" because the temp name ends in .tmp.
            height, width = video.shape[1:3]
            gen = imageio_ffmpeg.write_frames(str(tmp), (width, height), fps=10, codec="libx264",
                                              pix_fmt_out="yuv444p", macro_block_size=1,
                                              output_params=["-crf", "12", "-f", "mp4"])
            gen.send(None)  # start ffmpeg
            for frame in video:
                gen.send(np.ascontiguousarray(frame))
            gen.close()

        atomic_write(_companion_npz(path), lambda tmp: _write_npz(tmp, small, compress))
        atomic_write(path, write_mp4)
    else:
        raise EpisodeError(path, "cannot write: episode path must end in .npz or .mp4")
    return path
