"""`grpo doctor`: versions, capability probes and a verdict per mode, with the command that fixes what is missing."""

from __future__ import annotations

import dataclasses
import json
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer


class Mode(str, Enum):
    """The modes `grpo doctor` judges (same names as `grpo_cli.launch.doctor_verdict.MODES`)."""

    hf_colocate = "hf-colocate"
    vllm_colocate = "vllm-colocate"
    server = "server"
    sglang = "sglang"
    async_ = "async"
    deepspeed = "deepspeed"
    megatron = "megatron"
    multi_node = "multi-node"


def doctor(
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON (for scripts and bug reports).")] = False,
    modes: Annotated[Optional[list[Mode]], typer.Option(
        "--mode", "-m", help="Only judge these modes; exit 1 when one of them cannot run here.")] = None,
    quick: Annotated[bool, typer.Option(
        "--quick", help="Skip importing vLLM, Ray, DeepSpeed and Megatron-core (faster; vllm-colocate and async "
                     "are not judged).")] = False,
    shared_dir: Annotated[Optional[Path], typer.Option(help="multi-node: the job's deployment.shared_dir (every "
                                                             "node's manifest is compared; must be writable).")] = None,
    master_addr: Annotated[Optional[str], typer.Option(help="multi-node: node 0's address (rendezvous).")] = None,
    master_port: Annotated[int, typer.Option(help="multi-node: the rendezvous port.")] = 29500,
    write_manifest: Annotated[Optional[Path], typer.Option(help="multi-node: write this node's manifest (host, "
                                                                 "versions, model fingerprint) to this file.")] = None,
    model: Annotated[Optional[str], typer.Option(help="multi-node: the job's model.name_or_path.")] = None,
) -> None:
    """Check this machine: torch/CUDA/NCCL, transformers, accelerate, vLLM, SGLang, DeepSpeed, Ray, Megatron-core
    and mbridge versions (the last two against the `megatron` extra's pins);
    what the installed vLLM can do (sleep mode, in-place weight loading, processed logprobs, external launcher);
    free ports; then a verdict per mode (ok / limited / no) with the exact install command for what is missing.
    Starts no engine and takes no GPU memory."""
    if modes and Mode.multi_node in modes:
        raise typer.Exit(_multi_node(shared_dir, master_addr, master_port, write_manifest, model))
    from grpo_cli.launch.doctor import collect
    from grpo_cli.launch.doctor_verdict import NO, render_text

    report = collect(engines=not quick)
    wanted = [m.value for m in modes or []]
    if wanted:
        report.modes = [v for v in report.modes if v.mode in wanted]
        judged = {v.mode for v in report.modes}
        skipped = [m for m in wanted if m not in judged]
        if skipped:
            typer.echo(f"error: --quick cannot judge {', '.join(skipped)}; run without --quick.", err=True)
            raise typer.Exit(2)
    typer.echo(json.dumps(dataclasses.asdict(report), indent=2) if as_json else render_text(report))
    if wanted and any(v.status == NO for v in report.modes):
        raise typer.Exit(1)


def _multi_node(shared_dir, master_addr, master_port, write_manifest, model) -> int:
    """`--mode multi-node`: write this node's manifest, or check the job from this node (exit 1 on a failure)."""
    from grpo_cli.launch.doctor_nodes import multi_node_checks, write_manifest as write

    if write_manifest is not None:
        write(write_manifest, model or "builtin:tiny")
        return 0
    if shared_dir is None:
        typer.echo("error: --mode multi-node needs --shared-dir (the job's deployment.shared_dir).", err=True)
        return 2
    checks = multi_node_checks(shared_dir, master_addr, master_port)
    for c in checks:
        typer.echo(f"{'ok' if c.ok else 'NO':3s} {c.name}: {c.detail}")
    return 0 if all(c.ok for c in checks) else 1
