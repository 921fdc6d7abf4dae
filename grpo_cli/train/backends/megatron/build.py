"""Build the Megatron side of a run: parallel state from `distributed.megatron`, the `GPTModel` chunks of this rank
(one per virtual pipeline stage) loaded from the HF checkpoint, Megatron's DDP, its optimizer and our LR schedule."""

from __future__ import annotations

import torch

from grpo_cli.config.errors import UserError
from grpo_cli.config.rules_megatron import context_parallel_refusal
from grpo_cli.config.schema import GRPOConfig
from grpo_cli.train.backends.base import compute_dtype, lr_lambda


def init_parallel_state(cfg: GRPOConfig, world_size: int, device: torch.device) -> None:
    """`initialize_model_parallel` with tensor × pipeline (× data = the rest) = world; idempotent per process. A
    single-process run gets a 1-rank process group first (Megatron's groups need one), destroyed at the end of the
    job after Megatron forgets its subgroups (`runtime.dist.ensure_process_group`)."""
    from megatron.core import parallel_state as mpu

    from grpo_cli.runtime.dist import ensure_process_group

    if why := context_parallel_refusal(cfg):  # `grpo train` refuses it first; this guards every other caller
        raise UserError(why)

    ensure_process_group(device, timeout_minutes=cfg.distributed.timeout_minutes,
                         before_destroy=mpu.destroy_model_parallel)

    m = cfg.distributed.megatron
    if world_size % (m.tensor_parallel * m.pipeline_parallel * m.context_parallel_size):
        raise ValueError(f"distributed.megatron: tensor_parallel {m.tensor_parallel} × pipeline_parallel "
                         f"{m.pipeline_parallel} × context_parallel_size {m.context_parallel_size} does not divide "
                         f"the {world_size} processes")
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=m.tensor_parallel, pipeline_model_parallel_size=m.pipeline_parallel,
        virtual_pipeline_model_parallel_size=m.virtual_pipeline, expert_model_parallel_size=m.expert_parallel,
        context_parallel_size=m.context_parallel_size,
        distributed_timeout_minutes=max(1, int(cfg.distributed.timeout_minutes)),
    )


def define_missing_te_names() -> None:
    """megatron-core 0.16.1's MoE router tests `te_general_gemm is not None` (moe/moe_utils.py), but the name is
    defined only when Transformer Engine imports: without it every MoE forward raises NameError. Define it as None
    there (the router then takes its own `torch.mm` path); with Transformer Engine installed nothing changes."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def transformer_overrides(cfg: GRPOConfig) -> dict:
    """`TransformerConfig` fields we set over mbridge's: per-token loss (the GRPO loss arrives already scaled, so
    Megatron's DDP sums gradients over data-parallel ranks instead of averaging), no fused CUDA kernels, MoE experts
    as one MLP each (`SequentialMLP`: the pure-torch spec's grouped GEMM needs the separate `grouped_gemm` package),
    the configured sequence parallelism and recomputation."""
    m = cfg.distributed.megatron
    out = {
        "calculate_per_token_loss": True, "sequence_parallel": m.sequence_parallel and m.tensor_parallel > 1,
        "masked_softmax_fusion": False, "bias_activation_fusion": False, "bias_dropout_fusion": False,
        "apply_rope_fusion": False, "gradient_accumulation_fusion": False, "persist_layer_norm": False,
        "attention_dropout": 0.0, "hidden_dropout": 0.0, "variable_seq_lengths": True,
        "moe_grouped_gemm": False, "context_parallel_size": m.context_parallel_size,
    }
    if m.recompute != "none":
        out["recompute_granularity"] = m.recompute
        if m.recompute == "full":
            out.update(recompute_method="uniform", recompute_num_layers=1)
    return out


def build_chunks(bridge, device: torch.device, *, trainable: bool) -> list[torch.nn.Module]:
    """This rank's `GPTModel` chunks (pre/post-process flags per virtual stage), on `device`, in the bridge's dtype,
    bf16/fp16 wrapped in `Float16Module` as Megatron's training does."""
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from megatron.core.transformer.module import Float16Module

    provider = bridge._model_provider([])
    vpp = mpu.get_virtual_pipeline_model_parallel_world_size()
    chunks = []
    for stage in range(vpp or 1):
        pre = mpu.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage if vpp else None)
        post = mpu.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage if vpp else None)
        model = provider(pre_process=pre, post_process=post, vp_stage=stage if vpp else None)
        if vpp:
            model.vp_stage = stage
        for p in model.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(p)
        model = model.to(device)
        if bridge.config.bf16 or bridge.config.fp16:
            model = Float16Module(bridge.config, model)
        if not trainable:
            model.eval().requires_grad_(False)
        chunks.append(model)
    return chunks


def wrap_ddp(cfg: GRPOConfig, bridge, chunks: list[torch.nn.Module]) -> list[torch.nn.Module]:
    """Megatron's DistributedDataParallel per chunk: float32 gradient buffers, one reduction after the last
    micro-batch (`finalize_model_grads`), the buffer ZeRO-1 shards when `distributed_optimizer` is on."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
    )

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, overlap_param_gather=False,
        use_distributed_optimizer=cfg.distributed.megatron.distributed_optimizer, average_in_collective=False)
    return [DistributedDataParallel(config=bridge.config, ddp_config=ddp_config, module=chunk,
                                    disable_bucketing=i > 0) for i, chunk in enumerate(chunks)]


def make_optimizer(cfg: GRPOConfig, chunks: list[torch.nn.Module]):
    """Megatron's Adam (decoupled weight decay, i.e. AdamW, on every parameter like `base.make_adamw`) over float32
    main weights, clipping at `train.max_grad_norm`."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    t, dtype = cfg.train, compute_dtype(cfg)
    config = OptimizerConfig(
        optimizer="adam", lr=t.learning_rate, min_lr=0.0, weight_decay=t.weight_decay, adam_beta1=t.adam_betas[0],
        adam_beta2=t.adam_betas[1], adam_eps=t.adam_epsilon, decoupled_weight_decay=True,
        clip_grad=t.max_grad_norm if t.max_grad_norm is not None else 0.0,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16, params_dtype=dtype,
        use_distributed_optimizer=cfg.distributed.megatron.distributed_optimizer,
        loss_scale=1.0 if dtype == torch.float16 else None,
    )
    return get_megatron_optimizer(config, chunks, config_overrides={})


class MegatronSchedule:
    """`base.lr_lambda` applied to every param group of Megatron's optimizer (which has no `LambdaLR`): the same
    warm-up and decay as the other backends, stepped once per optimizer step."""

    def __init__(self, cfg: GRPOConfig, optimizer) -> None:
        t = cfg.train
        self.peak = t.learning_rate
        self.fn = lr_lambda(warmup_steps=t.warmup_steps, total_steps=cfg.total_optimizer_steps,
                            schedule=t.lr_scheduler)
        self.optimizer, self.last_epoch = optimizer, 0
        self._apply()

    def _apply(self) -> None:
        lr = self.peak * self.fn(self.last_epoch)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self._last_lr = [lr]

    def step(self) -> None:
        self.last_epoch += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return self._last_lr

    def state_dict(self) -> dict:
        return {"last_epoch": self.last_epoch}

    def load_state_dict(self, state: dict) -> None:
        self.last_epoch = state["last_epoch"]
        self._apply()


def _master_pairs(optimizer):
    """(model parameter, its float32 main tensor, the flat range of the parameter it holds) for every bf16/fp16
    parameter: whole tensors in Megatron's mixed-precision optimizer, this rank's shard in the distributed one."""
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(part, "shard_fp32_from_float16_groups"):
            for models, mains in zip(part.model_float16_groups, part.shard_fp32_from_float16_groups, strict=True):
                for model_param, main in zip(models, mains, strict=True):
                    span = part._get_model_param_range_map(model_param)["param"]
                    yield model_param, main, (span.start, span.end)
        elif hasattr(part, "fp32_from_float16_groups"):
            for models, mains in zip(part.float16_groups, part.fp32_from_float16_groups, strict=True):
                for model_param, main in zip(models, mains, strict=True):
                    yield model_param, main, (0, model_param.numel())


@torch.no_grad()
def keep_float32_masters(optimizer, chunks: list[torch.nn.Module], float32_chunks: list[torch.nn.Module]) -> int:
    """Overwrite the float32 main weights Megatron copied from the bf16/fp16 model with the checkpoint's float32
    values (`float32_chunks`: the same layout loaded in float32), so low-precision compute does not round the
    masters once at start. Returns how many tensors were set."""
    from mbridge.core.util import unwrap_model

    exact = {}
    for chunk, twin in zip(chunks, float32_chunks, strict=True):
        twins = dict(unwrap_model(twin).named_parameters())
        for name, p in unwrap_model(chunk).named_parameters():
            exact[id(p)] = twins[name]
    count = 0
    for model_param, main, (start, stop) in _master_pairs(optimizer):
        main.copy_(exact[id(model_param)].reshape(-1)[start:stop].view_as(main))
        count += 1
    return count


def master_weights(optimizer) -> dict[int, tuple[torch.Tensor, tuple[int, int]]]:
    """id(model parameter) → (its float32 main tensor, flat range), for checks."""
    return {id(p): (main, span) for p, main, span in _master_pairs(optimizer)}
