"""The `grpo` command. Each command parses, loads the config and calls one function; torch loads only inside."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from grpo_cli import __version__
from grpo_cli.cli.common import ConfigOpt, PresetArg, PresetOpt, SetOpt, load_config, user_errors

app = typer.Typer(
    name="grpo", help="Post-train language models with GRPO.", no_args_is_help=True,
    pretty_exceptions_show_locals=False, add_completion=False,
)
presets_app = typer.Typer(help="List and show the shipped presets.", no_args_is_help=True)
config_app = typer.Typer(help="Check config files.", no_args_is_help=True)
app.add_typer(presets_app, name="presets")
app.add_typer(config_app, name="config")



def _version(value: bool) -> None:
    if value:
        typer.echo(f"grpo-cli {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="Show version.")] = False,
) -> None:
    """grpo: GRPO post-training — colocated vLLM, rollout servers, async, mismatch correction."""


@app.command()
def train(
    preset: PresetArg = None,
    preset_opt: PresetOpt = None,
    config: ConfigOpt = None,
    overrides: SetOpt = None,
    output_dir: Annotated[Optional[Path], typer.Option("--output-dir", "-o", help="Run directory.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print config, plan and launch command; run nothing.")] = False,
    nproc: Annotated[Optional[int], typer.Option("--nproc", help="Processes per machine (= distributed.num_processes).")] = None,
    nnodes: Annotated[Optional[int], typer.Option("--nnodes", help="Machines in the job (= distributed.num_machines).")] = None,
    node_rank: Annotated[Optional[int], typer.Option("--node-rank", help="This machine's index (= distributed.machine_rank).")] = None,
    master_addr: Annotated[Optional[str], typer.Option("--master-addr", help="Machine 0's address (= distributed.main_process_ip).")] = None,
    master_port: Annotated[Optional[int], typer.Option("--master-port", help="Rendezvous port (= distributed.main_process_port).")] = None,
    rehearse: Annotated[bool, typer.Option("--rehearse", help="Dress rehearsal on CPU: the preset's topology (backend, "
                                           "engine, mode, TP, offload, server) on builtin:tiny; checks every "
                                           "transition and exits 0 only when all pass.")] = False,
    write_script: Annotated[Optional[Path], typer.Option("--write-script", help="With --dry-run and a `deployment:` "
                                                         "scheduler: also write its script (sbatch or Ray bootstrap) "
                                                         "to this file.")] = None,
    worker: Annotated[bool, typer.Option("--worker", hidden=True, help="Internal: run as a launched worker.")] = False,
) -> None:
    """Train with GRPO. With no arguments, runs the built-in tiny-cpu preset (no download, a few minutes on CPU)."""
    with user_errors():
        from grpo_cli.launch.command import external_launch

        options = {"num_processes": nproc, "num_machines": nnodes, "machine_rank": node_rank,
                   "main_process_ip": master_addr, "main_process_port": master_port}
        extra = [f"distributed.{key}={value}" for key, value in options.items() if value is not None]
        launched = None if worker else external_launch(dict(os.environ))
        cfg = load_config(preset, preset_opt, config, [*(overrides or []), *extra, *(launched or [])])
        worker = worker or launched is not None
        from grpo_cli.cli.train_cmd import run_train

        if rehearse:
            from grpo_cli.cli.train_cmd import run_rehearse

            raise typer.Exit(run_rehearse(cfg, output_dir=output_dir, dry_run=dry_run))
        code = run_train(cfg, output_dir=output_dir, dry_run=dry_run, worker=worker,
                         argv=sys.argv[1:], write_script=write_script)
    raise typer.Exit(code)


@app.command()
def plan(
    preset: PresetArg = None,
    preset_opt: PresetOpt = None,
    config: ConfigOpt = None,
    overrides: SetOpt = None,
    gpu_mem: Annotated[Optional[str], typer.Option("--gpu-mem", help="GPU memory to check the plan against, e.g. 80GiB.")] = None,
    host_mem: Annotated[Optional[str], typer.Option("--host-mem", help="Host memory per machine to check the plan "
                                                    "against, e.g. 2TB.")] = None,
) -> None:
    """Print the batch plan, a per-GPU memory estimate for the chosen mode and the host memory per machine."""
    with user_errors():
        cfg = load_config(preset, preset_opt, config, overrides)
        from grpo_cli.planner.plan import parse_size
        from grpo_cli.planner.plan_render import render_plan

        typer.echo(render_plan(cfg, gpu_mem=parse_size(gpu_mem) if gpu_mem else None,
                               host_mem=parse_size(host_mem, "--host-mem") if host_mem else None))


@presets_app.command("list")
def presets_list() -> None:
    """Shipped presets with a one-line description each."""
    from grpo_cli.config.load import list_presets

    for name, desc in list_presets().items():
        typer.echo(f"{name:28s} {desc}")


@presets_app.command("show")
def presets_show(name: Annotated[str, typer.Argument(help="Preset name.")]) -> None:
    """The resolved config of a preset as YAML, each field with its documentation."""
    with user_errors():
        from grpo_cli.config.docs import documented_yaml
        from grpo_cli.config.load import build_config

        typer.echo(documented_yaml(build_config(name)))


@config_app.command("validate")
def config_validate(
    file: Annotated[Path, typer.Argument(help="YAML config file.")],
    preset: PresetOpt = None,
    overrides: SetOpt = None,
) -> None:
    """Validate a config file (merged over a preset); exit 0 when valid, 2 with the reason otherwise."""
    with user_errors():
        cfg = load_config(None, preset, file, overrides)
        typer.echo(f"{file}: valid (preset {cfg.preset})")


def _register_commands() -> None:
    """Commands defined in their own modules; each imports nothing heavy at load time."""
    from grpo_cli.cli.diagnose import diagnose_mismatch
    from grpo_cli.cli.doctor import doctor
    from grpo_cli.cli.eval_cmd import eval_command
    from grpo_cli.cli.report import report
    from grpo_cli.cli.serve import serve_rollout

    app.command("serve-rollout")(serve_rollout)
    app.command("diagnose-mismatch")(diagnose_mismatch)
    app.command("doctor")(doctor)
    app.command("report")(report)
    app.command("eval")(eval_command)


_register_commands()


def main() -> None:
    app()
