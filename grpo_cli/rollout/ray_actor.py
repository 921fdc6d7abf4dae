"""One rollout engine (hf or vllm) inside a Ray actor process: generates, takes weight pushes, answers probes.

Ray runs an actor's calls one at a time in submission order, so a weight push queued behind a generation
lands after it, and a generation queued behind a push samples with the pushed weights: the version stamped
on each batch is exactly the version of the weights that sampled it.
"""

from __future__ import annotations

import os

from grpo_cli.rollout.base import RolloutBatch, SamplingParams


def build_actor_engine(cfg_dump: dict, ctx_fields: dict):
    """The engine of one actor, from the config (JSON dump) and the `EngineContext` fields. It owns its weights:
    `hf` loads a copy of the checkpoint in the rollout dtype, `vllm` runs a single-process `vllm.LLM`."""
    import torch

    from grpo_cli.config.schema import GRPOConfig
    from grpo_cli.rollout.factory import EngineContext, engine_dtype

    cfg = GRPOConfig.model_validate(cfg_dump)
    ctx = EngineContext(**ctx_fields)
    if cfg.rollout.engine == "vllm":
        from grpo_cli.rollout.vllm_engine import VLLMEngine

        return VLLMEngine.from_config(cfg, ctx)
    from transformers import AutoModelForCausalLM

    from grpo_cli.rollout.attention import attention_implementation
    from grpo_cli.rollout.hf import HFEngine

    dtype = engine_dtype(cfg)
    model = AutoModelForCausalLM.from_pretrained(
        ctx.model_path, dtype=getattr(torch, dtype),
        attn_implementation=attention_implementation(cfg.model.attn_implementation))
    if cfg.distributed.device != "cpu" and torch.cuda.is_available():
        model = model.to("cuda")
    model.eval().requires_grad_(False)
    if cfg.rollout.compile:
        from grpo_cli.rollout.hf import require_compilable

        require_compilable(model)
    return HFEngine(model, eos_token_ids=ctx.eos_token_ids, pad_token_id=ctx.pad_token_id,
                    shares_policy_weights=False, compile_step=cfg.rollout.compile)


class RolloutActor:
    """The Ray actor body (made remote by `grpo_cli.rollout.ray_engine`). `threads` caps torch's intra-op
    threads to the cores Ray reserved for it."""

    def __init__(self, cfg_dump: dict, ctx_fields: dict, threads: int) -> None:
        import torch

        from grpo_cli.launch.quiet import quiet_hf_stack

        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # no INFO line per weight push in the trainer's log
        torch.set_num_threads(threads)
        quiet_hf_stack()
        self.engine = build_actor_engine(cfg_dump, ctx_fields)

    def ready(self) -> int:
        """Returns the process id once the engine is built (the manager waits on it with a timeout)."""
        return os.getpid()

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingParams) -> RolloutBatch:
        return self.engine.generate(prompt_ids, sampling)

    def update_weights(self, parts: list, version: int) -> int:
        """Load `[(layout, buffer ref), ...]` (`flat_weights` buckets in the object store), fetching one bucket
        at a time, as `version`."""
        import ray

        from grpo_cli.rollout.flat_weights import unflatten

        def stream():
            for layout, ref in parts:
                yield from unflatten(layout, ray.get(ref))

        self.engine.update_weights(stream(), version)
        return self.engine.weight_version

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        return self.engine.score(sequences)

    def read_weights(self, names: list[str]) -> dict:
        if hasattr(self.engine, "read_weights"):
            return self.engine.read_weights(names)
        from grpo_cli.rollout.weight_names import parameters_by_name

        params = parameters_by_name(self.engine.model)
        return {n: params[n].detach().cpu().clone() for n in names if n in params}
