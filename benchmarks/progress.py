"""Progress of a benchmark run: tqdm's bar on a terminal, a plain line per measurement elsewhere.

A bar that redraws itself with carriage returns turns into one endless line in a CI log or a
file; there each finished measurement gets a line of its own instead.
"""

from __future__ import annotations

import sys
from typing import IO, Any

from tqdm import tqdm


class Progress:
    """Counts ``total`` measurements; ``done`` reports one as finished."""

    def __init__(self, total: int, *, quiet: bool, stream: IO[str] | None = None) -> None:
        self.total = total
        self.count = 0
        self.stream = stream if stream is not None else sys.stdout
        self.quiet = quiet
        self.interactive = self.stream.isatty()
        self.bar: Any = None
        if not quiet and self.interactive:
            self.bar = tqdm(total=total, desc="bench", unit="run", dynamic_ncols=True)

    def start(self, label: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(label)

    def done(self, label: str, seconds: float | None, error: str | None = None) -> None:
        self.count += 1
        if self.bar is not None:
            self.bar.update(1)
            return
        if self.quiet:
            return
        outcome = f"FAILED: {error.strip().splitlines()[-1][:200]}" if error else f"{seconds:.3f} s"
        width = len(str(self.total))
        line = f"[{self.count:>{width}}/{self.total}] {label}: {outcome}"
        print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
