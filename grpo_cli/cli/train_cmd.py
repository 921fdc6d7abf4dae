"""Body of `grpo train`: dry-run printout, relaunch through accelerate/torchrun, or run in this process."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import typer

from grpo_cli.config.errors import UserError
from grpo_cli.config.load import dump_config
from grpo_cli.planner.plan import required_gpus
from grpo_cli.planner.plan_render import render_plan
from grpo_cli.config.schema import GRPOConfig
from grpo_cli.planner.deepspeed import deepspeed_json
from grpo_cli.config.rules_megatron import context_parallel_refusal
from grpo_cli.launch.command import launch_command
from grpo_cli.launch.deploy_ray import render_deployment
from grpo_cli.runtime.faults import FaultPlan


def check_gpus(cfg: GRPOConfig) -> None:
    """Stop at once when the preset needs CUDA GPUs this machine lacks."""
    needed = required_gpus(cfg)
    if not needed:
        return
    import torch

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < needed:
        raise UserError(
            f"preset '{cfg.preset}' needs {needed} CUDA GPUs, found {found}. Run it on a machine with the GPUs, "
            "use `--dry-run` to see its plan and launch command, or start with the CPU preset `grpo train tiny-cpu`."
        )


def _deployment_script(cfg: GRPOConfig, write_script: Path | None) -> None:
    """Print (and with --write-script save) the script of `deployment.scheduler`."""
    script = render_deployment(cfg)
    if write_script is not None and script is None:
        raise UserError("--write-script writes the script of deployment.scheduler (slurm or ray), and this config's "
                        "scheduler is 'none'; set deployment.scheduler or drop --write-script.")
    if script:
        typer.echo(f"\n# deployment ({cfg.deployment.scheduler}): the script below, saved as a file\n" + script)
    if write_script is not None:
        write_script.write_text(script)
        write_script.chmod(0o755)
        typer.echo(f"# wrote {write_script}")


def run_train(cfg: GRPOConfig, *, output_dir: Path | None, dry_run: bool, worker: bool, argv: list[str],
              write_script: Path | None = None) -> int:
    """Exit code of the training command."""
    cmd = launch_command(cfg, argv)
    FaultPlan.from_env()  # a malformed GRPO_INJECT_FAULT fails here (exit 2), before any worker starts or a dry run
    if dry_run:
        typer.echo("# resolved config\n" + dump_config(cfg))
        typer.echo(render_plan(cfg, gpu_mem=None))
        if cfg.distributed.backend == "deepspeed":
            typer.echo("\n# DeepSpeed config (each worker builds it from the config above)\n" + deepspeed_json(cfg))
        typer.echo("\n# launch command\n" + (" ".join(cmd) if cmd else "(single process: runs in this process)"))
        _deployment_script(cfg, write_script)
        return 0
    joined = cfg.rollout.server.urls or (cfg.rollout.mode == "async" and cfg.rollout.ray.address)
    if cfg.deployment.rollout_nodes and not joined and not worker:  # the script derives the URLs / starts Ray
        raise UserError(
            f"deployment.rollout_nodes={cfg.deployment.rollout_nodes}: this config is a multi-node job; print its "
            f"{cfg.deployment.scheduler} script with `grpo train ... --dry-run` and submit that (it starts the "
            "rollout servers and passes their URLs to the trainers).")
    check_gpus(cfg)
    if why := context_parallel_refusal(cfg):  # not a config rule: `grpo plan`/`--rehearse`/`--dry-run` model it
        raise UserError(why)
    if cmd and not worker:
        typer.echo("launching: " + " ".join(cmd))
        return subprocess.call(cmd)
    from grpo_cli.train.run import run_training
    from grpo_cli.train.supervise.run_dir import default_output_dir
    from grpo_cli.ui.progress import ProgressView

    main_rank = os.environ.get("RANK", "0") == "0"
    run_dir = Path(output_dir or cfg.logging.output_dir or default_output_dir(cfg))
    with ProgressView(cfg.train.steps, mode=cfg.logging.progress if main_rank else "plain",
                      log_path=run_dir / "train.log" if main_rank else None) as view:
        summary = run_training(cfg, output_dir=str(run_dir), reporter=view)
        if main_rank:
            view.finish(
                f"done: {summary['steps']} steps; mean reward first 10% = {summary['reward_first_10pct']:.3f}, "
                f"last 10% = {summary['reward_last_10pct']:.3f}; run dir {summary['output_dir']}"
            )
    from grpo_cli.runtime.dist import leave_worker

    leave_worker()  # a worker of a multi-process job ends here, past torch's C++ teardown
    return 0


def run_rehearse(cfg: GRPOConfig, *, output_dir: Path | None, dry_run: bool) -> int:
    """`--rehearse`: print the CPU rehearsal's config and notes (dry run) or run it."""
    from grpo_cli.launch.rehearse import deepspeed_ready, plan_rehearsal

    if dry_run:
        reh = plan_rehearsal(cfg, deepspeed_ready=deepspeed_ready())
        typer.echo("# rehearsal config (CPU)\n" + dump_config(reh.config))
        typer.echo(f"# changes from preset '{cfg.preset}'\n" + "\n".join(f"- {n}" for n in reh.notes))
        typer.echo("# only a GPU can check\n" + "\n".join(f"- {w}: {why}" for w, why in reh.gpu_only))
        return 0
    from grpo_cli.launch.rehearse_run import run_rehearsal

    FaultPlan.from_env()  # its server and training runs inherit GRPO_INJECT_FAULT: a malformed one fails here
    return run_rehearsal(cfg, output_dir=output_dir, deepspeed_ready=deepspeed_ready())
