"""Fault handling: NaN steps are skipped then stop the run; reward functions that raise or misbehave are named."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from grpo_cli.config.load import build_config
from grpo_cli.runtime.dist import DistInfo
from grpo_cli.rewards.resolve import RewardError, build_reward_fns, score
from grpo_cli.train.loop import LoopState, TrainingStopped, run_step
from grpo_cli.train import step as step_module
from grpo_cli.train.run import build_trainer


def _trainer(tiny_checkpoint, *overrides):
    cfg = build_config(overrides=[f"model.name_or_path={tiny_checkpoint}", "train.prompts_per_step=2",
                                  "train.micro_batch_size=16", *overrides])
    return build_trainer(cfg, DistInfo(), torch.device("cpu"), log=lambda *_: None)


@pytest.fixture()
def nan_loss(monkeypatch):
    """Inject a NaN into every micro-batch loss (as an overflow in the loss would)."""
    real = step_module.compute_loss

    def poisoned(**kwargs):
        loss, metrics = real(**kwargs)
        return loss * float("nan"), metrics

    monkeypatch.setattr(step_module, "compute_loss", poisoned)


def test_nan_loss_is_skipped_counted_then_stops(tiny_checkpoint, nan_loss):
    tr = _trainer(tiny_checkpoint, "train.max_consecutive_nonfinite=2")
    before = {k: v.clone() for k, v in tr.policy.module.state_dict().items()}
    state = LoopState()
    metrics, _ = run_step(tr, state)
    assert metrics["train/skipped_steps"] == 1.0 and state.nonfinite_streak == 1
    for k, v in tr.policy.module.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} changed: the NaN step must not update weights"
    with pytest.raises(TrainingStopped, match=r"non-finite loss nan .*\(2 in a row\)"):
        run_step(tr, state)


def test_nan_with_on_nonfinite_stop_stops_at_once(tiny_checkpoint, nan_loss):
    tr = _trainer(tiny_checkpoint, "train.on_nonfinite=stop")
    with pytest.raises(TrainingStopped, match="1 in a row"):
        run_step(tr, LoopState())


def _fns(tmp_path, body):
    f = tmp_path / "my_rewards.py"
    f.write_text(body)
    cfg = build_config(overrides=[f'rewards.functions=[{{"name": "{f}:reward"}}]'])
    return build_reward_fns(cfg.rewards.functions), f


def test_raising_reward_is_named_with_sample(tmp_path):
    fns, f = _fns(tmp_path, "def reward(prompts, completions, **kw):\n    raise KeyError('answer')\n")
    with pytest.raises(RewardError, match=rf"reward '{f}:reward' raised KeyError.*first completion: 'a b'"):
        score(fns, ["p"], ["a b"], {}, on_error="raise")
    table, errors = score(fns, ["p"], ["a b"], {}, on_error="skip")
    assert errors == 1 and table[0][0] != table[0][0]  # NaN: scored as missing


def test_wrong_length_and_non_numeric_rewards_are_named(tmp_path):
    fns, _ = _fns(tmp_path, "def reward(prompts, completions, **kw):\n    return [1.0]\n")
    with pytest.raises(RewardError, match="returned 1 values for 2 completions"):
        score(fns, ["p", "p"], ["a", "b"], {}, on_error="raise")
    fns, _ = _fns(tmp_path, "def reward(prompts, completions, **kw):\n    return ['x' for _ in completions]\n")
    with pytest.raises(RewardError, match="returned 'x' for sample 0"):
        score(fns, ["p"], ["a"], {}, on_error="raise")


def test_cli_reward_error_exits_2_without_traceback(tmp_path):
    f = tmp_path / "bad.py"
    f.write_text("def reward(prompts, completions, **kw):\n    return [0.0]\n")
    out = subprocess.run(
        [sys.executable, "-m", "grpo_cli", "train", "--output-dir", str(tmp_path / "run"),
         "--set", f'rewards.functions=[{{"name": "{f}:reward"}}]', "--set", "train.steps=2"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**__import__("os").environ, "GRPO_CLI_CACHE": str(tmp_path / "cache")},
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "reward '" in out.stderr and "returned 1 values for 64 completions" in out.stderr
    assert "Traceback" not in out.stderr


def test_missing_reward_module_fails_before_training(tmp_path):
    cfg = build_config(overrides=['rewards.functions=[{"name": "no_such_module_xyz:fn"}]'])
    with pytest.raises(RewardError, match="importing no_such_module_xyz failed"):
        build_reward_fns(cfg.rewards.functions)


def test_report_to_tensorboard_writes_events(tmp_path, tiny_checkpoint):
    from grpo_cli.train.run import run_training

    cfg = build_config(overrides=[f"model.name_or_path={tiny_checkpoint}", "train.steps=2",
                                  "train.prompts_per_step=2", "train.micro_batch_size=16",
                                  "logging.report_to=[tensorboard]"])
    run_training(cfg, output_dir=str(tmp_path / "run"))
    events = list((tmp_path / "run" / "tensorboard").rglob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


class _Messages:
    """A reporter that keeps what the run says (rank 0's terminal and train.log)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def message(self, text: str) -> None:
        self.lines.append(text)

    def update(self, *_args) -> None:
        pass

    def alarm(self, _step, text: str) -> None:
        self.lines.append(text)


def test_injected_nonfinite_loss_is_announced_once_then_skipped(tmp_path, tiny_checkpoint, monkeypatch):
    """GRPO_INJECT_FAULT reaches the loss through the loop (the real detection path), and the run says so loudly."""
    from grpo_cli.train.run import run_training

    monkeypatch.setenv("GRPO_INJECT_FAULT", "nonfinite_loss:rank=0:step=2")
    cfg = build_config(overrides=[f"model.name_or_path={tiny_checkpoint}", "train.steps=2", "train.prompts_per_step=2",
                                  "train.micro_batch_size=16", "eval.every_steps=0"])
    reporter = _Messages()
    summary = run_training(cfg, output_dir=str(tmp_path / "run"), reporter=reporter)
    assert summary["skipped_steps"] == 1 and summary["steps"] == 2
    loud = [line for line in reporter.lines if "FAULT INJECTION" in line]
    assert len(loud) == 1 and "the loss of rank 0 at step 2 is NaN" in loud[0]
