"""The exact accelerate/torchrun command a multi-process `grpo train` relaunches itself with."""

from __future__ import annotations

import sys

from grpo_cli.config.schema import GRPOConfig


def _worker_args(argv: list[str]) -> list[str]:
    """The user's `grpo ...` arguments, minus --dry-run, plus --worker."""
    args = [a for a in argv if a != "--dry-run"]
    return [*args, "--worker"]


def external_launch(env: dict[str, str]) -> list[str] | None:
    """Overrides matching a launcher that started this process (`accelerate launch -m grpo_cli ...` or
    `torchrun -m grpo_cli ...` by hand: WORLD_SIZE set), so the config's rules see the real process count and
    `grpo train` runs as a worker instead of launching again; None when no launcher is involved."""
    if "WORLD_SIZE" not in env:
        return None
    world = int(env["WORLD_SIZE"])
    local = int(env.get("LOCAL_WORLD_SIZE", world))
    return [f"distributed.num_processes={local}", f"distributed.num_machines={max(1, world // local)}",
            f"distributed.machine_rank={int(env.get('GROUP_RANK', env.get('NODE_RANK', '0')))}",
            *([f"distributed.main_process_ip={env['MASTER_ADDR']}"] if world > local and "MASTER_ADDR" in env else [])]


def launch_command(cfg: GRPOConfig, argv: list[str]) -> list[str]:
    """[] for a single process; otherwise the accelerate or torchrun command running `python -m grpo_cli`."""
    d = cfg.distributed
    if d.num_processes * d.num_machines == 1:
        return []
    worker = ["-m", "grpo_cli", *_worker_args(argv)]
    if d.launcher == "torchrun":
        nodes = [f"--node_rank={d.machine_rank}", f"--master_addr={d.main_process_ip}"] if d.num_machines > 1 else []
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={d.num_processes}",
                f"--nnodes={d.num_machines}", *nodes, f"--master_port={d.main_process_port}", *worker]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes",
           str(d.num_processes * d.num_machines), "--num_machines", str(d.num_machines)]
    if d.num_machines > 1:
        cmd += ["--machine_rank", str(d.machine_rank), "--main_process_ip", str(d.main_process_ip)]
    cmd += ["--main_process_port", str(d.main_process_port)]
    # Every backend (ddp, fsdp2, deepspeed) is built inside the workers from the config (train/backends), so
    # accelerate only starts the processes: its `--multi_gpu` launcher (torchrun) works on CPU too, where the
    # workers join a gloo group; its `--cpu` would run ONE process.
    # Precision and compilation are the config's (model.dtype, rollout.compile), not accelerate's: saying so
    # also keeps accelerate from printing its "values were not passed ... defaults used" block on every launch.
    cmd += ["--multi_gpu", "--mixed_precision", "no", "--dynamo_backend", "no"]
    return [*cmd, *worker]
