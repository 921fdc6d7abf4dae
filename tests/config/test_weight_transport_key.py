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


def test_one_list_of_transport_names_the_literal_the_rows_and_the_registry_agree():
    """`config/transports.py` is the list: the config's Literal holds its names, every server row takes its
    client's transports from it, and the registry of implementations has exactly its (client, name) pairs."""
    import typing

    from grpo_cli.config.rollout import ServerConfig
    from grpo_cli.config.transports import TRANSPORTS, WeightTransportName, names_for
    from grpo_cli.rollout.transport import base

    assert set(typing.get_args(WeightTransportName)) == {t.name for t in TRANSPORTS}
    field = ServerConfig.model_fields["weight_transport"].annotation
    assert set(typing.get_args(typing.get_args(field)[0])) == set(typing.get_args(WeightTransportName))
    servers = [row for row in MODES.values() if row.mode == "server"]
    assert servers and all(row.client and row.transports == names_for(row.client) for row in servers)
    assert {(t.client, t.name) for t in TRANSPORTS} == set(base.TRANSPORTS)


def test_a_row_cannot_take_other_transports_than_its_clients():
    from grpo_cli.config.engine_modes import EngineMode

    with pytest.raises(ValueError, match=r"a row of the sglang client takes its transports \('disk', 'tensor'\)"):
        EngineMode("toy", "server", "x:y", remote=True, client="sglang", transports=("http",))


@pytest.mark.parametrize("engine, name", [("vllm-serve", None), ("hf", "shm"), ("sglang", "tensor")])
def test_a_same_host_transport_refuses_a_server_elsewhere_at_config_time(engine, name):
    pick = [f"rollout.server.weight_transport={name}"] if name else []
    with pytest.raises(ConfigError, match=r"needs every rollout server on the trainer's host, addressed by a loopback "
                                          r"URL .* has http://10\.1\.2\.3:8000: point the URLs at 127\.0\.0\.1"):
        build_config(overrides=["rollout.mode=server", 'rollout.server.urls=["http://10.1.2.3:8000/"]',
                                f"rollout.engine={engine}", *pick])
    fine = build_config(overrides=["rollout.mode=server", 'rollout.server.urls=["http://localhost:8000"]',
                                   f"rollout.engine={engine}", *pick])
    assert fine.rollout.transport == (name or "shm")


def test_dry_run_refuses_shm_to_a_server_on_another_host():
    from typer.testing import CliRunner

    from grpo_cli.cli.main import app

    result = CliRunner().invoke(app, ["train", "--preset", "tiny-cpu-vllm-serve", "--set",
                                      'rollout.server.urls=["http://10.1.2.3:8000"]', "--dry-run"])
    assert result.exit_code == 2 and "weight_transport=shm (same host, same user) needs every rollout server" in \
        " ".join(result.output.split()), result.output
    assert "Traceback" not in result.output
