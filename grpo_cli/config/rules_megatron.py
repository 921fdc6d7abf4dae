"""Cross-field rules of the megatron backend (`distributed.megatron`): the Megatron-core grid fits the processes and
the model, and the settings the backend cannot honour are refused; each failure names the field and the fix."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from grpo_cli.config.sections import GRPOSections


def megatron_layout(cfg: GRPOSections) -> dict[str, int]:
    """Megatron-core's process grid for `distributed.megatron` (what `initialize_model_parallel` builds): tp, pp,
    ep, cp (context parallel); dp = world / (tp·pp·cp) (the dense parameters' data-parallel ranks; the distributed
    optimizer shards over dp·cp, as megatron-core's data-parallel group with context parallel); etp = the expert
    tensor parallel size, tensor_parallel (Megatron's default when `expert_tensor_parallel_size` is not given, as
    the backend does); edp = world / (ep·etp·pp) (the expert parameters' data-parallel ranks). dp/edp are 0 where
    the grid does not divide the world (the config rules refuse that)."""
    d, m = cfg.distributed, cfg.distributed.megatron
    world = d.num_processes * d.num_machines
    tp, pp, ep, cp = m.tensor_parallel, m.pipeline_parallel, m.expert_parallel, m.context_parallel_size
    etp = tp
    return {"world": world, "tp": tp, "pp": pp, "cp": cp, "ep": ep, "etp": etp, "dp": world // (tp * pp * cp),
            "edp": world // (ep * etp * pp)}


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_megatron(cfg: GRPOSections) -> None:
    """The Megatron-core grid (tensor × pipeline × data, experts over expert × expert-tensor × pipeline) fits the
    processes and the model; the settings the backend cannot honour are refused."""
    d, m, model = cfg.distributed, cfg.distributed.megatron, cfg.model
    if d.backend != "megatron":
        return
    from grpo_cli.config.model_shape import local_model_config, model_shape, num_experts

    lay = megatron_layout(cfg)
    world, tp, pp, ep = lay["world"], lay["tp"], lay["pp"], lay["ep"]
    if world % (tp * pp):
        grids = [f"{t}x{world // t}" for t in divisors(world)]
        raise ValueError(
            f"distributed.megatron.tensor_parallel={tp} × pipeline_parallel={pp} = {tp * pp} does not divide the "
            f"{world} training processes (num_processes × num_machines); data parallel is what is left, "
            f"world / (tensor_parallel × pipeline_parallel). Pick a product that divides {world}: tensor_parallel x "
            f"pipeline_parallel in {grids[:6]}."
        )
    if world % (tp * pp * lay["cp"]):
        raise ValueError(
            f"distributed.megatron.tensor_parallel={tp} × pipeline_parallel={pp} × context_parallel_size="
            f"{lay['cp']} = {tp * pp * lay['cp']} does not divide the {world} training processes (data parallel is "
            f"what is left); valid context_parallel_size values: {divisors(world // (tp * pp))}."
        )
    if world % (ep * lay["etp"] * pp):
        valid = [e for e in divisors(world // (lay["etp"] * pp))]
        raise ValueError(
            f"distributed.megatron.expert_parallel={ep} does not fit the grid: Megatron splits the experts over "
            f"expert_parallel × expert tensor parallel (= tensor_parallel {lay['etp']}) × pipeline_parallel {pp} "
            f"ranks, which must divide the {world} processes, i.e. expert_parallel must divide data parallel "
            f"{lay['dp']}; valid values: {valid}."
        )
    if m.virtual_pipeline is not None and pp == 1:
        raise ValueError(
            f"distributed.megatron.virtual_pipeline={m.virtual_pipeline} interleaves model chunks between pipeline "
            "stages, but pipeline_parallel is 1; set pipeline_parallel > 1 or virtual_pipeline: null."
        )
    if m.sequence_parallel:
        raise ValueError(
            "distributed.megatron.sequence_parallel cannot take effect here: the megatron backend builds "
            "megatron-core's pure-torch layer spec (no Transformer Engine), whose RMSNorm (WrappedTorchNorm, "
            "transformer/torch_norm.py) refuses sequence parallelism at model build, on any device. Set "
            "sequence_parallel=false; tensor_parallel still splits the weights and the attention/MLP activations."
        )
    if any(d.offload.model_dump().values()):
        on = [k for k, v in d.offload.model_dump().items() if v]
        raise ValueError(
            f"distributed.offload ({', '.join(on)}) is not implemented for distributed.backend 'megatron': its "
            "weights, float32 gradient buffers and optimizer state stay on the GPU while the colocated engine "
            "generates. Turn the distributed.offload flags off (and leave room for the engine: lower "
            "rollout.vllm.gpu_memory_utilization, or raise tensor/expert parallelism; `grpo plan` shows the fit)."
        )
    if model.gradient_checkpointing:
        raise ValueError(
            f"model.gradient_checkpointing={model.gradient_checkpointing!r} applies to the Hugging Face backends; "
            "distributed.backend 'megatron' recomputes activations per distributed.megatron.recompute. Set "
            "model.gradient_checkpointing=false and distributed.megatron.recompute=selective (or full)."
        )
    if model.master_weights != "float32":
        raise ValueError(
            "model.master_weights 'compute_dtype' is not available with distributed.backend 'megatron': its "
            "optimizer always keeps float32 main weights for bf16/fp16 models; set model.master_weights=float32."
        )
    c = local_model_config(model.name_or_path)
    if c is not None:
        _check_megatron_model(cfg, c, num_experts(c))
    experts = num_experts(c) if c is not None else model_shape(model.name_or_path).experts
    if experts and tp > 1:
        raise ValueError(
            f"distributed.megatron.tensor_parallel={tp} cannot train {model.name_or_path}, a mixture-of-experts "
            "model: megatron-core refuses a MoE layer with tensor parallelism but no sequence parallelism "
            "(transformer/moe/moe_layer.py), and this backend's pure-torch layer spec cannot do sequence "
            "parallelism. Set tensor_parallel=1 and split the experts with expert_parallel (and the layers with "
            "pipeline_parallel) instead."
        )


def _check_megatron_model(cfg: GRPOSections, c: dict, experts: int) -> None:
    """Head, layer and expert counts from the model's config.json against the Megatron grid."""
    m, name = cfg.distributed.megatron, cfg.model.name_or_path
    tp, pp, ep, vp = m.tensor_parallel, m.pipeline_parallel, m.expert_parallel, m.virtual_pipeline or 1
    heads = c.get("num_attention_heads")
    kv = c.get("num_key_value_heads", heads)
    if heads and heads % tp:
        raise ValueError(
            f"distributed.megatron.tensor_parallel={tp} does not divide {name}'s num_attention_heads={heads} (each "
            f"tensor-parallel rank takes whole heads); valid values: {divisors(heads)}."
        )
    if kv and kv % tp and tp % kv:
        valid = sorted({t for t in divisors(heads) if kv % t == 0 or t % kv == 0})
        raise ValueError(
            f"distributed.megatron.tensor_parallel={tp} does not fit {name}'s num_key_value_heads={kv}: Megatron "
            f"splits the key/value heads over the tensor-parallel ranks (tensor_parallel divides them) or replicates "
            f"each over a group of ranks (they divide tensor_parallel); valid values: {valid}."
        )
    layers = c.get("num_hidden_layers")
    if layers and layers % (pp * vp):
        what = f"pipeline_parallel={pp} × virtual_pipeline={vp} = {pp * vp}" if vp > 1 else f"pipeline_parallel={pp}"
        raise ValueError(
            f"distributed.megatron.{what} does not divide {name}'s num_hidden_layers={layers} (every stage "
            f"{'chunk ' if vp > 1 else ''}gets the same number of layers); valid products: {divisors(layers)}."
        )
    if ep > 1 and not experts:
        raise ValueError(
            f"distributed.megatron.expert_parallel={ep} splits MoE experts, but {name} is a dense model (no "
            "num_experts / num_local_experts in its config.json); set expert_parallel=1."
        )
    if experts and experts % ep:
        raise ValueError(
            f"distributed.megatron.expert_parallel={ep} does not divide {name}'s {experts} experts (each rank holds "
            f"the same number of whole experts); valid values: {divisors(experts)}."
        )


def context_parallel_refusal(cfg: GRPOConfig) -> str | None:
    """Why `grpo train` cannot run `distributed.megatron.context_parallel_size` > 1 (None when it is 1 or the backend
    is not megatron). Not a config rule: `grpo plan` and `--rehearse` still model the setting."""
    cp = cfg.distributed.megatron.context_parallel_size
    if cfg.distributed.backend != "megatron" or cp == 1:
        return None
    return (
        f"distributed.megatron.context_parallel_size={cp} cannot train with this backend, on any machine: "
        "megatron-core (0.16) runs context parallelism only inside Transformer Engine's attention "
        "(TEDotProductAttention in megatron/core/extensions/transformer_engine.py, CUDA kernels and a CUDA stream "
        "for the key/value exchange), while its pure-torch DotProductAttention asserts context_parallel_size == 1 "
        "at model build (DotProductAttention.__init__, megatron/core/transformer/dot_product_attention.py; seen on "
        "2 gloo processes), and grpo-cli's megatron backend builds that pure-torch layer spec. `grpo plan` and "
        "`--rehearse` still model the setting. Set distributed.megatron.context_parallel_size=1; to fit long "
        "sequences use distributed.megatron.recompute=full or a larger tensor_parallel, or distributed.backend=fsdp2 "
        "with distributed.sequence_parallel.size (Ulysses or ring; docs/distributed.md, Long context)."
    )
