"""The trainer's weight file in /dev/shm for `weight_transport: shm`: created owner-only under a name that carries
the trainer's pid, overwritten in place by each sync, removed when the engine closes or the process exits; files
left by a trainer that was killed (its pid gone) are removed when the next one is created."""

from __future__ import annotations

import os
import re
import weakref
from pathlib import Path
from typing import BinaryIO

from grpo_cli.server.codec import SHM_DIR

PREFIX = "grpo-weights-"
_NAME = re.compile(rf"^{PREFIX}(\d+)-[0-9a-f]+$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def sweep_stale(folder: str = SHM_DIR) -> list[str]:
    """Remove this user's weight files whose trainer process is gone; the names removed."""
    removed = []
    for entry in os.scandir(folder):
        m = _NAME.match(entry.name)
        if not m or int(m.group(1)) == os.getpid():
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid == os.getuid() and not _alive(int(m.group(1))):
                os.unlink(entry.path)
                removed.append(entry.name)
        except FileNotFoundError:  # removed meanwhile
            continue
    return removed


def _remove(path: Path, out: BinaryIO) -> None:
    out.close()
    path.unlink(missing_ok=True)


class ShmFile:
    """One owner-only file in /dev/shm, kept open for writing (never reopened by name)."""

    def __init__(self, path: Path, out: BinaryIO) -> None:
        self.path, self._out = path, out
        self._finalizer = weakref.finalize(self, _remove, path, out)  # also runs at interpreter exit

    @classmethod
    def create(cls, folder: str = SHM_DIR) -> ShmFile:
        sweep_stale(folder)
        path = Path(folder) / f"{PREFIX}{os.getpid()}-{os.urandom(6).hex()}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        return cls(path, os.fdopen(fd, "wb", buffering=0))

    def rewind(self) -> BinaryIO:
        """The open file at offset 0, to be overwritten (the caller truncates it to what it wrote)."""
        self._out.seek(0)
        return self._out

    def remove(self) -> None:
        self._finalizer()
