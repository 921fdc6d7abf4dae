"""`distributed.sequence_parallel` before any model loads (config/rules_sequence.py) and when the model is built
(`train.sequence_parallel.check_model`): what the sharded path cannot reproduce exactly is refused with the field
and the fix; the size-1 default and the supported combinations pass."""

from __future__ import annotations

import json

import pytest

from grpo_cli.config.load import ConfigError, build_config

SP2 = ["distributed.num_processes=2", "train.prompts_per_step=2", "train.micro_batch_size=8",
       "distributed.sequence_parallel.size=2"]


def _folder(tmp_path, heads: int) -> str:
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 96, "num_hidden_layers": 2, "num_attention_heads": heads,
        "num_key_value_heads": heads, "intermediate_size": 128, "vocab_size": 100}))
    return str(tmp_path)


@pytest.mark.parametrize(("overrides", "match"), [
    (["distributed.num_processes=3", "train.prompts_per_step=3", "train.micro_batch_size=8",
      "distributed.sequence_parallel.size=2"],
     r"sequence_parallel\.size=2 must divide the 3 training processes"),
    ([*SP2, "distributed.backend=deepspeed"], r"runs on distributed\.backend ddp or fsdp2, not 'deepspeed'"),
    ([*SP2, "distributed.backend=megatron", "rollout.engine=vllm"],
     r"not 'megatron' \(megatron shards sequences with its own context parallelism"),
    ([*SP2, "model.attn_implementation=eager"], r"model\.attn_implementation is 'eager'; set .*=sdpa"),
    ([*SP2, "model.name_or_path=builtin:tiny-vlm"], r"vision-language model, whose image tokens"),
    # the hf engine generating with fsdp2's sharded weights stays refused (config/rules.py), with or without SP
    ([*SP2, "distributed.backend=fsdp2"], r"rollout\.engine 'hf' in colocate mode generates with the policy's own"),
    ([*SP2, "algorithm.distill.teacher=builtin:tiny"], r"does not shard the distillation teacher"),
])
def test_refusals_name_the_field_and_the_fix(overrides, match):
    with pytest.raises(ConfigError, match=match):
        build_config(overrides=overrides)


def test_ulysses_needs_the_size_to_divide_the_heads(tmp_path):
    path = _folder(tmp_path, heads=3)
    with pytest.raises(ConfigError, match=r"splits the 3 attention heads .* \(valid: \[3\]\); pick one of those "
                                          r"or set style=ring"):
        build_config(overrides=[*SP2, f"model.name_or_path={path}"])
    build_config(overrides=[*SP2, f"model.name_or_path={path}", "distributed.sequence_parallel.style=ring"])


@pytest.mark.parametrize("backend", ["ddp", "fsdp2"])
def test_supported_combinations_pass(backend):
    engine = ["rollout.engine=vllm"] if backend == "fsdp2" else []
    cfg = build_config(overrides=[*SP2, f"distributed.backend={backend}", *engine, "model.lora.r=4"])
    assert cfg.distributed.sequence_parallel.size == 2


def test_the_built_model_is_checked(tiny_checkpoint):
    """builtin:tiny has 2 heads (no local config.json for the rule to read before it is built): size 4 under Ulysses
    is refused once the model is loaded, and an eager-attention model under any style."""
    from transformers import AutoModelForCausalLM

    from grpo_cli.config.errors import UserError
    from grpo_cli.models.attention import attention_implementation
    from grpo_cli.models.sequence_attention import SequenceShard
    from grpo_cli.train.sequence_parallel import check_model

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, attn_implementation=attention_implementation("sdpa"))
    check_model(model, SequenceShard(None, 2, 0, "ulysses"))
    with pytest.raises(UserError, match=r"splits the 2 attention heads .* \[2\] or set"):
        check_model(model, SequenceShard(None, 4, 0, "ulysses"))
    check_model(model, SequenceShard(None, 4, 0, "ring"))
    eager = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, attn_implementation="eager")
    with pytest.raises(UserError, match=r"needs model\.attn_implementation=sdpa"):
        check_model(eager, SequenceShard(None, 2, 0, "ring"))


def test_the_token_budget_is_per_rank():
    """A sequence longer than one rank's `train.micro_batch_tokens` fits a group of `size` ranks: the rule asks for
    the longest sequence over `size` ranks, not whole on one."""
    longest = build_config(overrides=SP2).max_sequence_length
    half = -(-longest // 2)
    cfg = build_config(overrides=[*SP2, f"train.micro_batch_tokens={half}"])
    assert cfg.train.micro_batch_tokens * 2 >= longest > cfg.train.micro_batch_tokens
    with pytest.raises(ConfigError, match=rf"over distributed\.sequence_parallel\.size=2 ranks.*at least {half}"):
        build_config(overrides=[*SP2, f"train.micro_batch_tokens={half - 1}"])
