"""Output streams that outlive their terminal: a hung-up tty (closed tmux pane, dropped ssh) fails writes with EIO;
the training must keep going (to its checkpoint), so writes are dropped and later prints go to /dev/null."""

from __future__ import annotations

import os
import sys
from typing import TextIO


class TerminalStream:
    """Wraps a text stream; the first failed write marks the terminal `lost`, points fds 1 and 2 at /dev/null
    (so other modules' prints do not raise either) and drops all later writes."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self.lost = False

    def _lose(self) -> None:
        self.lost = True
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            for fd in (1, 2):
                os.dup2(null, fd)
            os.close(null)
        except OSError:
            pass

    def write(self, text: str) -> int:
        if not self.lost:
            try:
                return self._stream.write(text)
            except OSError:
                self._lose()
        return len(text)

    def flush(self) -> None:
        if not self.lost:
            try:
                self._stream.flush()
            except OSError:
                self._lose()

    def isatty(self) -> bool:
        return not self.lost and self._stream.isatty()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def stdout_stream() -> TerminalStream:
    return TerminalStream(sys.stdout)
