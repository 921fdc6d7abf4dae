"""A fake SGLang server that follows SGLang's source, NOT SGLang itself (SGLang needs CUDA and cannot run here).

Written from the sglang 0.5.23 wheel: `srt/entrypoints/http_server.py` (routes, status codes, response bodies),
`srt/managers/io_struct.py` (request fields), `srt/sampling/sampling_params.py` (`top_k=-1` = off,
`stop_token_ids`, `sampling_seed`, `n`), `srt/managers/tokenizer_manager.py` (`meta_info.output_token_logprobs` as
`[logprob, token_id, text|None]`, `finish_reason` dicts, `input_token_logprobs` starting with a None logprob,
batch outputs prompt-major), `srt/multimodal/processors/qwen_vl.py` and `base_processor.py` (`image_data` of a
Qwen-VL model: the ids decoded and run through transformers' own Qwen2-VL processor, `sglang_contract_mm.py`).
Each server-side rule the client must respect cites its upstream file below. It is
configured from the `sglang.launch_server` argument list (`launch_args`), so a test can run the launcher's own
command against it. Generation is backed by the hf engine on the tiny checkpoint.

Deviation on purpose: `/update_weights_from_tensor` carries SGLang's MultiprocessingSerializer (pickle, CUDA IPC)
bytes in real SGLang; this fake never unpickles and decodes base64 safetensors instead (the tests inject a matching
serializer into the client)."""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from safetensors.torch import load as st_load
from safetensors.torch import load_file

from grpo_cli.rollout.base import SamplingParams
from grpo_cli.server.sglang_contract_mm import (
    ContractError,
    expanded_ids,
    logit_bias_bans,
    prompt_logprobs,
    qwen_vl_processor,
)

# srt/constants.py: GPU_MEMORY_ALL_TYPES, what `tags: null` means for release and resume.
ALL_TAGS = ("kv_cache", "weights", "cuda_graph")


def safetensors_b64_serializer(named_tensors: list) -> str:
    """The tests' pickle-free stand-in for SGLang's MultiprocessingSerializer.serialize(..., output_str=True)."""
    from safetensors.torch import save

    return base64.b64encode(save({n: t.detach().contiguous() for n, t in named_tensors})).decode()


def launch_flags(args: list[str]) -> dict[str, Any]:
    """The `sglang.launch_server` flags this fake models, read from a command line (defaults as SGLang's)."""
    def value(flag: str, default: str | None) -> str | None:
        return args[args.index(flag) + 1] if flag in args else default

    # server_args.py: `--attn-dp-size` (or the deprecated `--enable-dp-attention`) is DP attention, which
    # resolved_dict reports as enable_dp_attention; `--dp-size` counts data-parallel replicas.
    return {"tp_size": int(value("--tp-size", "1")), "api_key": value("--api-key", None),
            "deterministic": "--enable-deterministic-inference" in args, "dp_size": int(value("--dp-size", "1")),
            "dp_attention": int(value("--attn-dp-size", "1")) > 1 or "--enable-dp-attention" in args,
            "context_length": int(value("--context-length", "0")) or None}


def create_contract_app(served, *, launch_args: list[str] = (), api_key: str | None = None,
                        version: str = "0.5.23") -> FastAPI:
    flags = launch_flags(list(launch_args))
    api_key = api_key or flags["api_key"]
    engine = served.engine
    state: dict[str, Any] = {"weight_version": "default", "model_path": served.model, "requests": [], "log": [],
                             "flushes": 0, "released": set(), "session": None, "dead": None, **flags}
    sessions = tuple(map(int, re.findall(r"\d+", version)[:3])) >= (0, 5, 21)  # /begin_weight_update: 0.5.21+
    app = FastAPI()
    app.state.contract = state

    @app.middleware("http")
    async def gate(request: Request, call_next):
        if state["dead"]:
            return JSONResponse({"error": f"server is down ({state['dead']})"}, status_code=503)
        if api_key and request.url.path != "/health" and \
                request.headers.get("authorization") != f"Bearer {api_key}":
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        body = await request.body()
        state["log"].append((request.url.path, (await request.json()) if body else None))
        return await call_next(request)

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info():
        # tokenizer_manager._update_model_path_info: a disk update moves model_path to the folder it loaded.
        return {"model_path": state["model_path"], "served_model_name": state["model_path"],
                "tokenizer_path": served.model, "is_generation": True, "weight_version": state["weight_version"],
                "model_type": "llama", "architectures": served.architectures}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        # utils/common.py build_server_info: the resolved server args (flat), plus "version".
        return {"model_path": served.model, "tp_size": state["tp_size"], "dp_size": state["dp_size"],
                "enable_dp_attention": state["dp_attention"], "random_seed": 0,
                "enable_deterministic_inference": state["deterministic"], "version": version,
                "context_length": state["context_length"]}

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        obj = await request.json()
        state["requests"].append(obj)
        if obj.get("stream"):
            return JSONResponse({"error": "stream not supported by the contract server"}, status_code=400)
        if state["released"] & {"kv_cache", "cuda_graph"}:  # not an upstream rule: undefined behaviour there
            return _die(state, f"generate with released memory {sorted(state['released'])}")
        ids = obj["input_ids"]
        single = bool(ids) and isinstance(ids[0], int)
        ids = [ids] if single else ids
        params = obj.get("sampling_params") or {}
        params = params if isinstance(params, list) else [params] * len(ids)
        images = _image_data(obj.get("image_data"), ids, served)
        if isinstance(images, JSONResponse):
            return images
        outs = []
        try:
            ids = [_run_ids(served, state, prompt, imgs) for prompt, imgs in zip(ids, images, strict=True)]
            for prompt, p in zip(ids, params, strict=True):
                _check_context(state["context_length"], len(prompt), p.get("max_new_tokens"))
            for prompt, p, imgs in zip(ids, params, images, strict=True):
                for _ in range(p.get("n", 1) or 1):
                    outs.append(_one(engine, prompt, p, obj, state, imgs))
        except ContractError as exc:
            return JSONResponse(exc.body, status_code=exc.status)
        return outs[0] if single and len(outs) == 1 else outs

    _weight_routes(app, engine, state, sessions)
    _memory_routes(app, engine, state)
    return app


def _check_context(context_length: int | None, prompt: int, max_new: int | None) -> None:
    """`srt/managers/tokenizer_manager.py` `_validate_one_request` (a ValueError: 400): the input must be shorter
    than the context length, and input + max_new_tokens must stay below it. (A server without `--context-length`
    takes the model's; the fake then checks nothing.)"""
    if context_length is None:
        return
    if prompt >= context_length:
        raise ContractError(400, {"error": f"The input ({prompt} tokens) is longer than the model's context length "
                                           f"({context_length} tokens)."})
    if max_new is not None and prompt + max_new >= context_length:
        raise ContractError(400, {"error": f"Requested token count exceeds the model's maximum context length of "
                                           f"{context_length} tokens. You requested a total of {prompt + max_new} "
                                           f"tokens: {prompt} tokens from the input messages and {max_new} tokens "
                                           "for the completion."})


def _image_data(data, ids: list[list[int]], served) -> list | JSONResponse:
    """Each input's images (None: none). `srt/managers/io_struct.py` GenerateReqInput._normalize_image_data: a list
    must have one entry per input ("The length of image_data should be equal to the batch size.", a ValueError: 400),
    an entry a list of images (or one image); `srt/utils` load_image decodes a `data:...;base64,` string. How the
    images pair with the ids: `_run_ids`."""
    from grpo_cli.rollout import images as wire_images

    if data is None or data == []:
        return [None] * len(ids)
    if not isinstance(data, list) or len(data) != len(ids):
        return JSONResponse({"error": "The length of image_data should be equal to the batch size."},
                            status_code=400)
    if "images" not in served.capabilities:
        return JSONResponse({"error": f"{served.model} is not a multimodal model"}, status_code=400)
    out = []
    for i, entry in enumerate(data):
        entry = None if entry in (None, [None]) else (entry if isinstance(entry, list) else [entry])
        try:
            out.append(None if entry is None else [wire_images.from_data_url(u, where=f"image_data[{i}]")
                                                   for u in entry])
        except ValueError as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
    return out


def _run_ids(served, state: dict, prompt: list[int], images: list | None) -> list[int]:
    """The ids SGLang runs for one input: as sent without images; with images, as its Qwen-VL processor path
    rebuilds them (`sglang_contract_mm.expanded_ids`, transformers' processor built once per server)."""
    if images is None:
        return list(prompt)
    if "processor" not in state:
        state["processor"] = qwen_vl_processor(served.model)
    return expanded_ids(state["processor"], served.engine.model.config, prompt, images)


def _die(state: dict, why: str) -> JSONResponse:
    """A scheduler exception kills SGLang's whole process tree; here every later call answers 503."""
    state["dead"] = why
    return JSONResponse({"error": f"scheduler died: {why}"}, status_code=500)


def _weight_routes(app: FastAPI, engine, state: dict, sessions: bool) -> None:
    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        obj = await request.json()
        files = sorted(Path(obj["model_path"]).glob("*.safetensors"))
        if not files or not (Path(obj["model_path"]) / "config.json").is_file():
            return JSONResponse({"success": False, "message": f"cannot load {obj['model_path']}",
                                 "num_paused_requests": 0}, status_code=400)
        for f in files:
            engine.update_weights(load_file(str(f)).items(), 0)
        state["model_path"] = obj["model_path"]
        _after_update(state, obj)
        return {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request):
        obj = await request.json()
        # managers/tokenizer_control_mixin.py update_weights_from_tensor: `assert get_parallel().dp_size == 1`
        # (0.5.23; older: `dp_size == 1 or enable_dp_attention`) in the HTTP process, uncaught: a bare 500.
        if state["dp_size"] > 1 and not state["dp_attention"]:
            return Response("Internal Server Error", status_code=500)
        # scheduler_components/weight_updater.py (0.5.21+): refused outside begin/end_weight_update.
        if sessions and state["session"] is None:
            return JSONResponse({"success": False, "message": "update_weights_from_tensor must run between "
                                 "begin_weight_update() and end_weight_update()"}, status_code=400)
        payloads = obj["serialized_named_tensors"]
        if not isinstance(payloads, list) or not all(isinstance(p, str) for p in payloads):
            return JSONResponse({"success": False, "message": "serialized_named_tensors: list of base64 strings"},
                                status_code=400)
        # managers/tp_worker.py deserialize_own_rank: rank r reads payloads[r]; a short list is an IndexError in
        # the scheduler of rank r, which takes the server down.
        if len(payloads) < state["tp_size"]:
            return _die(state, f"IndexError: list index out of range (tp rank {len(payloads)} of {state['tp_size']})")
        per_rank = [st_load(base64.b64decode(payloads[r])) for r in range(state["tp_size"])]
        if any(sorted(t) != sorted(per_rank[0]) for t in per_rank):
            return _die(state, "TP ranks received different tensor names")
        engine.update_weights(per_rank[0].items(), 0)
        if state["session"] is not None:
            state["session"]["loaded_weights"] = True
        _after_update(state, obj)
        return {"success": True, "message": "Succeeded to update model weights."}

    if sessions:
        @app.post("/begin_weight_update")
        async def begin_weight_update(request: Request):
            obj = await request.json()
            # scheduler_components/weight_updater.py begin_weight_update: one session at a time.
            if state["session"] is not None:
                return JSONResponse({"success": False, "message": "a weight-update session is already open; call "
                                     "end_weight_update() first"}, status_code=400)
            state["session"] = {"selector": obj.get("selector", "all"), "loaded_weights": False}
            return {"success": True, "message": "Success"}

        @app.post("/end_weight_update")
        async def end_weight_update(request: Request):
            await request.json()
            if state["session"] is None:
                return JSONResponse({"success": False, "message": "no weight-update session is open; call "
                                     "begin_weight_update() first"}, status_code=400)
            state["session"] = None
            return {"success": True, "message": "Success"}


def _memory_routes(app: FastAPI, engine, state: dict) -> None:
    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        state["flushes"] += 1
        return Response("Cache flushed.\n", status_code=200)

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release(request: Request):
        # weight_updater.py release_memory_occupation: null/empty tags = all; tags are added to a set.
        tags = (await request.json()).get("tags") or ALL_TAGS
        if "weights" in tags:  # SGLang drops (does not offload) released weights
            with torch.no_grad():
                for p in engine.model.parameters():
                    p.normal_()
        state["released"] |= set(tags)

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume(request: Request):
        # weight_updater.py resume_memory_occupation: null/empty tags = all, each `offload_tags.remove(tag)`:
        # resuming a tag that was not released raises KeyError in the scheduler.
        tags = (await request.json()).get("tags") or ALL_TAGS
        missing = [t for t in tags if t not in state["released"]]
        if missing:
            return _die(state, f"KeyError: {missing[0]!r}")
        state["released"] -= set(tags)


def _after_update(state: dict, obj: dict) -> None:
    """Per call, so a client may send its buckets in several calls and flush / set the version on the last only:
    `managers/tokenizer_control_mixin.py` sets the version when the call succeeded and `weight_version is not None`;
    `scheduler_components/weight_updater.py` flushes when the request's `flush_cache` (default true) is."""
    if obj.get("weight_version") is not None:
        state["weight_version"] = obj["weight_version"]
    if obj.get("flush_cache", True):
        state["flushes"] += 1


def _one(engine, prompt: list[int], p: dict, obj: dict, state: dict, images: list | None = None) -> dict:
    max_new = p.get("max_new_tokens", 128)
    with_images = {} if images is None else {"images": [images]}
    meta: dict[str, Any] = {"id": "rid", "prompt_tokens": len(prompt), "weight_version": state["weight_version"]}
    if max_new == 0:
        out_ids: list[int] = []
        meta["finish_reason"] = {"type": "length", "length": 0}
        if images is not None:
            meta["input_token_logprobs"] = prompt_logprobs(engine, prompt, images)
        else:
            lps = engine.score([prompt])[0] if len(prompt) > 1 else []
            meta["input_token_logprobs"] = [[None, prompt[0], None]] + [[lp, t, None] for lp, t in
                                                                        zip(lps, prompt[1:])]
        meta["output_token_logprobs"] = []
    else:
        top_k = p.get("top_k", -1)
        # sampling/sampling_batch_info.py: sampling_seed is used only with --enable-deterministic-inference
        # (then a missing seed means 42); otherwise the sampler draws from the global RNG.
        seed = (42 if p.get("sampling_seed") is None else p["sampling_seed"]) if state["deterministic"] else None
        sampling = SamplingParams(n=1, max_tokens=max_new, temperature=p.get("temperature", 1.0),
                                  top_p=p.get("top_p", 1.0), top_k=0 if top_k in (-1, None) else top_k, seed=seed)
        # sampling_batch_info.py: the request's logit_bias is added to the logits, nothing else is banned (the hf
        # engine would ban a VLM's placeholders by itself: here it bans what the request bans).
        bans = logit_bias_bans(p["logit_bias"], engine.model.config.get_text_config().vocab_size) \
            if p.get("logit_bias") else []
        saved = engine.eos_token_ids
        engine.eos_token_ids = list(p.get("stop_token_ids") or saved)
        engine.banned_ids = lambda: bans or None
        try:
            batch = engine.generate([prompt], sampling, **with_images)
        finally:
            engine.eos_token_ids = saved
            del engine.banned_ids
        out_ids, lps = batch.completion_ids[0], batch.sampler_logprobs[0]
        meta["finish_reason"] = ({"type": "stop", "matched": out_ids[-1]} if batch.finish_reasons[0] == "stop"
                                 else {"type": "length", "length": max_new})
        if obj.get("return_logprob"):
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, out_ids, strict=True)]
            meta["input_token_logprobs"] = []
    meta["completion_tokens"] = len(out_ids)
    return {"output_ids": out_ids, "meta_info": meta}
