"""Run a rehearsal: start the preset's rollout server (if any) on 127.0.0.1, train the first steps and checkpoint,
resume to the end in a second launch, stop the server, then check every transition (`rehearse_checks`)."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from grpo_cli.config.errors import UserError
from grpo_cli.config.load import dump_config
from grpo_cli.config.schema import GRPOConfig
from grpo_cli.launch.rehearse import Rehearsal, plan_rehearsal
from grpo_cli.rollout.base import engine_dtype
from grpo_cli.server.launch import wait_ready_line

PHASE_TIMEOUT_S = 900.0
SERVER_TIMEOUT_S = 180.0
_LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


@dataclass
class Phase:
    """One `grpo train` launch of the rehearsal."""

    name: str
    code: int
    started: float
    seconds: float
    log: Path

    def tail(self, lines: int = 25) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class Server:
    """The rollout server child process and what it printed."""

    kind: str
    proc: subprocess.Popen
    url: str
    ready_s: float
    log: Path

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after 15 s; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        return self.proc.returncode


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rehearsal_env(token: str, token_env: str) -> dict[str, str]:
    """This process's environment without launcher variables, with loopback gloo, 1 GiB vLLM KV cache, the token."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV}
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env["GRPO_CLI_FORCE_OFFLOAD"] = "1"  # train/weights/offload.py FORCE_ENV: the offload path runs on CPU too
    env[token_env] = token
    return env


def server_command(kind: str, cfg: GRPOConfig, model: str) -> list[str]:
    token_env = cfg.rollout.server.token_env
    if kind == "sglang-contract":
        return [sys.executable, "-m", "grpo_cli.server.sglang_contract_serve", "--model", model,
                "--token-env", token_env]
    return [sys.executable, "-m", "grpo_cli.cli.serve", "--engine", kind.removeprefix("grpo-"), "--model", model,
            "--port", "0", "--dtype", engine_dtype(cfg), "--token-env", token_env]


def start_server(kind: str, cfg: GRPOConfig, env: dict[str, str], log: Path) -> Server:
    """Start the server and wait for its `listening on URL` line (bounded); its output goes to `log`."""
    start = time.perf_counter()
    # One thread: the server shares this machine's cores with the training processes (torchrun gives each one).
    proc = subprocess.Popen(server_command(kind, cfg, "builtin:tiny"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**env, "OMP_NUM_THREADS": "1"},
                            start_new_session=True)
    out = open(log, "w", buffering=1)  # noqa: SIM115 - written by the reader thread for the server's lifetime
    url = wait_ready_line(proc, SERVER_TIMEOUT_S, out.write)
    server = Server(kind, proc, url or "", time.perf_counter() - start, log)
    if url is None:
        server.stop()
        raise UserError(f"the rehearsal's rollout server ({kind}) did not start within {SERVER_TIMEOUT_S:.0f} s; "
                        f"its log is {log}:\n" + "\n".join(log.read_text(errors="replace").splitlines()[-20:]))
    return server


def run_phase(name: str, config_file: Path, run_dir: Path, *, steps: int, resume: bool, env: dict[str, str],
              log: Path) -> Phase:
    """`grpo train --config FILE` (relaunching itself through the preset's launcher) for `steps` steps."""
    cmd = [sys.executable, "-m", "grpo_cli", "train", "--config", str(config_file), "--output-dir", str(run_dir),
           "--set", f"train.steps={steps}", "--set", f"distributed.main_process_port={free_port()}"]
    if resume:
        cmd += ["--set", "checkpoint.resume=auto"]
    start = time.time()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            code = proc.wait(timeout=PHASE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher's whole process group (its workers)
            proc.wait()
            out.write(f"\nrehearsal: {name} killed after {PHASE_TIMEOUT_S:.0f} s\n")
            code = -9
        except BaseException:  # Ctrl-C: the launch runs in its own session, so stop it here
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    return Phase(name, code, start, time.time() - start, log)


def default_root(cfg: GRPOConfig) -> Path:
    return Path("runs") / f"{cfg.preset or 'custom'}-rehearsal-{time.strftime('%Y%m%d-%H%M%S')}"


def _say(message: str) -> None:
    print(message, flush=True)


def _server_for(reh: Rehearsal, cfg: GRPOConfig, env: dict[str, str], root: Path, *, deepspeed_ready: bool):
    """Start the rehearsal's server (if the preset has one) and re-plan with its URL."""
    if reh.server is None:
        return None, reh
    server = start_server(reh.server, reh.config, env, root / "server.log")
    _say(f"rollout server ({reh.server}) listening on {server.url} after {server.ready_s:.1f} s")
    return server, plan_rehearsal(cfg, deepspeed_ready=deepspeed_ready, server_url=server.url)


def run_rehearsal(cfg: GRPOConfig, *, output_dir: Path | None, deepspeed_ready: bool) -> int:
    """Rehearse `cfg` on CPU; prints the notes, the checks table and the GPU-only list. 0 when all passed."""
    from grpo_cli.launch.rehearse_checks import collect_checks
    from grpo_cli.ui.rehearse_view import render_rehearsal

    root = Path(output_dir) if output_dir else default_root(cfg)
    run_dir = root / "run"
    if run_dir.exists() and any(run_dir.iterdir()):
        raise UserError(f"{run_dir} is not empty; give the rehearsal a new --output-dir.")
    root.mkdir(parents=True, exist_ok=True)
    reh = plan_rehearsal(cfg, deepspeed_ready=deepspeed_ready)
    _say(f"rehearsing preset '{cfg.preset}' on CPU:\n" + "\n".join(f"  - {n}" for n in reh.notes))
    env = rehearsal_env(secrets.token_hex(16), reh.config.rollout.server.token_env)
    server, reh = _server_for(reh, cfg, env, root, deepspeed_ready=deepspeed_ready)
    config_file = root / "rehearsal.yaml"
    config_file.write_text(dump_config(reh.config))
    phases: list[Phase] = []
    try:
        total = reh.config.train.steps
        for name, first, steps in (("first run", 1, reh.resume_at), ("resumed run", reh.resume_at + 1, total)):
            log = root / f"{name.replace(' ', '-')}.log"
            _say(f"{name}: steps {first}-{steps} (log {log})")
            phase = run_phase(name, config_file, run_dir, steps=steps, resume=first > 1, env=env, log=log)
            phases.append(phase)
            if phase.code != 0:
                _say(f"{name} exited with code {phase.code}; last lines of {phase.log}:\n{phase.tail()}")
                break
    finally:
        server_code = server.stop() if server is not None else None
    checks = collect_checks(reh, phases, run_dir, server=server, server_code=server_code)
    render_rehearsal(cfg.preset or "custom", checks)
    failed = [c.name for c in checks if c.status == "FAIL"]
    if failed:
        raise UserError(f"rehearsal of '{cfg.preset}' failed at: {', '.join(failed)}. Fix these before renting "
                        f"GPUs; the logs and the run are in {root}.")
    _say(f"rehearsal of '{cfg.preset}' passed: every transition exercised on CPU worked ({root}).")
    return 0
