"""As a user sees it: `grpo train` in a tmux pane shows the live view (read back with capture-pane); closing the
session (SIGHUP) leaves a complete checkpoint, exit code 0 and train.log with the stop line."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

import pytest

WRAPPER = """
import signal, subprocess, sys
signal.signal(signal.SIGHUP, lambda *_: None)  # the wrapper outlives the pane to record the exit code
code = subprocess.call(sys.argv[2:])
open(sys.argv[1], "w").write(str(code))
"""


def _wait(predicate, what: str, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_live_view_in_tmux_then_closed_session_checkpoints(tmp_path):
    from grpo_cli.train.checkpoint import complete_checkpoints, verify_checkpoint

    sock, run, rc = f"grpo-test-{os.getpid()}", tmp_path / "run", tmp_path / "rc"
    (tmp_path / "wrapper.py").write_text(WRAPPER)
    train = [sys.executable, "-m", "grpo_cli", "train", "--output-dir", str(run), "--set", "train.steps=400",
             "--set", "train.prompts_per_step=4", "--set", "train.micro_batch_size=16"]
    env = {**os.environ, "GRPO_CLI_CACHE": os.environ.get("GRPO_CLI_CACHE", str(tmp_path / "cache"))}
    tmux = ["tmux", "-L", sock]
    # as a user does: an interactive shell in the pane runs the command as its foreground job; closing the session
    # hangs up the shell, which forwards SIGHUP to its jobs, and the kernel sends another to the foreground group
    subprocess.run([*tmux, "-f", "/dev/null", "new-session", "-d", "-s", "train", "-x", "110", "-y", "30",
                    "-c", str(tmp_path), "bash --norc --noprofile -i"], check=True, env=env)
    command = " ".join([sys.executable, str(tmp_path / "wrapper.py"), str(rc), *train])
    subprocess.run([*tmux, "send-keys", "-t", "train", command, "Enter"], check=True)
    try:
        def pane() -> str | None:
            out = subprocess.run([*tmux, "capture-pane", "-p", "-t", "train"], capture_output=True, text=True).stdout
            return out if "sample (step" in out and "reward ▁" in out and re.search(r"\d steps/s", out) else None

        screen = _wait(pane, "the live view")
        time.sleep(2)
        screen = pane() or screen
        subprocess.run([*tmux, "kill-session", "-t", "train"], check=True)
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
    (tmp_path / "screen.txt").write_text(screen)
    assert "━" in screen and "/400" in screen and "elapsed 0:" in screen and "ETA " in screen, screen
    assert "phases" in screen and "generate" in screen and "train" in screen, screen
    assert "alarm " in screen and "completion " in screen, screen
    assert "\x1b" not in screen  # capture-pane -p gives the text the user reads

    code = _wait(lambda: rc.exists() and rc.read_text(), "the exit code", timeout=120)
    assert code == "0", (run / "train.log").read_text()
    log = (run / "train.log").read_text()
    assert "stopped by signal SIGHUP (the terminal or ssh session closed)" in log, log
    last = complete_checkpoints(run)[-1]
    assert verify_checkpoint(last)["step"] == int(log.rsplit("stopped by signal", 1)[1].split("after step ")[1]
                                                   .split(";")[0])
