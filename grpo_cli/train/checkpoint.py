"""Atomic checkpoints: everything needed for an exact resume, written to a temp folder and renamed when whole.

Layout of `checkpoint-<step>/`: the backend's weights + optimizer state (ddp: an HF folder + optimizer.pt;
fsdp2: `dcp/` shards; deepspeed: its own per-rank files), tokenizer, scheduler.pt, `rng-<rank>.pt` (each rank's
Python, NumPy, torch CPU and, on CUDA, its device's generator), trainer_state.json, config.yaml and MANIFEST.json
(every file's size and XXH3-128 checksum, hashed by all ranks in parallel: `train/manifest.py`), written last.
A folder without a valid manifest is partial and is never loaded.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from grpo_cli.config.load import dump_config
from grpo_cli.config.schema import GRPOConfig
from grpo_cli.data.images import copy_processor_files
from grpo_cli.models.tiny import model_folder
from grpo_cli.runtime.accel import rng_states, set_rng_states
from grpo_cli.runtime.dist import DistInfo, all_gather_object, barrier
from grpo_cli.train.manifest import MANIFEST, CheckpointError, verify_manifest, write_manifest

PREFIX = "checkpoint-"


def resume_fingerprint(cfg: GRPOConfig) -> dict:
    """Config fields that must match for a resume to continue the same run (train.steps may grow)."""
    dump = cfg.model_dump(mode="json")
    train = {k: v for k, v in dump["train"].items() if k != "steps"}
    return {"model": dump["model"], "data": dump["data"], "rewards": dump["rewards"],
            "algorithm": dump["algorithm"], "train": train,
            "sampling": {k: dump["rollout"][k] for k in ("max_completion_length", "temperature", "top_p", "top_k")},
            "world_size": cfg.distributed.num_processes * cfg.distributed.num_machines}


def rng_state(device: torch.device) -> dict:
    """This process's generators: Python's, NumPy's, torch's CPU one and, on CUDA, its device's (dropout draws from
    it), as tensors and plain numbers only, so that resuming loads them with `torch.load(weights_only=True)` (an
    unpickler that builds no arbitrary objects: a crafted checkpoint cannot run code). Saved per rank: each rank's
    generators advance differently."""
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
            "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
            **rng_states(device)}


def set_rng_state(state: dict, device: torch.device) -> None:
    py, npy = state["python"], state["numpy"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    np.random.set_state((npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached_gaussian"]))
    set_rng_states(state, device)


def load_rng_file(path: Path) -> dict:
    """An RNG file read with `torch.load(weights_only=True)`, which builds tensors and plain values only. Anything
    else is refused with the way out, never unpickled without that restriction: the RNG files of older grpo-cli
    checkpoints (pickled NumPy arrays), a crafted file (the unrestricted unpickler runs whatever code it names), a
    damaged one, or one without this version's layout."""
    import pickle

    try:
        state = torch.load(path, weights_only=True)
    except (pickle.UnpicklingError, EOFError, RuntimeError):
        state = None
    if not (isinstance(state, dict) and isinstance(state.get("python"), dict) and isinstance(state.get("numpy"), dict)
            and isinstance(state.get("torch"), torch.Tensor)):
        raise CheckpointError(
            f"{path} is not a random-generator file this version can read safely (tensors and plain values, read "
            "with torch.load(weights_only=True)). Older grpo-cli checkpoints pickled NumPy arrays there, and a "
            "crafted file can carry code: reading either takes an unrestricted unpickler, which runs whatever the "
            "file says, so grpo-cli does not use one. Resume from a checkpoint this version wrote, or start a new "
            "run from these weights with --set model.name_or_path=<checkpoint folder> (a ddp checkpoint is a "
            "Hugging Face folder; sharded ones: their run's final-model/)."
        )
    return state


def _rng_file(path: Path, rank: int) -> Path:
    """This rank's RNG file; checkpoints written before per-rank files hold rank 0's CPU state alone in rng.pt."""
    own = path / f"rng-{rank}.pt"
    if own.exists() or not (path / "rng.pt").exists():
        return own
    return path / "rng.pt"


def _check_rng_files(path: Path, info: DistInfo) -> None:
    """Every rank reads its RNG file as `load_rng_file` does, so an old or crafted one fails before any model loads;
    collective: every rank raises the first refusal (none is left waiting for the others in a collective). A rank
    without a file of its own (a run resumed on more processes) is left to the fingerprint check of the load."""
    own, refusal = _rng_file(path, info.rank), ""
    try:
        if own.exists():
            load_rng_file(own)
    except CheckpointError as exc:
        refusal = str(exc)
    found = [r for r in all_gather_object(refusal, info) if r]
    if found:
        raise CheckpointError(found[0])


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(root: Path, *, step: int, cfg: GRPOConfig, policy, trainer_state: dict, keep_last: int) -> Path:
    """Write checkpoint-<step> atomically under `root`, then prune to the newest `keep_last` complete ones.

    Collective: every rank writes its part of the weights and optimizer state (`backend.save_state`: one HF folder
    for ddp, DCP shards for fsdp2, DeepSpeed's own files for ZeRO) and its RNG file; rank 0 writes the rest; all
    ranks hash their share of the files (`write_manifest`); rank 0 writes the manifest last and renames the folder.
    On any failure (disk full, kill) only the temp folder is affected."""
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
        torch.save(rng_state(policy.device), tmp / f"rng-{info.rank}.pt")
        if info.is_main:
            policy.tokenizer.save_pretrained(tmp)
            copy_processor_files(model_folder(cfg.model.name_or_path), tmp)  # a VLM's image processor
            torch.save(policy.scheduler.state_dict(), tmp / "scheduler.pt")
            state = {**trainer_state, "step": step, "fingerprint": resume_fingerprint(cfg)}
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=2))
            (tmp / "config.yaml").write_text(dump_config(cfg))
        barrier(info)
        write_manifest(tmp, step=step, info=info)
        if info.is_main:
            for d in [*(p for p in tmp.rglob("*") if p.is_dir()), tmp]:
                _fsync_dir(d)
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


def resolve_resume(resume: str, output_dir: Path, info: DistInfo | None = None) -> Path | None:
    """`auto` → newest complete checkpoint in the output dir (None if there is none); else the given path.

    Collective when `info` spans several ranks: each rank looks on its own disk, then they agree (one object
    all-gather). Ranks that see different checkpoints (machines without a shared output directory) or a refusal on
    any rank raise the same CheckpointError everywhere, instead of some resuming (collective loads) while others start
    afresh."""
    info = info or DistInfo()
    found, refusal = None, ""
    try:
        found = _resolve_here(resume, output_dir)
    except CheckpointError as exc:
        refusal = str(exc)
    if info.world_size == 1:
        if refusal:
            raise CheckpointError(refusal)
        return found
    seen = all_gather_object((None if found is None else str(found), refusal), info)
    refusals = [f"rank {r}: {msg}" for r, (_, msg) in enumerate(seen) if msg]
    if refusals:
        raise CheckpointError(refusals[0])
    if len({path for path, _ in seen}) > 1:
        views = ", ".join(f"rank {r}: {path or 'none'}" for r, (path, _) in enumerate(seen))
        raise CheckpointError(f"checkpoint.resume: {resume}: the processes found different checkpoints ({views}). "
                              "Every machine must see the same output directory (a shared file system): point "
                              "--output-dir at one, or copy the checkpoint to each machine and give its path.")
    return found


def _resolve_here(resume: str, output_dir: Path) -> Path | None:
    if resume == "auto":
        found = complete_checkpoints(output_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not path.exists():
        raise CheckpointError(f"checkpoint.resume: {path} does not exist; give a checkpoint-N folder or 'auto'.")
    return path


def verify_checkpoint(path: Path, info: DistInfo | None = None) -> dict:
    """Check the manifest and every file's size and checksum; return trainer_state. Collective when `info` spans
    several ranks: each file is hashed once, by one rank (shares balanced by size), and every rank raises the same
    CheckpointError naming the first bad file. Manifests of older checkpoints (SHA-256) verify too; RNG files of the
    old pickled format do not (`load_rng_file`)."""
    info = info or DistInfo()
    verify_manifest(path, info)
    _check_rng_files(path, info)
    return json.loads((path / "trainer_state.json").read_text())


def load_checkpoint(path: Path, *, cfg: GRPOConfig, policy, verify: bool = True) -> dict:
    """Restore policy weights and optimizer (through the backend), scheduler and this rank's RNG from `path`;
    return its trainer_state. Collective under several processes. `verify=False` skips the checksums when the
    caller has just run `verify_checkpoint` on `path` (`grpo train` does, before building anything), so a resume
    reads the checkpoint's bytes for hashing once."""
    info = policy.backend.info
    if verify:
        state = verify_checkpoint(path, info)
    elif (path / MANIFEST).exists():
        state = json.loads((path / "trainer_state.json").read_text())
    else:
        raise CheckpointError(f"{path} is a partial checkpoint (no {MANIFEST}); resume from an earlier one.")
    want, have = resume_fingerprint(cfg), state["fingerprint"]
    diff = sorted(k for k in want if want[k] != have.get(k))
    if diff:
        raise CheckpointError(
            f"{path} was written by a run with different settings in: {', '.join(diff)}. Resume with the same "
            "config (only train.steps may change), or start a new run in another output dir."
        )
    policy.backend.load_state(path)
    policy.scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    set_rng_state(load_rng_file(_rng_file(path, info.rank)), policy.device)
    return state
