"""Small timing helpers shared by the benchmark scripts (CPU or GPU; no dependency beyond torch).

    from benchmarks.common import set_threads, interleaved, median, print_table
    set_threads(1)
    times = interleaved({"a": fa, "b": fb}, repeats=3, warmup=1)   # name -> [seconds, ...]
    print_table(["method", "ms"], [[k, f"{1e3 * median(v):.1f}"] for k, v in times.items()])

Timings on a shared machine drift: `interleaved` runs the candidates round-robin (a, b, a, b, ...) so a
slow stretch hits all of them alike, and callers report medians and ratios rather than single times.
For long workloads `Lockstep` interleaves finer: each workload runs in its own thread, one at a time,
and hands the CPU to the next at every `pause()` it reaches (e.g. each model call), so a busy minute on
the machine is shared by all workloads; each is charged only its own time (`spent`, `clock()`).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["Lockstep", "interleaved", "median", "print_table", "random_weights", "set_threads", "sync", "timed"]


def set_threads(n: int | None) -> int:
    """Set torch's intra-op threads (None or <= 0: leave as is); returns the number in use."""
    if n is not None and n > 0:
        torch.set_num_threads(n)
    return torch.get_num_threads()


@torch.no_grad()
def random_weights(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its zero-initialised matrices (AdaLN-Zero, the zero output layer) drawn at random too (normal,
    std 1/√fan-in), so that a benchmark's untrained model's output depends on its input and its past."""
    for p in model.parameters():
        if p.dim() >= 2 and not p.any():
            p.normal_(0.0, 1.0 / p.shape[1] ** 0.5)
    return model


def sync(device: Any = None) -> None:
    """Wait for queued GPU work (no-op on the CPU), so a wall-clock reading covers it."""
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: Any = None) -> tuple[float, Any]:
    """Run fn() once; returns (seconds, its result)."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def interleaved(fns: dict[str, Callable[[], Any]], repeats: int = 3, warmup: int = 1,
                device: Any = None, on_result: Callable[[str, int, Any], None] | None = None
                ) -> dict[str, list[float]]:
    """Time several callables round-robin: `warmup` untimed rounds, then `repeats` timed rounds.

    Returns name -> list of seconds (one per repeat). `on_result(name, repeat, result)` sees every
    timed call's return value (e.g. to compare the outputs of two methods).
    """
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(repeats):
        for name, fn in fns.items():
            sec, out = timed(fn, device)
            times[name].append(sec)
            if on_result is not None:
                on_result(name, r, out)
    return times


class Lockstep:
    """Run workloads round-robin at their `pause()` points, one at a time, charging each its own time.

        ls = Lockstep()
        results = ls.run({"a": fa, "b": fb})   # fa/fb call ls.pause() now and then (e.g. per model call)
        ls.spent["a"]                          # seconds a held the CPU; ls.clock() inside a workload

    Workloads run in threads but never concurrently (torch releases the GIL, so they would otherwise
    compete); a workload that finishes leaves the rotation. An exception in one is re-raised by `run`.
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._local = threading.local()
        self._order: list[str] = []
        self._turn: str | None = None
        self._since = 0.0
        self.spent: dict[str, float] = {}

    def clock(self) -> float:
        """Seconds charged so far to the calling workload (0 outside `run`)."""
        name = getattr(self._local, "name", None)
        return 0.0 if name is None else self.spent[name] + time.perf_counter() - self._since

    def pause(self) -> None:
        """Hand the CPU to the next workload; returns when it is this one's turn again."""
        name = getattr(self._local, "name", None)
        if name is None:
            return
        with self._cv:
            self._hand_over(name, keep=True)
            self._cv.wait_for(lambda: self._turn == name)
            self._since = time.perf_counter()

    def _hand_over(self, name: str, keep: bool) -> None:  # with the lock held
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # charge queued GPU work to the workload that queued it
        self.spent[name] += time.perf_counter() - self._since
        i = self._order.index(name)
        if not keep:
            self._order.remove(name)
        rest = self._order[i:] + self._order[:i] if not keep else self._order[i + 1:] + self._order[:i + 1]
        self._turn = rest[0] if rest else None
        self._cv.notify_all()

    def run(self, fns: dict[str, Callable[[], Any]]) -> dict[str, Any]:
        """Run every workload to completion; returns name -> result."""
        results: dict[str, Any] = {}
        errors: list[BaseException] = []
        self._order, self.spent = list(fns), {name: 0.0 for name in fns}

        def worker(name: str) -> None:
            self._local.name = name
            with self._cv:
                self._cv.wait_for(lambda: self._turn == name)
                self._since = time.perf_counter()
            try:
                results[name] = fns[name]()
            except BaseException as e:  # noqa: BLE001 - re-raised by run()
                errors.append(e)
            finally:
                with self._cv:
                    self._hand_over(name, keep=False)
                self._local.name = None

        threads = [threading.Thread(target=worker, args=(name,), daemon=True) for name in fns]
        for t in threads:
            t.start()
        with self._cv:
            self._turn = self._order[0] if self._order else None
            self._cv.notify_all()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> str:
    """Print (and return) a plain aligned table; numbers right-aligned, text left-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    numeric = [all(_is_number(row[i]) for row in rows) and rows != [] for i in range(len(headers))]

    def fmt(row: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric)).rstrip()

    lines = ([title] if title else []) + [fmt(cells[0]), "  ".join("-" * w for w in widths)]
    lines += [fmt(r) for r in cells[1:]]
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def _is_number(x: Any) -> bool:
    if isinstance(x, (int, float)):
        return True
    try:
        float(str(x).rstrip("x%"))
        return True
    except ValueError:
        return False
