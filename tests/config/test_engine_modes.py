"""The (engine, mode) table (`config/engine_modes.py`) is what the config rules, the factory, `grpo plan` and
`--rehearse` read: an engine declared there in a test is accepted, built, planned and rehearsed without touching
any of them; the derived config properties say once what was recomputed in several places."""

from __future__ import annotations

import pytest

from grpo_cli.config import engine_modes
from grpo_cli.config.engine_modes import MODES, EngineMode, engine_mode, engines, register
from grpo_cli.config.errors import UserError
from grpo_cli.config.load import build_config
from grpo_cli.planner.plan import memory_plan
from grpo_cli.planner.plan_render import render_plan
from grpo_cli.launch.rehearse import plan_rehearsal
from grpo_cli.rollout.base import EngineContext, RolloutEngine
from grpo_cli.rollout.factory import make_engine

URL = ["rollout.server.urls=[\"http://127.0.0.1:9\"]"]


class ToyEngine(RolloutEngine):
    def __init__(self, cfg, ctx, **extras) -> None:
        self.cfg, self.ctx, self.extras = cfg, ctx, extras

    def generate(self, prompt_ids, sampling):
        raise AssertionError("not called")

    def score(self, sequences):
        return [[0.0] * (len(s) - 1) for s in sequences]

    def update_weights(self, named_tensors, version):
        self.weight_version = version


def build_toy(cfg, ctx, **extras) -> ToyEngine:
    return ToyEngine(cfg, ctx, **extras)


@pytest.fixture
def toy(monkeypatch):
    """Two rows of a new engine `toy`: a colocated one sharing the policy's weights, and a server client whose
    rehearsal runs against `grpo serve-rollout --engine hf`."""
    monkeypatch.setattr(engine_modes, "MODES", dict(MODES))
    build = f"{__name__}:build_toy"
    register(EngineMode("toy", "colocate", build, ("policy",), colocated=True, shares_policy_weights=True))
    register(EngineMode("toy", "server", f"{__name__}:ToyEngine", remote=True, transports=("http",),
                        rehearsal_server="grpo-hf"))


def test_the_default_table_has_every_mode_the_factory_builds():
    assert sorted(MODES) == [("hf", "async"), ("hf", "colocate"), ("hf", "server"), ("sglang", "server"),
                             ("vllm", "async"), ("vllm", "colocate"), ("vllm", "server"), ("vllm-serve", "server"),
                             ("vllm-serve", "stream")]
    assert engines() == ["hf", "vllm", "sglang", "vllm-serve"]
    assert [k for k, row in MODES.items() if row.can_sleep] == [("vllm", "colocate")]


def test_an_engine_outside_the_table_is_refused_with_the_engines_there():
    with pytest.raises(UserError, match="rollout.engine 'toy' is not an engine grpo-cli has; use one of hf, vllm"):
        build_config(overrides=["rollout.engine=toy"])


def test_a_declared_engine_is_accepted_built_planned_and_rehearsed(toy):
    cfg = build_config(overrides=["rollout.engine=toy", "model.dtype=bfloat16"])
    assert cfg.rollout.layout is engine_mode("toy", "colocate") and cfg.rollout.colocated
    assert not cfg.rollout.colocated_vllm
    engine = make_engine(cfg, EngineContext("m", [1], 0), policy="the policy", device="cpu")
    assert isinstance(engine, ToyEngine) and engine.extras == {"policy": "the policy"}  # only its build_args
    # plan: a colocated engine sharing the policy's weights keeps the bf16 generation copy of float32 masters
    assert "hf_generation_copy" in memory_plan(cfg, None)
    assert "# batch plan" in render_plan(cfg, gpu_mem=None)
    # rules: the row's facts, not the engine's name (shared weights cannot be sharded by fsdp2)
    with pytest.raises(UserError, match="generates with the policy's own parameters"):
        build_config(overrides=["rollout.engine=toy", "distributed.backend=fsdp2"])
    with pytest.raises(UserError, match="rollout.vllm.sleep_level applies only"):
        build_config(overrides=["rollout.engine=toy", "rollout.vllm.sleep_level=1"])

    served = build_config(overrides=["rollout.engine=toy", "rollout.mode=server", *URL])
    assert isinstance(make_engine(served, EngineContext("m", [1], 0)), ToyEngine)
    reh = plan_rehearsal(served, deepspeed_ready=False)
    assert reh.server == "grpo-hf" and reh.config.rollout.server.urls == ["http://127.0.0.1:0"]
    with pytest.raises(UserError, match="cannot run in mode 'async': it runs in mode\\(s\\) colocate, server"):
        build_config(overrides=["rollout.engine=toy", "rollout.mode=async"])


def test_derived_lengths_and_steps():
    cfg = build_config(overrides=["data.max_prompt_length=40", "rollout.max_completion_length=24", "train.steps=7",
                                  "algorithm.num_iterations=3"])
    assert cfg.max_sequence_length == 64 and cfg.total_optimizer_steps == 21


def test_every_row_builds_a_class_on_the_contract():
    """A row whose builder is a class's `from_config` builds an engine on `RolloutEngine` (an engine outside the
    contract would miss the members the trainer asks of every engine, e.g. `bind_prompts`)."""
    from grpo_cli.rollout.base import RolloutEngine
    from grpo_cli.rollout.factory import resolve

    classes = {row.build.rpartition(".")[0] for row in MODES.values() if row.build.endswith(".from_config")}
    assert len(classes) >= 4
    for where in classes:
        assert issubclass(resolve(where), RolloutEngine), where
