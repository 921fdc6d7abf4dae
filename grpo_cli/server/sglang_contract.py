"""A contract stand-in for an SGLang server, NOT SGLang itself (SGLang needs CUDA and cannot run here).

Written from sglang 0.5.23's documented native API: `sglang/srt/entrypoints/http_server.py` (routes, status
codes, response bodies) and `sglang/srt/managers/io_struct.py` (`GenerateReqInput`,
`UpdateWeightFromDiskReqInput`, `UpdateWeightsFromTensorReqInput`, `Release/ResumeMemoryOccupationReqInput`),
`sampling_params.py` (`max_new_tokens`, `top_k=-1` = off, `stop_token_ids`, `sampling_seed`, `n`) and
`tokenizer_manager.py` (`meta_info.output_token_logprobs` as `[logprob, token_id, text|None]`, `finish_reason`
as `{"type": "stop", "matched": id}` / `{"type": "length", "length": n}`, `input_token_logprobs` starting with
a None logprob, batch outputs prompt-major). Generation is backed by the hf engine on the tiny checkpoint.

Deviation on purpose: `/update_weights_from_tensor` carries SGLang's MultiprocessingSerializer (pickle) bytes in
real SGLang; this stand-in never unpickles and decodes base64 safetensors instead (the tests inject a
matching serializer into the client)."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from safetensors.torch import load as st_load
from safetensors.torch import load_file

from grpo_cli.rollout.base import SamplingParams


def safetensors_b64_serializer(named_tensors: list) -> str:
    """The tests' pickle-free stand-in for SGLang's MultiprocessingSerializer.serialize(..., output_str=True)."""
    from safetensors.torch import save

    return base64.b64encode(save({n: t.detach().contiguous() for n, t in named_tensors})).decode()


def create_contract_app(served, *, api_key: str | None = None) -> FastAPI:
    engine = served.engine
    state: dict[str, Any] = {"weight_version": "default", "requests": [], "flushes": 0, "released": False}
    app = FastAPI()
    app.state.contract = state

    @app.middleware("http")
    async def auth(request: Request, call_next):
        if api_key and request.url.path != "/health" and \
                request.headers.get("authorization") != f"Bearer {api_key}":
            return JSONResponse({"error": "Unauthorized"}, status_code=401)
        return await call_next(request)

    @app.get("/health")
    async def health():
        return Response(status_code=200)

    @app.get("/model_info")
    async def model_info():
        return {"model_path": served.model, "tokenizer_path": served.model, "is_generation": True,
                "weight_version": state["weight_version"], "model_type": "llama",
                "architectures": served.architectures}

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        obj = await request.json()
        state["requests"].append(obj)
        if obj.get("stream"):
            return JSONResponse({"error": "stream not supported by the contract server"}, status_code=400)
        ids = obj["input_ids"]
        single = bool(ids) and isinstance(ids[0], int)
        ids = [ids] if single else ids
        params = obj.get("sampling_params") or {}
        params = params if isinstance(params, list) else [params] * len(ids)
        outs = []
        for prompt, p in zip(ids, params, strict=True):
            for _ in range(p.get("n", 1) or 1):
                outs.append(_one(engine, prompt, p, obj, state))
        return outs[0] if single and len(outs) == 1 else outs

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        obj = await request.json()
        files = sorted(Path(obj["model_path"]).glob("*.safetensors"))
        if not files or not (Path(obj["model_path"]) / "config.json").is_file():
            return JSONResponse({"success": False, "message": f"cannot load {obj['model_path']}",
                                 "num_paused_requests": 0}, status_code=400)
        for f in files:
            engine.update_weights(load_file(str(f)).items(), 0)
        _after_update(state, obj)
        return {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request):
        obj = await request.json()
        payloads = obj["serialized_named_tensors"]
        if not isinstance(payloads, list) or not all(isinstance(p, str) for p in payloads):
            return JSONResponse({"success": False, "message": "serialized_named_tensors: list of base64 strings"},
                                status_code=400)
        engine.update_weights(st_load(base64.b64decode(payloads[0])).items(), 0)  # one copy per TP rank
        _after_update(state, obj)
        return {"success": True, "message": "Succeeded to update model weights."}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        state["flushes"] += 1
        return Response("Cache flushed.\n", status_code=200)

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release(request: Request):
        tags = (await request.json()).get("tags")
        if tags is None or "weights" in tags:  # SGLang drops (does not offload) released weights
            with torch.no_grad():
                for p in engine.model.parameters():
                    p.normal_()
        state["released"] = True

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume(request: Request):
        await request.json()
        state["released"] = False

    return app


def _after_update(state: dict, obj: dict) -> None:
    if obj.get("weight_version") is not None:
        state["weight_version"] = obj["weight_version"]
    if obj.get("flush_cache", True):
        state["flushes"] += 1


def _one(engine, prompt: list[int], p: dict, obj: dict, state: dict) -> dict:
    max_new = p.get("max_new_tokens", 128)
    meta: dict[str, Any] = {"id": "rid", "prompt_tokens": len(prompt), "weight_version": state["weight_version"]}
    if max_new == 0:
        out_ids: list[int] = []
        meta["finish_reason"] = {"type": "length", "length": 0}
        lps = engine.score([prompt])[0] if len(prompt) > 1 else []
        meta["input_token_logprobs"] = [[None, prompt[0], None]] + [[lp, t, None] for lp, t in zip(lps, prompt[1:])]
        meta["output_token_logprobs"] = []
    else:
        top_k = p.get("top_k", -1)
        sampling = SamplingParams(n=1, max_tokens=max_new, temperature=p.get("temperature", 1.0),
                                  top_p=p.get("top_p", 1.0), top_k=0 if top_k in (-1, None) else top_k,
                                  seed=p.get("sampling_seed"))
        saved = engine.eos_token_ids
        engine.eos_token_ids = list(p.get("stop_token_ids") or saved)
        try:
            batch = engine.generate([prompt], sampling)
        finally:
            engine.eos_token_ids = saved
        out_ids, lps = batch.completion_ids[0], batch.sampler_logprobs[0]
        meta["finish_reason"] = ({"type": "stop", "matched": out_ids[-1]} if batch.finish_reasons[0] == "stop"
                                 else {"type": "length", "length": max_new})
        if obj.get("return_logprob"):
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, out_ids, strict=True)]
            meta["input_token_logprobs"] = []
    meta["completion_tokens"] = len(out_ids)
    return {"output_ids": out_ids, "meta_info": meta}
