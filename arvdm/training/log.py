"""The run's log: RUN/log.csv, one row per logged step, plus TensorBoard scalars when TensorBoard is installed.

    log = RunLogger(run_dir, step)          # step: where this session starts (0, or the resumed checkpoint's)
    log.write(step, elapsed_s, {"loss": 0.41, "lr": 3e-4})
    log.close()

Contract: the columns are LOG_COLUMNS, in that order; a value not given in a row is left empty. A resumed
run keeps the rows up to its checkpoint's step and drops the later ones (they belong to the lost session).
"""

from __future__ import annotations

import csv
import time
from pathlib import Path

import torch

LOG_COLUMNS = ["step", "loss", "lr", "grad_norm", "steps_per_s", "frames_per_s", "val_loss", "val_loss_ema",
               "elapsed_s"]


class RunLogger:
    """log.csv (appended across resumes; rows after the resumed step are dropped) + optional TensorBoard."""

    def __init__(self, run_dir: Path, step: int):
        run_dir.mkdir(parents=True, exist_ok=True)
        self.path = run_dir / "log.csv"
        kept: list[dict[str, str]] = []
        if self.path.exists():  # a resumed run: forget what happened after its checkpoint
            with open(self.path, newline="") as f:
                kept = [r for r in csv.DictReader(f) if r.get("step", "").isdigit() and int(r["step"]) <= step]
        self.file = open(self.path, "w", newline="")  # noqa: SIM115 - open for the whole run, closed in close()
        self.writer = csv.DictWriter(self.file, fieldnames=LOG_COLUMNS)
        self.writer.writeheader()
        self.writer.writerows({k: r.get(k, "") for k in LOG_COLUMNS} for r in kept)
        self.file.flush()
        self.tb = None
        try:  # lazy: TensorBoard is optional; torch.utils.tensorboard alone needs the package
            import tensorboard  # noqa: F401
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(run_dir / "tensorboard"))
        except ImportError:
            pass

    def write(self, step: int, elapsed: float, row: dict[str, float]) -> None:
        out = {k: "" for k in LOG_COLUMNS}
        out.update({k: f"{v:.6g}" for k, v in row.items()}, step=str(step), elapsed_s=f"{elapsed:.1f}")
        self.writer.writerow(out)
        self.file.flush()
        if self.tb is not None:
            for k, v in row.items():
                self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()


class LossMeter:
    """Training loss and speed since the last log row; the loss stays on the device until a row is due."""

    def __init__(self, device: torch.device):
        self.loss_sum = torch.zeros((), device=device)
        self.steps = 0
        self.since = time.perf_counter()

    def add(self, loss: torch.Tensor) -> None:
        self.loss_sum += loss
        self.steps += 1

    def report(self, gnorm: torch.Tensor, lr: float, frames_per_step: int) -> dict[str, float]:
        """The row's training numbers (mean loss since the last report, this step's lr and grad norm); resets."""
        steps_per_s = self.steps / (time.perf_counter() - self.since)
        row = {"loss": (self.loss_sum / self.steps).item(), "lr": lr, "grad_norm": gnorm.item(),
               "steps_per_s": steps_per_s, "frames_per_s": steps_per_s * frames_per_step}
        self.loss_sum.zero_()
        self.steps, self.since = 0, time.perf_counter()
        return row
