"""`distributed.fsdp2.replicate` (HSDP): its rules, and `grpo plan`'s per-GPU and per-node memory with the state
sharded over world/R processes instead of the world. Expectations are computed here from the parameter count."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from grpo_cli.cli.main import app
from grpo_cli.config.load import ConfigError, build_config
from grpo_cli.planner.plan import host_plan, memory_plan
from grpo_cli.planner.plan_render import render_plan

GIB = 1024**3
TWO_NODES = ["distributed.backend=fsdp2", "distributed.num_machines=2", "distributed.main_process_ip=10.0.0.1"]
"""qwen-7b-colocate-tp2 (8 processes per machine) on 2 machines: 16 processes."""


def test_replicate_must_divide_the_processes():
    with pytest.raises(ConfigError, match=r"distributed.fsdp2.replicate=3 does not divide the 16 training processes"
                                          r".*Use one of \[1, 2, 4, 8, 16\]"):
        build_config("qwen-7b-colocate-tp2", overrides=[*TWO_NODES, "distributed.fsdp2.replicate=3"])


def test_replicate_is_refused_with_another_backend():
    with pytest.raises(ConfigError, match="distributed.fsdp2 settings apply only to distributed.backend=fsdp2"):
        build_config(overrides=["distributed.backend=ddp", "distributed.num_processes=2",
                                "distributed.fsdp2.replicate=2"])


def test_a_bad_replicate_exits_2_with_the_message():
    out = CliRunner().invoke(app, ["plan", "qwen-7b-colocate-tp2", *(a for s in TWO_NODES for a in ("--set", s)),
                                   "--set", "distributed.fsdp2.replicate=5"])
    assert out.exit_code == 2 and "replicate=5 does not divide" in out.output and "Traceback" not in out.output


def test_plan_shards_the_state_over_a_replica():
    """16 processes, R=2: weights, gradients and AdamW moments (fp32) 1/8 per GPU instead of 1/16; with cpu_offload
    each node's host holds a whole copy (8 processes x 1/8) instead of half."""
    p = 7e9
    plain, hsdp = (build_config("qwen-7b-colocate-tp2", overrides=[*TWO_NODES, f"distributed.fsdp2.replicate={r}"])
                   for r in (1, 2))
    for cfg, n in ((plain, 16), (hsdp, 8)):
        mem = memory_plan(cfg, 80 * GIB)
        assert (mem["weights"], mem["gradients"], mem["optimizer"]) == pytest.approx((p * 4 / n, p * 4 / n, p * 8 / n))
    text = render_plan(hsdp, gpu_mem=80 * GIB)
    assert "HSDP mesh: 2 replicas x 8 shard ranks" in text and "1/8 shard, reduce-scattered" in text
    assert "HSDP mesh" not in render_plan(plain, gpu_mem=80 * GIB)
    offload = ["distributed.fsdp2.cpu_offload=true"]
    for r, copies in ((1, 0.5), (2, 1.0)):
        cfg = build_config("qwen-7b-colocate-tp2", overrides=[*TWO_NODES, *offload, f"distributed.fsdp2.replicate={r}"])
        host = host_plan(cfg, memory_plan(cfg, 80 * GIB))
        assert host["optimizer"][0] == pytest.approx(p * 8 * copies), r
