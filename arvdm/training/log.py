"""The run's log: RUN/log.csv, one row per logged step, plus TensorBoard scalars when TensorBoard is installed.

    log = RunLogger(run_dir, step)          # step: where this session starts (0, or the resumed checkpoint's)
    log.write(step, elapsed_s, {"loss": 0.41, "lr": 3e-4})
    log.close()

Contract: the columns are LOG_COLUMNS, in that order; a value not given in a row is left empty. A resumed
run keeps the rows up to its checkpoint's step and drops the later ones (they belong to the lost session).
"""

from __future__ import annotations

import csv
from pathlib import Path

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
