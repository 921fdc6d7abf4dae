"""Presets validate; overrides parse; errors name the field; cross-field rules fire before any model loads."""

from __future__ import annotations

import pytest

from grpo_cli.config.load import ConfigError, build_config, list_presets, parse_override, parse_value
from grpo_cli.planner.plan import batch_plan, memory_plan, parse_size
from grpo_cli.planner.plan_render import render_plan

REQUIRED = {
    "tiny-cpu", "tiny-cpu-vllm", "tiny-cpu-server", "qwen2-0.5b-tldr-length", "qwen-1.5b-colocate",
    "qwen-1.5b-server", "qwen-7b-colocate-tp2", "qwen-72b-colocate", "qwen-7b-async", "qwen-7b-sglang-server",
    "tiny-cpu-async",
}


def test_all_required_presets_ship_with_descriptions():
    presets = list_presets()
    assert REQUIRED <= set(presets)
    assert all(presets[name] for name in presets), "every preset starts with a '# description' line"


@pytest.mark.parametrize("name", sorted(list_presets()))
def test_every_preset_validates(name):
    cfg = build_config(name)
    assert cfg.preset == name
    assert render_plan(cfg, gpu_mem=80 * 1024**3).startswith("# batch plan")


def test_default_preset_is_tiny_cpu():
    cfg = build_config()
    assert cfg.preset == "tiny-cpu" and cfg.model.name_or_path == "builtin:tiny"
    assert cfg.rollout.engine == "hf" and cfg.distributed.device != "cuda"


def test_extends_merges_parent_values():
    cfg = build_config("tiny-cpu-vllm")
    assert cfg.rollout.engine == "vllm"
    assert cfg.train.learning_rate == build_config("tiny-cpu").train.learning_rate


@pytest.mark.parametrize("text,value", [("1e-3", 1e-3), ("3", 3), ("true", True), ("abc", "abc"),
                                        ("[1, 2]", [1, 2]), ("null", None), ("-2.5E+2", -250.0)])
def test_parse_value(text, value):
    assert parse_value(text) == value


def test_override_wins_over_preset_and_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  learning_rate: 0.5\n  steps: 7\n")
    cfg = build_config("tiny-cpu", f, ["train.learning_rate=1e-4"])
    assert cfg.train.learning_rate == 1e-4 and cfg.train.steps == 7


@pytest.mark.parametrize("item", ["noequals", "=3", "a..b=1"])
def test_malformed_override(item):
    with pytest.raises(ConfigError, match="key.path=value"):
        parse_override(item)


def test_bad_value_names_field():
    with pytest.raises(ConfigError, match=r"train\.learning_rate: .*valid number.*'abc'"):
        build_config(overrides=["train.learning_rate=abc"])


def test_unknown_key_lists_valid_keys():
    with pytest.raises(ConfigError, match=r"nope: unknown key\. Valid keys under the top level: preset, model"):
        build_config(overrides=["nope.x=1"])
    with pytest.raises(ConfigError, match=r"train\.lr: unknown key\. Valid keys under train: steps"):
        build_config(overrides=["train.lr=1"])


def test_unknown_preset_lists_presets():
    with pytest.raises(ConfigError, match="unknown preset 'nope'.*tiny-cpu"):
        build_config("nope")


@pytest.mark.parametrize("overrides,match", [
    (["train.generations_per_prompt=1"], r"train\.generations_per_prompt"),
    (["train.micro_batch_size=5"], r"micro_batch_size=5 does not divide the 64 .*valid values: \[1, 2, 4"),
    (["distributed.num_processes=3"], r"prompts_per_step=8 is not divisible by the 3"),
    (["rollout.mode=server"], r"rollout\.server\.urls is empty"),
    (['rollout.server.urls=["http://x:1"]'], r"server URLs are used only in server mode"),
    (["rollout.engine=sglang"], r"'sglang' cannot run in mode 'colocate'"),
    (["rollout.server.shm_keep_file=false"], r"shm_keep_file=false applies only to rollout\.mode=server with "
                                             r"rollout\.server\.weight_transport=shm"),
    (["rollout.engine=vllm", "rollout.vllm.tensor_parallel_size=2"], r"tensor_parallel_size=2 must divide"),
    (["distributed.offload.optimizer=true", "rollout.mode=server", 'rollout.server.urls=["http://x:1"]'],
     r"distributed\.offload"),
    (["distributed.deepspeed.offload_params=true"], r"offload_params needs zero_stage 3"),
    (["model.cpu_linear=onednn", "model.dtype=bfloat16"], r"model\.cpu_linear 'onednn' .*needs ddp and float32"),
    (["model.cpu_linear=onednn", "distributed.backend=fsdp2", "rollout.mode=server",
      'rollout.server.urls=["http://x:1"]'], r"model\.cpu_linear 'onednn' .*backend is 'fsdp2'"),
    (["distributed.backend=deepspeed", "distributed.deepspeed.zero_stage=3", "rollout.engine=vllm",
      "distributed.offload.optimizer=true"], r"offload\.optimizer with ZeRO-3.*offload_optimizer=true"),
    (["rollout.mode=async", "distributed.num_processes=2"], r"rollout\.ray\.num_actors=1 must be a multiple of the 2"),
    (["rollout.vllm.block_size=32"], r"block_size sets .* but rollout\.engine is 'hf'"),
    (["rollout.engine=vllm", "rollout.mode=server", 'rollout.server.urls=["http://x:1"]', "rollout.vllm.block_size=32"],
     r"serve-rollout --block-size"),
    (["rollout.mode=async", "distributed.device=cuda", "distributed.rollout_gpus=1", "rollout.ray.num_actors=2"],
     r"2 GPU\(s\), but distributed\.rollout_gpus x num_machines = 1"),
])
def test_cross_field_rules(overrides, match):
    with pytest.raises(ConfigError, match=match):
        build_config(overrides=overrides)


def test_config_is_frozen():
    cfg = build_config()
    with pytest.raises(Exception):
        cfg.train.steps = 3


def test_async_plan_shows_actors_and_staleness():
    text = render_plan(build_config("qwen-7b-async"), gpu_mem=None)
    assert "# async rollouts (Ray)" in text
    assert "4 (1 per training process), engine vllm" in text and "CPU 1, GPU 1" in text
    assert "1 optimizer step(s)" in text


def test_batch_plan_derives_accumulation():
    cfg = build_config("qwen-7b-colocate-tp2")
    plan = batch_plan(cfg)
    assert plan["sequences_per_step"] == 64 * 8
    assert plan["sequences_per_process"] == 64 and plan["gradient_accumulation"] == 16


def test_memory_plan_zero3_shards_and_offload():
    cfg = build_config("qwen-72b-colocate")
    mem = memory_plan(cfg, 80 * 1024**3)
    assert mem["optimizer"] == 0.0  # offloaded
    assert mem["weights"] == pytest.approx(72e9 * 2 / 8)
    assert "fits" in render_plan(cfg, gpu_mem=80 * 1024**3)
    assert "does NOT fit" in render_plan(cfg, gpu_mem=16 * 1024**3)


@pytest.mark.parametrize("text,value", [("80GiB", 80 * 1024**3), ("24G", 24 * 1024**3), ("512MiB", 512 * 1024**2)])
def test_parse_size(text, value):
    assert parse_size(text) == value


def test_stream_plan_shows_pool_buffer_and_the_lag_bound_that_applies():
    text = render_plan(build_config("tiny-cpu-stream"), gpu_mem=None)
    assert "# stream rollouts (pool, buffer, lag)" in text
    assert "up to 12 (max_in_flight 12; the lag bound admits 16: 8 a step × 2 versions)" in text
    assert "up to 8 finished group(s)" in text and "≤ 1 per token" in text and "KV kept" in text
    wide = render_plan(build_config("tiny-cpu-stream", None, ["rollout.stream.max_in_flight=40",
                                                             "rollout.stream.on_stale=regenerate"]), gpu_mem=None)
    assert "up to 16 (max_in_flight 40" in wide and "regenerated" in wide
