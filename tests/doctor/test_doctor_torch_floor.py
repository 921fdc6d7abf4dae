"""`grpo doctor` says when the installed torch is outside grpo-cli's own range, read from the one place it is
declared (pyproject.toml's `dependencies`, or the installed metadata). The floor is 2.6: the first torch whose
FSDP2 is public as `torch.distributed.fsdp.fully_shard` (issue 36)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

from grpo_cli.launch import doctor as d
from grpo_cli.launch import doctor_verdict as dv

ROOT = Path(__file__).resolve().parents[2]


def test_the_floor_is_pyprojects_and_admits_what_the_backends_import():
    deps = {Requirement(r).name: str(Requirement(r).specifier)
            for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    assert d.pinned_versions(None)["torch"] == deps["torch"] == ">=2.6"
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard  # noqa: F401


@pytest.mark.parametrize(("version", "ok"), [
    ("2.4.1", False), ("2.5.1+cu124", False), ("2.6.0", True), ("2.6.0a0+ecf3bae40a", True), ("2.11.0+cu128", True),
    ("2.13.0+cpu", True), ("3.0.0.dev20270101", True),
])
def test_installed_torch_against_the_floor(monkeypatch, version, ok):
    """A pre-release or local build of X.Y (a nightly, NVIDIA's containers' 2.6.0a0+...) counts as X.Y."""
    monkeypatch.setattr(torch, "__version__", version)
    check = next(c for c in d._torch_checks() if c.id == "torch.version")
    assert check.ok is ok, check
    assert version in check.detail and ">=2.6" in check.detail
    if not ok:
        assert check.fix.endswith('install "torch>=2.6"') and "fully_shard" in check.detail


def test_an_old_torch_limits_every_training_mode(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.5.1")
    checks = d._torch_checks() + [dv.Check(i, True, "") for i in ("transformers.import", "accelerate.import")]
    verdicts = {v.mode: v for v in dv.judge(checks, {"hf-colocate": dv.MODES["hf-colocate"]})}
    assert verdicts["hf-colocate"].status == dv.LIMITED
    assert any(r.startswith("torch.version: 2.5.1") for r in verdicts["hf-colocate"].reasons)


def test_an_installed_wheel_reads_the_floor_from_its_metadata(monkeypatch):
    """Outside a checkout the same line comes from grpo-cli's installed metadata (extras' lines left out)."""
    monkeypatch.setattr(d, "_source_tree", lambda: None)
    monkeypatch.setattr(d.md, "requires", lambda name: ["torch>=2.6", "typer>=0.12",
                                                        'torch==2.13.0; extra == "vllm-cpu"'])
    assert d.pinned_versions(None) == {"torch": ">=2.6", "typer": ">=0.12"}
    assert d.pinned_versions("vllm-cpu") == {"torch": "==2.13.0"}
