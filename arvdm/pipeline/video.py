"""Video files: tensors in [-1, 1] to uint8 frames, side-by-side ground truth | generated, mp4/gif.

Every file is written through `data.atomic.atomic_write` (a temporary name in its folder, then a rename),
so a killed run never leaves a half-written video where a finished one is expected.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from data.atomic import atomic_write


def to_uint8(video: torch.Tensor) -> np.ndarray:
    """(..., T, C, H, W) float in [-1, 1] -> (..., T, H, W, C) uint8 (TECO's on-disk layout)."""
    x = ((video.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)  # (..., T, C, H, W)
    return x.movedim(-3, -1).cpu().numpy()  # (..., T, H, W, C)


def side_by_side(real: torch.Tensor, fake: torch.Tensor, scale: int = 2, gap: int = 2) -> np.ndarray:
    """Ground truth left, generated right, one episode per row: (B, T, C, H, W) x2 -> (T, H', W', 3) uint8."""
    if real.shape != fake.shape:
        raise ValueError(f"side_by_side: real {tuple(real.shape)} and fake {tuple(fake.shape)} differ")
    r, f = to_uint8(real), to_uint8(fake)  # (B, T, H, W, 3)
    b, t, h, w, c = r.shape
    canvas = np.full((t, b * (h + gap) - gap, 2 * w + gap, c), 255, np.uint8)  # white separators
    for i in range(b):
        y = i * (h + gap)
        canvas[:, y:y + h, :w] = r[i]
        canvas[:, y:y + h, w + gap:] = f[i]
    if scale > 1:  # nearest-neighbour upscaling keeps 64x64 frames readable in a player
        canvas = canvas.repeat(scale, axis=1).repeat(scale, axis=2)
    return canvas


def write_video(path: str | os.PathLike, frames: np.ndarray, fps: int = 8) -> Path:
    """Write (T, H, W, 3) uint8 frames as .mp4 (libx264 via imageio-ffmpeg) or .gif, atomically."""
    import imageio.v2 as imageio  # lazy: imageio (+ its ffmpeg plugin) is slow to import; only writers need it

    path = Path(path)

    def write(tmp: Path) -> None:
        if path.suffix == ".gif":
            imageio.mimsave(tmp, list(frames), duration=1000 / fps, loop=0)
            return
        # H.264 needs even sizes; macro_block_size=1 stops imageio from resizing behind our back
        t, h, w, c = frames.shape
        padded = np.pad(frames, ((0, 0), (0, h % 2), (0, w % 2), (0, 0)), constant_values=255)
        with imageio.get_writer(tmp, fps=fps, codec="libx264", macro_block_size=1, quality=8,
                                pixelformat="yuv420p") as writer:
            for frame in padded:
                writer.append_data(frame)

    atomic_write(path, write, suffix=path.suffix)  # imageio picks the format from the suffix
    return path


def filmstrip(real: torch.Tensor, fake: torch.Tensor, columns: int = 10, scale: int = 2, gap: int = 2,
              indices: list[int] | None = None) -> np.ndarray:
    """One picture of a rollout: for each episode a ground-truth row above a generated row, `columns` frames
    evenly spaced over time (or the frames `indices`). (B, T, C, H, W) x2 -> (H', W', 3) uint8."""
    if real.shape != fake.shape:
        raise ValueError(f"filmstrip: real {tuple(real.shape)} and fake {tuple(fake.shape)} differ")
    if indices is not None:
        idx = np.asarray([i for i in indices if 0 <= i < real.shape[1]], dtype=int)
    else:
        idx = np.linspace(0, real.shape[1] - 1, min(columns, real.shape[1])).round().astype(int)
    rows = [to_uint8(v)[idx] for pair in zip(real, fake) for v in pair]  # 2B x (n, H, W, 3)
    n, h, w, c = rows[0].shape
    canvas = np.full((len(rows) * (h + gap) - gap, n * (w + gap) - gap, c), 255, np.uint8)
    for r, frames in enumerate(rows):
        for j, frame in enumerate(frames):
            canvas[r * (h + gap):r * (h + gap) + h, j * (w + gap):j * (w + gap) + w] = frame
    return canvas.repeat(scale, axis=0).repeat(scale, axis=1) if scale > 1 else canvas


def write_image(path: str | os.PathLike, image: np.ndarray) -> Path:
    """Write an (H, W, 3) uint8 image (PNG by suffix), atomically."""
    import imageio.v2 as imageio  # lazy: slow to import; only writers need it

    path = Path(path)
    atomic_write(path, lambda tmp: imageio.imwrite(tmp, image), suffix=path.suffix)
    return path
