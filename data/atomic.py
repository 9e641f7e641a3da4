"""Atomic file writes, the one way every package of the project writes a file.

A file is written under a hidden temporary name in its own folder, flushed to disk, then renamed into
place: a reader (or a crash) sees either the old file, nothing, or the complete new one, never half of it.

    atomic_write(path, lambda tmp: np.savez(tmp, **arrays))
    atomic_write_text(path, text)
    atomic_write_json(path, result)          # indented JSON + newline
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: Path, writer, suffix: str = ".tmp") -> None:
    """Write via ``writer(tmp_path)`` to a hidden temp file in the same folder, fsync, then rename.

    The temp name starts with '.' (and by default ends with '.tmp'), so a concurrent folder scan never
    mistakes it for an episode; the rename is atomic, so readers see either nothing or the complete file.
    ``suffix`` is for writers that pick the format from the file name (ffmpeg: ``".mp4"``).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    os.close(fd)
    try:
        writer(Path(tmp))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual permissions
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically with `atomic_write`; parent folders are created."""
    path = Path(path)
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8", newline=""))
    return path


def atomic_write_json(path: str | os.PathLike, obj, indent: int | None = 1, default=None) -> Path:
    """``obj`` as JSON (``indent``, ``default`` as for ``json.dumps``) plus a newline, written with `atomic_write_text`:
    the one way a report, cache or plan reaches disk."""
    return atomic_write_text(path, json.dumps(obj, indent=indent, default=default) + "\n")
