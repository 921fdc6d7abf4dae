"""`grpo diagnose-mismatch`: measure the training–inference mismatch of a config's engine before a run (or on a
saved checkpoint mid-run). Parses and checks the arguments, then calls `grpo_cli.diagnose.command`; no torch here.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Literal, Optional

import typer

from grpo_cli.cli.common import ConfigOpt, PresetArg, PresetOpt, SetOpt, load_config, user_errors
from grpo_cli.config.errors import UserError

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "auto": "auto"}
ENGINE_OVERRIDES = {
    "hf": ["rollout.engine=hf", "rollout.mode=colocate", "rollout.server.urls=[]", "rollout.vllm.sleep_level=0"],
    "vllm": ["rollout.engine=vllm", "rollout.mode=colocate", "rollout.server.urls=[]"],
    "server": ["rollout.mode=server", "rollout.vllm.sleep_level=0"],
}


def checkpoint_model_path(folder: Path) -> str:
    """The Hugging Face model folder of `--checkpoint`: the folder itself or its policy/model/hf subfolder."""
    for cand in (folder, folder / "policy", folder / "model", folder / "hf"):
        if (cand / "config.json").is_file():
            if not any((cand / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
                raise UserError(f"--checkpoint {folder}: {cand} holds a model but no tokenizer; save the tokenizer "
                                "next to it (tokenizer.save_pretrained) so both sides tokenise alike.")
            return str(cand)
    raise UserError(f"--checkpoint {folder}: no Hugging Face model found (config.json missing in it and in its "
                    "policy/, model/ and hf/ subfolders); pass a folder written by save_pretrained.")


def parse_gates(items: list[str] | None, *, flag: str) -> dict[str, float]:
    """`metric=value` items (prefix `rollout_correction/` optional) -> {metric: limit}; UserError names the fix."""
    from grpo_cli.diagnose.rules import METRIC_NAMES

    out: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        name = name.strip().removeprefix("rollout_correction/")
        if not sep or name not in METRIC_NAMES:
            raise UserError(f"{flag} {item!r}: expected METRIC=VALUE with METRIC one of: {', '.join(METRIC_NAMES)}.")
        try:
            out[name] = float(value)
        except ValueError:
            raise UserError(f"{flag} {item!r}: {value!r} is not a number.") from None
    return out


def diagnose_mismatch(
    preset: PresetArg = None,
    preset_opt: PresetOpt = None,
    config: ConfigOpt = None,
    overrides: SetOpt = None,
    num_prompts: Annotated[Optional[int], typer.Option(
        "--num-prompts", "-n", min=1, help="Prompts to sample (× train.generations_per_prompt completions each); "
                                           "default train.prompts_per_step.")] = None,
    engine: Annotated[Optional[Literal["hf", "vllm", "server"]], typer.Option(
        help="Rollout engine to measure (default: the config's); server uses rollout.server.urls.")] = None,
    rollout_dtype: Annotated[Optional[Literal["bf16", "fp16", "fp32", "auto"]], typer.Option(
        help="Rollout engine dtype (rollout.dtype); the trainer side always uses model.dtype.")] = None,
    checkpoint: Annotated[Optional[Path], typer.Option(
        help="Evaluate this saved policy (Hugging Face folder, e.g. RUN_DIR/checkpoint-N) instead of "
             "model.name_or_path.")] = None,
    json_out: Annotated[Optional[Path], typer.Option(
        "--json", help="Write the full report as JSON to this file ('-': stdout, the table goes to stderr).")] = None,
    with_tokens: Annotated[bool, typer.Option(
        "--with-tokens", help="Include every sampled token's ids and both logprobs in the JSON.")] = False,
    fail_above: Annotated[Optional[list[str]], typer.Option(
        "--fail-above", help="CI gate, repeatable: exit 1 when METRIC > VALUE, e.g. k3_kl=1e-3.")] = None,
    fail_below: Annotated[Optional[list[str]], typer.Option(
        "--fail-below", help="CI gate, repeatable: exit 1 when METRIC < VALUE, e.g. ess=0.99.")] = None,
    print_schema: Annotated[bool, typer.Option(
        "--print-schema", help="Print the JSON schema of the --json report and exit.")] = False,
) -> None:
    """Measure training–inference mismatch: sample with the rollout engine, recompute the logprobs with the
    trainer's model (model.dtype, model.attn_implementation), and report every rollout_correction/ metric with a
    verdict, the worst sequences and tokens, a log-ratio histogram and which is_correction to use.
    Exit 0, or 1 when a --fail-above/--fail-below gate fails, 2 on bad input."""
    with user_errors():
        if print_schema:
            from grpo_cli.diagnose.rules import report_schema

            typer.echo(json.dumps(report_schema(), indent=2))
            return
        above = parse_gates(fail_above, flag="--fail-above")
        below = parse_gates(fail_below, flag="--fail-below")
        extra = list(ENGINE_OVERRIDES[engine]) if engine else []
        if rollout_dtype:
            extra.append(f"rollout.dtype={DTYPES[rollout_dtype]}")
        if checkpoint is not None:
            extra.append(f"model.name_or_path={checkpoint_model_path(checkpoint)}")
        cfg = load_config(preset, preset_opt, config, [*(overrides or []), *extra])
        report = _run(cfg, num_prompts=num_prompts or cfg.train.prompts_per_step, with_tokens=with_tokens,
                      above=above, below=below)
    _emit(report, json_out)
    raise typer.Exit(1 if any(g["failed"] for g in report["gates"]) else 0)


def _run(cfg, *, num_prompts: int, with_tokens: bool, above: dict, below: dict) -> dict:
    # vLLM logs to stdout by default; keep stdout for the report.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from grpo_cli.runtime.quiet import quiet_hf_stack
    from grpo_cli.diagnose.command import diagnose, metric_values
    from grpo_cli.diagnose.rules import check_gates

    quiet_hf_stack()
    report = diagnose(cfg, num_prompts=num_prompts, with_tokens=with_tokens)
    report["gates"] = check_gates(metric_values(report), above=above, below=below)
    return report


def _emit(report: dict, json_out: Path | None) -> None:
    from grpo_cli.ui.diagnose_view import render_report

    to_stdout = json_out is not None and str(json_out) == "-"
    render_report(report, stream=sys.stderr if to_stdout else sys.stdout)
    if json_out is None:
        return
    text = json.dumps(report, indent=2, allow_nan=False)
    if to_stdout:
        typer.echo(text)
    else:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(text + "\n")
        typer.echo(f"report written to {json_out}", err=True)
