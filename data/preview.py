"""Look at a data set: a contact-sheet PNG and a short animated GIF of a few episodes.

    python -m data.preview datasets/memory_maze            # writes datasets/memory_maze/preview.{png,gif}
    python -m data.preview datasets/memory_maze --out /tmp/look --episodes 6 --frames 10

DIR is a data set root (with training/ and validation/, or TECO's train/ and test/) or one split
folder. The contact sheet has one row per episode: evenly spaced frames (frame index on top) and, when
the episode has a pose, its top-down path coloured by time with the `revisit` excursions' return
points marked. The GIF plays the first frames of the episodes side by side.
"""

from __future__ import annotations

import argparse
import sys
import zipfile
from pathlib import Path

import numpy as np

from .atomic import atomic_write
from .dataset import DatasetError, list_episodes
from .episodes import load_episode
from .errors import DataError


def find_episodes(root, limit: int) -> list[Path]:
    """Up to `limit` episode files under `root`: from its split folders if it has them, else itself."""
    root = Path(root)
    if not root.is_dir():
        raise DatasetError(f"{root}: folder does not exist")
    splits = [root / s for s in ("training", "train", "validation", "test") if (root / s).is_dir()]
    found: list[Path] = []
    for folder in splits or [root]:
        found += list_episodes(folder)
    if not found:
        raise DatasetError(f"{root}: no episodes (*.npz, or *.mp4 + *.npz) here or in training/ validation/")
    return found[:limit]


def _revisits(path: Path) -> np.ndarray:
    """The generators' (left, returned) frame pairs, if the file carries them; else empty (0, 2)."""
    try:
        with np.load(path if path.suffix == ".npz" else path.with_suffix(".npz")) as z:
            return np.asarray(z["revisits"]).reshape(-1, 2) if "revisits" in z.files else np.zeros((0, 2), int)
    except (OSError, ValueError, KeyError, zipfile.BadZipFile):
        return np.zeros((0, 2), int)


def contact_sheet(paths: list[Path], out: Path, n_frames: int = 8) -> Path:
    """Rows = episodes, columns = evenly spaced frames (+ a pose plot when present); PNG at `out`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    episodes = [load_episode(p) for p in paths]
    with_pose = any(ep.pose is not None for ep in episodes)
    cols = n_frames + int(with_pose)
    fig, axes = plt.subplots(len(episodes), cols, figsize=(1.3 * cols, 1.45 * len(episodes)), squeeze=False)
    for row, (ep, path) in enumerate(zip(episodes, paths)):
        idx = np.linspace(0, len(ep) - 1, n_frames).round().astype(int)
        for col, t in enumerate(idx):
            ax = axes[row, col]
            ax.imshow(ep.video[t], interpolation="nearest")
            ax.set_title(f"t={t}", fontsize=7, pad=2)
            ax.set_xticks([])
            ax.set_yticks([])
        axes[row, 0].set_ylabel(f"{path.name}\n{len(ep)} frames", fontsize=7)
        if with_pose:
            ax = axes[row, -1]
            if ep.pose is not None:
                ax.scatter(ep.pose[:, 0], ep.pose[:, 1], c=np.arange(len(ep)), cmap="viridis", s=3)
                for _left, back in _revisits(path):
                    ax.plot(*ep.pose[back, :2], marker="x", color="red", markersize=5)
                ax.set_aspect("equal", adjustable="datalim")
                ax.set_title("path (x = return)", fontsize=7, pad=2)
            ax.tick_params(labelsize=5)
    fig.tight_layout()
    atomic_write(out, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    plt.close(fig)
    return out


def animation(paths: list[Path], out: Path, max_frames: int = 48, scale: int = 2) -> Path:
    """The first `max_frames` frames of each episode side by side, as a looping GIF at `out`."""
    from PIL import Image

    videos = [load_episode(p).video for p in paths]
    height = max(v.shape[1] for v in videos)
    n = min(max_frames, min(len(v) for v in videos))
    tiles = []
    for v in videos:  # pad to a common height, 2-pixel gap between episodes
        pad = np.zeros((n, height, v.shape[2] + 2, 3), np.uint8)
        pad[:, : v.shape[1], : v.shape[2]] = v[:n]
        tiles.append(pad)
    strip = np.concatenate(tiles, axis=2).repeat(scale, axis=1).repeat(scale, axis=2)  # (n, H', W', 3)
    images = [Image.fromarray(frame) for frame in strip]

    def write(tmp: Path) -> None:
        images[0].save(tmp, format="GIF", save_all=True, append_images=images[1:], duration=100, loop=0)

    atomic_write(out, write)
    return out


def preview(root, out: str | None = None, episodes: int = 4, frames: int = 8,
            gif_frames: int = 48) -> tuple[Path, Path]:
    """Write OUT/preview.png and OUT/preview.gif for the first `episodes` episodes under `root`."""
    for flag, value in (("--episodes", episodes), ("--frames", frames), ("--gif-frames", gif_frames)):
        if value < 1:
            raise DatasetError(f"{flag} must be >= 1, got {value}")
    paths = find_episodes(root, episodes)
    out_dir = Path(out) if out else Path(root)
    if out_dir.exists() and not out_dir.is_dir():
        raise DatasetError(f"--out {out_dir} exists and is not a folder")
    out_dir.mkdir(parents=True, exist_ok=True)
    return (contact_sheet(paths, out_dir / "preview.png", frames),
            animation(paths, out_dir / "preview.gif", gif_frames))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m data.preview",
                                     description="Contact sheet (PNG) and animation (GIF) of a few episodes.")
    parser.add_argument("dir", help="data set root (with training/ validation/) or a split folder")
    parser.add_argument("--out", default=None, help="output folder (default: DIR)")
    parser.add_argument("--episodes", type=int, default=4, help="episodes to show (default 4)")
    parser.add_argument("--frames", type=int, default=8, help="frames per contact-sheet row (default 8)")
    parser.add_argument("--gif-frames", type=int, default=48, help="frames in the GIF (default 48)")
    args = parser.parse_args(argv)
    try:
        png, gif = preview(args.dir, args.out, args.episodes, args.frames, args.gif_frames)
    except (DataError, OSError) as e:  # the data package's user errors; OSError: e.g. --out not writable
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {png}\nwrote {gif}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
