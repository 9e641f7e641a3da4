"""Schedule files: read a scheduling matrix from JSON (what ``ARSchedule.save`` writes), .npy, .txt or .csv.

    schedule = load_schedule("mine.json")        # delta, num_levels, init_steps, context_level in the file
    schedule = load_schedule("mine.npy", delta=1, num_levels=1000)

Every error is a ScheduleError (condition ``"file"``, or the violated condition) naming the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from arvdm.schedules.matrix import ARSchedule, ScheduleError

__all__ = ["load_schedule"]


def load_schedule(path: str | os.PathLike, *, delta: int | None = None, num_levels: int | None = None,
                  init_steps: int | None = None, context_level: int | None = None) -> ARSchedule:
    """Read a schedule file.

    * ``.json`` (primary; what :meth:`ARSchedule.save` writes): ``{"delta": 1, "num_levels": 1000,
      "matrix": [[...], ...], "init_steps": 3 (optional), "context_level": 20 (optional, default 0),
      "name": "..." (optional)}``;
    * ``.npy``: an integer (M+1, w) array; ``delta`` and ``num_levels`` passed as arguments;
    * ``.txt`` / ``.csv``: one matrix row per line, integers separated by commas or spaces; ``delta``,
      ``num_levels`` (and ``init_steps``, ``context_level``) as arguments or in ``#`` header lines, e.g.
      ``# delta=1 num_levels=1000``.

    An argument that contradicts the file is an error. Errors name the file.
    """
    path = Path(path)
    meta: dict[str, Any] = {}
    try:
        suffix = path.suffix.lower()
        if suffix == ".json":
            with open(path) as f:
                d = json.load(f)
            if not isinstance(d, dict) or "matrix" not in d:
                raise ScheduleError("file", f"{path}: expected a JSON object with a 'matrix' key")
            unknown = set(d) - {"name", "delta", "num_levels", "init_steps", "context_level", "matrix"}
            if unknown:
                raise ScheduleError("file", f"{path}: unknown keys {sorted(unknown)}")
            matrix = d["matrix"]
            meta = {k: d[k] for k in ("delta", "num_levels", "init_steps", "context_level") if k in d}
            name = str(d.get("name", path.stem))
        elif suffix == ".npy":
            matrix = np.load(path, allow_pickle=False)
            name = path.stem
        elif suffix in (".txt", ".csv"):
            rows = []
            for line in path.read_text().splitlines():
                line = line.strip()
                if line.startswith("#"):
                    for item in line[1:].replace(",", " ").split():
                        if "=" in item:
                            k, v = item.split("=", 1)
                            if k in ("delta", "num_levels", "init_steps", "context_level"):
                                meta[k] = int(v)
                elif line:
                    rows.append([int(v) for v in line.replace(",", " ").split()])
            matrix = rows
            name = path.stem
        else:
            raise ScheduleError("file", f"{path}: unknown schedule file type {path.suffix!r}; "
                                "use .json, .npy, .txt or .csv")
    except ScheduleError:
        raise
    except (OSError, ValueError) as e:
        raise ScheduleError("file", f"{path}: cannot read the schedule: {e}") from e
    for key, arg in (("delta", delta), ("num_levels", num_levels), ("init_steps", init_steps),
                     ("context_level", context_level)):
        if arg is not None:
            if key in meta and meta[key] is not None and int(meta[key]) != int(arg):
                raise ScheduleError("file", f"{path}: the file says {key}={meta[key]} but {key}={arg} was passed")
            meta[key] = arg
    for key in ("delta", "num_levels"):
        if meta.get(key) is None:
            raise ScheduleError("file", f"{path}: {key} is missing (put it in the file or pass {key}=...)")
    try:
        return ARSchedule(matrix, meta["delta"], meta["num_levels"], init_steps=meta.get("init_steps"), name=name,
                          context_level=meta.get("context_level") or 0)
    except ScheduleError as e:
        raise ScheduleError(e.condition, f"{path}: {str(e).split(': ', 1)[1]}") from None
