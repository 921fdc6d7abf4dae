"""`grpo train --rehearse`'s plan: every shipped GPU preset becomes a valid CPU config of the tiny task with the
same backend, offload, engine, mode and sleep level, TP scaled to at most 2 processes, and a note for each change;
`--rehearse --dry-run` prints it without importing torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from grpo_cli.cli.main import app
from grpo_cli.config.load import build_config, list_presets
from grpo_cli.launch.rehearse import MAX_PROCESSES, plan_rehearsal

GPU_PRESETS = sorted(name for name in list_presets() if build_config(name).distributed.device == "cuda")


def _plan(name: str, *, deepspeed_ready: bool = True):
    return plan_rehearsal(build_config(name), deepspeed_ready=deepspeed_ready)


def test_every_gpu_preset_is_covered():
    assert set(GPU_PRESETS) == {"qwen-72b-colocate", "qwen-7b-colocate-tp2", "qwen-7b-async", "qwen-1.5b-server",
                                "qwen-1.5b-colocate", "qwen-7b-sglang-server", "qwen2-0.5b-tldr-length",
                                "qwen3-30b-a3b-megatron", "qwen2.5-vl-3b-colocate", "qwen3-8b-long-sp4",
                                "qwen-7b-disagg-2x8", "qwen-72b-disagg-4x8"}


STOCK_SERVER = [n for n in GPU_PRESETS if build_config(n).rollout.engine == "vllm-serve"]
"""Presets against a stock `vllm serve` (qwen-72b-disagg-4x8): --rehearse starts only grpo-cli's own servers."""


@pytest.mark.parametrize("name", STOCK_SERVER)
def test_a_stock_server_preset_is_refused_with_the_command_pair(name):
    from grpo_cli.config.errors import UserError

    with pytest.raises(UserError, match="cannot start the server of rollout.engine 'vllm-serve'"):
        _plan(name)


@pytest.mark.parametrize("name", [n for n in GPU_PRESETS if n not in STOCK_SERVER])
def test_topology_kept_task_replaced(name):
    src, reh = build_config(name), _plan(name)
    vlm = name == "qwen2.5-vl-3b-colocate"  # the only vision-language preset: the tiny VLM on its shapes task
    cfg, tiny = reh.config, build_config("tiny-cpu-vlm" if vlm else "tiny-cpu")
    moe = name == "qwen3-30b-a3b-megatron"  # the only mixture-of-experts preset
    stand_in = "builtin:tiny-moe" if moe else "builtin:tiny-vlm-qwen2.5" if vlm else "builtin:tiny"
    assert cfg.distributed.device == "cpu" and cfg.model.name_or_path == stand_in
    assert cfg.rollout.max_completion_length == tiny.rollout.max_completion_length
    assert cfg.distributed.num_processes == min(src.distributed.num_processes, MAX_PROCESSES)
    assert (cfg.distributed.backend, cfg.distributed.deepspeed, cfg.distributed.offload) == \
        (src.distributed.backend, src.distributed.deepspeed, src.distributed.offload)
    assert (cfg.rollout.engine, cfg.rollout.mode, cfg.rollout.vllm.sleep_level) == \
        (src.rollout.engine, src.rollout.mode, src.rollout.vllm.sleep_level)
    assert (cfg.model.dtype, cfg.model.gradient_checkpointing, cfg.algorithm) == \
        (src.model.dtype, src.model.gradient_checkpointing, src.algorithm)
    assert cfg.data == tiny.data and cfg.rewards == tiny.rewards
    assert cfg.train.learning_rate == tiny.train.learning_rate and cfg.train.steps > reh.resume_at > 0
    assert any("builtin:tiny" in n for n in reh.notes) and any("device cuda → cpu" in n for n in reh.notes)
    assert any(what == "real memory fit" and f"grpo plan {name}" in why for what, why in reh.gpu_only)


@pytest.mark.parametrize(("name", "config", "stand_in"), [
    ("Qwen/Qwen2.5-VL-3B-Instruct", None, "builtin:tiny-vlm-qwen2.5"),
    ("Qwen/Qwen2-VL-7B-Instruct", None, "builtin:tiny-vlm"),
    ("local-qwen2.5-vl", {"model_type": "qwen2_5_vl", "text_config": {"model_type": "qwen2_5_vl_text"}},
     "builtin:tiny-vlm-qwen2.5"),
    ("local-qwen2-vl", {"model_type": "qwen2_vl", "text_config": {"model_type": "qwen2_vl_text"}}, "builtin:tiny-vlm"),
])
def test_a_vision_preset_is_rehearsed_with_a_tiny_vlm_of_its_architecture(tmp_path, name, config, stand_in):
    """A Qwen2.5-VL (by hub name, or a local folder's config.json: its text config's model_type on top) gets the
    tiny Qwen2.5-VL, any other VLM the tiny Qwen2-VL; either rehearses in fewer steps (VLM_REHEARSAL_STEPS)."""
    import json

    from grpo_cli.launch.rehearse import VLM_REHEARSAL_STEPS, VLM_RESUME_AT

    if config is not None:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**config, "vision_config": {}}))
        name = str(tmp_path / name)
    reh = plan_rehearsal(build_config("qwen2.5-vl-3b-colocate", overrides=[f"model.name_or_path={name}"]),
                         deepspeed_ready=True)
    assert reh.config.model.name_or_path == stand_in
    assert (reh.config.train.steps, reh.resume_at) == (VLM_REHEARSAL_STEPS, VLM_RESUME_AT)


@pytest.mark.parametrize(("name", "tp", "note"), [
    ("qwen-72b-colocate", 2, "vLLM tensor_parallel_size 8 → 2 (the process count)"),
    ("qwen-7b-colocate-tp2", 2, "vLLM tensor_parallel_size 2 kept"),
    ("qwen-1.5b-colocate", 1, None),
])
def test_tensor_parallel_scaled_to_the_processes(name, tp, note):
    reh = _plan(name)
    assert reh.config.rollout.vllm.tensor_parallel_size == tp
    assert note is None or note in reh.notes
    assert reh.config.distributed.num_processes % tp == 0


@pytest.mark.parametrize("name", [n for n in GPU_PRESETS if build_config(n).rollout.engine == "vllm"])
def test_vllm_maps_to_vllm_cpu_and_sleep_is_said(name):
    src, reh = build_config(name), _plan(name)
    assert any(n.startswith("engine vllm → vllm-cpu") for n in reh.notes)
    said = any("sleep_level" in n and "cannot act" in n for n in reh.notes)
    assert said == bool(src.rollout.vllm.sleep_level)
    assert any(w.startswith("CUDA sleep level") for w, _ in reh.gpu_only) == bool(src.rollout.vllm.sleep_level)


def test_processes_scaled_and_said():
    reh = _plan("qwen-72b-colocate")
    assert "processes 8×1 machine(s) → 2 (this machine)" in reh.notes
    assert not any(n.startswith("processes") for n in _plan("qwen-1.5b-colocate").notes)


def test_servers_and_async():
    assert _plan("qwen-1.5b-server").server == "grpo-vllm"
    sgl = _plan("qwen-7b-sglang-server")
    assert sgl.server == "sglang-contract"
    assert any("SGLang rehearsed against the contract server" in n for n in sgl.notes)
    assert any(w == "live SGLang" for w, _ in sgl.gpu_only)
    assert plan_rehearsal(build_config("qwen-1.5b-server"), deepspeed_ready=True,
                          server_url="http://127.0.0.1:5555").config.rollout.server.urls == ["http://127.0.0.1:5555"]
    asy = _plan("qwen-7b-async")
    assert asy.server is None and asy.config.rollout.ray.num_actors == 2 and asy.config.distributed.rollout_gpus == 0
    assert "async: 4 Ray rollout actor(s) → 2 on a local Ray cluster (1 CPU each), max_staleness 1 kept" in asy.notes


def test_megatron_grid_shrunk_to_the_rehearsal():
    """The MoE preset's ep 8 becomes ep 2 (expert parallel kept first, on the tiny MoE's 4 experts, up to the 2
    processes), tp 1 kept; what is lost is a GPU-only item. A dense model under a tp 2 grid keeps tp 2 and drops
    expert parallel."""
    reh = _plan("qwen3-30b-a3b-megatron")
    m = reh.config.distributed.megatron
    assert reh.config.distributed.backend == "megatron" and not reh.deepspeed_substituted
    assert reh.config.model.name_or_path == "builtin:tiny-moe"
    assert (m.tensor_parallel, m.pipeline_parallel, m.expert_parallel, m.sequence_parallel) == (1, 1, 2, False)
    assert m.recompute == "selective" and m.distributed_optimizer
    assert any(n.startswith("backend megatron kept") and "expert_parallel 8 → 2" in n and "tiny MoE" in n
               for n in reh.notes)
    dense = plan_rehearsal(build_config("qwen3-30b-a3b-megatron", overrides=[
        "model.name_or_path=Qwen/Qwen2.5-7B-Instruct", "distributed.megatron.expert_parallel=1",
        "distributed.megatron.tensor_parallel=2"]), deepspeed_ready=True).config
    assert dense.model.name_or_path == "builtin:tiny" and dense.distributed.megatron.tensor_parallel == 2
    assert any(w == "megatron grid" and "expert_parallel 8" in why for w, why in reh.gpu_only)


def test_deepspeed_stand_in_is_said():
    assert _plan("qwen-72b-colocate").config.distributed.backend == "deepspeed"
    zero3 = _plan("qwen-72b-colocate", deepspeed_ready=False)
    assert zero3.config.distributed.backend == "fsdp2" and zero3.deepspeed_substituted
    assert any("deepspeed ZeRO-3 → fsdp2" in n and "NOT rehearsed" in n for n in zero3.notes)
    assert _plan("qwen-7b-colocate-tp2", deepspeed_ready=False).config.distributed.backend == "ddp"


def test_dry_run_prints_config_and_notes_without_torch():
    out = CliRunner().invoke(app, ["train", "qwen-72b-colocate", "--rehearse", "--dry-run"])
    assert out.exit_code == 0, out.output
    assert "# rehearsal config (CPU)" in out.output and "name_or_path: builtin:tiny" in out.output
    assert "vLLM tensor_parallel_size 8 → 2 (the process count)" in out.output
    code = ("import sys; from grpo_cli.cli.main import app\n"
            "try:\n    app(['train', '--preset', 'qwen-7b-async', '--rehearse', '--dry-run'])\n"
            "except SystemExit as e:\n    assert e.code == 0, e.code\n"
            "heavy = [m for m in ('torch', 'transformers', 'vllm') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=120)


def test_what_a_backend_ignores_is_said():
    notes = _plan("qwen-72b-colocate").notes
    assert any(n.startswith("distributed.offload.optimizer: DeepSpeed keeps the optimizer state") and
               "nothing to move" in n for n in notes)
    assert any(n.startswith("distributed.offload.grads: only ZeRO-3's reduce bucket leaves the GPU") for n in notes)
    stand_in = _plan("qwen-72b-colocate", deepspeed_ready=False).notes  # fsdp2 moves what it is asked to
    assert not any(n.startswith("distributed.offload.") for n in stand_in)


def test_gpu_only_lists_what_cpu_cannot_exercise():
    big = dict(_plan("qwen-72b-colocate").gpu_only)
    assert {"NCCL", "pinned host memory", "CUDA RNG", "CUDA sleep level 2", "real memory fit"} <= set(big)
    assert "--host-mem" in big["real memory fit"]
    assert "pinned host memory" not in dict(_plan("qwen-7b-colocate-tp2").gpu_only)  # nothing offloaded there
    tensor = build_config("qwen-7b-sglang-server", overrides=["rollout.server.weight_transport=tensor"])
    assert "CUDA IPC" in dict(plan_rehearsal(tensor, deepspeed_ready=True).gpu_only)
    assert "CUDA IPC" not in dict(_plan("qwen-7b-sglang-server").gpu_only)


def test_a_server_the_rehearsal_cannot_start_is_refused_naming_what_to_do():
    """`rollout.engine: vllm-serve` is a client of a `vllm serve` the user starts: the rehearsal refuses it (it would
    otherwise train against URLs nobody serves) and names the command pair's page and the engine it can rehearse."""
    from grpo_cli.config.errors import UserError

    with pytest.raises(UserError, match=r"cannot start the server of rollout.engine 'vllm-serve'.*"
                                        r"docs/server-mode.md.*rollout.engine=vllm"):
        plan_rehearsal(build_config("tiny-cpu-vllm-serve"), deepspeed_ready=True)


def test_the_nccl_weight_transport_is_named_among_what_only_a_gpu_checks():
    """A server-mode preset with `rollout.server.weight_transport: nccl` syncs over NCCL, which the CPU rehearsal
    cannot run: `gpu_only` names it (and does not for the default transport)."""
    from grpo_cli.launch.rehearse import gpu_only

    server = ["rollout.mode=server", 'rollout.server.urls=["http://127.0.0.1:1"]']
    nccl = dict(gpu_only(build_config(overrides=[*server, "rollout.server.weight_transport=nccl"])))
    assert "server weight broadcast" in nccl.get("NCCL", "")
    assert "server weight broadcast" not in dict(gpu_only(build_config(overrides=server))).get("NCCL", "")
