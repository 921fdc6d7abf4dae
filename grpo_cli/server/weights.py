"""Weight endpoints of `grpo serve-rollout`: the streamed frame upload, a same-host shared-memory file handed over
by name, loading from disk, and the NCCL path.

An update holds the engine lock from its first byte to its last, so no generation sees half-new weights; one
that fails after a tensor was loaded marks the server `inconsistent` until a complete update arrives."""

from __future__ import annotations

import mmap
from pathlib import Path

import anyio
from fastapi import FastAPI, Request

from grpo_cli.server.state import CommBody, DiskBody, NcclUpdateBody, ShmBody, State, UserError, reset_cache
from grpo_cli.server.codec import SHM_DIR, Frame, FrameError, FrameReader, read_stream


class _Apply:
    """Checks names and shapes against the served model, then loads tensors; counts what it loaded."""

    def __init__(self, st: State, version: int) -> None:
        self.st, self.version = st, version
        self.seen: set[str] = set()
        self.tensors = self.bytes = 0

    def check(self, tensors) -> None:
        shapes = self.st.served.param_shapes
        for name, t in tensors:
            if name in self.seen:
                raise UserError(f"tensor {name!r} sent twice in one update")
            if shapes and name not in shapes:
                close = [n for n in shapes if n.split(".")[-1] == name.split(".")[-1]][:3]
                raise UserError(f"unknown tensor {name!r} for this model (e.g. {close or list(shapes)[:3]})")
            if shapes and tuple(t.shape) != shapes[name]:
                raise UserError(f"tensor {name!r} has shape {tuple(t.shape)}, the model's is {shapes[name]}")
            self.seen.add(name)

    def counted(self, tensors):
        """Check then pass on tensors (a lazy iterator: the engine loads them as they arrive)."""
        tensors = list(tensors)
        self.check(tensors)
        self.tensors += len(tensors)
        self.bytes += sum(t.nbytes for _, t in tensors)
        yield from tensors

    async def load_all(self, tensors) -> None:
        """One engine call per update (vLLM opens one reload session per call), fed lazily from `tensors`."""
        finished = []

        def run():
            def marked():
                yield from tensors
                finished.append(True)

            self.st.served.engine.update_weights(marked(), self.version)
            for _ in marked() if not finished else ():  # the engine stopped early: consume to surface errors
                raise UserError("the engine did not take every tensor of the update")

        await anyio.to_thread.run_sync(run)

    def done(self, seconds: float) -> dict:
        st = self.st
        st.weight_version = self.version
        st.state = "sleeping" if st.state == "sleeping" else "ready"
        st.last_error = ""
        return {"weight_version": self.version, "tensors": self.tensors, "bytes": self.bytes,
                "seconds": seconds, "mb_per_s": self.bytes / 2**20 / max(seconds, 1e-9)}

    def failed(self, exc: Exception, prior: str) -> None:
        self.st.last_error = f"update to v{self.version} failed: {exc}"
        self.st.state = "inconsistent" if self.tensors else prior


def weight_routes(app: FastAPI, st: State, *, max_frame_bytes: int) -> None:
    @app.post("/update_weights")
    async def update_weights(request: Request, version: int):
        if version < 0:
            raise UserError("version must be >= 0")
        start = anyio.current_time()
        async with st.lock:
            prior, st.state = st.state, "updating"
            apply = _Apply(st, version)
            stream = request.stream()
            try:
                await apply.load_all(_frames(stream, FrameReader(max_frame_bytes=max_frame_bytes), apply, version))
                await anyio.to_thread.run_sync(reset_cache, st.served.engine)
            except Exception as e:
                apply.failed(e, prior if prior != "updating" else "ready")
                await _drain(stream)
                raise
            return apply.done(anyio.current_time() - start)

    @app.post("/update_weights_shm")
    async def update_weights_shm(body: ShmBody):
        path = Path(SHM_DIR) / body.name
        if not path.is_file() or path.stat().st_size != body.bytes:
            raise UserError(f"{path}: no file of {body.bytes} bytes there; the shm weight transport needs the "
                            "server on the trainer's host, run by the same user (else use weight_transport=http)")
        start = anyio.current_time()
        async with st.lock:
            prior, st.state = st.state, "updating"
            apply = _Apply(st, body.version)
            try:
                with path.open("rb") as f:  # the mapping outlives the file object; unmapped when the views go
                    mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if body.bytes else b""
                frames = read_stream(memoryview(mapped), max_frame_bytes=max_frame_bytes)
                await apply.load_all(_checked(frames, apply, body.version))
                await anyio.to_thread.run_sync(reset_cache, st.served.engine)
            except Exception as e:
                apply.failed(e, prior)
                raise
            return apply.done(anyio.current_time() - start)

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: DiskBody):
        files = _safetensors_files(body.path)
        start = anyio.current_time()
        async with st.lock:
            prior, st.state = st.state, "updating"
            apply = _Apply(st, body.version)
            try:
                await apply.load_all(t for f in files for batch in _read_batches(f) for t in apply.counted(batch))
                await anyio.to_thread.run_sync(reset_cache, st.served.engine)
            except Exception as e:
                apply.failed(e, prior)
                raise
            return apply.done(anyio.current_time() - start)

    @app.post("/init_communicator")
    async def init_communicator(body: CommBody):
        from grpo_cli.server.nccl import NcclReceiver, nccl_available

        ok, why = nccl_available()
        if not ok:
            raise UserError(f"NCCL weight sync is not available on this server: {why}; use the HTTP path "
                            "(rollout.server.weight_transport=http)")
        async with st.lock:
            st.comm = await anyio.to_thread.run_sync(
                lambda: NcclReceiver.join(body.host, body.port, body.world_size, body.rank, timeout_s=body.timeout_s))
        return {"rank": body.rank}

    @app.post("/update_weights_nccl")
    async def update_weights_nccl(body: NcclUpdateBody):
        if st.comm is None:
            raise UserError("no NCCL communicator: call /init_communicator first")
        if not len(body.names) == len(body.dtypes) == len(body.shapes):
            raise UserError("names, dtypes and shapes must have the same length")
        start = anyio.current_time()
        async with st.lock:
            prior, st.state = st.state, "updating"
            apply = _Apply(st, body.version)
            apply.check([(n, _Shape(s)) for n, s in zip(body.names, body.shapes, strict=True)])
            apply.seen.clear()
            try:
                tensors = await anyio.to_thread.run_sync(st.comm.receive, body.names, body.dtypes, body.shapes)
                await apply.load_all(apply.counted(tensors))
                await anyio.to_thread.run_sync(reset_cache, st.served.engine)
            except Exception as e:
                apply.failed(e, prior)
                raise
            return apply.done(anyio.current_time() - start)


class _Shape:
    def __init__(self, shape: list[int]) -> None:
        self.shape = tuple(shape)


def _frames(stream, reader: FrameReader, apply: _Apply, version: int):
    """Tensors of the upload, in order, pulled from the request stream by the engine's worker thread."""
    chunks = stream.__aiter__()

    async def pull(limit: int = 8 << 20) -> list[bytes]:  # one thread hop per ~8 MB, not per socket read
        out, size = [], 0
        async for chunk in chunks:
            out.append(chunk)
            size += len(chunk)
            if size >= limit:
                break
        return out

    def received():
        while pieces := anyio.from_thread.run(pull):
            yield from (f for piece in pieces for f in reader.feed(piece))
        reader.finish()

    yield from _checked(received(), apply, version)


def _checked(frames, apply: _Apply, version: int):
    """Tensors of a frame stream, checked: every frame for `version`, nothing after the end frame, and the counts
    the end frame announces equal what arrived."""
    end: Frame | None = None
    count = 0
    for frame in frames:
        count += 1
        if end is not None:
            raise FrameError("data after the end frame")
        if frame.metadata.get("version") != str(version):
            raise FrameError(f"frame for version {frame.metadata.get('version')} in an update to v{version}")
        if frame.is_end:
            end = frame
        else:
            yield from apply.counted(frame.tensors)
    if end is None:
        raise FrameError("weight stream ended without its end frame (client stopped mid-update)")
    want = (end.metadata.get("frames"), end.metadata.get("tensors"))
    if want != (str(count - 1), str(apply.tensors)):
        raise FrameError(f"end frame announces {want[0]} frames / {want[1]} tensors, received "
                         f"{count - 1} / {apply.tensors}")


async def _drain(stream) -> None:
    """Read the rest of a rejected upload so the client gets our 4xx instead of a broken pipe."""
    try:
        async for _ in stream:
            pass
    except Exception:  # noqa: BLE001 - client already gone
        pass


def _safetensors_files(path: str) -> list[Path]:
    p = Path(path)
    files = [p] if p.is_file() else sorted(p.glob("*.safetensors")) if p.is_dir() else []
    if not files:
        raise UserError(f"{path}: no .safetensors file there (the path is read on the server's machine)")
    return files


def _read_batches(f: Path, batch_bytes: int = 256 << 20):
    from safetensors import safe_open

    with safe_open(str(f), framework="pt") as st:
        batch, size = [], 0
        for name in st.keys():  # noqa: SIM118
            t = st.get_tensor(name)
            batch.append((name, t))
            size += t.nbytes
            if size >= batch_bytes:
                yield batch
                batch, size = [], 0
        if batch:
            yield batch
