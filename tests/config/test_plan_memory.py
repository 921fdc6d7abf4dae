"""`grpo plan`'s memory accounting: host memory per node with a `--host-mem` verdict (the 72B preset's CPU optimizer
lives there), fsdp2's per-rank gradient figure (sharded every micro-batch by default, the whole model unsharded
with `unsharded_grad_accumulation`), `fsdp2.cpu_offload`, `reduce_dtype`. Each expectation is computed here from
the parameter count and the bytes per element, not read back from the plan."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from grpo_cli.cli.main import app
from grpo_cli.config.errors import UserError
from grpo_cli.config.load import build_config
from grpo_cli.config.model_shape import model_shape
from grpo_cli.planner.plan import host_plan, memory_plan, parse_size, peak_bytes, resident_while_generating, state_between_steps, training_state_bytes
from grpo_cli.planner.plan_render import render_plan

GIB, TIB = 1024**3, 1024**4
FSDP2_7B = ["distributed.backend=fsdp2"]  # qwen-7b-colocate-tp2: 8 processes on one machine, bf16 compute


def _host(cfg, gpu_mem=80 * GIB) -> dict[str, float]:
    return {k: b for k, (b, _) in host_plan(cfg, memory_plan(cfg, gpu_mem)).items()}


def test_72b_preset_host_memory_per_node():
    cfg = build_config("qwen-72b-colocate")
    p, n, hidden = 72e9, 8, 8192  # parameters (from the name), processes on the one machine, Qwen2.5-72B's width
    host = _host(cfg)
    # ZeRO-3 + offload_optimizer: fp32 masters (4 B) + AdamW's two fp32 moments (8 B) per parameter, 1/n per
    # process, n processes per node: 0.864e12 B, the "≈ 0.87 TB"
    assert host["optimizer"] == pytest.approx(p * (4 + 8))
    # + the fp32 gradients the host AdamW reads (4 B) and ZeRO-3's fp32 accumulation partitions (reduce_dtype, 4 B)
    assert host["gradients"] == pytest.approx(p * (4 + 4))
    # distributed.offload.grads: only the reduce bucket (hidden² bf16 elements) each GPU keeps leaves it;
    # distributed.offload.optimizer: nothing is on the GPU to move
    assert host["offload_while_generating"] == pytest.approx(n * hidden**2 * 2)
    assert set(host) == {"optimizer", "gradients", "offload_while_generating"}
    assert sum(host.values()) == pytest.approx(1.4411e12, rel=1e-4)
    mem = memory_plan(cfg, 80 * GIB)
    assert mem["optimizer"] == 0.0 and mem["gradients"] == hidden**2 * 2
    bf16 = _host(build_config("qwen-72b-colocate", overrides=["distributed.reduce_dtype=bfloat16"]))
    assert bf16["gradients"] == pytest.approx(p * (4 + 2))


@pytest.mark.parametrize(("host_mem", "verdict"), [("1TB", "does NOT fit in 1024 GiB"), ("1.5TiB", "fits in 1536 GiB"),
                                                   ("2TB", "fits in 2048 GiB")])
def test_host_mem_verdict(host_mem, verdict):
    out = CliRunner().invoke(app, ["plan", "qwen-72b-colocate", "--gpu-mem", "80GiB", "--host-mem", host_mem])
    assert out.exit_code == 0, out.output
    assert f"# host verdict: {verdict} per node" in out.output
    assert "# verdict: fits in 80 GiB" in out.output  # the GPU verdict is unchanged by the host's
    assert "offload_while_generating" in out.output and "(optimizer: already on the host)" in out.output


def test_host_verdict_keeps_headroom():
    cfg = build_config("qwen-72b-colocate")
    total = sum(_host(cfg).values())
    assert "host verdict: fits" in render_plan(cfg, gpu_mem=None, host_mem=total / 0.9 * 1.001)
    assert "host verdict: does NOT fit" in render_plan(cfg, gpu_mem=None, host_mem=total / 0.9 * 0.999)
    assert "host verdict" not in render_plan(cfg, gpu_mem=None)


def test_parse_sizes_for_both_options():
    assert parse_size("2TB", "--host-mem") == 2 * TIB and parse_size("768GiB") == 768 * GIB
    with pytest.raises(UserError, match="--host-mem 'lots' is not a size"):
        parse_size("lots", "--host-mem")


@pytest.mark.parametrize(("sets", "per_param"), [
    ([], 4 / 8),  # the default: reduce-scattered every micro-batch, each rank keeps its fp32 shard
    (["distributed.fsdp2.unsharded_grad_accumulation=true"], 4),  # the whole model's fp32 gradients on every rank
    (["distributed.fsdp2.unsharded_grad_accumulation=true", "distributed.reduce_dtype=bfloat16"], 2),
    (["distributed.reduce_dtype=bfloat16"], 4 / 8),  # the shard is in the master dtype whatever the reduction's
])
def test_fsdp2_gradients_per_rank(sets, per_param):
    cfg = build_config("qwen-7b-colocate-tp2", overrides=[*FSDP2_7B, *sets])
    assert training_state_bytes(cfg, 7e9)["gradients"] == pytest.approx(7e9 * per_param)


def test_fsdp2_unsharded_accumulation_is_gone_while_generating():
    """Between steps (while vLLM generates) a rank holds its shard: the unsharded accumulation is freed at the
    step's last micro-batch, so it raises the training peak, not the generation one."""
    on = build_config("qwen-7b-colocate-tp2",
                      overrides=[*FSDP2_7B, "distributed.fsdp2.unsharded_grad_accumulation=true"])
    off = build_config("qwen-7b-colocate-tp2", overrides=FSDP2_7B)
    mem_on, mem_off = memory_plan(on, 80 * GIB), memory_plan(off, 80 * GIB)
    assert state_between_steps(on, mem_on)["gradients"] == pytest.approx(7e9 * 4 / 8) == mem_off["gradients"]
    assert mem_on["gradients"] - mem_off["gradients"] == pytest.approx(7e9 * 4 * (1 - 1 / 8))
    assert resident_while_generating(on, mem_on) == resident_while_generating(off, mem_off)
    assert peak_bytes(on, mem_on) == pytest.approx(sum(v for k, v in mem_on.items() if not k.startswith("vllm")))
    assert "whole model, unsharded, float32, between micro-batches" in render_plan(on, gpu_mem=80 * GIB)


def test_fsdp2_cpu_offload_moves_the_state_to_the_host():
    cfg = build_config("qwen-7b-colocate-tp2", overrides=[*FSDP2_7B, "distributed.fsdp2.cpu_offload=true"])
    mem, shape = memory_plan(cfg, 80 * GIB), model_shape("Qwen/Qwen2.5-7B-Instruct")
    assert (mem["weights"], mem["gradients"], mem["optimizer"]) == (0.0, 0.0, 0.0)
    # the GPU holds the gathered compute-dtype units: the root (embeddings + untied head) and two layers
    root = 151_936 * 3584 * 2 + 3584
    assert mem["weights_gathered"] == pytest.approx((root + 2 * (7e9 - root) / 28) * 2)
    host = _host(cfg)  # fp32 shards: weights 4 B, gradients 4 B, two moments 8 B per parameter, over 8 processes
    assert (host["weights"], host["gradients"], host["optimizer"]) == pytest.approx((7e9 * 4, 7e9 * 4, 7e9 * 8))
    two_nodes = build_config("qwen-7b-colocate-tp2", overrides=[*FSDP2_7B, "distributed.fsdp2.cpu_offload=true",
                                                                "distributed.num_machines=2",
                                                                "distributed.main_process_ip=10.0.0.1"])
    assert _host(two_nodes)["optimizer"] == pytest.approx(7e9 * 8 / 2)  # each node holds half the shards


def test_engine_and_offload_host_rows():
    sleep1 = build_config("qwen-1.5b-colocate")  # vLLM sleep level 1 keeps the bf16 weights on the host
    assert _host(sleep1) == {"vllm_weights_asleep": pytest.approx(1.5e9 * 2)}
    assert _host(build_config("qwen-1.5b-colocate", overrides=["rollout.vllm.sleep_level=2"])) == {}
    assert _host(build_config("qwen-7b-async"))["ray_object_store"] == pytest.approx(7e9 * 2)
    ddp = build_config("qwen-1.5b-colocate", overrides=["distributed.offload.optimizer=true",
                                                        "distributed.offload.grads=true"])
    # ddp, fp32 masters: AdamW's moments (8 B) and the gradients (4 B) move while generating
    assert _host(ddp)["offload_while_generating"] == pytest.approx(1.5e9 * (8 + 4))


def test_hf_generation_copy_is_counted_under_bf16_autocast_only():
    """ddp with float32 masters computing in bf16: the hf engine decodes a bf16 copy of the weights (2 B/parameter,
    resident for the run); no copy when the weights are already in the compute dtype, or with LoRA."""
    cfg = build_config("tiny-cpu", None, ["model.dtype=bfloat16"])
    p = model_shape(cfg.model.name_or_path).params
    mem = memory_plan(cfg, None)
    assert mem["hf_generation_copy"] == pytest.approx(p * 2)
    assert peak_bytes(cfg, mem) >= mem["hf_generation_copy"] + mem["weights"]
    assert "hf_generation_copy" in render_plan(cfg, gpu_mem=None)
    for extra in (["model.master_weights=compute_dtype"], [], ["rollout.engine=vllm"]):
        other = build_config("tiny-cpu", None, (["model.dtype=bfloat16"] if extra else []) + extra)
        assert "hf_generation_copy" not in memory_plan(other, None)


@pytest.mark.parametrize(("device", "gpu_mem", "rows"), [
    ("cuda", None, 1766), ("auto", 80 * GIB, 1766), ("auto", None, 110), ("cpu", 80 * GIB, 110)])
def test_head_chunk_row_uses_the_plan_devices_chunk(device, gpu_mem, rows):
    """The chunked output layer's row: one chunk of float32 logits, 3 buffers, sized for the device the plan's
    processes compute on: a GPU plan (`cuda`, or `auto` sized with --gpu-mem) 2**28 // 151,936 = 1,766 positions of
    Qwen's vocabulary, a CPU plan 2**24 // 151,936 = 110 (10,240 positions a micro-batch here)."""
    cfg = build_config("qwen-7b-colocate-tp2", overrides=[f"distributed.device={device}"])
    assert memory_plan(cfg, gpu_mem)["head_chunk"] == rows * 151_936 * 4 * 3
    tiny = build_config("tiny-cpu", overrides=["train.micro_batch_size=1"])  # vocabulary 68: every position fits
    assert memory_plan(tiny, gpu_mem)["head_chunk"] == tiny.max_sequence_length * 68 * 4 * 3
