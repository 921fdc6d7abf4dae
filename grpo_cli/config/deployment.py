"""`deployment:`, where a job's processes run: training and rollout node groups, the rollout servers' layout on a
node, and the scheduler whose script `grpo train --dry-run` renders (docs/distributed.md, "Deployment")."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from grpo_cli.config.base import Section


class DeploymentConfig(Section):
    """Node groups rendered to one Slurm batch script or a Ray bootstrap (`scheduler: none`: nothing rendered)."""

    scheduler: Literal["none", "slurm", "ray"] = "none"
    """`slurm`: `grpo train --dry-run` prints one sbatch script that starts the rollout servers on the rollout nodes,
    waits for their /health, then starts the trainers on the training nodes with their rendezvous (rollout.mode
    server); `ray`: a bootstrap script that starts a Ray cluster in which only the rollout GPUs are visible, then
    the trainers (rollout.mode async); `none`: a single machine, or a launch written by hand."""
    train_nodes: int = Field(1, ge=1)
    """Nodes that run the training processes (`distributed.num_processes` each); the first one hosts the
    rendezvous on `distributed.main_process_port`."""
    rollout_nodes: int = Field(0, ge=0)
    """Nodes that only generate: every GPU of each serves rollouts (0: rollouts share the training nodes)."""
    gpus_per_node: int = Field(8, ge=1)
    """GPUs of one node (Slurm's `--gpus-per-node`)."""
    rollout_layout: Literal["servers", "data_parallel"] = "servers"
    """How a rollout node's GPUs serve: `servers`: one `grpo serve-rollout --data-parallel-size N` per node, which
    starts N = gpus_per_node / rollout_tensor_parallel engines on consecutive ports, each its own URL in the
    trainer's pool; `data_parallel`: one stock `vllm serve --data-parallel-size N` per node, one URL (engine
    `vllm-serve`)."""
    rollout_tensor_parallel: int = Field(1, ge=1)
    """GPUs per rollout engine (tensor parallel); must divide `gpus_per_node`."""
    rollout_port: int = Field(8000, ge=1, le=65000)
    """First port of a rollout node's servers (engine i listens on rollout_port + i). The trainer's
    `rollout.server.urls` are derived from the rollout nodes' names and these ports, never typed."""
    shared_dir: str = "runs/grpo"
    """Folder every node sees (a shared filesystem): the rendered script writes the resolved config there, each
    node its manifest (`grpo doctor --mode multi-node` compares them), and the run directory is `<shared_dir>/run`."""
    server_start_timeout_s: int = Field(1800, ge=1)
    """How long the training nodes wait for every rollout server's /health before the job fails."""
    sbatch_options: list[str] = Field(default_factory=list)
    """Extra `#SBATCH` lines, e.g. `[--partition=gpu, --time=24:00:00, --account=me]`."""

    @property
    def rollout_engines_per_node(self) -> int:
        """Engines one rollout node runs (one per tensor-parallel group of its GPUs)."""
        return self.gpus_per_node // self.rollout_tensor_parallel

    @property
    def nodes(self) -> int:
        """Nodes of the whole job."""
        return self.train_nodes + self.rollout_nodes
