"""The `grpo serve-rollout` FastAPI app: one engine behind a lock, bearer-token auth, body limits, and errors
that come back as 4xx/5xx JSON `{"error": ...}` instead of crashing the server."""

from __future__ import annotations

import hmac
import json

import anyio
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

import grpo_cli
from grpo_cli.rollout import images as wire_images
from grpo_cli.rollout.base import RolloutError, SamplingParams
from grpo_cli.rollout.transport.codec import FrameError
from grpo_cli.server.engines import Served
from grpo_cli.server.state import (
    Conflict,
    GenerateBody,
    ScoreBody,
    SleepBody,
    State,
    RequestError,
    WakeBody,
    reset_cache,
)

OPEN_PATHS = {"/health"}
STREAM_PATHS = {"/update_weights"}


class Guard:
    """Pure-ASGI middleware: bearer token on every path but /health (checked before any body is read), and a
    byte limit on bodies of every path but the weight stream (which its frame reader bounds)."""

    def __init__(self, app, *, token: str | None, max_body: int) -> None:
        self.app, self.max_body = app, max_body
        self.expected = f"Bearer {token}".encode() if token else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        headers = dict(scope["headers"])
        if self.expected is not None and path not in OPEN_PATHS:
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
                return await _send_json(send, 401, "missing or wrong bearer token (Authorization: Bearer <token>)",
                                        [(b"www-authenticate", b"Bearer")])
        if path in STREAM_PATHS:
            return await self.app(scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            return await _send_json(send, 413, f"request body over the server limit of {self.max_body} bytes")
        body = bytearray()  # small JSON bodies: read (bounded) before the app sees them, then replay
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return
            body += message.get("body", b"")
            if len(body) > self.max_body:
                return await _send_json(send, 413, f"request body over the server limit of {self.max_body} bytes")
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class HangFrom:
    """Pure-ASGI wrapper for `GRPO_INJECT_FAULT=server_hang:step=S`: from the first /generate that arrives while the
    server holds the weights the trainer pushed after step S-1 (version S-1: the rollout of step S), no request on any
    path is answered, /health included, as when the engine hangs; the trainer's timeouts and
    `rollout.server.on_failure` take over."""

    def __init__(self, app, st: State, *, step: int) -> None:
        self.app, self.st, self.version = app, st, step - 1
        self.hung = False

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and not self.hung and scope["path"] == "/generate":
            self.hung = self.st.weight_version >= self.version
        if self.hung and scope["type"] == "http":
            await anyio.sleep_forever()
        return await self.app(scope, receive, send)


async def _send_json(send, status: int, message: str, extra=()) -> None:
    body = json.dumps({"error": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *extra]})
    await send({"type": "http.response.body", "body": body})


def create_app(served: Served, *, token: str | None = None, max_request_bytes: int = 16 << 20,
               max_frame_bytes: int = 4 << 30, on_startup=None, hang_from_step: int | None = None):
    """The ASGI app (FastAPI wrapped in `Guard`) serving `served`; with `hang_from_step`, wrapped in `HangFrom`."""
    st = State(served)
    app = FastAPI(title="grpo serve-rollout", version=grpo_cli.__version__, docs_url=None, redoc_url=None,
                  openapi_url=None, on_startup=[on_startup] if on_startup else None)
    app.state.rollout = st
    _errors(app)
    _routes(app, st)
    from grpo_cli.server.weights import weight_routes

    weight_routes(app, st, max_frame_bytes=max_frame_bytes)
    guarded = Guard(app, token=token, max_body=max_request_bytes)
    return guarded if hang_from_step is None else HangFrom(guarded, st, step=hang_from_step)


def _errors(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(_req, exc: RequestValidationError):
        msgs = [f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors()[:5]]
        return JSONResponse({"error": "invalid request: " + "; ".join(msgs)}, status_code=400)

    @app.exception_handler(Conflict)
    async def _conflict(_req, exc: Exception):
        return JSONResponse({"error": str(exc)}, status_code=409)

    @app.exception_handler(RequestError)
    @app.exception_handler(FrameError)
    @app.exception_handler(RolloutError)
    async def _user(_req, exc: Exception):
        return JSONResponse({"error": str(exc)}, status_code=400)

    @app.exception_handler(Exception)
    async def _internal(_req, exc: Exception):
        return JSONResponse({"error": f"{type(exc).__name__}: {exc}"}, status_code=500)


def _check_ids(seqs: list[list[int]], vocab: int, what: str, min_len: int = 1) -> None:
    for i, s in enumerate(seqs):
        if len(s) < min_len:
            raise RequestError(f"{what}[{i}] has {len(s)} tokens; at least {min_len} needed")
        if s and (min(s) < 0 or max(s) >= vocab):
            raise RequestError(f"{what}[{i}] has token ids outside [0, {vocab})")


def _routes(app: FastAPI, st: State) -> None:
    sv = st.served

    @app.get("/health")
    async def health():
        return {"status": "ok", "state": st.state}

    @app.get("/info")
    async def info():
        return {"model": sv.model, "engine": sv.engine_name, "dtype": sv.dtype, "weight_version": st.weight_version,
                "state": st.state, "last_error": st.last_error, "vocab_size": sv.vocab_size,
                "architectures": sv.architectures, "max_model_len": sv.max_model_len,
                "capabilities": sv.capabilities, "eos_token_ids": sv.eos_token_ids,
                "server": f"grpo-cli {grpo_cli.__version__}",
                "num_parameters": len(sv.param_shapes)}

    @app.post("/generate")
    async def generate(body: GenerateBody):
        s = body.sampling
        _check_ids(body.prompt_ids, sv.vocab_size, "prompt_ids")
        longest = max(len(p) for p in body.prompt_ids)
        if longest + s.max_tokens > sv.max_model_len:
            raise RequestError(f"prompt of {longest} tokens + max_tokens {s.max_tokens} exceeds the server's "
                            f"max_model_len {sv.max_model_len}")
        stop = body.stop_token_ids
        if stop is not None:
            _check_ids([stop], sv.vocab_size, "stop_token_ids", min_len=0)
        sampling = SamplingParams(n=s.n, max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
                                  top_k=s.top_k, seed=s.seed)
        images = _images(sv, body.images, len(body.prompt_ids), "images")
        async with st.lock:
            _require_ready(st)
            batch = await anyio.to_thread.run_sync(_generate, sv.engine, body.prompt_ids, sampling, stop, images)
            version = st.weight_version
        return {"completion_ids": batch.completion_ids, "finish_reasons": batch.finish_reasons,
                "sampler_logprobs": batch.sampler_logprobs, "weight_version": version, "timings": batch.timings}

    @app.post("/score")
    async def score(body: ScoreBody):
        _check_ids(body.sequences, sv.vocab_size, "sequences", min_len=2)
        if max(len(s) for s in body.sequences) > sv.max_model_len:
            raise RequestError(f"a sequence is longer than the server's max_model_len {sv.max_model_len}")
        images = _images(sv, body.images, len(body.sequences), "images")
        async with st.lock:
            _require_ready(st)
            logprobs = await anyio.to_thread.run_sync(_score, sv.engine, body.sequences, images)
            version = st.weight_version
        return {"logprobs": logprobs, "weight_version": version}

    @app.post("/sleep")
    async def sleep(body: SleepBody):
        if body.level and sv.engine_name == "vllm" and "sleep" not in sv.capabilities:
            raise RequestError("this server was started without sleep mode: restart it with --sleep-level 1 or 2")
        async with st.lock:
            _require_no_session(st)
            await anyio.to_thread.run_sync(sv.engine.sleep, body.level)
            st.state = "sleeping" if body.level else st.state
        return {"state": st.state}

    @app.post("/wake_up")
    async def wake_up(body: WakeBody | None = None):
        async with st.lock:
            _require_no_session(st)
            await anyio.to_thread.run_sync(sv.engine.wake_up, body.tags if body else None)
            if st.state == "sleeping":
                st.state = "ready"
        return {"state": st.state}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        async with st.lock:
            _require_no_session(st)
            await anyio.to_thread.run_sync(reset_cache, sv.engine)
        return {"reset": True}


def _require_ready(st: State) -> None:
    _require_no_session(st)
    if st.state == "inconsistent":
        raise Conflict(f"weights are inconsistent after a failed update ({st.last_error}); push the weights again")
    if st.state == "sleeping":
        raise Conflict("the engine is asleep: call /wake_up first")


def _require_no_session(st: State) -> None:
    """Between the bucket requests of an NCCL update the engine is mid-load (and the lock free): refuse."""
    if st.session is not None:
        raise Conflict(f"an NCCL weight update to v{st.session.apply.version} is in progress (or its trainer stopped "
                       "between buckets): push the weights again, or wait for the update to complete")


def _images(sv: Served, rows: list[list[str]] | None, count: int, what: str):
    """A request's images decoded (one list per prompt/sequence), or None without any; refused (400) when the
    served engine does not take images or the lists do not match the prompts."""
    if rows is None:
        return None
    if "images" not in sv.capabilities:
        raise RequestError(f"this server's {sv.engine_name} engine does not take images (see /info capabilities): "
                           "start it with --engine hf for a vision-language model")
    if len(rows) != count:
        raise RequestError(f"{what} has {len(rows)} lists for {count} prompts: send one list per prompt")
    try:
        return wire_images.decode(rows, what=what)
    except ValueError as exc:
        raise RequestError(str(exc)) from exc


def _with_images(images) -> dict:
    """`images=` only where a request has images, so a text-only engine keeps its text-only signature."""
    return {} if images is None else {"images": images}


def _score(engine, sequences, images):
    return engine.score(sequences, **_with_images(images))


def _generate(engine, prompt_ids, sampling, stop_token_ids, images=None):
    """The hf/vllm engines stop at their own EOS ids; a client may pass the trainer's (e.g. chat end tokens)."""
    if stop_token_ids is None:
        return engine.generate(prompt_ids, sampling, **_with_images(images))
    saved = engine.eos_token_ids
    engine.eos_token_ids = list(stop_token_ids) or saved
    try:
        return engine.generate(prompt_ids, sampling, **_with_images(images))
    finally:
        engine.eos_token_ids = saved
