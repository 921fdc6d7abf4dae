"""`grpo serve-rollout`: a rollout server for `rollout.mode: server` (also `python -m grpo_cli.cli.serve`)."""

from __future__ import annotations

import contextlib
import os
from typing import Annotated, Literal, Optional

import typer

from grpo_cli.cli.common import user_errors


def serve_rollout(
    model: Annotated[str, typer.Option(help="Checkpoint folder (Hugging Face format); `builtin:tiny` works.")],
    engine: Annotated[Literal["hf", "vllm", "sglang"], typer.Option(
        help="hf: transformers generate; vllm: vLLM in-process; sglang: launch "
             "`python -m sglang.launch_server` (SGLang's native API).")] = "hf",
    host: Annotated[str, typer.Option(help="Interface to listen on; beyond loopback, set a token.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port; 0 picks a free one (the URL is printed).")] = 8000,
    tensor_parallel_size: Annotated[int, typer.Option(min=1, help="sglang tensor-parallel size (hf and vllm serve "
                                                                  "one device per server: 1).")] = 1,
    gpu_memory_utilization: Annotated[float, typer.Option(min=0.01, max=1.0,
                                                          help="vllm/sglang share of device memory.")] = 0.5,
    dtype: Annotated[Literal["auto", "float32", "bfloat16", "float16"], typer.Option(
        help="Engine dtype; auto uses the checkpoint's.")] = "auto",
    max_model_len: Annotated[int | None, typer.Option(min=1, help="Longest prompt+completion served.")] = None,
    sleep_level: Annotated[int, typer.Option(min=0, max=2,
                                             help="vllm sleep mode (0 off, 1, 2); sglang: memory saver.")] = 0,
    token_env: Annotated[str, typer.Option(help="Environment variable holding the bearer token every call but "
                                                "/health must carry (unset: no token).")] = "GRPO_ROLLOUT_TOKEN",
    max_request_mb: Annotated[float, typer.Option(min=0.001, help="Largest JSON request body.")] = 16.0,
    max_frame_mb: Annotated[float, typer.Option(min=1.0, help="Largest weight frame of /update_weights.")] = 4096.0,
    seed: Annotated[int, typer.Option(help="Engine seed.")] = 0,
    block_size: Annotated[int | None, typer.Option(
        min=1, help="vllm KV-cache block size (default vLLM's: 16 on CUDA, 128 on CPU). Prefix caching reuses "
                    "whole blocks: serving multi-turn (agent) runs on CPU, set 32.")] = None,
    compile: Annotated[bool, typer.Option(help="hf engine: run the decode step under torch.compile (the "
                                               "trainer's rollout.compile; needs a C++ compiler on CPU).")] = False,
    data_parallel_size: Annotated[Optional[int], typer.Option(
        min=1, help="Start N engines (each its own process, its own GPU group of --tensor-parallel-size on CUDA) on "
                    "ports --port .. --port + N - 1, each one URL of the trainer's pool (deployment: derives them); "
                    "works on CPU too.")] = None,
    gpus: Annotated[Optional[Literal["all"]], typer.Option(
        help="`all`: one engine per GPU (per --tensor-parallel-size GPUs) of this machine, as "
             "--data-parallel-size would; refused without CUDA.")] = None,
    task: Annotated[Literal["rollout", "reward"], typer.Option(
        help="rollout: the routes below; reward: a sequence-classification checkpoint on /classify (SGLang's "
             "reward-model route), for rewards.functions entries {url: ...}.")] = "rollout",
) -> None:
    """Serve rollouts over HTTP: /health, /info, /generate, /score, /update_weights (streamed safetensors
    frames), /update_weights_from_disk, /sleep, /wake_up, /reset_prefix_cache."""
    from grpo_cli.server.engines import ServeOptions
    from grpo_cli.server.launch import run_server
    from grpo_cli.models.tiny import resolve_model_path

    opts = ServeOptions(engine=engine, model=resolve_model_path(model), host=host, port=port,
                        tensor_parallel_size=tensor_parallel_size, gpu_memory_utilization=gpu_memory_utilization,
                        dtype=dtype, max_model_len=max_model_len, sleep_level=sleep_level, seed=seed,
                        token=os.environ.get(token_env) or None, max_request_mb=max_request_mb,
                        max_frame_mb=max_frame_mb, compile=compile, block_size=block_size)
    with user_errors(), contextlib.suppress(KeyboardInterrupt):
        if (data_parallel_size or 1) > 1 or gpus:
            from grpo_cli.server.fleet import cuda_gpus, fleet_size, run_fleet

            found = cuda_gpus()
            raise typer.Exit(run_fleet(opts, fleet_size(data_parallel_size, gpus == "all", tensor_parallel_size,
                                                        found), token_env=token_env, gpus=found))
        if task == "reward":
            from grpo_cli.server.launch import run_reward_server

            run_reward_server(opts)
        else:
            run_server(opts)


if __name__ == "__main__":
    typer.run(serve_rollout)
