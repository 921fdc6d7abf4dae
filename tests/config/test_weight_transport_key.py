"""One key picks the weight transport of every server-mode engine (`rollout.server.weight_transport`): its default
is the engine's first, a value the engine does not take is refused naming the valid ones, SGLang's old key is
refused with the new spelling, and the config's table of names is the registry's."""

from __future__ import annotations

import pytest

from grpo_cli.config.load import ConfigError, build_config
from grpo_cli.config.engine_modes import MODES

SERVER = ["rollout.mode=server", 'rollout.server.urls=["http://127.0.0.1:1"]']


@pytest.mark.parametrize("engine, default", [("hf", "http"), ("vllm", "http"), ("sglang", "disk")])
def test_the_default_is_the_engines_first_transport(engine, default):
    assert build_config(overrides=[*SERVER, f"rollout.engine={engine}"]).rollout.transport == default


@pytest.mark.parametrize("engine, name", [("hf", "shm"), ("vllm", "nccl"), ("sglang", "tensor")])
def test_a_transport_of_the_engine_is_taken(engine, name):
    cfg = build_config(overrides=[*SERVER, f"rollout.engine={engine}", f"rollout.server.weight_transport={name}"])
    assert cfg.rollout.transport == name


@pytest.mark.parametrize("engine, name, valid", [
    ("sglang", "http", r"an SGLang server takes disk, tensor \(default disk\)"),
    ("hf", "disk", r"`grpo serve-rollout --engine hf` takes http, shm, nccl \(default http\)"),
])
def test_a_transport_the_engine_does_not_take_is_refused_naming_the_valid_ones(engine, name, valid):
    with pytest.raises(ConfigError, match=rf"rollout\.server\.weight_transport={name} is not a weight transport of "
                                          rf"rollout\.engine '{engine}': {valid}"):
        build_config(overrides=[*SERVER, f"rollout.engine={engine}", f"rollout.server.weight_transport={name}"])


def test_outside_server_mode_the_key_is_refused():
    with pytest.raises(ConfigError, match=r"weight_transport=shm applies only to rollout\.mode=server"):
        build_config(overrides=["rollout.server.weight_transport=shm"])


def test_the_old_sglang_key_is_refused_with_the_new_spelling():
    with pytest.raises(ConfigError, match=r"sglang_weight_transport was merged into rollout\.server\.weight_transport: "
                                          r"write rollout\.server\.weight_transport: tensor instead"):
        build_config(overrides=[*SERVER, "rollout.engine=sglang", "rollout.server.sglang_weight_transport=tensor"])


def test_the_config_table_is_the_registry():
    from grpo_cli.rollout.transport.base import TRANSPORTS, names_for

    client = {"hf": "serve-rollout", "vllm": "serve-rollout", "sglang": "sglang", "vllm-serve": "vllm-serve"}
    table = {engine: row.transports for (engine, mode), row in MODES.items() if mode == "server"}
    assert set(table) == set(client)
    assert {engine: names_for(client[engine]) for engine in table} == table
    assert {(client[engine], n) for engine, names in table.items() for n in names} == set(TRANSPORTS)
