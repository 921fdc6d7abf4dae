"""Atomic checkpoints: everything needed for an exact resume, written to a temp folder and renamed when whole.

Layout of `checkpoint-<step>/`: the backend's weights + optimizer state (ddp: an HF folder + optimizer.pt;
fsdp2: `dcp/` shards; deepspeed: its own per-rank files), tokenizer, scheduler.pt, rng.pt, trainer_state.json, config.yaml and MANIFEST.json (sha256 of every file), written last.
A folder without a valid manifest is partial and is never loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from grpo_cli.config.errors import UserError
from grpo_cli.config.load import dump_config
from grpo_cli.config.schema import GRPOConfig
from grpo_cli.launch.dist import barrier

PREFIX = "checkpoint-"
MANIFEST = "MANIFEST.json"


class CheckpointError(UserError):
    """A checkpoint is partial, corrupt, or belongs to a different run; the message says which file or field."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def resume_fingerprint(cfg: GRPOConfig) -> dict:
    """Config fields that must match for a resume to continue the same run (train.steps may grow)."""
    dump = cfg.model_dump(mode="json")
    train = {k: v for k, v in dump["train"].items() if k != "steps"}
    return {"model": dump["model"], "data": dump["data"], "rewards": dump["rewards"],
            "algorithm": dump["algorithm"], "train": train,
            "sampling": {k: dump["rollout"][k] for k in ("max_completion_length", "temperature", "top_p", "top_k")},
            "world_size": cfg.distributed.num_processes * cfg.distributed.num_machines}


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_manifest_and_fsync(tmp: Path, step: int) -> None:
    files = {str(p.relative_to(tmp)): _sha256(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
    (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": files}, indent=2))
    for p in tmp.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def save_checkpoint(root: Path, *, step: int, cfg: GRPOConfig, policy, trainer_state: dict, keep_last: int) -> Path:
    """Write checkpoint-<step> atomically under `root`, then prune to the newest `keep_last` complete ones.

    Collective: every rank writes its part of the weights and optimizer state (`backend.save_state`: one HF folder
    for ddp, DCP shards for fsdp2, DeepSpeed's own files for ZeRO); rank 0 writes the rest, the manifest last, and
    renames the folder. On any failure (disk full, kill) only the temp folder is affected."""
    info = policy.backend.info
    final = root / f"{PREFIX}{step}"
    tmp = root / f".tmp-{PREFIX}{step}"
    try:
        if info.is_main:
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        barrier(info)
        policy.backend.save_state(tmp)
        barrier(info)
        if info.is_main:
            policy.tokenizer.save_pretrained(tmp)
            torch.save(policy.scheduler.state_dict(), tmp / "scheduler.pt")
            torch.save(rng_state(), tmp / "rng.pt")
            state = {**trainer_state, "step": step, "fingerprint": resume_fingerprint(cfg)}
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
            (tmp / "config.yaml").write_text(dump_config(cfg))
            _write_manifest_and_fsync(tmp, step)
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(root)
    except BaseException:
        if info.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    barrier(info)
    if info.is_main:
        prune(root, keep_last)
    return final


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints (manifest present) under `root`, oldest first."""
    if not root.exists():
        return []
    found = [p for p in root.glob(f"{PREFIX}*") if (p / MANIFEST).exists() and p.name[len(PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def prune(root: Path, keep_last: int) -> None:
    for old in complete_checkpoints(root)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def resolve_resume(resume: str, output_dir: Path) -> Path | None:
    """`auto` → newest complete checkpoint in the output dir (None if there is none); else the given path."""
    if resume == "auto":
        found = complete_checkpoints(output_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not path.exists():
        raise CheckpointError(f"checkpoint.resume: {path} does not exist; give a checkpoint-N folder or 'auto'.")
    return path


def verify_checkpoint(path: Path) -> dict:
    """Check the manifest and every file's sha256; return trainer_state. Raises CheckpointError naming the file."""
    manifest = path / MANIFEST
    if not manifest.exists():
        raise CheckpointError(f"{path} is a partial checkpoint (no {MANIFEST}); resume from an earlier one.")
    files = json.loads(manifest.read_text())["files"]
    for name, digest in files.items():
        f = path / name
        if not f.exists():
            raise CheckpointError(f"{path} is missing {name}; the checkpoint is incomplete, use an earlier one.")
        if _sha256(f) != digest:
            raise CheckpointError(f"{f} is corrupt (checksum mismatch); resume from an earlier checkpoint.")
    return json.loads((path / "trainer_state.json").read_text())


def load_checkpoint(path: Path, *, cfg: GRPOConfig, policy) -> dict:
    """Restore policy weights and optimizer (through the backend), scheduler and RNG from `path`; return its
    trainer_state. Collective under sharded backends."""
    state = verify_checkpoint(path)
    want, have = resume_fingerprint(cfg), state["fingerprint"]
    diff = sorted(k for k in want if want[k] != have.get(k))
    if diff:
        raise CheckpointError(
            f"{path} was written by a run with different settings in: {', '.join(diff)}. Resume with the same "
            "config (only train.steps may change), or start a new run in another output dir."
        )
    policy.backend.load_state(path)
    policy.scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    set_rng_state(torch.load(path / "rng.pt", weights_only=False))  # our own file, checksum-verified above
    return state
