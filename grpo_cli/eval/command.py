"""`grpo eval RUN_DIR_OR_CHECKPOINT --data FILE`: the in-training evaluation, run once on a run's final model, a
checkpoint, a LoRA adapter folder or any Hugging Face folder, with a JSON report."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import yaml

from grpo_cli.config.errors import UserError
from grpo_cli.config.load import build_config, deep_merge, parse_override, set_path, validate_tree
from grpo_cli.config.schema import GRPOConfig
from grpo_cli.train.checkpoint import complete_checkpoints


def model_folder(target: Path) -> Path:
    """The weights to evaluate: a run dir's `final-model/` (else `final-adapter/`, else its newest checkpoint), or
    the folder itself (a checkpoint, an adapter folder or a Hugging Face folder)."""
    if not target.is_dir():
        raise UserError(f"{target} is not a folder; give a run directory, a checkpoint-N folder, a LoRA adapter "
                        "folder or a Hugging Face model folder.")
    if (target / "metrics.jsonl").exists():
        for name in ("final-model", "final-adapter"):
            if (target / name / "config.json").exists() or (target / name / "adapter_config.json").exists():
                return target / name
        found = complete_checkpoints(target)
        if not found:
            raise UserError(f"{target} holds no final model and no complete checkpoint yet.")
        target = found[-1]
    if not ((target / "config.json").exists() or (target / "adapter_config.json").exists()):
        raise UserError(f"{target} holds no Hugging Face weights (no config.json or adapter_config.json); a sharded "
                        "(fsdp2/deepspeed) checkpoint is evaluated through its run's final-model/ folder.")
    return target


def run_config(target: Path, folder: Path, overrides: list[str]) -> GRPOConfig:
    """The run's own config (from `config.yaml` beside the weights or in the run dir; else the defaults), set up to
    evaluate `folder` in one process with a colocated engine."""
    for candidate in (folder / "config.yaml", target / "config.yaml", folder.parent / "config.yaml"):
        if candidate.is_file():
            tree = yaml.safe_load(candidate.read_text())
            break
    else:
        tree = build_config().model_dump(mode="json")
    engine = tree["rollout"]["engine"] if tree["rollout"]["mode"] == "colocate" else "hf"
    forced = {"model": {"name_or_path": str(folder), "lora": None},
              "rollout": {"mode": "colocate", "engine": engine, "server": {"urls": []},
                          "vllm": {"tensor_parallel_size": 1, "sleep_level": 0}},
              "distributed": {"num_processes": 1, "num_machines": 1, "machine_rank": 0, "backend": "ddp",
                              "offload": {"optimizer": False, "grads": False, "params": False}},
              "checkpoint": {"resume": None}}
    tree = deep_merge(tree, forced)
    for item in overrides:
        path, value = parse_override(item)
        tree = set_path(tree, path, value)
    return validate_tree(tree)


def merged_copy(folder: Path, cfg: GRPOConfig, scratch: Path) -> Path:
    """A LoRA adapter folder → a Hugging Face folder of its base with the adapter merged (engines load that)."""
    import torch

    from grpo_cli.train.weights.lora import load_merged
    from grpo_cli.train.policy import load_tokenizer

    model = load_merged(str(folder), dtype=torch.float32, attn_implementation=cfg.model.attn_implementation)
    model.save_pretrained(scratch, safe_serialization=True)
    load_tokenizer(str(folder)).save_pretrained(scratch)
    return scratch


def evaluate_folder(cfg: GRPOConfig) -> dict[str, float]:
    """Build the policy and the engine the run used (one process) and run the evaluation once."""
    from grpo_cli.train.evaluation import Evaluator
    from grpo_cli.runtime.dist import DistInfo, release_own_group
    from grpo_cli.runtime.quiet import quiet_hf_stack
    from grpo_cli.rewards.resolve import reward_fns_for
    from grpo_cli.data.prompts import images_of
    from grpo_cli.rollout.base import EngineContext, generate_with_images
    from grpo_cli.rollout.factory import make_engine
    from grpo_cli.runtime.accel import resolve_device
    from grpo_cli.train.policy import eos_token_ids, load_policy

    quiet_hf_stack()
    info, path = DistInfo(), cfg.model.name_or_path
    device = resolve_device(cfg.distributed.device, 0)
    policy = load_policy(cfg, path, device=device, info=info)
    hf_module = policy.backend.hf_module()
    ctx = EngineContext(path, eos_token_ids(policy.tokenizer, path if hf_module is None else hf_module),
                        policy.tokenizer.pad_token_id, info.rank, info.world_size)  # seeds as the run's ranks had
    from grpo_cli.agent.wrap import wrap_rollout

    engine = make_engine(cfg, ctx, policy=hf_module, device=device, wrap=wrap_rollout)  # async: in each actor
    try:
        evaluator = Evaluator.build(cfg, reward_fns=reward_fns_for(cfg, device),
                                    tokenizer=policy.tokenizer, dist=info)

        def generate(prompts, sampling):
            import contextlib

            compute = policy.backend.compute_context() if engine.shares_policy_weights else contextlib.nullcontext()
            with compute:
                return generate_with_images(engine, [p.ids for p in prompts], sampling, images_of(prompts))

        return evaluator.run(generate)
    finally:
        engine.close()
        release_own_group()  # the 1-rank group a sharded backend made to load the policy in this process


def run_eval(target: Path, *, data: str | None, out: Path | None, overrides: list[str]) -> dict:
    """Evaluate `target` on `data` (default: the run's `eval.source`); write and return the JSON report."""
    folder = model_folder(target)
    sets = ([f"eval.source={data}"] if data else []) + list(overrides)
    with tempfile.TemporaryDirectory(prefix="grpo-eval-") as scratch:
        cfg = run_config(target, folder, sets)
        if (folder / "adapter_config.json").exists():
            merged = merged_copy(folder, cfg, Path(scratch))
            cfg = validate_tree(deep_merge(cfg.model_dump(mode="json"), {"model": {"name_or_path": str(merged)}}))
        metrics = evaluate_folder(cfg)
    from grpo_cli.train.evaluation import eval_sampling, eval_source

    report = {"model": str(folder), "data": eval_source(cfg), "num_prompts": cfg.eval.num_prompts,
              "generations_per_prompt": cfg.eval.generations_per_prompt, "seed": eval_sampling(cfg).seed,
              "engine": cfg.rollout.engine, "metrics": metrics}
    out = out or (target / "eval.json" if target.is_dir() else Path("eval.json"))
    out.write_text(json.dumps(report, indent=2))
    report["written_to"] = str(out)
    return report
