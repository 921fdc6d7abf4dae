"""`distributed.backend: megatron` before any model loads: the grid rules (tp·pp divides the world, experts fit
data parallel, heads/layers/experts of a local config.json), the refused combinations, `grpo plan`'s per-GPU
memory checked by hand against the documented formula, and `grpo doctor`'s megatron probes."""

from __future__ import annotations

import json

import pytest

from grpo_cli.config.load import ConfigError, build_config
from grpo_cli.config.model_shape import model_shape
from grpo_cli.config.rules_megatron import megatron_layout
from grpo_cli.planner.plan import GIB, memory_plan, peak_bytes, training_state_bytes
from grpo_cli.launch import doctor as d
from grpo_cli.launch import doctor_verdict as dv

MEG = ["distributed.backend=megatron", "rollout.engine=vllm", "train.micro_batch_size=1"]


def _moe_folder(tmp_path, **fields):
    """A local folder with a Qwen3-MoE-like config.json (only what the rules and the plan read)."""
    c = {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 8,
         "num_key_value_heads": 4, "head_dim": 8, "intermediate_size": 128, "moe_intermediate_size": 32,
         "num_experts": 8, "vocab_size": 100, "tie_word_embeddings": False, **fields}
    (tmp_path / "config.json").write_text(json.dumps(c))
    return str(tmp_path)


@pytest.mark.parametrize(("overrides", "match"), [
    (["distributed.num_processes=4", "train.prompts_per_step=4", "distributed.megatron.tensor_parallel=3"],
     r"tensor_parallel=3 × pipeline_parallel=1 = 3 does not divide the 4 training processes"),
    (["distributed.num_processes=4", "train.prompts_per_step=4", "distributed.megatron.tensor_parallel=2",
      "distributed.megatron.expert_parallel=4"], r"expert_parallel=4 does not fit the grid.*data parallel 2; "
                                                 r"valid values: \[1, 2\]"),
    (["distributed.megatron.virtual_pipeline=2"], r"virtual_pipeline=2 .* pipeline_parallel is 1"),
    # the pure-torch layer spec's RMSNorm refuses sequence parallelism (megatron-core's torch_norm.py), any device
    (["distributed.num_processes=2", "train.prompts_per_step=2", "distributed.megatron.tensor_parallel=2",
      "distributed.megatron.sequence_parallel=true", "distributed.device=cuda"],
     r"sequence_parallel cannot take effect here: .*RMSNorm \(WrappedTorchNorm"),
    # and a MoE layer at tensor parallel > 1 needs it (moe_layer.py): refused, from config.json or the name
    (["distributed.num_processes=2", "train.prompts_per_step=2", "distributed.megatron.tensor_parallel=2",
      "model.name_or_path=builtin:tiny-moe"], r"tensor_parallel=2 cannot train builtin:tiny-moe, a "
                                              r"mixture-of-experts model"),
    (["distributed.num_processes=8", "train.prompts_per_step=8", "distributed.megatron.tensor_parallel=2",
      "model.name_or_path=Qwen/Qwen3-30B-A3B"], r"megatron-core refuses a MoE layer with tensor parallelism but "
                                                r"no sequence parallelism .*Set tensor_parallel=1"),
    (["distributed.offload.optimizer=true"], r"distributed\.offload \(optimizer\) is not implemented for "
                                             r"distributed\.backend 'megatron'"),
    (["model.gradient_checkpointing=true"], r"distributed\.megatron\.recompute"),
    (["model.master_weights=compute_dtype"], r"master_weights 'compute_dtype' is not available with "
                                             r"distributed\.backend 'megatron'"),
    (["distributed.reduce_dtype=bfloat16"], r"reduce_dtype 'bfloat16' is not available with distributed\.backend "
                                            r"'megatron'"),
    (['model.lora={"r": 8}'], r"model\.lora is not available with distributed\.backend 'megatron'"),
])
def test_megatron_rules(overrides, match):
    with pytest.raises(ConfigError, match=match):
        build_config(overrides=[*MEG, *overrides])


def test_hf_colocate_and_server_accepted():
    """The hf engine holds its own Hugging Face copy, synced from the Megatron shards (no shared module needed)."""
    build_config(overrides=["distributed.backend=megatron"])
    build_config(overrides=["distributed.backend=megatron", "rollout.mode=server",
                            'rollout.server.urls=["http://x:1"]'])


def test_plan_counts_the_hf_engine_copy():
    """With megatron the hf engine loads the whole model on every rank in `rollout.dtype`: the plan shows that copy
    and its peak grows by it (vLLM's rows instead, split by its TP; the hf engine under ddp shares the policy)."""
    base = ["distributed.backend=megatron", "distributed.megatron.tensor_parallel=2", "rollout.dtype=bfloat16",
            "model.gradient_checkpointing=false"]
    HF = ["rollout.engine=hf", "rollout.vllm.sleep_level=0"]
    cfg = build_config("qwen-7b-colocate-tp2", overrides=[*base, *HF])
    hf = memory_plan(cfg, 80 * GIB)
    params = model_shape(cfg.model.name_or_path).params
    assert hf["hf_engine_copy"] == params * 2 and not any(k.startswith("vllm") for k in hf)
    without = {k: v for k, v in hf.items() if k != "hf_engine_copy"}
    assert peak_bytes(cfg, hf) == pytest.approx(peak_bytes(cfg, without) + params * 2)
    assert "hf_engine_copy" not in memory_plan(build_config("qwen-7b-colocate-tp2", overrides=base), 80 * GIB)
    assert "hf_engine_copy" not in memory_plan(build_config("qwen-7b-colocate-tp2", overrides=[
        *HF, "distributed.backend=ddp"]), 80 * GIB)


@pytest.mark.parametrize("setting", ["distributed.megatron.tensor_parallel=2", "distributed.megatron.recompute=full",
                                     "distributed.megatron.distributed_optimizer=false"])
def test_megatron_settings_refused_under_another_backend(setting):
    with pytest.raises(ConfigError, match=r"distributed\.megatron settings apply only to "
                                          r"distributed\.backend=megatron, but the backend is 'ddp'"):
        build_config(overrides=[setting])


@pytest.mark.parametrize("overrides", [
    [],
    ["distributed.num_processes=8", "distributed.megatron.tensor_parallel=2", "distributed.megatron.pipeline_parallel=2",
     "distributed.megatron.virtual_pipeline=2",
     "distributed.megatron.expert_parallel=2", "distributed.megatron.recompute=full"],
    ["distributed.num_processes=2", "train.prompts_per_step=2", "distributed.megatron.tensor_parallel=2",
     "distributed.device=cpu"],  # tensor parallel on CPU is fine; only sequence parallel needs CUDA
])
def test_megatron_grids_accepted(overrides):
    cfg = build_config(overrides=[*MEG, *overrides])
    lay = megatron_layout(cfg)
    assert lay["tp"] * lay["pp"] * lay["dp"] == lay["world"]


@pytest.mark.parametrize(("fields", "overrides", "match"), [
    # 8 | 8 heads, kv 4 | 8 (dense: a MoE model trains at tensor parallel 1)
    ({"num_experts": None}, ["distributed.megatron.tensor_parallel=8", "distributed.megatron.expert_parallel=1"], None),
    ({"num_attention_heads": 6, "head_dim": 8}, ["distributed.megatron.tensor_parallel=4"],
     r"tensor_parallel=4 does not divide .*num_attention_heads=6 .*valid values: \[1, 2, 3, 6\]"),
    ({"num_key_value_heads": 2, "num_experts": None}, ["distributed.megatron.tensor_parallel=8"], None),  # kv 2 × 4
    ({"num_attention_heads": 12, "num_key_value_heads": 3}, ["distributed.megatron.tensor_parallel=2"],
     r"tensor_parallel=2 does not fit .*num_key_value_heads=3.*valid values: \[1, 3, 6, 12\]"),
    ({}, ["distributed.megatron.pipeline_parallel=8"], r"pipeline_parallel=8 does not divide .*num_hidden_layers=4"),
    ({}, ["distributed.megatron.pipeline_parallel=4", "distributed.megatron.virtual_pipeline=2"],
     r"pipeline_parallel=4 × virtual_pipeline=2 = 8 does not divide .*num_hidden_layers=4"),
    ({"num_experts": 6}, ["distributed.megatron.expert_parallel=4"],
     r"expert_parallel=4 does not divide .* 6 experts .*valid values: \[1, 2, 3, 6\]"),
    ({"num_experts": None}, ["distributed.megatron.expert_parallel=2"], r"is a dense model"),
    ({"num_experts": None, "num_local_experts": 8}, ["distributed.megatron.expert_parallel=8"], None),  # Mixtral's key
])
def test_model_config_rules(tmp_path, fields, overrides, match):
    path = _moe_folder(tmp_path, **fields)
    sets = [*MEG, f"model.name_or_path={path}", "distributed.num_processes=8", *overrides]
    if match is None:
        build_config(overrides=sets)
    else:
        with pytest.raises(ConfigError, match=match):
            build_config(overrides=sets)


def test_moe_shape_counts_experts():
    """Qwen3-30B-A3B from the name (no local folder): 30.5B parameters, 29.0B of them in the routed experts."""
    s = model_shape("Qwen/Qwen3-30B-A3B")
    h, layers, experts, moe = 2048, 48, 128, 768
    attn = 2 * h * 4096 + 2 * h * 512 + 2 * h + 2 * 128  # q/o, k/v, two norms, q/k norms
    x = layers * experts * 3 * h * moe
    assert s.expert_params == x == pytest.approx(28.99e9, rel=1e-3)
    assert s.params == layers * (attn + h * experts) + x + 2 * 151_936 * h + h == pytest.approx(30.53e9, rel=1e-3)
    assert (s.experts, s.heads, s.kv_heads, s.vocab) == (128, 32, 4, 151_936)


def test_preset_memory_by_hand():
    """qwen3-30b-a3b-megatron: 8 GPUs, tp 1, ep 8 (etp = tp = 1), pp 1, so dp 8, edp 8 / 8 = 1; bf16."""
    cfg = build_config("qwen3-30b-a3b-megatron")
    s = model_shape("Qwen/Qwen3-30B-A3B")
    x, dense = s.expert_params, s.params - s.expert_params
    held = dense + x / 8  # dense 1/(tp·pp), experts 1/(ep·etp·pp)
    mem = memory_plan(cfg, 141 * GIB)
    assert mem["weights"] == pytest.approx(held * 2)  # bf16
    assert mem["gradients"] == pytest.approx(held * 4)  # float32 DDP buffers
    assert mem["optimizer"] == pytest.approx(12 * (dense / 8 + x / 8 / 1))  # masters + moments / dp, / edp
    assert mem["weights"] / GIB == pytest.approx(9.62, abs=0.01) and mem["optimizer"] / GIB == pytest.approx(42.65,
                                                                                                            abs=0.01)
    # activations: selective recompute, no sequence parallel, t = 1 → s·b·h·(10 + 24/t) per layer, 48 layers, 1
    # micro-batch in flight (pp 1), plus one chunk of the chunked head, not the whole (2560, 151936) float32 logits
    # (4.7 GB): on CUDA (the preset's device) 2**28 // 151,936 = 1,766 positions × 151,936 × 4 bytes × 3 buffers
    # (logits, exp, gradient) = 3.2 GB; the same run planned on the CPU: 2**24 // 151,936 = 110 positions, 0.2 GB
    seq = 512 + 2048
    layers = 48 * seq * 2048 * 34
    act = layers + 1766 * 151_936 * 4 * 3
    assert mem["activations"] == pytest.approx(act)
    cpu = memory_plan(build_config("qwen3-30b-a3b-megatron", overrides=["distributed.device=cpu"]), None)
    assert cpu["activations"] == pytest.approx(layers + 110 * 151_936 * 4 * 3)
    none = memory_plan(build_config("qwen3-30b-a3b-megatron", overrides=["distributed.megatron.recompute=none"]),
                       141 * GIB)
    # without recompute the s² attention scores stay: + 5·a·s/(h·t) per s·b·h
    assert none["activations"] - act == pytest.approx(48 * seq * 2048 * 5 * 32 * seq / 2048)


@pytest.mark.parametrize(("sets", "expect"), [
    # dense model (the 7B from its name), 8 GPUs, tp 2 × pp 2, dp 2; bf16; optimizer sharded by dp 2
    (["distributed.megatron.tensor_parallel=2", "distributed.megatron.pipeline_parallel=2"],
     {"weights": 7e9 * 2 / 4, "gradients": 7e9 * 4 / 4, "optimizer": 7e9 * 12 / 8}),
    # no distributed optimizer: every data-parallel rank keeps its model shard's whole optimizer state
    (["distributed.megatron.tensor_parallel=4", "distributed.megatron.distributed_optimizer=false"],
     {"weights": 7e9 * 2 / 4, "gradients": 7e9 * 4 / 4, "optimizer": 7e9 * 12 / 4}),
    # float32 model: no separate master, the optimizer holds the two moments only
    (["distributed.megatron.tensor_parallel=8", "model.dtype=float32"],
     {"weights": 7e9 * 4 / 8, "gradients": 7e9 * 4 / 8, "optimizer": 7e9 * 8 / 8}),
])
def test_dense_state_by_hand(sets, expect):
    cfg = build_config("qwen-7b-colocate-tp2", overrides=["distributed.backend=megatron",
                                                          "model.gradient_checkpointing=false", *sets])
    assert training_state_bytes(cfg, 7e9) == pytest.approx(expect)


def test_pipeline_activations_in_flight():
    """pp 2: each stage stores L/2 layers for min(2, micro-batches) micro-batches, i.e. as much as one whole
    model's micro-batch; the logits term is the same."""
    base = ["distributed.backend=megatron", "model.gradient_checkpointing=false", "distributed.megatron.tensor_parallel=2"]
    one = memory_plan(build_config("qwen-7b-colocate-tp2", overrides=base), 80 * GIB)["activations"]
    two = memory_plan(build_config("qwen-7b-colocate-tp2", overrides=[*base, "distributed.megatron.pipeline_parallel=2"]),
                      80 * GIB)["activations"]
    assert two == pytest.approx(one)


def test_plan_renders_megatron_notes():
    from grpo_cli.planner.plan_render import render_plan

    text = render_plan(build_config("qwen3-30b-a3b-megatron"), gpu_mem=80 * GIB)
    assert "backend megatron" in text and "experts 1/(ep 8 x etp 1 x pp 1)" in text
    assert "# verdict: does NOT fit in 80 GiB" in text
    assert "# verdict: fits in 141 GiB" in render_plan(build_config("qwen3-30b-a3b-megatron"), gpu_mem=141 * GIB)


# ---- grpo doctor ------------------------------------------------------------------------------------------------

def test_doctor_megatron_absent_fails_only_its_mode(monkeypatch):
    monkeypatch.setattr(d, "_version", lambda name: (None, None) if name in d.MEGATRON_PACKAGES else ("1.0", name))
    checks = {c.id: c for c in d._megatron_checks(import_modules=False)}
    assert checks["megatron-core.import"].ok is False and checks["megatron-core.import"].detail == "not installed"
    assert "[megatron]" in checks["mbridge.import"].fix
    base = [dv.Check(i, True, "") for i in ("torch.import", "transformers.import", "accelerate.import")]
    verdicts = {v.mode: v for v in dv.judge([*base, *checks.values()])}
    assert verdicts["megatron"].status == dv.NO and verdicts["hf-colocate"].status == dv.OK


def test_doctor_megatron_version_against_the_pin(monkeypatch):
    monkeypatch.setattr(d, "_version", lambda name: {"megatron-core": ("0.15.0", "megatron-core"),
                                                     "mbridge": ("0.15.1", "mbridge")}.get(name, (None, None)))
    pins = d.pinned_versions("megatron")
    assert pins == {"megatron-core": "==0.16.1", "mbridge": "==0.15.1"}  # pyproject's `megatron` extra
    checks = {c.id: c for c in d._megatron_checks(import_modules=False)}
    assert checks["megatron-core.version"].ok is False and "pins ==0.16.1" in checks["megatron-core.version"].detail
    assert checks["mbridge.version"].ok is True
    assert "import not tried with --quick" in checks["mbridge.import"].detail


def test_doctor_quick_judges_megatron():
    from typer.testing import CliRunner

    from grpo_cli.cli.main import app

    out = CliRunner().invoke(app, ["doctor", "--quick"])
    assert out.exit_code == 0, out.output  # whatever megatron's verdict, no --mode: no failure
    assert "megatron-core.import" in out.output and "mbridge.version" in out.output
    assert any(line.strip().startswith("megatron ") for line in out.output.splitlines())
