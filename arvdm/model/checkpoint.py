"""Checkpoints: atomic folders of safetensors weights + a weights_only training state.

A checkpoint is one folder per saved step::

    run_dir/checkpoints/step_0000250/
        model.safetensors   the trained weights           (save_pretrained)
        config.json         the full run Config            (rebuilds the model; sample.py reads it)
        ema.safetensors     the EMA weights, fp32          (what sampling uses by default)
        state.pt            optimizer, lr schedule, step, RNG states, data position

It is written under a temporary name (``.tmp-step_0000250-<pid>``) in the same parent folder, every
file is fsync'd, and only then renamed to its final name: the rename is the "complete" mark, so a run
killed mid-write leaves a temp folder that `latest_checkpoint` ignores and the next save removes.

Nothing from a checkpoint is ever unpickled: weights load through safetensors and the training state
through ``torch.load(weights_only=True)`` (torch >= 2.6, CVE-2025-32434), which only rebuilds tensors,
numbers, strings, lists, tuples and dicts. `save_checkpoint` checks that before it writes.

Weights I/O lives here and only here: `save_pretrained` / `from_pretrained` / `load_weights` work on any
module (``Denoiser.save_pretrained`` and ``Denoiser.from_pretrained`` delegate to them); files are written
with `data.atomic.atomic_write`, folders by `write_folder_atomically`. This module imports no model
code (`arvdm.pipeline.runs.load_for_inference` puts checkpoint and model together), so there is no circle.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from arvdm.config import Config, ConfigError
from arvdm.errors import ArvdmError
from data.atomic import atomic_write

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
CKPT_DIRNAME = "checkpoints"
_STEP_RE = re.compile(r"^step_(\d+)$")
TMP_PREFIX = ".tmp-"


class CheckpointError(ArvdmError):
    """A run folder has no usable checkpoint, or a checkpoint does not fit its config."""


# -- finding checkpoints ---------------------------------------------------------------------------
def checkpoint_dir(run_dir: str | os.PathLike, step: int) -> Path:
    return Path(run_dir) / CKPT_DIRNAME / f"step_{step:07d}"


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints of a run, oldest first. Temp folders (interrupted writes) are skipped."""
    root = Path(run_dir) / CKPT_DIRNAME
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint folder of `run_dir`, or None."""
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def checkpoint_step(ckpt: str | os.PathLike) -> int:
    m = _STEP_RE.match(Path(ckpt).name)
    if not m:
        raise CheckpointError(f"{ckpt}: not a checkpoint folder (expected a name like step_0000250)")
    return int(m.group(1))


# -- writing -------------------------------------------------------------------------------------
def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The plain module under DistributedDataParallel and/or torch.compile wrappers."""
    while True:
        if hasattr(model, "module") and isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def state_dict_for_safetensors(module: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A CPU, contiguous, storage-unshared copy of `module.state_dict()` (safetensors refuses shared storage);
    `module` may be a state dict already (a sharded model's, gathered: arvdm.training.sharding)."""
    state = module if isinstance(module, Mapping) else module.state_dict()
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}


def save_checkpoint(run_dir: str | os.PathLike, step: int, model: torch.nn.Module | Mapping[str, torch.Tensor],
                    cfg: Config, *,
                    ema: torch.nn.Module | None = None, state: dict[str, Any] | None = None,
                    keep: int = 2, protect: tuple[int, ...] = ()) -> Path:
    """Write checkpoint `step` of `run_dir` atomically, then keep only the newest `keep` ones and those of the steps
    in `protect` (train.member_fork's step, which the run's other members start from).

    Call on one process only (rank 0 under DDP); the caller puts barriers around it.
    """
    if state is not None:
        _check_weights_only(state)
    root = Path(run_dir) / CKPT_DIRNAME
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(root)

    def fill(folder: Path) -> None:
        # The full run Config goes in config.json: it rebuilds the model and tells sample.py how it was trained.
        save_pretrained(unwrap(model), folder, cfg)
        if ema is not None:
            atomic_write(folder / "ema.safetensors",
                         lambda p: save_file(state_dict_for_safetensors(unwrap(ema)), str(p)))
        if state is not None:
            atomic_write(folder / "state.pt", lambda p: torch.save(state, p))

    final = write_folder_atomically(checkpoint_dir(run_dir, step), fill)
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        if checkpoint_step(old) not in protect:
            shutil.rmtree(old, ignore_errors=True)
    return final


def write_folder_atomically(final: str | os.PathLike, fill) -> Path:
    """Fill a temp folder beside `final` via ``fill(tmp)``, fsync it, then rename it to `final`.

    The rename is the "complete" mark: readers see the old folder (or none) or the whole new one. An existing
    `final` is replaced. A killed write leaves a ``.tmp-`` folder, which `save_checkpoint` removes.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f"{TMP_PREFIX}{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        fill(tmp)
        _fsync_dir(tmp)
        if final.exists():  # re-saving a step (e.g. a resumed run that reached it again): replace it
            old = final.parent / f"{TMP_PREFIX}old-{final.name}-{os.getpid()}"
            os.rename(final, old)
            shutil.rmtree(old)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(final.parent)
    return final


# -- weights I/O (diffusers-style save_pretrained / from_pretrained) ------------------------------------
def save_pretrained(module: torch.nn.Module | Mapping[str, torch.Tensor], directory: str | os.PathLike,
                    cfg: Config | None = None) -> Path:
    """Write `model.safetensors` + `config.json` (the whole Config; default ``module.cfg``) into `directory`.
    `module` may be its full state dict (then `cfg` is needed).

    A new folder is written under a temporary name and renamed into place; into an existing folder each
    file is written to a temporary name, flushed and renamed over the old one (`atomic_write`).
    """
    directory = Path(directory)
    cfg = cfg if cfg is not None else module.cfg
    tensors = state_dict_for_safetensors(module)
    config_text = cfg.to_json()

    def fill(folder: Path) -> None:
        atomic_write(folder / WEIGHTS_NAME, lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
        atomic_write(folder / CONFIG_NAME, lambda p: p.write_text(config_text))

    if directory.is_dir():
        fill(directory)
        return directory
    return write_folder_atomically(directory, fill)


def from_pretrained(model_cls, directory: str | os.PathLike, map_location: str | torch.device = "cpu"):
    """``model_cls(cfg)`` with the weights of `save_pretrained`'s folder (safetensors only; no pickle runs).

    Raises:
        CheckpointError: missing folder/files, unreadable config or weights, or weights that do not
            match the model the config describes (missing/unexpected keys, wrong shapes).
    """
    directory = Path(directory)
    cfg_path, w_path = directory / CONFIG_NAME, directory / WEIGHTS_NAME
    for p in (cfg_path, w_path):
        if not p.is_file():
            raise CheckpointError(f"{directory}: no {p.name} (not a save_pretrained folder?)")
    try:
        cfg = Config.from_dict(json.loads(cfg_path.read_text()))
    except (json.JSONDecodeError, ConfigError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{cfg_path}: unreadable config ({e})") from e
    model = model_cls(cfg)
    load_weights(model, w_path, device=map_location)
    return model.to(map_location)


def _remove_stale_temps(root: Path) -> None:
    # Only one process writes checkpoints, so any temp folder is left over from a killed write.
    for p in root.iterdir():
        if p.name.startswith(TMP_PREFIX) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some filesystems do not allow opening folders; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _check_weights_only(state: dict[str, Any]) -> None:
    """Fail at save time (not at resume time) if `state` would not load with weights_only=True."""
    buf = io.BytesIO()
    try:
        torch.save(state, buf)
        buf.seek(0)
        torch.load(buf, weights_only=True)
    except Exception as e:
        raise TypeError(f"training state holds an object torch.load(weights_only=True) refuses: {e}") from e


# -- reading -------------------------------------------------------------------------------------
def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """`path` is a checkpoint folder or a run folder (then its newest complete checkpoint)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such run or checkpoint folder")
    if (path / "model.safetensors").is_file():
        return path
    ckpt = latest_checkpoint(path)
    if ckpt is None:
        raise CheckpointError(f"{path}: no complete checkpoint (looked for {path / CKPT_DIRNAME}/step_*/); "
                              f"train one with: python train.py --out {path}")
    return ckpt


def load_config(ckpt: str | os.PathLike) -> Config:
    """The run Config saved in a checkpoint folder."""
    path = Path(ckpt) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{ckpt}: config.json is missing")
    try:
        return Config.from_dict(json.loads(path.read_text())).validate()
    except (json.JSONDecodeError, ConfigError) as e:
        raise CheckpointError(f"{path}: not a valid run config: {e}") from e


def load_weights(module: torch.nn.Module, weights: str | os.PathLike | dict[str, torch.Tensor], *,
                 what: str = "weights", device: str | torch.device = "cpu") -> None:
    """Load a safetensors file (or a flat tensor dict) into `module` strictly.

    Raises CheckpointError naming the file and, on a mismatch, the missing/unexpected keys and wrong shapes.
    """
    if isinstance(weights, dict):
        tensors, source = weights, "state dict"
    else:
        source = Path(weights)
        if not source.is_file():
            raise CheckpointError(f"{source}: missing")
        try:
            tensors = load_file(str(source), device=str(device))
        except Exception as e:  # safetensors raises SafetensorError / OSError on a corrupt file
            raise CheckpointError(f"{source}: cannot read: not a readable safetensors file ({e})") from e
    module = unwrap(module)
    own = module.state_dict()
    missing = sorted(set(own) - set(tensors))
    unexpected = sorted(set(tensors) - set(own))
    wrong = [f"{k}: file {tuple(tensors[k].shape)} vs model {tuple(own[k].shape)}"
             for k in sorted(set(own) & set(tensors)) if tensors[k].shape != own[k].shape]
    if missing or unexpected or wrong:
        def few(xs: list[str]) -> str:
            return ", ".join(xs[:5]) + (f" ... (+{len(xs) - 5})" if len(xs) > 5 else "")
        parts = [f"{name}: {few(xs)}" for name, xs in
                 (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatches", wrong)) if xs]
        raise CheckpointError(f"{source}: {what} do not match config.json (the model it describes): "
                              + "; ".join(parts))
    module.load_state_dict(tensors, strict=True)


def load_training_state(ckpt: str | os.PathLike) -> dict[str, Any]:
    path = Path(ckpt) / "state.pt"
    if not path.is_file():
        raise CheckpointError(f"{ckpt}: state.pt is missing (a weights-only folder cannot be resumed)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{path}: cannot load training state ({e})") from e


def run_folder(path: str | os.PathLike) -> Path:
    """The run folder of `path`: itself, or for a checkpoint folder (RUN/checkpoints/step_N) its RUN."""
    path = Path(path)
    if path.parent.name == CKPT_DIRNAME and _STEP_RE.match(path.name):
        return path.parent.parent
    return path


def data_path_candidates(cfg: Config, run_dir: str | os.PathLike | None = None) -> list[Path]:
    """Where a run's data may be, in the order they are tried (duplicates removed).

    ``data.path`` as stored (relative to the current directory unless absolute); ``data.abs_path`` (the
    absolute path train.py resolved it to); then ``data.path`` relative to the run folder and each folder
    above it, so a project folder moved or copied whole (runs/ beside datasets/) still finds its data.
    """
    given = Path(cfg.data.path).expanduser()
    out = [given]
    if cfg.data.abs_path:
        out.append(Path(cfg.data.abs_path))
    if run_dir is not None and not given.is_absolute():
        run = run_folder(run_dir).resolve()
        out += [folder / given for folder in (run, *run.parents)]
    seen: set[str] = set()
    unique = []
    for p in out:
        key = os.path.abspath(p)
        if key not in seen:
            seen.add(key)
            unique.append(p)
    return unique


def resolve_data_path(cfg: Config, run_dir: str | os.PathLike | None = None, given: str | os.PathLike | None = None,
                      *, flag: str = "--data") -> Path:
    """The run's data folder: `given` (a --data flag) when set, else the first candidate that exists.

    Raises CheckpointError listing every path tried and suggesting `flag`.
    """
    if given is not None:
        if not Path(given).is_dir():
            raise CheckpointError(f"{flag} {given}: folder does not exist")
        return Path(given)
    tried = data_path_candidates(cfg, run_dir)
    for p in tried:
        if p.is_dir():
            return p
    listing = "\n  ".join(os.path.abspath(p) for p in tried)
    where = f" of run {run_folder(run_dir)}" if run_dir is not None else ""
    raise CheckpointError(f"the data{where} was not found: data.path={cfg.data.path!r}; tried:\n  {listing}\n"
                          f"pass {flag} DIR to point at the data (a folder with training/ and validation/)")
