"""Weight frames: named tensors as a stream of safetensors blobs, each framed with its length and XXH3-128
checksum, sent over HTTP or written to a same-host shared-memory file (`write_stream` / `read_stream`).

Never pickle: a frame's header is JSON (names, dtypes, shapes, offsets) and its data raw little-endian bytes.

The checksum is for integrity (a truncated, corrupted or concurrently rewritten frame), not authentication: that is
the bearer token's job on every update route, and the shm file is owner-only. XXH3-128 hashes at ~24 GB/s on one
core here against SHA-256's ~1.7 GB/s, which made hashing the largest cost of a same-host sync (two 0.25 s passes
over a 403 MB model); 128 bits keep an accidental collision out of reach.
"""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

import torch
import xxhash

MAGIC = b"GRW2"  # GRW1 carried SHA-256: an old server refuses these frames by their magic
_PREFIX = struct.Struct("<4sQ16s")  # magic, blob length, xxh3_128(blob)
MAX_HEADER_BYTES = 100 << 20  # the safetensors spec's own limit
SHM_DIR = "/dev/shm"
"""Same-host weight files (`write_stream` / `read_stream`) live here: tmpfs, so the file's pages are shared memory."""

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_CODES = {v: k for k, v in DTYPES.items()}


class FrameError(ValueError):
    """A weight stream that does not decode: the message says which frame and what is wrong."""


def _blob_header(tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> bytes:
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors:
        if t.dtype not in _CODES:
            raise FrameError(f"tensor {name!r}: dtype {t.dtype} cannot be sent (supported: {sorted(DTYPES)})")
        header[name] = {"dtype": _CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # 8-byte alignment of the data section, as safetensors writers do
    return struct.pack("<Q", len(raw)) + raw


def _as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")


def _pieces(tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> list[memoryview | bytes]:
    """A frame's blob as pieces (no copy of tensor data): safetensors header, then each tensor's bytes."""
    return [_blob_header(tensors, metadata), *(_as_bytes(t) for _, t in tensors)]


def _digest(pieces: list[memoryview | bytes]) -> bytes:
    digest = xxhash.xxh3_128()
    for p in pieces:
        digest.update(p)
    return digest.digest()


def encode_frame(tensors: list[tuple[str, torch.Tensor]], metadata: dict[str, str]) -> list[memoryview | bytes]:
    """One frame as pieces to send in order (no copy of tensor data): prefix, safetensors header, tensor bytes."""
    pieces = _pieces(tensors, metadata)
    return [_PREFIX.pack(MAGIC, sum(len(p) for p in pieces), _digest(pieces)), *pieces]


def _prepare(name: str, t: torch.Tensor, seen: set[int]) -> torch.Tensor:
    t = t.detach().to("cpu").contiguous()
    if t.data_ptr() in seen and t.numel():  # tied weights: send a copy, the receiver loads both names
        t = t.clone()
    seen.add(t.data_ptr())
    return t


def size_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], *, chunk_bytes: int,
                 prepare: Callable[[torch.Tensor], torch.Tensor] = torch.Tensor.detach,
                 ) -> Iterator[tuple[list[tuple[str, torch.Tensor]], bool]]:
    """(tensors, is_last) of ~`chunk_bytes` each (a bigger tensor gets a bucket of its own), each tensor passed
    through `prepare`, read lazily: a bucket is yielded when the next tensor would overflow it, so the last is known
    and what is held is one bucket plus that tensor (the caller clears a bucket it sent: the loop variable still
    names it while the next one fills). No tensor at all gives one empty last bucket. The NCCL and SGLang tensor
    transports send these; the HTTP frames are cut the same way (`_batches`)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        t = prepare(tensor)
        if bucket and size + t.nbytes > chunk_bytes:
            yield bucket, False
            bucket, size = [], 0
        bucket.append((name, t))
        size += t.nbytes
    yield bucket, True


def _batches(named_tensors: Iterable[tuple[str, torch.Tensor]], *, chunk_bytes: int,
             version: int) -> Iterator[tuple[list[tuple[str, torch.Tensor]], dict[str, str]]]:
    """(tensors, metadata) of frames of at most ~`chunk_bytes` each (a bigger tensor gets a frame of its own),
    then the end frame, whose metadata carries the counts the receiver checks."""
    batch: list[tuple[str, torch.Tensor]] = []
    size = count = frames = 0
    seen: set[int] = set()
    for name, tensor in named_tensors:
        t = _prepare(name, tensor, seen)
        if batch and size + t.nbytes > chunk_bytes:
            yield batch, {"grpo_frame": "data", "index": str(frames), "version": str(version)}
            frames, batch, size = frames + 1, [], 0
        batch.append((name, t))
        size += t.nbytes
        count += 1
    if batch:
        yield batch, {"grpo_frame": "data", "index": str(frames), "version": str(version)}
        frames += 1
    yield [], {"grpo_frame": "end", "frames": str(frames), "tensors": str(count), "version": str(version)}


def encode_stream(
    named_tensors: Iterable[tuple[str, torch.Tensor]], *, chunk_bytes: int, version: int
) -> Iterator[list[memoryview | bytes]]:
    """The frames of `_batches`, each as `encode_frame` pieces."""
    for tensors, metadata in _batches(named_tensors, chunk_bytes=chunk_bytes, version=version):
        yield encode_frame(tensors, metadata)


def write_stream(out: BinaryIO, named_tensors: Iterable[tuple[str, torch.Tensor]], *, chunk_bytes: int,
                 version: int) -> int:
    """Write the frames of `encode_stream` into a file (one copy of the tensor bytes); returns the bytes written.
    Short writes are continued (Linux writes at most ~2 GiB per call: one tensor of a 70B model is more)."""
    size = 0
    for frame in encode_stream(named_tensors, chunk_bytes=chunk_bytes, version=version):
        for piece in frame:
            view = memoryview(piece).cast("B")
            while len(view):
                view = view[out.write(view):]
            size += len(piece)
    return size


def read_stream(buffer: memoryview, *, max_frame_bytes: int) -> Iterator[Frame]:
    """Frames of a `write_stream` file mapped in `buffer`, in order, each checked against its checksum before it
    is decoded. Tensors view `buffer` (no copy)."""
    offset, index = 0, 0
    while offset < len(buffer):
        if len(buffer) - offset < _PREFIX.size:
            raise FrameError(f"weight frame {index}: the file ends inside its prefix")
        magic, length, digest = _PREFIX.unpack_from(buffer, offset)
        if magic != MAGIC:
            raise FrameError(f"weight frame {index}: bad magic {magic!r} (expected {MAGIC!r})")
        if length > max_frame_bytes or offset + _PREFIX.size + length > len(buffer):
            raise FrameError(f"weight frame {index}: {length} bytes exceeds the file or the server limit")
        blob = buffer[offset + _PREFIX.size : offset + _PREFIX.size + length]
        if _digest([blob]) != digest:
            raise FrameError(f"weight frame {index}: checksum mismatch (the file changed or was corrupted)")
        yield decode_blob(blob, index=index)
        offset, index = offset + _PREFIX.size + length, index + 1


def checked_frames(frames: Iterable[Frame], version: int) -> Iterator[Frame]:
    """The data frames of a stream, checked: each for `version`, nothing after the end frame, and the frame and
    tensor counts the end frame announces equal to what came before it (the last check when the stream ends)."""
    end: Frame | None = None
    count = tensors = 0
    for frame in frames:
        if end is not None:
            raise FrameError("data after the end frame")
        if frame.metadata.get("version") != str(version):
            raise FrameError(f"frame for version {frame.metadata.get('version')} in an update to v{version}")
        if frame.is_end:
            end = frame
            continue
        count, tensors = count + 1, tensors + len(frame.tensors)
        yield frame
    if end is None:
        raise FrameError("weight stream ended without its end frame (client stopped mid-update)")
    want = (end.metadata.get("frames"), end.metadata.get("tensors"))
    if want != (str(count), str(tensors)):
        raise FrameError(f"end frame announces {want[0]} frames / {want[1]} tensors, received {count} / {tensors}")


@dataclass
class Frame:
    metadata: dict[str, str]
    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)

    @property
    def is_end(self) -> bool:
        return self.metadata.get("grpo_frame") == "end"


def decode_blob(blob: bytearray | memoryview, *, index: int) -> Frame:
    """Parse one safetensors blob strictly (dtype whitelist, contiguous in-bounds offsets); tensors view `blob`."""
    where = f"weight frame {index}"
    if len(blob) < 8:
        raise FrameError(f"{where}: {len(blob)} bytes is too short for a safetensors header")
    (hlen,) = struct.unpack_from("<Q", blob)
    if hlen > min(MAX_HEADER_BYTES, len(blob) - 8):
        raise FrameError(f"{where}: header length {hlen} exceeds the frame")
    try:
        header = json.loads(bytes(blob[8 : 8 + hlen]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FrameError(f"{where}: header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise FrameError(f"{where}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise FrameError(f"{where}: __metadata__ must map strings to strings")
    data_start, end = 8 + hlen, 0
    frame = Frame(metadata=metadata)
    for name, info in sorted(header.items(), key=lambda kv: _offsets(kv, where)[0]):
        begin, stop = _offsets((name, info), where)
        dtype = DTYPES.get(info.get("dtype"))
        shape = info.get("shape")
        if dtype is None:
            raise FrameError(f"{where}: tensor {name!r} has unsupported dtype {info.get('dtype')!r}")
        if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise FrameError(f"{where}: tensor {name!r} has invalid shape {shape!r}")
        numel = 1
        for s in shape:
            numel *= s
        itemsize = torch.empty((), dtype=dtype).element_size()
        if begin != end or stop - begin != numel * itemsize:
            raise FrameError(f"{where}: tensor {name!r} offsets [{begin}, {stop}) do not match its shape/dtype")
        end = stop
        if numel:
            flat = torch.frombuffer(blob, dtype=dtype, count=numel, offset=data_start + begin)
        else:
            flat = torch.empty(0, dtype=dtype)
        frame.tensors.append((name, flat.view(shape)))
    if data_start + end != len(blob):
        raise FrameError(f"{where}: {len(blob) - data_start - end} trailing bytes after the last tensor")
    return frame


def _offsets(item: tuple[str, object], where: str) -> tuple[int, int]:
    name, info = item
    offs = info.get("data_offsets") if isinstance(info, dict) else None
    ok = isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) for o in offs)
    if not (ok and 0 <= offs[0] <= offs[1]):
        raise FrameError(f"{where}: tensor {name!r} has invalid data_offsets {offs!r}")
    return offs[0], offs[1]


class ReceiveBuffer:
    """Frame buffers reused frame after frame and update after update once no tensor views them any more (then this
    object holds their only reference). Three: when a frame starts, the one finished in the same chunk and the last
    tensor of the one before it (which the engine is loading) are still referenced. A fresh bytearray per 128 MB frame
    cost a page fault per 4 KiB page on every frame of every sync (a fifth of the server's CPU time in a profile);
    the price is three buffers of the largest frame (`weight_chunk_mb`, or a bigger tensor) held between syncs."""

    KEEP = 3

    def __init__(self) -> None:
        self._bufs: list[bytearray] = []
        self._largest = 0

    def take(self, length: int) -> memoryview:
        """A buffer of `length` bytes (a view of one at least the largest frame seen, so frames of any size fit)."""
        self._largest = max(self._largest, length)
        free = [b for b in self._bufs if sys.getrefcount(b) <= 3]  # the list, `b` and the call's argument
        buf = next((b for b in free if len(b) >= length), None)
        if buf is None:
            if len(self._bufs) >= self.KEEP:  # drop a free one (too small) or, all busy, the oldest
                self._bufs.remove(free[0] if free else self._bufs[0])
            buf = bytearray(self._largest)
            self._bufs.append(buf)
        return memoryview(buf)[:length]


class FrameReader:
    """Incremental decoder: `feed(bytes)` returns the frames completed so far; `finish()` checks nothing is left.

    Holds at most one frame in memory (in `buffer`, when given, else a new bytearray per frame); rejects a frame
    longer than `max_frame_bytes` before buffering it."""

    def __init__(self, *, max_frame_bytes: int, buffer: ReceiveBuffer | None = None) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buffer = buffer
        self._prefix = bytearray()
        self._blob: bytearray | memoryview | None = None
        self._filled = 0
        self._expect: tuple[int, bytes] = (0, b"")
        self._hash = xxhash.xxh3_128()
        self.frames = 0
        self.bytes = 0

    def feed(self, data: bytes) -> list[Frame]:
        out: list[Frame] = []
        view = memoryview(data)
        self.bytes += len(data)
        while len(view):
            if self._blob is None:
                take = min(_PREFIX.size - len(self._prefix), len(view))
                self._prefix += view[:take]
                view = view[take:]
                if len(self._prefix) == _PREFIX.size:
                    self._start_blob()
            if self._blob is not None:
                take = min(len(self._blob) - self._filled, len(view))
                self._blob[self._filled : self._filled + take] = view[:take]
                self._hash.update(view[:take])  # hashed as it arrives: no second pass over the frame
                self._filled += take
                view = view[take:]
                if self._filled == len(self._blob):
                    out.append(self._finish_blob())
        return out

    def pull(self, readinto: Callable[[memoryview], int]) -> Iterator[Frame]:
        """The frames of a body read with `readinto(view) -> bytes written (0 at its end)`: the bytes go straight
        into the frame buffer (no copy of ours) and are hashed there; the body must end after the last frame."""
        prefix = memoryview(bytearray(_PREFIX.size))
        while True:
            filled = 0
            while filled < _PREFIX.size:
                n = readinto(prefix[filled:])
                if n == 0:
                    if filled:
                        break
                    return self.finish()
                filled += n
            self._prefix[:] = prefix[:filled]
            self.bytes += filled
            if filled < _PREFIX.size:
                return self.finish()
            self._start_blob()
            blob = memoryview(self._blob)
            while self._filled < len(blob):
                n = readinto(blob[self._filled :])
                if n == 0:
                    return self.finish()
                self._hash.update(blob[self._filled : self._filled + n])  # hashed while the bytes are in cache
                self._filled += n
                self.bytes += n
            del blob  # the frame's tensors hold the buffer from here on (ReceiveBuffer counts references)
            yield self._finish_blob()

    def _start_blob(self) -> None:
        magic, length, digest = _PREFIX.unpack(bytes(self._prefix))
        if magic != MAGIC:
            raise FrameError(f"weight frame {self.frames}: bad magic {magic!r} (expected {MAGIC!r}); "
                             "the body must be a grpo weight stream")
        if length > self.max_frame_bytes:
            raise FrameError(f"weight frame {self.frames}: {length} bytes exceeds the server limit of "
                             f"{self.max_frame_bytes} bytes (lower the client's chunk size or raise --max-frame-mb)")
        blob = self._buffer.take(length) if self._buffer is not None else bytearray(length)
        self._blob, self._filled, self._expect = blob, 0, (length, digest)
        self._hash = xxhash.xxh3_128()
        self._prefix.clear()

    def _finish_blob(self) -> Frame:
        blob, self._blob = self._blob, None
        if self._hash.digest() != self._expect[1]:
            raise FrameError(f"weight frame {self.frames}: checksum mismatch (corrupted in transit)")
        frame = decode_blob(blob, index=self.frames)
        self.frames += 1
        return frame

    def finish(self) -> None:
        if self._blob is not None or self._prefix:
            raise FrameError(f"weight stream ended inside frame {self.frames} (client disconnected or truncated body)")
