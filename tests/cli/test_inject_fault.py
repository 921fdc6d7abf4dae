"""`GRPO_INJECT_FAULT` (runtime/faults.py): the accepted forms, a malformed value refused with exit 2 by `grpo train`
(before any worker starts) and `grpo serve-rollout`, the loud line, and the kill fault's SIGKILL."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from grpo_cli.cli.main import app
from grpo_cli.runtime.faults import ENV, FORMS, Fault, FaultPlan, FaultSpecError

runner = CliRunner()


def test_accepted_forms():
    plan = FaultPlan.parse("nonfinite_loss:rank=1:step=2, kill:step=3,server_hang:step=4")
    assert plan.faults == (Fault("nonfinite_loss", 2, 1), Fault("kill", 3, 0), Fault("server_hang", 4))
    assert plan.nonfinite_loss(rank=1, step=2) and not plan.nonfinite_loss(rank=0, step=2)
    assert not plan.nonfinite_loss(rank=1, step=3) and plan.server_hang_step() == 4
    assert not FaultPlan.parse("") and not FaultPlan.from_env({}) and FaultPlan.from_env({ENV: "kill:step=1"})


@pytest.mark.parametrize("value,why", [
    ("nan:rank=1:step=2", "unknown fault 'nan'"),
    ("nonfinite_loss:rank=1", "nonfinite_loss needs step=S with S >= 1"),
    ("nonfinite_loss:rank=1:step=0", "nonfinite_loss needs step=S with S >= 1"),
    ("kill:rank=one:step=2", "rank must be a whole number, got 'one'"),
    ("server_hang:rank=1:step=2", "'rank=1' is not a field of server_hang"),
    ("kill:step=2:step=3", "'step=3' is not a field of kill"),
    ("kill:step=2,", "unknown fault ''"),
    ("kill step=2", "unknown fault 'kill step=2'"),
])
def test_malformed_values_name_the_variable_and_the_forms(value, why):
    with pytest.raises(FaultSpecError) as err:
        FaultPlan.parse(value)
    assert f"{ENV}='{value}' is malformed: {why}" in str(err.value) and FORMS in str(err.value)


@pytest.mark.parametrize("flags", [[], ["--dry-run"]])
def test_grpo_train_refuses_a_malformed_value_before_launching(tmp_path, flags):
    out = runner.invoke(app, ["train", "--nproc", "2", "--output-dir", str(tmp_path / "run"), *flags],
                        env={ENV: "nonfinite_loss:rank=1:step=two"})
    assert out.exit_code == 2, out.output
    assert f"{ENV}='nonfinite_loss:rank=1:step=two' is malformed" in out.output and "launching" not in out.output
    assert "Traceback" not in out.output and not (tmp_path / "run").exists() and "# resolved config" not in out.output


def test_serve_rollout_refuses_a_malformed_value(tmp_path):
    out = runner.invoke(app, ["serve-rollout", "--model", str(tmp_path), "--port", "0"], env={ENV: "hang:step=1"})
    assert out.exit_code == 2, out.output
    assert f"{ENV}='hang:step=1' is malformed: unknown fault 'hang'" in out.output


def test_banner_is_loud_and_says_what_is_injected():
    banner = FaultPlan.parse("nonfinite_loss:rank=1:step=2,kill:step=5").banner()
    assert banner.startswith("!!! FAULT INJECTION: GRPO_INJECT_FAULT='nonfinite_loss:rank=1:step=2,kill:step=5'")
    assert "the loss of rank 1 at step 2 is NaN" in banner and "rank 0 SIGKILLs itself at the start of step 5" in banner


def test_kill_fault_sigkills_the_process_at_its_step_only():
    code = ("from grpo_cli.runtime.faults import FaultPlan\n"
            "plan = FaultPlan.parse('kill:rank=1:step=3')\n"
            "plan.kill_if_due(rank=1, step=2); plan.kill_if_due(rank=0, step=3); print('alive', flush=True)\n"
            "plan.kill_if_due(rank=1, step=3); print('survived')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == -signal.SIGKILL and out.stdout == "alive\n", out.stdout + out.stderr
