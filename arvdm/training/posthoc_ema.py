"""Post-hoc EMA (EDM2: Karras et al. 2024, Sec. 3): an EMA of any length, chosen after training, from the power-EMA
snapshots a run trained with `train.ema_posthoc` wrote (`arvdm.training.power_ema`).

Every snapshot is a known power profile p(τ) ∝ τ^γ on [0, t], so the EMA of any other (σ_rel, step) is, up to the
fit's residual, a linear combination of the snapshots: the coefficients solve the least-squares problem A x = b in
the profiles' L2 inner product (`profile_inner`, closed form), and the weights are Σ x_i θ̂_i. Two snapshot lengths
(EDM2 uses 0.05 and 0.10) reconstruct σ_rel from about 0.03 to 0.2; `posthoc.json` records the fit's relative
residual.

    python train.py --out runs/ph --set "train.ema_posthoc=[0.05,0.1]" --set train.ema_posthoc_every=35
    python -m arvdm.training.posthoc_ema runs/ph --sigma-rel 0.03 --out runs/ph_ema003   # a checkpoint folder
    python -m arvdm.training.posthoc_ema runs/ph --sigma-rel 0.03 0.05 0.19 --out "runs/ph_ema{sigma_rel}"  # a sweep
    python sample.py --run runs/ph_ema003 --frames 120 --eval
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from arvdm.errors import USER_ERRORS, ArvdmError
from arvdm.model.checkpoint import (
    CheckpointError,
    checkpoint_dir,
    checkpoint_step,
    list_checkpoints,
    resolve_checkpoint,
    write_folder_atomically,
)
from arvdm.training.power_ema import SIGMA_REL_MAX, SNAPSHOT_DIRNAME, gamma_of


def profile_inner(t_a: np.ndarray, g_a: np.ndarray, t_b: np.ndarray, g_b: np.ndarray) -> np.ndarray:
    """∫ p_a(τ) p_b(τ) dτ for normalised power profiles p(τ) = (γ+1) τ^γ / t^(γ+1) on [0, t] (broadcasting):
    (γa+1)(γb+1) min(ta,tb)^(γa+γb+1) / ((γa+γb+1) ta^(γa+1) tb^(γb+1)). Give t's in a common unit near 1."""
    m = np.minimum(t_a, t_b)
    return (g_a + 1) * (g_b + 1) * m ** (g_a + g_b + 1) / ((g_a + g_b + 1) * t_a ** (g_a + 1) * t_b ** (g_b + 1))


def solve_coefficients(steps: np.ndarray, gammas: np.ndarray, step: int, gamma: float) -> tuple[np.ndarray, float]:
    """Coefficients x (one per snapshot (steps[i], gammas[i])) whose combination of the snapshot profiles is
    nearest the target profile (step, gamma), and the fit's relative L2 residual |Σ x_i p_i − p| / |p|."""
    scale = float(step)  # the inner products scale together with t: x does not, and τ^γ stays in range
    t, g = np.asarray(steps, np.float64) / scale, np.asarray(gammas, np.float64)
    a = profile_inner(t[:, None], g[:, None], t[None, :], g[None, :])  # (n, n)
    b = profile_inner(t, g, np.float64(1.0), np.float64(gamma))  # (n,)
    x = np.linalg.lstsq(a, b, rcond=None)[0]
    pp = profile_inner(np.float64(1.0), np.float64(gamma), np.float64(1.0), np.float64(gamma))
    err2 = max(float(pp - 2 * x @ b + x @ a @ x), 0.0)
    return x, math.sqrt(err2 / pp)


@dataclass(frozen=True)
class Snapshot:
    path: Path
    sigma_rel: float
    gamma: float
    step: int


def list_snapshots(run_dir: str | Path) -> list[Snapshot]:
    """Every complete snapshot of a run (their metadata, not their names, say what they are), by step."""
    found = []
    for path in sorted((Path(run_dir) / SNAPSHOT_DIRNAME).glob("sigma_rel_*/step_*.safetensors")):
        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata() or {}
            found.append(Snapshot(path, float(meta["sigma_rel"]), float(meta["gamma"]), int(meta["step"])))
        except Exception as err:  # a truncated or foreign file: name it rather than reconstruct from it
            raise CheckpointError(f"{path}: not a readable power-EMA snapshot ({type(err).__name__}: {err})") from err
    return sorted(found, key=lambda s: (s.step, s.sigma_rel))


def reconstruct(run_dir: str | Path, sigma_rel: float, step: int | None = None
                ) -> tuple[dict[str, torch.Tensor], dict]:
    """The EMA of length `sigma_rel` at `step` (default: the newest snapshot's) from the run's snapshots at or
    before it: (state dict, fp32; info for posthoc.json: coefficients, residual, snapshots used)."""
    gamma = gamma_of(sigma_rel)
    snaps = list_snapshots(run_dir)
    if not snaps:
        raise CheckpointError(f"{run_dir} has no power-EMA snapshots in {SNAPSHOT_DIRNAME}/ (train it with "
                              f"--set train.ema_posthoc=[0.05,0.1] --set train.ema_posthoc_every=N)")
    step = snaps[-1].step if step is None else step
    used = [s for s in snaps if s.step <= step]
    if not any(s.step == step for s in used):
        raise CheckpointError(f"{run_dir}: no snapshot at step {step} (snapshot steps: "
                              f"{sorted({s.step for s in snaps})})")
    x, residual = solve_coefficients(np.array([s.step for s in used]), np.array([s.gamma for s in used]),
                                     step, gamma)
    out: dict[str, torch.Tensor] = {}
    for coef, snap in zip(x, used):
        with safe_open(str(snap.path), "pt") as f:
            for key in f.keys():
                t = f.get_tensor(key).double() * float(coef)
                out[key] = t if key not in out else out[key] + t
    info = {"sigma_rel": sigma_rel, "gamma": gamma, "step": step, "relative_residual": residual,
            "snapshots": [{"file": str(s.path), "sigma_rel": s.sigma_rel, "step": s.step, "coefficient": float(c)}
                          for s, c in zip(used, x)]}
    return {k: v.float() for k, v in out.items()}, info


def write_checkpoint(run_dir: str | Path, sigma_rel: float, out: str | Path, step: int | None = None) -> dict:
    """A checkpoint folder `out` for sample.py (`--run OUT`): the run's checkpoint at `step` (config, raw weights)
    with its EMA replaced by the reconstruction, and posthoc.json; written atomically. Returns the info."""
    gamma_of(sigma_rel)  # a length out of range is refused before any file is read
    snaps = list_snapshots(run_dir)
    step = snaps[-1].step if step is None and snaps else step
    ckpts = {checkpoint_step(c): c for c in list_checkpoints(run_dir)}
    if snaps and step not in ckpts:  # checked before the (slow) reconstruction
        raise CheckpointError(f"{run_dir}: no checkpoint at step {step} to take the config and raw weights "
                              f"from (checkpoints: {sorted(ckpts)}); pass --step one of those")
    weights, info = reconstruct(run_dir, sigma_rel, step)
    src = resolve_checkpoint(checkpoint_dir(run_dir, info["step"]))

    def fill(folder: Path) -> None:
        for name in ("config.json", "model.safetensors"):
            shutil.copy2(src / name, folder / name)
        save_file(weights, str(folder / "ema.safetensors"))
        (folder / "posthoc.json").write_text(json.dumps({**info, "from_checkpoint": str(src)}, indent=1))

    write_folder_atomically(out, fill)
    return info


def output_folders(out: str, sigma_rels: list[float]) -> list[Path]:
    """One folder per length: `out` itself for one, `out` with {sigma_rel} filled in for several (a sweep); every
    length and folder is checked here, before the first folder is written."""
    for s in sigma_rels:
        gamma_of(s)
    if len(sigma_rels) > 1 and "{sigma_rel}" not in out:
        raise ArvdmError(f"--out {out}: several --sigma-rel lengths need a {{sigma_rel}} in --out, e.g. "
                         f"runs/ph_ema{{sigma_rel}}")
    if len(set(sigma_rels)) != len(sigma_rels):
        raise ArvdmError(f"--sigma-rel {' '.join(map(str, sigma_rels))}: a length is given twice")
    folders = [Path(out.replace("{sigma_rel}", f"{s:g}")) for s in sigma_rels]
    for folder in folders:
        if folder.exists():
            raise ArvdmError(f"--out {folder} exists; choose a new folder")
    return folders


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m arvdm.training.posthoc_ema", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="a run folder trained with train.ema_posthoc")
    p.add_argument("--sigma-rel", type=float, nargs="+", required=True,
                   help=f"the EMA length(s) to build, each in (0, {SIGMA_REL_MAX}]")
    p.add_argument("--step", type=int, default=None, help="the training step (default: the newest snapshot's)")
    p.add_argument("--out", required=True, help="the checkpoint folder to write (sample.py --run OUT); with several "
                                                "lengths a pattern holding {sigma_rel}, e.g. runs/ph_ema{sigma_rel}")
    args = p.parse_args(argv)
    try:
        folders = output_folders(args.out, args.sigma_rel)
        for s, folder in zip(args.sigma_rel, folders):
            info = write_checkpoint(args.run, s, folder, args.step)
            print(f"{folder}: EMA σ_rel {info['sigma_rel']} (γ {info['gamma']:.2f}) at step {info['step']} from "
                  f"{len(info['snapshots'])} snapshots, relative profile residual {info['relative_residual']:.2e}")
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
