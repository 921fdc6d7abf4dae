"""Worker for test_checkpoint's two-process cases: checkpoint a fake policy whose backend writes one shard per rank,
resume from it as `grpo train` does, then corrupt one file of each rank's share of the verification and
verify again.

Run under torchrun: `checkpoint_worker.py OUT_DIR`. Each rank writes OUT_DIR/rank<r>.json with the files it hashed
while saving and while resuming (the checksum function is wrapped), whether its own generators came back, and the
error each corrupted file raised on this rank.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import torch

from grpo_cli.config.load import build_config
from grpo_cli.runtime.accel import local_rank_from_env, resolve_device
from grpo_cli.runtime.dist import all_gather_object, barrier, init_from_env, shutdown
from grpo_cli.train import checkpoint as ckpt
from grpo_cli.train import manifest

SHARD_BYTES = {0: 3 << 20, 1: 2 << 20}  # uneven, so the size-balanced split is not just "each its own shard"


class FakeBackend:
    """Writes what a sharded backend writes: one file per rank (rank 0 also a larger optimizer file, as ddp)."""

    def __init__(self, info):
        self.info = info

    def save_state(self, folder: Path) -> None:
        r = self.info.rank
        (folder / "shards").mkdir(exist_ok=True)
        (folder / "shards" / f"__{r}_0.bin").write_bytes(bytes([r + 1]) * SHARD_BYTES[r])
        if self.info.is_main:
            (folder / "optimizer.pt").write_bytes(b"o" * (4 << 20))

    def load_state(self, folder: Path) -> None:
        assert (folder / "shards" / f"__{self.info.rank}_0.bin").stat().st_size == SHARD_BYTES[self.info.rank]


class FakeTokenizer:
    def save_pretrained(self, folder: Path) -> None:
        (folder / "tokenizer.json").write_text("{}")


class FakeScheduler:
    def state_dict(self) -> dict:
        return {"last_epoch": 3}

    def load_state_dict(self, state: dict) -> None:
        assert state == {"last_epoch": 3}


class FakePolicy:
    def __init__(self, info, device):
        self.backend, self.tokenizer, self.scheduler = FakeBackend(info), FakeTokenizer(), FakeScheduler()
        self.device = device


def draws() -> list[float]:
    return [random.random(), float(np.random.rand()), float(torch.rand(1))]


def corrupt_and_verify(path: Path, name: str, info) -> str:
    """Flip one byte of `name` (size unchanged: only the checksum can tell), verify on every rank, restore it."""
    f = path / name
    original = f.read_bytes()
    barrier(info)
    if info.is_main:
        f.write_bytes(bytes([original[0] ^ 0xFF]) + original[1:])
    barrier(info)
    try:
        ckpt.verify_checkpoint(path, info)
        message = "no error"
    except ckpt.CheckpointError as exc:
        message = str(exc)
    barrier(info)
    if info.is_main:
        f.write_bytes(original)
    barrier(info)
    return message


def main(out_dir: str) -> None:
    device = resolve_device("cpu", local_rank_from_env())
    info = init_from_env(device, timeout_minutes=2)
    out = Path(out_dir)
    hashed: list[str] = []
    digest = manifest.file_digest

    def recording(path, algo, **kw):
        hashed.append(str(path))
        return digest(path, algo, **kw)

    manifest.file_digest = recording
    cfg = build_config(overrides=[f"distributed.num_processes={info.world_size}"])
    policy = FakePolicy(info, device)
    random.seed(10 + info.rank)
    np.random.seed(20 + info.rank)
    torch.manual_seed(30 + info.rank)
    path = ckpt.save_checkpoint(out / "run", step=3, cfg=cfg, policy=policy, trainer_state={"cursor": {}},
                                keep_last=1)
    expected = draws()
    saved = [str(Path(p).relative_to(out / "run" / ".tmp-checkpoint-3")) for p in hashed]
    hashed.clear()
    random.seed(999)
    np.random.seed(999)
    torch.manual_seed(999)
    ckpt.verify_checkpoint(path, info)  # what `grpo train` runs on a resume, then `_resume`'s load
    state = ckpt.load_checkpoint(path, cfg=cfg, policy=policy, verify=False)
    resumed = [str(Path(p).relative_to(path)) for p in hashed]
    rng_restored = draws() == expected
    names = manifest.read_manifest(path)[1]
    shares = all_gather_object(resumed, info)  # each rank's part of the verification
    errors = {share[0]: corrupt_and_verify(path, share[0], info) for share in shares}
    (out / f"rank{info.rank}.json").write_text(json.dumps({
        "saved": saved, "resumed": resumed, "rng_restored": rng_restored, "step": state["step"],
        "manifest_files": sorted(names), "errors": errors}))
    shutdown(info)


if __name__ == "__main__":
    main(sys.argv[1])
    from grpo_cli.runtime.dist import leave_worker

    leave_worker()  # past torch's C++ teardown, which now and then aborts a finished rank (SIGABRT)
