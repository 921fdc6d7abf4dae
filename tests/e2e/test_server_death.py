"""Server mode end to end: a real `grpo serve-rollout` process is killed mid-run; the trainer stops within the
configured timeout with a clear message and leaves a checkpoint that a resumed run (new server) continues from."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest


def _start_server(env, cwd) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "grpo_cli", "serve-rollout", "--engine", "hf", "--model", "builtin:tiny", "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
        if m:
            return proc, m.group(1)
        assert proc.poll() is None, "server exited early"
    raise AssertionError("server did not start")


@pytest.mark.slow
def test_server_killed_mid_run_stops_with_checkpoint_then_resumes(tmp_path):
    env = {**os.environ, "GRPO_CLI_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    server, url = _start_server(env, tmp_path)
    run = tmp_path / "run"
    args = [sys.executable, "-m", "grpo_cli", "train", "--preset", "tiny-cpu-server", "--output-dir", str(run),
            "--set", f'rollout.server.urls=["{url}"]', "--set", "train.steps=400",
            "--set", "checkpoint.every_steps=5", "--set", "rollout.server.request_timeout_s=10",
            "--set", "rollout.server.retries=1"]
    trainer = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
    deadline = time.monotonic() + 300
    while not (run / "checkpoint-5" / "MANIFEST.json").exists():
        assert trainer.poll() is None and time.monotonic() < deadline, trainer.communicate()[0]
        time.sleep(0.05)
    server.kill()
    killed_at = time.monotonic()
    out, _ = trainer.communicate(timeout=120)
    assert time.monotonic() - killed_at < 60
    assert trainer.returncode == 2, out
    assert "rollout server" in out.lower() and "Traceback" not in out
    ckpts = sorted(run.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    assert ckpts and (ckpts[-1] / "MANIFEST.json").exists()
    last = int(ckpts[-1].name.split("-")[1])
    server2, url2 = _start_server(env, tmp_path)
    try:
        resumed = subprocess.run(
            [*args[:-8], "--set", f'rollout.server.urls=["{url2}"]', "--set", f"train.steps={last + 2}",
             "--set", "checkpoint.resume=auto", "--set", "checkpoint.every_steps=5"],
            capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
        )
    finally:
        server2.kill()
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"step {last}" in resumed.stdout and "engine re-synced" in resumed.stdout
    assert (run / f"checkpoint-{last + 2}" / "MANIFEST.json").exists()
