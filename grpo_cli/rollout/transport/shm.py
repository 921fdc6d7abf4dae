"""`shm` weight transport (server on the trainer's host, same user): the frames of `codec.write_stream` written once
into an owner-only file in /dev/shm whose name every server gets (POST `/update_weights_shm`); each server maps it,
checks each frame's checksum and loads from the mapping.

The file (`ShmFile`) is created under a name that carries the trainer's pid, overwritten in place by each sync
(`keep_file`), removed when the transport closes or the process exits; files left by a trainer that was killed (its
pid gone) are removed when the next one is created."""

from __future__ import annotations

import os
import re
import weakref
from pathlib import Path
from typing import BinaryIO

from grpo_cli.rollout.transport import codec
from grpo_cli.rollout.transport.base import Link, NamedTensors, WeightTransport
from grpo_cli.rollout.transport.codec import SHM_DIR

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


class ShmTransport(WeightTransport):
    """The file is kept between syncs and overwritten in place unless `keep_file` is false (then removed after each)."""

    name = "shm"
    takes = ("keep_file",)

    def __init__(self, link: Link, *, keep_file: bool = True) -> None:
        super().__init__(link)  # the server is on this host: a config rule (`config.rules._check_same_host`)
        self.keep_file = keep_file
        self._file: ShmFile | None = None

    def _send(self, named_tensors: NamedTensors, version: int, chunk_bytes: int) -> list[dict]:
        if self._file is None:
            self._file = ShmFile.create()
        try:
            out = self._file.rewind()
            size = codec.write_stream(out, named_tensors, chunk_bytes=chunk_bytes, version=version)
            out.truncate(size)
            body = {"name": self._file.path.name, "bytes": size, "version": version}
            futures = [self.link.pool.submit(self.link.http.call, url, "POST", "/update_weights_shm",
                                             idempotent=False, json=body) for url in self.link.urls]
            return [f.result().json() for f in futures]
        finally:
            if not self.keep_file:
                self.close()

    def close(self) -> None:
        """Remove the kept /dev/shm weight file, if any (the next sync creates a new one)."""
        if self._file is not None:
            self._file.remove()
            self._file = None
