"""A progress bar for work over files: files and megabytes done, and megabytes per second."""

from __future__ import annotations

import time
from typing import TextIO

MB = 1e6
"""Megabytes are 10**6 bytes here, as in the MB/s figures."""


class ProgressBar:
    """`hashing|tokenizing [#####.....] files 12/168  2.1/4.7 MB  35.2 MB/s` on stderr:
    redrawn in place on a terminal, a line every 5 s in a log; silent without a stream."""

    def __init__(self, *, stream: TextIO | None, files: int, total: int) -> None:
        self.stream, self.files, self.total = stream, files, total
        self.label, self.done_files, self.done_bytes = "", 0, 0
        self.started = self.shown = time.perf_counter()
        self.tty = bool(stream and stream.isatty())
        self.drawn_in_place = False

    def phase(self, label: str) -> ProgressBar:
        self.label, self.done_files, self.done_bytes = label, 0, 0
        self.started = time.perf_counter()
        return self

    def advance(self, size: int) -> None:
        self.done_files += 1
        self.done_bytes += size
        now = time.perf_counter()
        finished = self.tty and self.done_files == self.files
        if self.stream and (now - self.shown >= (0.1 if self.tty else 5.0) or finished):
            self.shown = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        assert self.stream is not None
        width, share = 20, self.done_bytes / max(self.total, 1)
        speed = self.done_bytes / MB / max(now - self.started, 1e-9)
        text = (
            f"{self.label} [{'#' * round(width * share):.<{width}}] files "
            f"{self.done_files}/{self.files}  {self.done_bytes / MB:,.1f}/"
            f"{self.total / MB:,.1f} MB  {speed:,.1f} MB/s"
        )
        self.stream.write(f"\r{text}\x1b[K" if self.tty else text + "\n")
        self.stream.flush()
        self.drawn_in_place = self.tty

    def close(self) -> None:
        if self.stream and self.drawn_in_place:
            self.stream.write("\n")
            self.stream.flush()
            self.drawn_in_place = False
