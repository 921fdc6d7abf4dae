"""The `GRPOConfig` model tree: every default and every field's documentation lives here (`schema.GRPOConfig` adds the
cross-field rules to `GRPOSections`, which the rules read)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from grpo_cli.config.agent import AgentConfig
from grpo_cli.config.algorithm import AlgorithmConfig
from grpo_cli.config.base import Section
from grpo_cli.config.deployment import DeploymentConfig
from grpo_cli.config.megatron import MegatronConfig
from grpo_cli.config.rewards import RewardsConfig
from grpo_cli.config.rollout import RolloutConfig

DType = Literal["float32", "bfloat16", "float16"]


class LoraConfig(Section):
    """A LoRA adapter (PEFT) trained in place of the full weights."""

    r: int = Field(16, ge=1)
    """Rank of the low-rank update B·A of every targeted weight."""
    alpha: float = Field(32.0, gt=0)
    """Scale of the update: W + (alpha / r)·B·A."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input during training (0 keeps the training forward deterministic)."""
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """Module names (suffixes, e.g. `[q_proj, v_proj]`) that get an adapter; `all-linear` targets every linear
    layer except the output head."""
    modules_to_save: list[str] = Field(default_factory=list)
    """Modules trained in full beside the adapter (e.g. `[lm_head]`); saved with the adapter."""
    export_merged: bool = False
    """Also export the merged model (base + adapter, an ordinary Hugging Face folder) as `final-model/` at the end
    of the run; the adapter alone is always exported as `final-adapter/`."""


class ModelConfig(Section):
    name_or_path: str = "builtin:tiny"
    """Policy checkpoint: a local folder in Hugging Face format, a hub id already in the local cache, or
    `builtin:tiny`, a 2-layer model and word-level tokenizer that grpo-cli builds on first use (no network;
    `builtin:tiny-moe` is its mixture-of-experts twin, 4 experts, top 2; `builtin:tiny-vlm` a tiny Qwen2-VL
    vision-language model and `builtin:tiny-vlm-qwen2.5` a tiny Qwen2.5-VL, docs/vision.md)."""
    dtype: DType = "float32"
    """Compute dtype of the policy's and reference's forward/backward passes (and of exported weights). bf16
    compute comes from the backend's mixed precision (ddp: autocast; fsdp2: MixedPrecisionPolicy; deepspeed: its
    bf16 mode); the trained weights stay in `master_weights`."""
    master_weights: Literal["float32", "compute_dtype"] = "float32"
    """Dtype of the trained (master) weights and the AdamW state. `float32` keeps updates smaller than bf16's
    spacing (lr 1e-6 on bf16 weights moved 0.95% of the parameters in 5 steps); `compute_dtype` trains the
    weights in `model.dtype` directly, saving memory and losing those updates (not with deepspeed, whose bf16
    mode always keeps float32 masters)."""
    attn_implementation: Literal["eager", "sdpa"] = "sdpa"
    """Attention kernel used by the trainer's forward passes."""
    cpu_linear: Literal["auto", "onednn", "aten"] = "auto"
    """Kernel of the policy's (and reference's) float32 linear layers on CPU: `onednn` runs y = x·Wᵀ + b and its
    input gradient on oneDNN (1.4–1.7x MKL's float32 GEMM on the AMD EPYC reference machine; the same float32
    math in another summation order), `aten` keeps PyTorch's MKL matmul, `auto` picks `onednn` when training runs
    on CPU in float32 with the ddp backend and this torch build's oneDNN linear passes a self-check, else `aten`.
    `onednn` is refused where it cannot apply (bf16/fp16 compute, sharded backends, GPUs, a model with no layer of
    ≥ 512 input and output features)."""
    gradient_checkpointing: bool | Literal["selective"] = False
    """Recompute activations in the backward pass to save memory: `true` re-runs each decoder layer's forward;
    `selective` keeps the matmul and attention outputs and recomputes only the elementwise ops (norms, rotary,
    SiLU, products): one train step of the 19M benchmark model (16 prompts x 8, 1 thread) peaked at 3087 instead
    of 3789 MB for ~4% more CPU time (full: 2327 MB, ~24% more); a whole run's peak can sit elsewhere
    (generation, the optimizer step): measure on your shapes before relying on it."""
    lora: LoraConfig | None = None
    """Train a LoRA adapter (PEFT, `pip install 'grpo-cli[lora]'`) instead of every weight; null trains the full
    model. The reference model (β > 0) is the same model with the adapter disabled, and weight sync sends the
    merged weights. On a vision-language model the adapters go on the language model only (never the vision
    tower)."""
    freeze_vision: bool = True
    """Vision-language models (docs/vision.md): the vision tower (`model.visual.*`: patch embedding, vision blocks,
    merger) gets no gradient and is not in the optimizer, so its weights stay bit-identical; the weight sync sends
    it once. `false` trains it with the rest. No effect on a text-only model."""


class DataConfig(Section):
    source: str = "builtin:words"
    """Prompts: a `.jsonl` or `.parquet` file, a `datasets` folder saved with `save_to_disk`, or `builtin:NAME`
    (`builtin:words`, `builtin:arith`, `builtin:shapes`: images for a VLM)."""
    prompt_column: str = "prompt"
    """Column holding the prompt: a string, or a list of chat messages ({role, content}) rendered with the
    tokenizer's chat template."""
    max_prompt_length: int = Field(128, ge=1)
    """Longest prompt in tokens; longer prompts are handled per `overlong_prompts`."""
    overlong_prompts: Literal["filter", "error"] = "filter"
    """`filter` drops prompts longer than `max_prompt_length` (the count is printed); `error` stops."""
    shuffle: bool = True
    """Shuffle prompts each epoch (seeded by `train.seed`)."""
    max_image_pixels: int = Field(1_003_520, ge=784)
    """Vision-language models: an image with more pixels (w·h) is scaled down to this many, aspect ratio kept,
    before the model's image processor sees it (which then rounds its sides to multiples of 28 within its own
    min/max pixels). The default is Qwen2-VL's largest image, 1280 · 28²."""


class DynamicSamplingConfig(Section):
    """DAPO dynamic sampling: train only on groups whose rewards differ."""

    enabled: bool = False
    """Drop prompt groups whose rewards are all equal (advantage 0, no gradient) and generate completions for
    more prompts until the step has `prompts_per_step` groups with different rewards."""
    max_extra_rounds: int = Field(4, ge=1)
    """Most extra generation rounds per step (each draws `prompts_per_step` new prompts). If the step is still
    short, it is filled with dropped groups (counted in `dynamic_sampling/short_groups`)."""


class TrainConfig(Section):
    steps: int = Field(100, ge=1)
    """Optimizer steps to run (each on a freshly generated batch)."""
    prompts_per_step: int = Field(8, ge=1)
    """Prompts per optimizer step, over all processes."""
    generations_per_prompt: int = Field(8, ge=2)
    """Completions sampled per prompt (the group size G); at least 2."""
    micro_batch_size: int = Field(8, ge=1)
    """Sequences per forward/backward pass on one process; gradient accumulation covers the rest. Must divide the
    sequences each process trains per step; not used (nor checked) when `micro_batch_tokens` is set."""
    micro_batch_tokens: int | None = Field(None, ge=1)
    """Cut micro-batches by positions instead of `micro_batch_size`, counting the positions the forward runs.
    Rows that run packed (the default for text: a shared prompt once, then its completions unpadded) are grouped
    prompt group by prompt group so that (prompts) × (longest prompt) + Σ completion lengths stays within this
    many positions, a group whole where it fits. Rows that run padded (sliding-window layers, image rows) are
    sorted by length and grouped so that rows × (longest prompt + longest completion) stays within it, each
    micro-batch cut to its own padding: there short completions share a pass and padding stops costing compute
    (train phase 1.45-1.60x on the CPU benchmark; with packed rows the padding was already gone: 1.0-1.1x). The
    loss does not depend on the grouping (its normalisers count the whole step). A row longer than the budget runs
    alone; every process runs as many micro-batches as the one that needs most. `grpo plan` suggests a value. Not
    with the megatron backend or the `token_mean_local` aggregation. Under `distributed.sequence_parallel` it counts
    one rank's positions: a group's micro-batch holds `size` times as many, one shard on each rank."""
    learning_rate: float = Field(1e-6, gt=0)
    """Peak AdamW learning rate."""
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    """Schedule after warm-up."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warm-up steps from 0 to `learning_rate`."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    adam_epsilon: float = Field(1e-8, gt=0)
    """AdamW epsilon."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this value; null disables clipping."""
    seed: int = 0
    """Seed of sampling, shuffling and initialisation."""
    on_nonfinite: Literal["skip", "stop"] = "skip"
    """A non-finite loss or gradient: `skip` the optimizer step (counted), or `stop`."""
    max_consecutive_nonfinite: int = Field(3, ge=1)
    """Stop after this many non-finite steps in a row, even with `skip`."""
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig)
    """DAPO dynamic sampling (drop groups of identical rewards, draw more prompts)."""


class DeepSpeedConfig(Section):
    zero_stage: Literal[1, 2, 3] = 2
    """ZeRO stage."""
    offload_optimizer: bool = False
    """Keep optimizer state on the CPU (ZeRO-Offload)."""
    offload_params: bool = False
    """ZeRO-3 only: keep parameters on the CPU."""
    overlap_comm: bool = True
    """Overlap gradient reduction with the backward pass."""
    contiguous_gradients: bool = True
    """Copy gradients into a contiguous buffer to avoid fragmentation."""


class FSDP2Config(Section):
    cpu_offload: bool = False
    """Keep parameters, gradients and optimizer state on the host for the whole run (FSDP2's own
    `CPUOffloadPolicy`: the optimizer steps on the CPU, each layer's shard is copied to the GPU for its forward and
    backward). What a 70B+ full fine-tune on fsdp2 needs; slower. Not combinable with `distributed.offload`, which
    moves the same state only while the engine generates."""
    unsharded_grad_accumulation: bool = False
    """Reduce-scatter gradients once per optimizer step instead of after every micro-batch: fewer collectives, but
    every rank holds the whole model's unsharded float32 gradients between micro-batches (7B: ~26 GiB per GPU;
    `grpo plan` counts them). Off by default (verl's choice): each micro-batch's gradients are reduce-scattered at
    once, so a rank keeps only its shard."""
    replicate: int = Field(1, ge=1)
    """HSDP (hybrid sharding): R replicas of the sharded model. The processes form an R × (processes/R) mesh: the
    parameters, gradients and optimizer state are sharded over the processes/R ranks of a shard group (one node's
    GPUs, when processes/R is the GPUs per node) and replicated across the R groups. A forward gathers weights
    inside the shard group only; gradients are reduce-scattered there, then all-reduced across replicas. 1: plain
    FSDP (everything sharded over every process). Must divide the processes of the job (docs/distributed.md)."""


class SequenceParallelConfig(Section):
    """Long context (docs/distributed.md): the world is data parallel × `size`; each packed micro-batch's positions
    are cut into `size` contiguous shards, one per rank of a sequence-parallel group."""

    size: int = Field(1, ge=1)
    """Ranks that share one sequence (1: off), on the ddp and fsdp2 backends (docs/distributed.md, "Long context").
    Must divide the processes of the job."""
    style: Literal["ulysses", "ring"] = "ulysses"
    """`ulysses`: an all-to-all around each attention swaps sequence shards for head shards (needs `size` to divide
    the attention heads); `ring`: key/value blocks pass around the group with online-softmax accumulation."""


class OffloadConfig(Section):
    optimizer: bool = False
    """Move optimizer state to host memory while the engine generates (colocate mode)."""
    grads: bool = False
    """Move gradients to host memory while the engine generates."""
    params: bool = False
    """Move policy parameters to host memory while the engine generates."""


class DistributedConfig(Section):
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """`cuda` requires GPUs (and says how many are missing); `auto` uses CUDA when present."""
    num_processes: int = Field(1, ge=1)
    """Training processes per machine (one per GPU); >1 relaunches through `launcher`."""
    num_machines: int = Field(1, ge=1)
    """Machines in the job."""
    machine_rank: int = Field(0, ge=0)
    """This machine's index in the job (0 on the machine that hosts the rendezvous)."""
    main_process_ip: str | None = None
    """Address of machine 0 for the rendezvous; required when `num_machines > 1`."""
    main_process_port: int = Field(29500, ge=1, le=65535)
    """Rendezvous port on machine 0."""
    rollout_gpus: int = Field(0, ge=0)
    """GPUs per machine reserved for rollout actors (async mode, disaggregated)."""
    launcher: Literal["accelerate", "torchrun"] = "accelerate"
    """How multi-process runs are launched."""
    backend: Literal["ddp", "deepspeed", "fsdp2", "megatron"] = "ddp"
    """Training backend: `ddp` (every process holds the whole model), `fsdp2` (`fully_shard` per decoder layer:
    each process holds 1/N of the parameters, gradients and optimizer state), `deepspeed` (ZeRO stage per
    `distributed.deepspeed`) or `megatron` (Megatron-core tensor × pipeline × data × expert parallel per
    `distributed.megatron`; extra `megatron`)."""
    deepspeed: DeepSpeedConfig = Field(default_factory=DeepSpeedConfig)
    """DeepSpeed settings (backend: deepspeed)."""
    fsdp2: FSDP2Config = Field(default_factory=FSDP2Config)
    """FSDP2 settings (backend: fsdp2)."""
    megatron: MegatronConfig = Field(default_factory=MegatronConfig)
    """Megatron-core settings (backend: megatron)."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype in which the sharded backends (fsdp2, deepspeed) reduce gradients across ranks and accumulate them over
    micro-batches: float32 keeps small gradients of long accumulations; bfloat16 halves the traffic."""
    timeout_minutes: float = Field(60.0, gt=0)
    """Timeout of every collective (NCCL's default is 10 minutes): a rank that waits longer (another rank writing a
    large checkpoint, a slow gather) fails instead of hanging, and one that finishes within it is not killed."""
    offload: OffloadConfig = Field(default_factory=OffloadConfig)
    """Training-state offload while generating."""
    sequence_parallel: SequenceParallelConfig = Field(default_factory=SequenceParallelConfig)
    """Sequence parallelism for long completions (ddp, fsdp2)."""
    weight_sync_bucket_mb: int = Field(512, ge=1)
    """Size cap of one bucket of gathered parameters during weight sync: fsdp2 and ZeRO-3 gather a bucket at once
    (fsdp2: one all-gather per bucket), so it bounds what a rank holds and sets the number of collectives."""


class CheckpointConfig(Section):
    every_steps: int = Field(20, ge=0)
    """Save every N steps, so a crash (power, OOM kill, SIGKILL) loses at most N-1 steps; 0: only at the end and
    on SIGINT/SIGTERM/SIGHUP."""
    keep_last: int = Field(2, ge=1)
    """Checkpoints kept; older ones are deleted after a new one is complete."""
    resume: str | None = None
    """`auto` (latest checkpoint in the output dir) or a checkpoint path."""


class EvalConfig(Section):
    """Held-out evaluation during training: the run's own engine samples, the run's reward functions score."""

    source: str = "auto"
    """Evaluation prompts, in any format `data.source` takes; `auto` is the held-out split of a built-in task
    (`builtin:NAME:heldout`, prompts the training split never contains)."""
    every_steps: int = Field(0, ge=0)
    """Evaluate every N optimizer steps (and after the last one); 0 turns evaluation off."""
    num_prompts: int = Field(32, ge=1)
    """Prompts evaluated each time (the first N of `source`, fixed across evaluations), split over processes."""
    generations_per_prompt: int = Field(4, ge=1)
    """Completions sampled per evaluation prompt (n of pass@k; k runs over 1, 2, 4, … up to n)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of evaluation completions."""
    max_completion_length: int | None = Field(None, ge=1)
    """Most tokens per evaluation completion; default `rollout.max_completion_length`."""
    pass_threshold: float = 1.0
    """A completion counts as correct for pass@k when its (weighted, summed) reward is at least this."""
    metrics: list[Literal["reward", "per_function", "pass_at_k", "length"]] = Field(
        default_factory=lambda: ["reward", "per_function", "pass_at_k", "length"])
    """What to log: `reward` (eval/reward/mean), `per_function` (eval/reward/<fn>/mean), `pass_at_k` (eval/pass@k),
    `length` (eval/completions/mean_length)."""


class LoggingConfig(Section):
    output_dir: str | None = None
    """Run directory; default `runs/<preset>-<timestamp>`."""
    progress: Literal["auto", "rich", "plain"] = "auto"
    """Live rich view, plain lines, or `auto` (rich on a terminal, plain otherwise)."""
    log_completions: int = Field(4, ge=0)
    """Completions per step written to completions.jsonl."""
    report_to: list[Literal["tensorboard", "wandb"]] = Field(default_factory=list)
    """Extra trackers (through accelerate)."""
    stall_warning_minutes: float = Field(10.0, gt=0)
    """Warn (and dump stacks) when one phase makes no progress for this long."""


class GRPOSections(Section):
    """The whole config's fields, before the cross-field rules (`config/rules.py`) check them together."""

    preset: str | None = None
    """Name of the preset this config started from (recorded for the run directory)."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy model."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Prompt data."""
    rewards: RewardsConfig = Field(default_factory=RewardsConfig)
    """Reward functions."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Generation engine and sampling."""
    agent: AgentConfig | None = None
    """Multi-turn tool calling during rollouts (null: single-turn completions)."""
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """Advantages, objective, aggregation, KL and importance-sampling correction."""
    train: TrainConfig = Field(default_factory=TrainConfig)
    """Batch sizes, optimizer, schedule."""
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    """Processes, devices, parallelism and offload."""
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    """Saving and resuming."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Held-out evaluation during training (and the settings `grpo eval` uses)."""
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    """Progress display and logs."""
    deployment: DeploymentConfig = Field(default_factory=DeploymentConfig)
    """Node groups and the scheduler script `grpo train --dry-run` renders (docs/distributed.md)."""

    @property
    def max_sequence_length(self) -> int:
        """The longest sequence a step holds: `data.max_prompt_length + rollout.max_completion_length`."""
        return self.data.max_prompt_length + self.rollout.max_completion_length

    @property
    def total_optimizer_steps(self) -> int:
        """Optimizer steps of the whole run: `train.steps × algorithm.num_iterations` (the LR schedule's length)."""
        return self.train.steps * self.algorithm.num_iterations
