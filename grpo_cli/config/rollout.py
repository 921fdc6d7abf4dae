"""The `rollout:` config section: engine, mode, sampling, and the vLLM, server and Ray (async) settings."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, field_validator, model_validator

from grpo_cli.config.base import Section
from grpo_cli.config.engine_modes import EngineMode, engine_mode, engines
from grpo_cli.config.stream import StreamConfig
from grpo_cli.config.transports import WeightTransportName


class VLLMConfig(Section):
    gpu_memory_utilization: float = Field(0.3, gt=0, le=1)
    """Fraction of device memory vLLM may take (weights + KV cache). Colocate mode shares the GPU with training;
    an async actor has a rollout GPU to itself (~0.9 there, see `qwen-7b-async`)."""
    tensor_parallel_size: int = Field(1, ge=1)
    """Tensor-parallel size of each vLLM instance; must divide the number of training processes (colocate);
    1 in async mode (one GPU per actor)."""
    sleep_level: Literal[0, 1, 2] = 0
    """0: vLLM keeps its memory; 1: offload weights to host and free KV cache while training; 2: free both
    (weights reloaded from the trainer at each sync). CUDA only; on CPU a notice is printed and 0 is used."""
    enforce_eager: bool = True
    """Disable CUDA graphs (faster start, slower decode)."""
    max_num_seqs: int | None = None
    """Concurrent sequences in vLLM's scheduler; default: the sequences one rank (async: one actor) generates per
    step."""
    max_model_len: int | None = None
    """Context length vLLM allocates for; default: `data.max_prompt_length + rollout.max_completion_length`."""
    kv_cache_space_gib: float = Field(1.0, gt=0)
    """CPU only: KV-cache size per process in GiB (vLLM's `kv_cache_memory_bytes`; VLLM_CPU_KVCACHE_SPACE is set
    to it rounded up)."""
    block_size: int | None = Field(None, ge=1)
    """KV-cache block size (vLLM's `block_size`); prefix caching reuses whole blocks only. Default: vLLM's own
    (16 on CUDA; 128 on CPU, whose attention takes multiples of 32), except multi-turn runs (`agent:`,
    `rollout.custom`) on CPU, which take 32 (`rollout/vllm/support.py: CPU_MULTI_TURN_BLOCK_SIZE`): every turn
    re-reads the whole conversation, and 128 reused nothing of a short one (tools added +114% to the rollout of
    a 21M model, +25% with 32; benchmarks/agent_tools.py)."""
    verify_sync: bool = True
    """After every weight sync, check the engine holds the new weights: a few small tensors read back must equal
    the trainer's, and the logprobs of a probe sequence must match the trainer's; a mismatch stops the run."""


class ServerConfig(Section):
    urls: list[str] = Field(default_factory=list)
    """Rollout servers (`grpo serve-rollout`, SGLang, or `vllm serve` with `engine: vllm-serve`); each new group of
    completions goes to the least-loaded server (requests in flight from this client), each later turn of a
    multi-turn trajectory to the server of its first turn (`sticky_max_excess`; docs/server-mode.md, Routing)."""
    connect_timeout_s: float = Field(60.0, gt=0)
    """How long to wait for `/health` at start before stopping with a message."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Timeout of one generate or weight-update call."""
    retries: int = Field(3, ge=0)
    """Retries (with exponential backoff) of idempotent calls."""
    on_failure: Literal["stop", "wait"] = "stop"
    """A server that dies mid-run: `stop` saves a checkpoint and exits; `wait` waits up to
    `wait_for_recovery_s` for it to come back, then re-syncs weights and continues."""
    wait_for_recovery_s: float = Field(300.0, gt=0)
    """With `on_failure: wait`, how long to wait for a dead server."""
    sticky_max_excess: int = Field(16, ge=0)
    """A later turn of a multi-turn trajectory goes to the server that served its first turn (whose prefix cache
    holds the conversation) unless that server has more than this many requests in flight beyond the least-loaded
    server, or restarted since: then it goes to the least-loaded one. 0 routes every turn by load alone."""
    token_env: str = "GRPO_ROLLOUT_TOKEN"
    """Environment variable holding the bearer token sent to the server (unset: no token); for `vllm serve`, its
    `--api-key`."""
    weight_transport: WeightTransportName | None = None
    """How weights reach the servers at each sync. Each engine takes its own transports, the first its default (a
    value it does not take is refused naming them): `grpo serve-rollout` (engines hf, vllm) streams checksummed
    safetensors chunks over HTTP (`http`), writes them once to a file in /dev/shm (`shm`) or broadcasts over NCCL
    (`nccl`); SGLang loads a checkpoint from `weight_sync_dir` (`disk`) or takes CUDA IPC handles (`tensor`); a
    stock `vllm serve` (`vllm-serve`, through vLLM's RL API) loads a /dev/shm file with grpo-cli's `grpo_shm` plugin
    (`shm`) or uses vLLM's NCCL engine (`nccl`). A same-host transport (`shm`, `tensor`) refuses a server URL that is
    not loopback. Table (generated from `config/transports.py`) and measured throughput: docs/server-mode.md."""
    shm_keep_file: bool = True
    """With `weight_transport: shm`: keep the /dev/shm file between syncs and overwrite it in place (about twice as
    fast as allocating and freeing a model's worth of shared memory every sync: 0.09 vs 0.22 s for 403 MB here),
    at the price of holding one copy of the weights in shared memory for the whole run; false frees it after each
    sync. The file is removed when the run ends; a file left by a killed trainer is removed by the next shm run of
    the same user."""
    weight_fanout: Literal["relay", "direct"] = "relay"
    """With `weight_transport: http` and several `grpo serve-rollout` servers: `relay` sends one upload to the first
    server, which forwards it to the next as it reads it, and so on down `urls` (the trainer sends each byte once;
    every server checks every frame and reports its version; the servers must reach each other and share the
    token); `direct` uploads to every server at once (each byte once per server). `shm` writes one file all servers
    map, and `nccl` broadcasts to all servers in one group, whatever this says."""
    weight_chunk_mb: int = Field(128, ge=1)
    """Size of one weight chunk (HTTP frame, or SGLang tensor bucket)."""
    weight_sync_dir: str | None = None
    """Folder both the trainer and the SGLang server can read (disk sync); default: the system temp dir."""

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data):
        if isinstance(data, dict) and "sglang_weight_transport" in data:
            raise ValueError(
                "rollout.server.sglang_weight_transport was merged into rollout.server.weight_transport: write "
                f"rollout.server.weight_transport: {data['sglang_weight_transport']} instead (one key for every "
                "engine; SGLang takes disk or tensor)")
        return data

    @property
    def token(self) -> str | None:
        """The bearer token every server client sends: the value of `token_env` in the environment (None: unset)."""
        return os.environ.get(self.token_env) or None


class RayConfig(Section):
    address: str | None = None
    """Ray cluster to join (`auto` for one started with `ray start`, or `HOST:PORT` of its head); null starts a
    local cluster for this run (rank 0) that the other training processes join."""
    num_actors: int = Field(1, ge=1)
    """Rollout engine actors (async mode); each generates its share of the step's prompts."""
    cpus_per_actor: int = Field(1, ge=1)
    """CPU cores reserved per rollout actor (its torch threads). On a CPU-only machine the trainer keeps the
    remaining cores."""
    start_timeout_s: float = Field(300.0, gt=0)
    """Longest wait for the rollout actors to be placed and load their engines."""


class RolloutConfig(Section):
    engine: str = "hf"
    """`hf`: the policy itself samples (grpo-cli's KV-cached decode loop on transformers models); `vllm`: vLLM;
    `sglang`: an SGLang server; `vllm-serve`: a stock `vllm serve` started in dev mode (docs/server-mode.md gives
    its command). Each engine runs in the modes `config/engine_modes.MODES` declares for it."""
    mode: Literal["colocate", "server", "async", "stream"] = "colocate"
    """`colocate`: the engine runs inside the training processes; `server`: a separate HTTP rollout server;
    `async`: rollouts for step k+1 are generated while step k trains (Ray actors); `stream`: `vllm serve` servers
    generate without stopping, weights land in flight and each token carries the version that sampled it
    (`rollout.stream`, docs/streaming.md)."""
    max_completion_length: int = Field(16, ge=1)
    """Most tokens generated per completion."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; the trainer's logprobs use the same temperature."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling; below 1 the sampler and trainer distributions differ (a warning is printed)."""
    top_k: int = Field(0, ge=0)
    """Top-k sampling; 0 disables."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Rollout engine dtype; `auto` uses `model.dtype`."""
    compile: bool = False
    """hf engine: run the decode step (one token for every row, and its draw) under `torch.compile` (inductor):
    the same math in a few fused loops, the same tokens (tested). It pays where a decode step is bound by its
    operator calls, i.e. small models: at 16 prompts × 8 × 64 tokens generation took 0.13 instead of 0.21 s per
    step on a 0.31M model, and nothing measurable at 18.9M (compute-bound: 3.5 vs 3.2 s, noise). The first
    generation pays the compile (~4 s with inductor's on-disk cache warm, 15–30 s cold), so it pays off on long
    runs. Applies where the trainer builds the engine (colocate, async; a `grpo serve-rollout --engine hf` server
    takes `--compile`); Llama/Qwen2/Qwen3 decoders only (refused otherwise); needs a C++ compiler and the Python
    headers on CPU."""
    custom: str | None = None
    """`pkg.module:function` or `path/file.py:function` that produces the step's completions itself, for rollouts
    neither single turns nor `agent:` cover: called as `fn(engine=, prompt_ids=, sampling=, tokenizer=)`, it returns
    one dict per completion (P × n, group-contiguous) with `ids`, `mask` (1 = trained, 0 = environment) and
    `logprobs` (sampled tokens; 0 elsewhere), optionally `finish_reason`. Every mode: in async mode each Ray
    actor calls it with its own engine (the module must import there). Not with a colocated vLLM engine at
    `vllm.tensor_parallel_size` > 1, whose every call the whole tensor-parallel group must make together."""
    max_staleness: int = Field(1, ge=0)
    """Async mode: how many optimizer steps a batch may lag behind the weights it is trained on: batches for up
    to this many future steps are generated while the current step trains (0 = synchronous, for comparison)."""
    ray: RayConfig = Field(default_factory=RayConfig)
    """Async mode: the Ray cluster and the rollout actors placed on it."""
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    """vLLM engine settings."""
    server: ServerConfig = Field(default_factory=ServerConfig)
    """Server mode settings (stream mode's servers too)."""
    stream: StreamConfig = Field(default_factory=StreamConfig)
    """Stream mode: the pool of groups generating, the buffer of finished ones, the per-token staleness bound."""

    @field_validator("engine")
    @classmethod
    def _declared_engine(cls, engine: str) -> str:
        if engine not in engines():
            raise ValueError(f"rollout.engine '{engine}' is not an engine grpo-cli has; use one of "
                             f"{', '.join(engines())}.")
        return engine

    @property
    def layout(self) -> EngineMode:
        """This engine × mode's row of the matrix (`config/engine_modes.MODES`; the config rules refuse a
        combination without one)."""
        row = engine_mode(self.engine, self.mode)
        if row is None:
            raise ValueError(f"rollout.engine '{self.engine}' has no mode '{self.mode}'")
        return row

    @property
    def colocated(self) -> bool:
        """The engine runs inside the training processes (`layout.colocated`)."""
        return self.layout.colocated

    @property
    def colocated_vllm(self) -> bool:
        """vLLM inside the training processes: tensor-parallel groups of training ranks, sleep levels, and its
        weights and KV cache beside the training state in each process's memory."""
        return self.engine == "vllm" and self.colocated

    @property
    def transport(self) -> str:
        """The weight transport in effect: `server.weight_transport`, or the default of this engine × mode's row
        (`layout.transports[0]`; the registry's names in server mode, `rollout/transport/base.py`)."""
        return self.server.weight_transport or self.layout.transports[0]
