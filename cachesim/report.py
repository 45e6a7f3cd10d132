"""Output helpers shared by the benchmarks: a text table, a JSON file, a progress bar.

Benchmarks print for people and write JSON for machines; neither decides
pass or fail.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Rows as aligned text: text columns left-aligned, numbers right-aligned."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, text in enumerate(row):
            widths[i] = max(widths[i], len(text))
    numeric = [
        all(isinstance(row[i], int | float) for row in rows if i < len(row))
        for i in range(len(headers))
    ]

    def line(values: Sequence[str]) -> str:
        parts = [
            v.rjust(w) if num else v.ljust(w)
            for v, w, num in zip(values, widths, numeric, strict=False)
        ]
        return "  ".join(parts).rstrip()

    out = [line(list(headers)), line(["-" * w for w in widths])]
    out.extend(line(row) for row in cells)
    return "\n".join(out)


def print_table(
    headers: Sequence[str], rows: Sequence[Sequence[Any]], file: TextIO | None = None
) -> None:
    print(format_table(headers, rows), file=file or sys.stdout)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if value != 0 and (abs(value) >= 1e6 or abs(value) < 1e-3):
            return f"{value:.3g}"
        return f"{value:.4g}" if abs(value) < 10 else f"{value:,.1f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def positive_int(text: str) -> int:
    """argparse type for a count that must be at least 1, such as --limit N."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1 or not text.strip().isascii():
        raise argparse.ArgumentTypeError(f"expected a positive integer: {text!r}")
    return value


def positive_int_list(text: str) -> list[int]:
    """argparse type for "1000,5e6": comma-separated positive integers."""
    try:
        values = [int(float(v)) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers: {text}") from exc
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers: {text}")
    return values


def machine() -> dict[str, Any]:
    """Where a result was measured: enough to tell two machines apart."""
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def write_json(path: str | Path, data: dict[str, Any]) -> Path:
    """Write `data` plus a `machine` record as indented JSON, creating parent directories."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {**data, "machine": machine()}
    path.write_text(json.dumps(record, indent=2, sort_keys=False) + "\n")
    return path


class Progress:
    """Progress on stderr, no dependencies: a one-line bar on a terminal.

    When stderr is not a terminal it is silent, unless `force=True` (the bar
    anyway) or `lines_every` is given: then a plain line (`label done/total,
    N s`) at the start, at most every `lines_every` seconds, and at `close`, for logs
    that a bar's carriage returns would garble. The bar redraws at most every
    `min_interval` seconds, so `update` costs nothing in a hot loop that calls
    it once per request.
    """

    def __init__(
        self,
        total: int,
        label: str = "",
        *,
        force: bool = False,
        lines_every: float | None = None,
        stream: TextIO | None = None,
        min_interval: float = 0.2,
        width: int = 30,
    ) -> None:
        self.total = max(int(total), 1)
        self.label = label
        self.stream = stream or sys.stderr
        bar = force or _isatty(self.stream)
        self.lines_every = None if bar else lines_every
        self.enabled = bar or lines_every is not None
        self.min_interval = min_interval if bar else (lines_every or 0.0)
        self.width = width
        self.done = 0
        self._start = time.monotonic()
        self._last_draw = 0.0 if bar else self._start
        if self.lines_every is not None:
            self._draw(self._start)

    def update(self, n: int = 1) -> None:
        self.done += n
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last_draw >= self.min_interval or (
            self.done >= self.total and self.lines_every is None
        ):
            self._last_draw = now
            self._draw(now)

    def close(self) -> None:
        if self.enabled:
            self._draw(time.monotonic())
            if self.lines_every is None:
                self.stream.write("\n")
            self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _draw(self, now: float) -> None:
        elapsed = now - self._start
        if self.lines_every is not None:
            self.stream.write(f"{self.label} {self.done:,}/{self.total:,}, {elapsed:.0f} s\n")
            self.stream.flush()
            return
        frac = min(self.done / self.total, 1.0)
        filled = int(frac * self.width)
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(
            f"\r{self.label} [{bar}] {frac:6.1%} {elapsed:6.1f}s elapsed, {eta:6.1f}s left"
        )
        self.stream.flush()


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def time_interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Seconds per call of each fn over `repeats` rounds, interleaved so that
    drift hits every fn (the floor and what is compared with it) alike; a
    first untimed round warms up (lazy imports, first thread start, pools)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for round_ in range(repeats + 1):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            if round_:
                times[name].append(time.perf_counter() - start)
    return times
