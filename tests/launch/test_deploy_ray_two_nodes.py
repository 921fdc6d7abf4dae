"""Issue 50 item 6, the Ray half: the rendered Ray bootstrap (`deployment.scheduler: ray`) runs on one machine as two
nodes, each `bash grpo-ray.sh NODE_RANK HEAD_ADDR` in its own network namespace joined by a veth pair (`netns.py`).
Node 1 joins node 0's Ray cluster with the token node 0 wrote in the shared directory and gives the cluster its
cores; node 0 starts Ray offering none and trains 3 steps in async mode, so its rollout actor runs on node 1 and
the rollouts and the weights cross the link as Ray objects. Ray's nodes need distinct addresses, so without
namespaces (not root, no `ip`) the test is skipped, never run on loopback."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from grpo_cli.config.load import build_config
from grpo_cli.launch.deploy_ray import render_ray
from dist_env import clean_env
from netns import drop_namespaces, make_namespaces

pytestmark = pytest.mark.slow


def test_rendered_ray_bootstrap_trains_three_steps_with_its_actor_on_the_rollout_node(tmp_path: Path) -> None:
    pytest.importorskip("ray")
    made = make_namespaces(f"r{os.getpid() % 1000}", subnet="10.231.9")
    if made is None:
        pytest.skip("needs root and `ip` to make two network namespaces: Ray's two nodes need two addresses")
    hosts, namespaces = made
    shared = tmp_path / "shared"
    cfg = build_config("tiny-cpu-async", None, [
        "train.steps=3", "train.prompts_per_step=2", "train.generations_per_prompt=4", "train.micro_batch_size=8",
        "eval.every_steps=0", "checkpoint.every_steps=0", "logging.progress=plain", "distributed.device=cpu",
        "deployment.scheduler=ray", "deployment.rollout_nodes=1", "deployment.gpus_per_node=1",
        f"deployment.shared_dir={shared}"])
    script = tmp_path / "grpo-ray.sh"
    script.write_text(render_ray(cfg))
    ray_tmp = tempfile.mkdtemp(prefix="gr", dir="/tmp")  # Ray's socket paths must stay short
    env = clean_env(PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", RAY_TMPDIR=ray_tmp,
                    RAY_USAGE_STATS_ENABLED="0", OMP_NUM_THREADS="1", PYTHONPATH=str(Path.cwd()))
    env.pop("GLOO_SOCKET_IFNAME")  # each namespace has its own interface
    logs = [tmp_path / f"node-{rank}.log" for rank in (0, 1)]
    procs = []
    try:
        for rank in (0, 1):
            with logs[rank].open("w") as log:
                procs.append(subprocess.Popen(["ip", "netns", "exec", namespaces[rank], "bash", str(script),
                                               str(rank), hosts[0]], cwd=tmp_path, env=env, stdout=log,
                                              stderr=subprocess.STDOUT, start_new_session=True))
        try:
            code = procs[0].wait(timeout=420)
        except subprocess.TimeoutExpired:
            code = None
        rollout_node_alive = procs[1].poll() is None  # `ray start --block`: it serves until the cluster goes
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        drop_namespaces(namespaces)  # Ray's daemons on both nodes
        shutil.rmtree(ray_tmp, ignore_errors=True)
    trained, served = logs[0].read_text(), logs[1].read_text()
    assert code == 0, trained[-6000:] + "\n--- node 1 ---\n" + served[-3000:]
    assert rollout_node_alive, served[-3000:]
    assert f"1 rollout actor(s) on Ray node {hosts[1]} hold weight version 0" in trained, trained[-3000:]
    rows = [json.loads(line) for line in (shared / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    token = shared / "ray" / "auth_token"
    assert len(token.read_text().strip()) == 64 and token.stat().st_mode & 0o077 == 0  # its owner's alone
    assert {p.name for p in (shared / "manifests").iterdir()} == {"node-0.json", "node-1.json"}
