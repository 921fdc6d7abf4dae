"""`grpo doctor`'s verdicts: the probe and verdict records, which probes each mode needs (`MODES`), the judgement
of a mode from the probes, and the plain-text report. The probes themselves are in `launch/doctor.py`."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

OK, LIMITED, NO = "ok", "limited", "no"


@dataclass
class Check:
    """One probe: `ok` is True/False, or None when it only informs. `fix` says how to make it pass."""

    id: str
    ok: bool | None
    detail: str
    fix: str | None = None


@dataclass
class Verdict:
    """ok / limited / no, the failed probes behind it and how to fix them."""

    mode: str
    status: str
    reasons: list[str] = field(default_factory=list)
    fixes: list[str] = field(default_factory=list)


@dataclass
class DoctorReport:
    system: dict[str, str]
    packages: dict[str, str | None]
    checks: list[Check]
    modes: list[Verdict]


# Mode -> (checks that must pass, checks whose failure only limits it). A required id absent from the run (vllm
# probes when vllm does not import) counts as failed; "x.*" stands for every check id starting with "x.".
_HF = ("torch.import", "transformers.import", "accelerate.import")
_HF_OPT = ("torch.version", "deps.transformers.*", "deps.accelerate.*", "env.cpu_torch_extras")
MODES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "hf-colocate": (_HF, _HF_OPT),
    "vllm-colocate": ((*_HF, "vllm.import", "vllm.version", "vllm.logprobs_mode", "vllm.weight_load", "vllm.sleep_api"),
                      (*_HF_OPT, "vllm.sleep_mode", "vllm.external_launcher", "deps.vllm.*", "env.alloc_conf")),
    "server": ((*_HF, "server.packages", "net.free_port"), (*_HF_OPT, "torch.nccl", "env.proxy")),
    "sglang": (("sglang.import", "cuda.available", "server.packages"), ("deps.sglang.*", "env.proxy")),
    "async": ((*_HF, "ray.import", "ray.placement_group"), _HF_OPT),
    "deepspeed": ((*_HF, "deepspeed.import", "cuda.available"), (*_HF_OPT, "deps.deepspeed.*")),
    "megatron": ((*_HF, "megatron-core.import", "megatron-core.version", "mbridge.import", "mbridge.version"),
                 (*_HF_OPT, "deps.megatron-core.*", "deps.mbridge.*", "cuda.available")),
}


# ---- verdicts -------------------------------------------------------------------------------------------------

def judge(checks: list[Check], modes: dict = MODES) -> list[Verdict]:
    """Verdict per mode: `no` when a required check failed or is absent, `limited` when an optional one failed
    (optional checks that only appear when something is wrong, like `env.proxy`, may be absent)."""
    by_id = {c.id: c for c in checks}
    verdicts = []

    def expand(ids: tuple[str, ...]) -> list[str]:
        return [c for i in ids for c in ([k for k in by_id if k.startswith(i[:-1])] if i.endswith("*") else [i])]

    for mode, (required, optional) in modes.items():
        v = Verdict(mode, OK)
        for cid, severity in [*((r, NO) for r in expand(required)), *((o, LIMITED) for o in expand(optional))]:
            c = by_id.get(cid)
            if (c.ok is not False) if c is not None else severity == LIMITED:  # absent optional: nothing wrong
                continue
            if severity == NO or v.status == OK:
                v.status = severity
            if c is None:  # a probe that never ran because its package failed to import; that check says why
                continue
            v.reasons.append(f"{cid}: {c.detail}")
            if c.fix and c.fix not in v.fixes:
                v.fixes.append(c.fix)
        verdicts.append(v)
    return verdicts


_COMMANDS = ("pip ", f"{sys.executable} -m pip", "export ", "unset ")  # fixes to run, not hardware to get


def render_text(report: DoctorReport) -> str:
    """Plain text (readable in logs and under nohup): versions, probes, verdicts with fix commands."""
    sym = {True: "ok", False: "no", None: "--"}
    lines = ["grpo doctor", "", "system", *(f"  {k:12s} {v}" for k, v in report.system.items()), "", "packages",
             *(f"  {k:12s} {v or 'not installed'}" for k, v in report.packages.items()), "", "probes",
             *(f"  [{sym[c.ok]}] {c.id:26s} {c.detail}" for c in report.checks), "", "modes"]
    for v in report.modes:
        lines.append(f"  {v.mode:14s} {v.status.upper()}")
        lines += [f"      why: {r}" for r in v.reasons]
        lines += [f"      {'run' if f.startswith(_COMMANDS) else 'need'}: {f}" for f in v.fixes]
    return "\n".join(lines)
