"""Weight endpoints of `grpo serve-rollout`: the streamed frame upload, a same-host shared-memory file handed over
by name, loading from disk, and the NCCL path.

An update holds the engine lock from its first byte to its last, so no generation sees half-new weights; one
that fails after a tensor was loaded marks the server `inconsistent` until a complete update arrives. An NCCL update
spans one request per bucket (`NcclSession`): between them the state stays `updating`, which refuses generation."""

from __future__ import annotations

import mmap
import queue
import threading
from pathlib import Path

import anyio
import torch
from fastapi import FastAPI, Request

from grpo_cli.rollout.transport.codec import SHM_DIR, FrameReader, checked_frames, read_stream
from grpo_cli.server.state import CommBody, DiskBody, NcclUpdateBody, RequestError, ShmBody, State, reset_cache
from grpo_cli.server import raw_body
from grpo_cli.server.relay import Relay
from grpo_cli.server.upload import StreamedBody

RAW_READ_TIMEOUT_S = 300.0
"""A weight stream read from the socket (`raw_body`) fails after this long without a byte from the client."""


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
                raise RequestError(f"tensor {name!r} sent twice in one update")
            if shapes and name not in shapes:
                close = [n for n in shapes if n.split(".")[-1] == name.split(".")[-1]][:3]
                raise RequestError(f"unknown tensor {name!r} for this model (e.g. {close or list(shapes)[:3]})")
            if shapes and tuple(t.shape) != shapes[name]:
                raise RequestError(f"tensor {name!r} has shape {tuple(t.shape)}, the model's is {shapes[name]}")
            self.seen.add(name)

    def add(self, tensors) -> None:
        """Count tensors already checked (by name and shape, before they were received)."""
        self.tensors += len(tensors)
        self.bytes += sum(t.nbytes for _, t in tensors)

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
                raise RequestError("the engine did not take every tensor of the update")

        await anyio.to_thread.run_sync(one_thread, run)

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


LOAD_THREADS = 1
"""Intra-op threads of the engine's copies during an update. With the default (one per core), every parameter copy
is a parallel region after which libgomp's idle threads spin-wait (OMP_WAIT_POLICY unset): 28% of the server's
CPU in a profile of a 403 MB HTTP sync on 2 cores, taken from the thread receiving the next frame. One thread copies
at memory speed (~0.05 s for 403 MB) and leaves the other cores to the receiver; generation keeps its threads (the
count is set back after the update, in the worker thread that ran it: OpenMP's setting is per thread)."""


def one_thread(fn, *args):
    """`fn(*args)` with torch's intra-op threads at LOAD_THREADS, set back afterwards."""
    saved = torch.get_num_threads()
    torch.set_num_threads(LOAD_THREADS)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(saved)


class NcclSession:
    """One NCCL update across its bucket requests. The engine's single `update_weights` call of the update (vLLM
    opens one reload session per call) runs on a thread of its own, fed bucket by bucket: `feed` returns once the
    engine took the bucket (it asked for the next tensor), or, for the last, once the call returned. A bucket that
    does not come within the group's timeout fails the update."""

    def __init__(self, st: State, version: int, prior: str, timeout_s: float) -> None:
        self.apply, self.prior, self.timeout_s = _Apply(st, version), prior, timeout_s
        self.next_bucket = 0
        self.start = anyio.current_time()
        self.error: BaseException | None = None
        self._buckets: queue.Queue = queue.Queue()
        self._taken = threading.Semaphore(0)
        self._thread = threading.Thread(target=self._run, name=f"nccl-update-v{version}", daemon=True)
        self._thread.start()

    def _tensors(self):
        while True:
            try:
                bucket = self._buckets.get(timeout=self.timeout_s)
            except queue.Empty:
                raise RequestError(f"NCCL update to v{self.apply.version}: bucket {self.next_bucket} did not come "
                                f"within {self.timeout_s:g} s (the trainer stopped mid-update)") from None
            if bucket is None:
                return
            if isinstance(bucket, BaseException):
                raise bucket
            yield from bucket
            del bucket  # the engine has the bucket: hold nothing of it while waiting for the next
            self._taken.release()

    def _run(self) -> None:
        finished = []

        def marked():
            yield from self._tensors()
            finished.append(True)

        try:
            self.apply.st.served.engine.update_weights(marked(), self.apply.version)
            if not finished:
                raise RequestError("the engine did not take every tensor of the update")
        except BaseException as e:  # noqa: BLE001 - handed to the request that fed the bucket
            self.error = e
        finally:
            self._taken.release()

    def feed(self, tensors: list, last: bool) -> None:
        """Hand one received bucket to the engine and wait until it took it (a worker thread's call)."""
        self._buckets.put(tensors)
        if last:
            self._buckets.put(None)
            self._thread.join(self.timeout_s)
            if self._thread.is_alive():
                raise RequestError(f"the engine did not finish loading v{self.apply.version} within "
                                   f"{self.timeout_s:g} s")
        elif not self._taken.acquire(timeout=self.timeout_s):
            raise RequestError(f"the engine did not take NCCL bucket {self.next_bucket} within {self.timeout_s:g} s")
        if self.error is not None:
            raise self.error
        self.next_bucket += 1

    def abort(self, why: str) -> None:
        """Stop the engine's call (the next tensor it asks for raises) and wait for it, bounded."""
        self._buckets.put(RequestError(why))
        self._thread.join(self.timeout_s)


def end_session(st: State, why: str) -> None:
    """End an NCCL update left unfinished (its trainer went away, or another update begins): the weights are then
    `inconsistent` until a complete update. Blocks (joins the engine's thread): call it from a worker thread."""
    session, st.session = st.session, None
    if session is not None:
        session.abort(why)
        session.apply.failed(RequestError(why), session.prior)


async def _end_session(st: State, why: str) -> None:
    if st.session is not None:
        await anyio.to_thread.run_sync(end_session, st, why)


async def _whole_update(st: State, version: int, what: str, tensors, body: StreamedBody | None = None) -> dict:
    """One update in one request, under the engine lock: end an NCCL update left unfinished, mark the server
    `updating`, load `tensors(apply)` (lazy: the engine pulls them as they arrive; a streamed `body` is read
    meanwhile) and reset the prefix cache. A failure marks the server (`_Apply.failed`) and raises; success commits
    `version`."""
    start = anyio.current_time()
    async with st.lock:
        await _end_session(st, f"{what} to v{version} began")
        prior, st.state = st.state, "updating"
        apply = _Apply(st, version)
        try:
            failure = None
            async with anyio.create_task_group() as tg:
                if body is not None:
                    tg.start_soon(body.fill)
                try:
                    await apply.load_all(tensors(apply))
                except Exception as e:  # noqa: BLE001 - raised below, outside the task group (no ExceptionGroup)
                    failure = e
                    if body is not None:
                        body.discard()
            if failure is not None:
                raise failure
            await anyio.to_thread.run_sync(reset_cache, st.served.engine)
        except Exception as e:
            apply.failed(e, prior if prior != "updating" else "ready")
            raise
        return apply.done(anyio.current_time() - start)


def weight_routes(app: FastAPI, st: State, *, max_frame_bytes: int) -> None:
    """Register the weight endpoints; each handler finds `st` and the frame limit on `app.state` (`_served`)."""
    app.state.rollout, app.state.max_frame_bytes = st, max_frame_bytes
    for path, handler in (("/update_weights", update_weights), ("/update_weights_shm", update_weights_shm),
                          ("/update_weights_from_disk", update_weights_from_disk),
                          ("/init_communicator", init_communicator), ("/update_weights_nccl", update_weights_nccl)):
        app.add_api_route(path, handler, methods=["POST"])


def _served(request: Request) -> tuple[State, int]:
    """The served engine's state and the largest frame an update may carry (set by `weight_routes`)."""
    return request.app.state.rollout, request.app.state.max_frame_bytes


async def update_weights(request: Request, version: int, relay: str = ""):
    """A streamed frame upload: read from the socket (`raw_body`) where the server can, else from the ASGI stream.
    `relay`: servers to forward it to as it is read (`server/relay.py`); their answers come back under `relayed`."""
    st, max_frame_bytes = _served(request)
    if version < 0:
        raise RequestError("version must be >= 0")
    chain = [u for u in relay.split(",") if u]
    fwd = Relay(chain, version=version, headers={k: v for k, v in request.headers.items()
                                                 if k.lower() == "authorization"}) if chain else None
    reader = FrameReader(max_frame_bytes=max_frame_bytes, buffer=st.receive_buffer)
    raw = raw_body.take(request.scope, request.receive, timeout_s=RAW_READ_TIMEOUT_S)
    try:
        if raw is None:
            body = StreamedBody(request.stream())
            answer = await _whole_update(st, version, "an HTTP update",
                                         lambda apply: _frames(body, reader, apply, version, fwd), body=body)
        else:
            readinto = raw.readinto if fwd is None else fwd.tee_readinto(raw.readinto)
            answer = await _whole_update(st, version, "an HTTP update",
                                         lambda apply: _checked(reader.pull(readinto), apply, version))
    except Exception:
        if raw is not None:
            await anyio.to_thread.run_sync(raw.drain)  # the client reads the error, not a reset connection
        raise
    finally:
        if raw is not None:
            raw.close()
        if fwd is not None:
            fwd.close()
    if fwd is not None:
        answer["relayed"] = await anyio.to_thread.run_sync(fwd.answers)
    return answer


async def update_weights_shm(request: Request, body: ShmBody):
    """The frames of a file in /dev/shm the trainer wrote on this host, mapped copy-on-write."""
    st, max_frame_bytes = _served(request)
    path = Path(SHM_DIR) / body.name
    if not path.is_file() or path.stat().st_size != body.bytes:
        raise RequestError(f"{path}: no file of {body.bytes} bytes there; the shm weight transport needs the "
                           "server on the trainer's host, run by the same user (else use weight_transport=http)")

    def tensors(apply: _Apply):
        with path.open("rb") as f:  # the mapping outlives the file object; unmapped when the views go
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if body.bytes else b""
        yield from _checked(read_stream(memoryview(mapped), max_frame_bytes=max_frame_bytes), apply, body.version)

    return await _whole_update(st, body.version, "a shared-memory update", tensors)


async def update_weights_from_disk(request: Request, body: DiskBody):
    files = _safetensors_files(body.path)
    return await _whole_update(_served(request)[0], body.version, "an update from disk",
                               lambda apply: (t for f in files for batch in _read_batches(f)
                                              for t in apply.counted(batch)))


async def init_communicator(request: Request, body: CommBody):
    from grpo_cli.rollout.transport.nccl import NcclReceiver, nccl_available

    st = _served(request)[0]
    ok, why = nccl_available()
    if not ok:
        raise RequestError(f"NCCL weight sync is not available on this server: {why}; use the HTTP path "
                           "(rollout.server.weight_transport=http)")
    async with st.lock:
        await _end_session(st, "the trainer joined again (/init_communicator)")
        if st.comm is not None:
            st.comm.close()
            st.comm = None
        st.comm = await anyio.to_thread.run_sync(
            lambda: NcclReceiver.join(body.host, body.port, body.world_size, body.rank, timeout_s=body.timeout_s))
    return {"rank": body.rank}


async def update_weights_nccl(request: Request, body: NcclUpdateBody):
    """One bucket: check its names and shapes, receive its broadcasts, hand them to the engine, answer. Nothing of the
    next bucket is allocated before this one is loaded; the last bucket commits the version."""
    st = _served(request)[0]
    if st.comm is None:
        raise RequestError("no NCCL communicator: call /init_communicator first")
    if not len(body.names) == len(body.dtypes) == len(body.shapes):
        raise RequestError("names, dtypes and shapes must have the same length")
    async with st.lock:
        try:
            session = await _session_for(st, body)
            session.apply.check([(n, _Shape(s)) for n, s in zip(body.names, body.shapes, strict=True)])
            tensors = await anyio.to_thread.run_sync(st.comm.receive, body.names, body.dtypes, body.shapes)
            session.apply.add(tensors)
            await anyio.to_thread.run_sync(session.feed, tensors, body.last)
            del tensors
            if body.last:
                await anyio.to_thread.run_sync(reset_cache, st.served.engine)
        except Exception as e:
            await _end_session(st, f"NCCL bucket {body.bucket} of v{body.version} failed: {e}")
            raise
        if not body.last:
            return {"bucket": body.bucket, "tensors": len(body.names), "weight_version": st.weight_version}
        st.session = None
        return session.apply.done(anyio.current_time() - session.start)


async def _session_for(st: State, body: NcclUpdateBody) -> NcclSession:
    """The update this bucket belongs to: bucket 0 begins one (ending any left unfinished), the others continue it."""
    if body.bucket == 0:
        await _end_session(st, f"a new NCCL update to v{body.version} began")
        prior, st.state = st.state, "updating"
        st.session = NcclSession(st, body.version, prior, st.comm.timeout_s)
    session = st.session
    if session is None or session.apply.version != body.version or session.next_bucket != body.bucket:
        want = f"bucket {session.next_bucket} of v{session.apply.version}" if session else "bucket 0"
        raise RequestError(f"NCCL bucket {body.bucket} of v{body.version} out of order (expected {want})")
    return session


class _Shape:
    def __init__(self, shape: list[int]) -> None:
        self.shape = tuple(shape)


def _frames(body: StreamedBody, reader: FrameReader, apply: _Apply, version: int, fwd: Relay | None = None):
    """Tensors of the upload, in order, decoded by the engine's worker thread as the body arrives (and forwarded)."""

    def received():
        for chunk in body.chunks() if fwd is None else fwd.tee_chunks(body.chunks()):
            yield from reader.feed(chunk)
        reader.finish()

    yield from _checked(received(), apply, version)


def _checked(frames, apply: _Apply, version: int):
    """Tensors of a frame stream, checked (`codec.checked_frames`: every frame for `version`, nothing after the end
    frame, its counts equal what arrived), each frame's through `apply.counted`."""
    for frame in checked_frames(frames, version):
        yield from apply.counted(frame.tensors)


def _safetensors_files(path: str) -> list[Path]:
    p = Path(path)
    files = [p] if p.is_file() else sorted(p.glob("*.safetensors")) if p.is_dir() else []
    if not files:
        raise RequestError(f"{path}: no .safetensors file there (the path is read on the server's machine)")
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
