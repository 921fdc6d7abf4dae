"""Issue 50 item 6: the rendered 2-node Slurm script runs on one machine, node 0 training and node 1 serving rollouts
(two hf engines, `grpo serve-rollout --data-parallel-size 2`), each node in its own network namespace joined by a veth
pair, so the /health wait, the rollout URLs and the weight pushes cross a link between two addresses. `srun` is a
stand-in that runs each step's task per node of --nodelist inside that node's namespace with the SLURM_* variables
Slurm sets for a task. Without namespaces (not root, no `ip`), both nodes run on loopback (127.0.0.1 and 127.0.0.2)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_cli.config.load import build_config
from grpo_cli.launch.deploy_slurm import render_slurm
from dist_env import clean_env, free_port
from netns import drop_namespaces, make_namespaces

_SRUN = r"""#!/usr/bin/env bash
# srun stand-in: the step's command once per node of --nodelist, in that node's namespace, with a task's SLURM_* vars.
nodelist=""
while [[ $# -gt 0 && "$1" == --* ]]; do [[ "$1" == --nodelist=* ]] && nodelist="${1#--nodelist=}"; shift; done
IFS=, read -r -a hosts <<<"$nodelist"
pids=()
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM INT
for i in "${!hosts[@]}"; do
  case "${hosts[$i]}" in NAMESPACES esac
  SLURM_PROCID=$i SLURM_NODEID=$i SLURM_LOCALID=0 SLURM_NNODES=${#hosts[@]} SLURM_STEP_NODELIST="$nodelist" \
    SLURMD_NODENAME="${hosts[$i]}" ${ns:+ip netns exec "$ns"} "$@" &
  pids+=($!)
done
code=0
for p in "${pids[@]}"; do wait "$p" || code=$?; done
wait
exit "$code"
"""


def test_rendered_slurm_script_trains_three_steps_across_two_nodes(tmp_path: Path) -> None:
    tag = str(os.getpid() % 10000)
    made = make_namespaces(tag)
    hosts, namespaces = made if made else (["127.0.0.1", "127.0.0.2"], [])
    shared = tmp_path / "shared"
    cfg = build_config("tiny-cpu", None, [
        "rollout.mode=server", "train.steps=3", "train.prompts_per_step=2", "train.generations_per_prompt=4",
        "train.micro_batch_size=8", "eval.every_steps=0", "checkpoint.every_steps=0", "logging.progress=plain",
        "distributed.device=cpu", f"distributed.main_process_port={free_port()}",
        "deployment.scheduler=slurm", "deployment.rollout_nodes=1", "deployment.gpus_per_node=2",
        f"deployment.rollout_port={free_port()}", f"deployment.shared_dir={shared}",
        "deployment.server_start_timeout_s=180"])
    (tmp_path / "grpo.sbatch").write_text(render_slurm(cfg))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    cases = "".join(f'{h}) ns={ns};; ' for h, ns in zip(hosts, namespaces)) + "*) ns=;; "
    (bin_dir / "srun").write_text(_SRUN.replace("NAMESPACES", cases))
    (bin_dir / "srun").chmod(0o755)
    env = clean_env(PATH=f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
                    SLURM_JOB_ID="4242", SLURM_JOB_NODELIST=",".join(hosts), SLURM_NNODES="2",
                    SLURM_SUBMIT_DIR=str(tmp_path), OMP_NUM_THREADS="1", PYTHONPATH=str(Path.cwd()))
    env.pop("GLOO_SOCKET_IFNAME")
    proc = subprocess.Popen(["bash", str(tmp_path / "grpo.sbatch")], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out = proc.communicate(timeout=420)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out = proc.communicate()[0]
    finally:
        sent = [int(subprocess.run(["ip", "netns", "exec", namespaces[0], "cat", f"/sys/class/net/vg{tag}a/statistics/"
                                    "tx_bytes"], capture_output=True, text=True).stdout or 0)] if namespaces else []
        leftover = [p for ns in namespaces for p in
                    subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()]
        drop_namespaces(namespaces)
    assert proc.returncode == 0, out[-6000:]
    assert leftover == [], "the rollout servers outlived the job"
    if namespaces:  # every weight push (3 steps, the model's float32 bytes each) left node 0 through its veth
        from grpo_cli.models.tiny import resolve_model_path

        weights = sum(f.stat().st_size for f in Path(resolve_model_path("builtin:tiny")).glob("*.safetensors"))
        assert sent[0] > 3 * weights, (sent, weights)
    rows = [json.loads(line) for line in (shared / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    saved = (shared / "run" / "config.yaml").read_text()
    port = cfg.deployment.rollout_port
    for url in (f"http://{hosts[1]}:{port}", f"http://{hosts[1]}:{port + 1}"):  # derived, one per engine
        assert url in saved
    assert {p.name for p in (shared / "manifests").iterdir()} == {"train-0.json", "rollout-0.json"}
    doctor = subprocess.run([sys.executable, "-m", "grpo_cli", "doctor", "--mode", "multi-node", "--shared-dir",
                             str(shared)], capture_output=True, text=True, env=env, timeout=120)
    assert doctor.returncode == 0 and "2 nodes agree" in doctor.stdout, doctor.stdout + doctor.stderr
