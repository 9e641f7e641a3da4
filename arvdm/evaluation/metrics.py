"""Frame-level video metrics for long rollouts: PSNR, SSIM, LPIPS, FVD, span summaries and ``eval.json``.

The paper's *error accumulation* ("temporal degradation" in v2) is measured by conditioning on ground-truth
context frames, rolling out, and comparing every generated frame with the ground truth at the same index.
This module computes those per-frame numbers, summarises them over spans of frames (0-16, 16-32, ...),
reduces them to the *max PSNR decay* (first span minus worst span), and writes ``metrics.csv`` (per frame
index). A whole rollout's evaluation and its ``eval.json`` live in ``arvdm.evaluation.evaluate``.

Conventions: videos are ``(B, T, C, H, W)`` float tensors in [-1, 1] (the package-wide convention), so the
data range of PSNR and SSIM is 2.0. Frame index 0 of every per-frame result is the first *generated* frame.

Nothing here downloads anything: LPIPS needs a backbone weights file and FVD an I3D TorchScript file,
both named by path by the user.
"""

from __future__ import annotations

import csv
import io
import math
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from data.atomic import atomic_write_text

__all__ = [
    "PSNR_CAP",
    "check_videos",
    "frechet_distance",
    "fvd",
    "gaussian_stats",
    "i3d_features",
    "lpips_per_frame",
    "max_psnr_decay",
    "per_frame_table",
    "psnr_per_frame",
    "span_label",
    "spatial_gradient_per_frame",
    "ssim_per_frame",
    "summarise_by_span",
    "write_metrics_csv",
]

# Frames per torchmetrics call: bounds the memory of SSIM's five filtered maps on long rollouts.
_FRAMES_PER_CALL = 256
#: Side of SSIM's Gaussian window: frames must be at least this large in both directions.
SSIM_WINDOW = 11


# --------------------------------------------------------------------------------------------------------
# PSNR / SSIM / LPIPS per frame
# --------------------------------------------------------------------------------------------------------


def check_videos(fake: Tensor, real: Tensor, name: str = "videos") -> None:
    """Raise a clear error unless ``fake`` and ``real`` are same-shaped float ``(B, T, C, H, W)`` tensors."""
    for label, x in (("fake", fake), ("real", real)):
        if not isinstance(x, Tensor):
            raise TypeError(f"{name}: {label} must be a torch.Tensor, got {type(x).__name__}")
        if x.ndim != 5:
            raise ValueError(f"{name}: {label} must be (B, T, C, H, W), got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"{name}: {label} must be a float tensor in [-1, 1], got dtype {x.dtype}")
    if fake.shape != real.shape:
        raise ValueError(f"{name}: fake {tuple(fake.shape)} and real {tuple(real.shape)} differ in shape")


def _frames(x: Tensor) -> Tensor:
    """(B, T, C, H, W) -> (B*T, C, H, W) float32, clamped to [-1, 1].

    Clamping: a sampler can overshoot [-1, 1] slightly; the metrics' constants (data range 2, SSIM's C1/C2)
    assume that range, and a saved video would be clipped to it anyway.
    """
    b, t = x.shape[:2]
    return x.reshape(b * t, *x.shape[2:]).float().clamp(-1.0, 1.0)


#: Where a summary that averages or compares PSNRs clips per-frame PSNR (dB): an identical frame (copy-last
#: while the agent stands still) has PSNR inf, which would make every mean and difference it enters infinite.
PSNR_CAP = 60.0


def psnr_per_frame(fake: Tensor, real: Tensor, data_range: float = 2.0) -> Tensor:
    """Peak signal-to-noise ratio of every frame, in dB: ``10 * log10(data_range**2 / MSE)``.

    Args:
        fake: generated video (B, T, C, H, W) in [-1, 1].
        real: ground truth of the same shape.
        data_range: max - min of the pixel range; 2.0 for [-1, 1] (equal to PSNR of [0, 1] images with
            range 1.0, i.e. the usual convention).
    Returns:
        (B, T) float32. Identical frames give ``inf`` (MSE = 0); span summaries keep that visible rather
        than inventing a cap (eval.json writes it as null); what averages or compares PSNRs across episodes
        (first-frames verdict, hold-up, revisit scores) clips at ``PSNR_CAP`` first.
    """
    # lazy: torchmetrics takes seconds to import, and a module that only reads eval.json needs none of it
    from torchmetrics.functional.image import peak_signal_noise_ratio

    check_videos(fake, real, "psnr_per_frame")
    b, t = fake.shape[:2]
    f, r = _frames(fake), _frames(real)  # (B*T, C, H, W)
    # dim=(1, 2, 3): MSE over C, H, W of each frame; reduction "none" keeps one value per frame.
    out = peak_signal_noise_ratio(f, r, data_range=data_range, reduction="none", dim=(1, 2, 3))
    return out.reshape(b, t)


def ssim_per_frame(fake: Tensor, real: Tensor, data_range: float = 2.0) -> Tensor:
    """Structural similarity of every frame (Wang et al. 2004, via torchmetrics).

    Gaussian window 11x11 with sigma 1.5, K1 = 0.01, K2 = 0.03, population (co)variances; the frame is
    reflect-padded by 5 pixels so the SSIM map covers every pixel, and the map is averaged over channels
    and pixels. (``skimage.metrics.structural_similarity(gaussian_weights=True, sigma=1.5,
    use_sample_covariance=False)`` crops that border instead, so values differ slightly at 64x64; compare
    SSIM numbers only within one implementation.) Frames must be at least 11x11.

    Args:
        fake, real: (B, T, C, H, W) in [-1, 1].
        data_range: 2.0 for [-1, 1].
    Returns:
        (B, T) float32 in [-1, 1]; 1 for identical frames.
    """
    # lazy: torchmetrics takes seconds to import (see psnr_per_frame)
    from torchmetrics.functional.image import structural_similarity_index_measure

    check_videos(fake, real, "ssim_per_frame")
    b, t, _, h, w = fake.shape
    if min(h, w) < SSIM_WINDOW:
        raise ValueError(f"ssim_per_frame: frames must be at least {SSIM_WINDOW}x{SSIM_WINDOW} (the SSIM window), "
                         f"got {h}x{w}")
    f, r = _frames(fake), _frames(real)  # (B*T, C, H, W)
    parts = [
        structural_similarity_index_measure(
            f[i : i + _FRAMES_PER_CALL], r[i : i + _FRAMES_PER_CALL], data_range=data_range, reduction="none"
        )
        for i in range(0, f.shape[0], _FRAMES_PER_CALL)
    ]
    return torch.cat(parts).reshape(b, t)


# Loaded LPIPS networks, keyed by (weights path, mtime, backbone) so repeated calls do not reload the file.
_LPIPS_CACHE: dict[tuple[str, float, str], torch.nn.Module] = {}


def _load_lpips(weights_path: str | os.PathLike | None, net_type: str) -> torch.nn.Module:
    """Build torchmetrics' LPIPS network with a backbone loaded from a local torchvision weights file."""
    if weights_path is None:
        raise ValueError(
            "lpips_per_frame needs weights_path: a local torchvision state dict of the LPIPS backbone "
            f"({net_type!r}; e.g. the file alexnet-owt-7be5be79.pth from a torch hub cache). "
            "arvdm never downloads weights."
        )
    path = Path(weights_path)
    if not path.is_file():
        raise FileNotFoundError(f"lpips_per_frame: backbone weights file not found: {path}")
    key = (str(path.resolve()), path.stat().st_mtime, net_type)
    if key in _LPIPS_CACHE:
        return _LPIPS_CACHE[key]

    # torchmetrics' private _LPIPS, not its public LearnedPerceptualImagePatchSimilarity: the public class
    # (and the functional form) always build the backbone with torchvision's ImageNet weights through
    # load_state_dict_from_url, which downloads unless torch.hub's cache holds a file of the name torchvision
    # picks, and takes no path. Feeding it a local file would mean redirecting torch.hub's folder for the
    # whole process, and a renamed file would then silently download. tests/test_metrics.py pins this use.
    from torchmetrics.functional.image.lpips import _LPIPS  # lazy: as in psnr_per_frame

    # pnet_rand=True: build the backbone without torchvision's ImageNet download; the LPIPS linear heads
    # (pretrained=True) ship inside torchmetrics. The real backbone weights come from the user's file below.
    net = _LPIPS(pretrained=True, net=net_type, pnet_rand=True)
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, Mapping):
        raise TypeError(f"lpips_per_frame: {path} does not hold a state dict (got {type(state).__name__})")
    # torchmetrics splits torchvision's `features` Sequential into slices that keep the layer indices as
    # child names (slice1.0, slice2.3, ... or slices.k.i for squeezenet): map features.i.* onto them.
    backbone = net.net
    containers = (
        [(f"slice{k}", getattr(backbone, f"slice{k}")) for k in range(1, 6)]
        if hasattr(backbone, "slice1")
        else [(f"slices.{k}", s) for k, s in enumerate(backbone.slices)]
    )
    index_to_prefix = {
        child: f"{cname}.{child}" for cname, c in containers for child, _ in c.named_children()
    }
    mapped = {}
    for k, v in state.items():
        k = k.removeprefix("features.")
        idx, _, rest = k.partition(".")
        if idx in index_to_prefix and rest:
            mapped[f"{index_to_prefix[idx]}.{rest}"] = v
    expected = set(backbone.state_dict())
    missing = sorted(expected - set(mapped))
    if missing:
        raise ValueError(
            f"lpips_per_frame: {path} does not match the {net_type!r} backbone (torchvision layout); "
            f"missing {len(missing)} tensors, e.g. {missing[:3]}"
        )
    try:
        backbone.load_state_dict(mapped, strict=True)
    except RuntimeError as e:
        raise ValueError(f"lpips_per_frame: {path} does not fit the {net_type!r} backbone: {e}") from None
    net.eval()
    _LPIPS_CACHE[key] = net
    return net


@torch.no_grad()
def lpips_per_frame(
    fake: Tensor, real: Tensor, weights_path: str | os.PathLike | None = None, net_type: str = "alex"
) -> Tensor:
    """LPIPS distance of every frame (lower = more similar; 0 for identical frames).

    Uses torchmetrics' LPIPS heads with a backbone whose weights the user supplies by path (a torchvision
    state dict of ``alexnet`` / ``vgg16`` / ``squeezenet1_1``, either the whole model or only its
    ``features``). Raises ``ValueError`` if no path is given and ``FileNotFoundError`` if it does not exist.
    Frames must have 3 channels.

    Returns:
        (B, T) float32.
    """
    check_videos(fake, real, "lpips_per_frame")
    b, t, c = fake.shape[:3]
    if c != 3:
        raise ValueError(f"lpips_per_frame: LPIPS needs RGB frames (C=3), got C={c}")
    net = _load_lpips(weights_path, net_type)
    f, r = _frames(fake), _frames(real)
    parts = [
        net(f[i : i + _FRAMES_PER_CALL], r[i : i + _FRAMES_PER_CALL]).reshape(-1)
        for i in range(0, f.shape[0], _FRAMES_PER_CALL)
    ]
    return torch.cat(parts).reshape(b, t).float()


# --------------------------------------------------------------------------------------------------------
# Span summaries
# --------------------------------------------------------------------------------------------------------


def spatial_gradient_per_frame(x: Tensor) -> Tensor:
    """Mean absolute spatial gradient of every frame: mean of |x[.., i, j+1] − x[.., i, j]| and
    |x[.., i+1, j] − x[.., i, j]| over pixels and channels. (B, T, C, H, W) -> (B, T) float32.

    Its ratio generated / real tells sharp frames (≈ 1) from noise (≫ 1) and blur (≪ 1).
    """
    if x.ndim != 5:
        raise ValueError(f"spatial_gradient_per_frame: expected (B, T, C, H, W), got {tuple(x.shape)}")
    x = x.float()
    dx = (x[..., :, 1:] - x[..., :, :-1]).abs().mean(dim=(2, 3, 4))  # (B, T)
    dy = (x[..., 1:, :] - x[..., :-1, :]).abs().mean(dim=(2, 3, 4))  # (B, T)
    return 0.5 * (dx + dy)


def span_label(start: int, end: float | None) -> str:
    """Human label of a span of frame indices [start, end): ``"0-16"``, or ``"112+"`` for an open end."""
    if end is None or (isinstance(end, float) and math.isinf(end)):
        return f"{start}+"
    return f"{start}-{int(end)}"


def summarise_by_span(per_frame: Tensor | Sequence[float], span: int = 16) -> list[dict[str, Any]]:
    """Mean of a per-frame metric over consecutive spans of ``span`` frames: [0, 16), [16, 32), ...

    Args:
        per_frame: (T,) or (B, T) values, frame index 0 = first generated frame. With a batch, the mean is
            over all B * (frames in span) values.
        span: frames per span (> 0). The last span may be shorter; its ``n`` says so.
    Returns:
        ``[{"start", "end", "label", "mean", "n"}, ...]`` with ``end`` exclusive and ``n`` the number of
        values averaged. NaN values (e.g. a metric that was not computed) are skipped and not counted;
        a span with none left has ``mean`` NaN and ``n`` 0.
    """
    if span <= 0:
        raise ValueError(f"summarise_by_span: span must be > 0, got {span}")
    x = torch.as_tensor(per_frame, dtype=torch.float64)
    if x.ndim == 1:
        x = x[None]  # (1, T)
    if x.ndim != 2:
        raise ValueError(f"summarise_by_span: expected (T,) or (B, T) values, got shape {tuple(x.shape)}")
    t = x.shape[1]
    out = []
    for start in range(0, t, span):
        end = min(start + span, t)
        chunk = x[:, start:end].reshape(-1)
        chunk = chunk[~torch.isnan(chunk)]
        n = int(chunk.numel())
        mean = float(chunk.mean()) if n else float("nan")
        out.append({"start": start, "end": end, "label": span_label(start, end), "mean": mean, "n": n})
    return out


def max_psnr_decay(psnr_by_span: Sequence[Mapping[str, Any]] | Sequence[float]) -> float:
    """First span's mean PSNR minus the worst span's: the paper's summary of error accumulation (dB).

    Accepts the output of ``summarise_by_span`` or a plain list of span means. 0.0 when there is a single
    span; a positive number means the rollout degrades. Spans with no values (NaN) are ignored except that
    a NaN first span makes the result NaN.
    """
    means = [float(s["mean"]) if isinstance(s, Mapping) else float(s) for s in psnr_by_span]
    if not means:
        raise ValueError("max_psnr_decay: no spans given")
    valid = [m for m in means if not math.isnan(m)]
    if math.isnan(means[0]) or not valid:
        return float("nan")
    return means[0] - min(valid)


# --------------------------------------------------------------------------------------------------------
# metrics.csv
# --------------------------------------------------------------------------------------------------------


def _batch_mean(x: Tensor | None, name: str, t: int) -> list[float] | None:
    """(B, T) or (T,) -> per-frame mean over the batch as a list of T floats."""
    if x is None:
        return None
    x = torch.as_tensor(x, dtype=torch.float64)
    if x.ndim == 1:
        x = x[None]
    if x.ndim != 2 or x.shape[1] != t:
        raise ValueError(f"per_frame_table: {name} must be (B, {t}) or ({t},), got {tuple(x.shape)}")
    return x.mean(0).tolist()


def per_frame_table(
    psnr: Tensor, ssim: Tensor, lpips: Tensor | None = None, frame_offset: int = 0,
    extra: Mapping[str, Tensor] | None = None,
) -> list[dict[str, Any]]:
    """Rows of ``metrics.csv``: one per frame index, the metrics averaged over the batch.

    Args:
        psnr, ssim: (B, T) or (T,) per-frame values (from ``psnr_per_frame`` / ``ssim_per_frame``).
        lpips: optional (B, T) values.
        frame_offset: added to the frame index (e.g. the number of context frames, to index the episode).
        extra: more (B, T) columns by name (e.g. ``psnr_copy_last``), written after the model's.
    Returns:
        ``[{"frame", "psnr", "ssim", ["lpips",] *extra, "n"}, ...]`` where ``n`` is the batch size behind
        each mean.
    """
    psnr_t = torch.as_tensor(psnr)
    t = psnr_t.shape[-1]
    n = psnr_t.shape[0] if psnr_t.ndim == 2 else 1
    cols = {"psnr": _batch_mean(psnr, "psnr", t), "ssim": _batch_mean(ssim, "ssim", t)}
    if lpips is not None:
        cols["lpips"] = _batch_mean(lpips, "lpips", t)
    for name, values in (extra or {}).items():
        cols[name] = _batch_mean(values, name, t)
    rows = []
    for i in range(t):
        row: dict[str, Any] = {"frame": i + frame_offset}
        row.update({k: v[i] for k, v in cols.items()})
        row["n"] = n
        rows.append(row)
    return rows


def write_metrics_csv(
    path: str | os.PathLike,
    psnr: Tensor,
    ssim: Tensor,
    lpips: Tensor | None = None,
    frame_offset: int = 0,
    extra: Mapping[str, Tensor] | None = None,
) -> Path:
    """Write ``per_frame_table(...)`` as CSV (header ``frame,psnr,ssim[,lpips][,extra...],n``) atomically."""
    rows = per_frame_table(psnr, ssim, lpips, frame_offset, extra)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]) if rows else ["frame", "psnr", "ssim", "n"])
    writer.writeheader()
    for row in rows:
        writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
    return atomic_write_text(path, buf.getvalue())


# --------------------------------------------------------------------------------------------------------
# FVD
# --------------------------------------------------------------------------------------------------------


def gaussian_stats(features: Tensor) -> tuple[Tensor, Tensor]:
    """Mean (D,) and covariance (D, D) of features (N, D), in float64 (unbiased, divisor N - 1)."""
    x = torch.as_tensor(features, dtype=torch.float64)
    if x.ndim != 2 or x.shape[0] < 2:
        raise ValueError(f"gaussian_stats: need features (N >= 2, D), got shape {tuple(x.shape)}")
    mu = x.mean(0)
    xc = x - mu
    return mu, xc.T @ xc / (x.shape[0] - 1)


def _sqrtm_psd(a: Tensor) -> Tensor:
    """Square root of a symmetric positive semi-definite matrix by eigendecomposition."""
    w, v = torch.linalg.eigh((a + a.T) / 2)
    return (v * w.clamp(min=0).sqrt()) @ v.T


def frechet_distance(mu1: Tensor, sigma1: Tensor, mu2: Tensor, sigma2: Tensor) -> float:
    """Fréchet distance between Gaussians N(mu1, sigma1) and N(mu2, sigma2).

    ``d² = |mu1 - mu2|² + tr(sigma1 + sigma2 - 2 (sigma1 sigma2)^(1/2))``.
    tr((sigma1 sigma2)^(1/2)) is computed as tr((S1^(1/2) sigma2 S1^(1/2))^(1/2)): the two matrices are
    similar, and the second is symmetric PSD, so an eigendecomposition gives it without the complex
    round-off of a general ``sqrtm`` (which FID code then has to discard).
    """
    mu1, mu2 = (torch.as_tensor(m, dtype=torch.float64) for m in (mu1, mu2))
    s1, s2 = (torch.as_tensor(s, dtype=torch.float64) for s in (sigma1, sigma2))
    if mu1.shape != mu2.shape or s1.shape != s2.shape or s1.shape != (mu1.numel(), mu1.numel()):
        raise ValueError(
            f"frechet_distance: shapes do not fit: mu {tuple(mu1.shape)}/{tuple(mu2.shape)}, "
            f"sigma {tuple(s1.shape)}/{tuple(s2.shape)}"
        )
    r1 = _sqrtm_psd(s1)
    inner = r1 @ s2 @ r1  # (D, D) symmetric PSD, same eigenvalues as s1 @ s2
    tr_sqrt = torch.linalg.eigvalsh((inner + inner.T) / 2).clamp(min=0).sqrt().sum()
    d2 = (mu1 - mu2).pow(2).sum() + torch.trace(s1) + torch.trace(s2) - 2 * tr_sqrt
    return float(d2)


@torch.no_grad()
def i3d_features(
    videos: Tensor,
    i3d: torch.nn.Module,
    size: int = 224,
    batch_size: int = 8,
    i3d_kwargs: Mapping[str, Any] | None = None,
) -> Tensor:
    """Features of videos (B, T, C, H, W) in [-1, 1] from an I3D network: (B, D) float64.

    Frames are resized to ``size`` x ``size`` (bilinear) and given as (B, 3, T, size, size) in [-1, 1], the
    input of the common TorchScript port of the Kinetics-400 I3D used for FVD; ``i3d_kwargs`` defaults to
    ``{"rescale": False, "resize": False, "return_features": True}`` for that port (pass ``{}`` for a module
    whose ``forward`` takes only the video). Grayscale videos are repeated to 3 channels.
    """
    if videos.ndim != 5:
        raise ValueError(f"i3d_features: videos must be (B, T, C, H, W), got {tuple(videos.shape)}")
    default_kwargs = {"rescale": False, "resize": False, "return_features": True}
    kwargs = default_kwargs if i3d_kwargs is None else dict(i3d_kwargs)
    device = next((p.device for p in i3d.parameters()), torch.device("cpu"))
    feats = []
    for i in range(0, videos.shape[0], batch_size):
        v = videos[i : i + batch_size].float().clamp(-1, 1)  # (b, T, C, H, W)
        b, t, c, h, w = v.shape
        if c == 1:
            v = v.expand(b, t, 3, h, w)
        x = F.interpolate(v.reshape(b * t, 3, h, w), size=(size, size), mode="bilinear", align_corners=False)
        x = x.reshape(b, t, 3, size, size).permute(0, 2, 1, 3, 4).contiguous()  # (b, 3, T, size, size)
        out = i3d(x.to(device), **kwargs)
        feats.append(out.reshape(b, -1).double().cpu())
    return torch.cat(feats)


def fvd(
    real: Tensor,
    fake: Tensor,
    i3d_path: str | os.PathLike | None,
    device: str | torch.device = "cpu",
    batch_size: int = 8,
    i3d_kwargs: Mapping[str, Any] | None = None,
) -> float:
    """Fréchet Video Distance between sets of videos, with a TorchScript I3D the user supplies by path.

    Args:
        real, fake: (N, T, C, H, W) in [-1, 1]; N >= 2 each (a covariance needs it; FVD is only meaningful
            with hundreds of videos). I3D needs roughly T >= 10 frames.
        i3d_path: a ``torch.jit`` file (e.g. the ``i3d_torchscript.pt`` used by StyleGAN-V / common FVD
            code). Never downloaded: ``ValueError`` if None, ``FileNotFoundError`` if missing. Loading a
            TorchScript file runs its code: use only files from a source you trust.
    Returns:
        FVD (the squared Fréchet distance of I3D features, as reported in papers).
    """
    if i3d_path is None:
        raise ValueError(
            "fvd needs i3d_path: a TorchScript Kinetics-400 I3D file (e.g. i3d_torchscript.pt). "
            "arvdm never downloads it; fetch it yourself and pass its path."
        )
    path = Path(i3d_path)
    if not path.is_file():
        raise FileNotFoundError(f"fvd: I3D TorchScript file not found: {path}")
    if real.ndim != 5 or fake.ndim != 5 or real.shape[1:] != fake.shape[1:]:
        raise ValueError(
            f"fvd: real {tuple(real.shape)} and fake {tuple(fake.shape)} must both be (N, T, C, H, W)"
        )
    with warnings.catch_warnings():
        # torch deprecates TorchScript, but the standard FVD I3D port only exists as a TorchScript file.
        warnings.filterwarnings("ignore", category=FutureWarning, message=".*torch.jit.*")
        i3d = torch.jit.load(str(path), map_location=device).eval()
    fr = i3d_features(real, i3d, batch_size=batch_size, i3d_kwargs=i3d_kwargs)
    ff = i3d_features(fake, i3d, batch_size=batch_size, i3d_kwargs=i3d_kwargs)
    return frechet_distance(*gaussian_stats(fr), *gaussian_stats(ff))
