"""Checkpoint hashing on 2 processes: the old scheme (rank 0 SHA-256s every file serially while the other rank waits
in a barrier; on resume every rank SHA-256s the whole checkpoint twice) against the new one (`train/manifest.py`:
the files split between the ranks by size, each rank XXH3-128s and fsyncs its share; a resume hashes each file once).

One `torchrun` job of 2 gloo ranks per backend on the ~50M benchmark model (`benchmarks.compare`'s `50m`, 49.3M
parameters): load through the backend, one AdamW step (so the optimizer state exists), one real `save_checkpoint`;
then, on those same files, the manifest phase of a save (the wall time from the barrier after the files are written
to the barrier after the manifest is on disk, measured by rank 0: what the other ranks wait through) and the
verification of a resume (from a barrier to every rank done), old and new alternated `--rounds` times; medians.
A third save variant, XXH3 on rank 0 alone, separates the faster checksum's share of the gain from the split's.
The files are in the page cache (just written), as after a save; the hashing is what is measured, not the disk.

Run: `python -m benchmarks.checkpoint_hashing [--size 50m] [--rounds 5] [--backends ddp fsdp2]`.
Results: `benchmarks/results/checkpoint_hashing.json`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.compare import RESULTS_DIR, fmt_table, machine_info, run_each_backend, torchrun_two

BACKENDS = {
    "ddp": [],
    "fsdp2": ["distributed.backend=fsdp2", "rollout.engine=vllm"],
    "zero3": ["distributed.backend=deepspeed", "distributed.deepspeed.zero_stage=3", "rollout.engine=vllm"],
}


def _sha256(path: Path) -> str:  # the old scheme, as train/checkpoint.py had it
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def old_manifest(folder: Path, step: int) -> None:
    """Rank 0's manifest before: every file SHA-256'd serially, written, every file fsynced."""
    files = {str(p.relative_to(folder)): _sha256(p) for p in sorted(folder.rglob("*")) if p.is_file()}
    (folder / "MANIFEST.json").write_text(json.dumps({"step": step, "files": files}, indent=2))
    for p in folder.rglob("*"):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def xxh3_rank0_manifest(folder: Path) -> None:
    """The new checksum without the split (rank 0 hashes and fsyncs every file alone): what the split adds."""
    from grpo_cli.train.manifest import file_digest

    files = {str(p.relative_to(folder)): file_digest(p, "xxh3_128", fsync=True)
             for p in sorted(folder.rglob("*")) if p.is_file()}
    (folder / "MANIFEST.json").write_text(json.dumps({"step": 1, "hash": "xxh3_128", "files": files}))


def old_verify(folder: Path) -> None:
    """What every rank did on a resume before: verify the whole checkpoint (run.py), then again (load_checkpoint)."""
    for _ in range(2):
        for name, digest in json.loads((folder / "MANIFEST.json").read_text())["files"].items():
            assert _sha256(folder / name) == digest, name


def worker(ckpt: str, out_dir: str, rounds: int, overrides: list[str]) -> None:
    """One rank: train one step, save a checkpoint, then time the old and new manifest and verification phases."""
    import torch

    from grpo_cli.config.load import build_config
    from grpo_cli.runtime.dist import all_reduce_sum, barrier, init_from_env
    from grpo_cli.train.batch import TrainBatch
    from grpo_cli.train.checkpoint import save_checkpoint
    from grpo_cli.train.manifest import verify_manifest, write_manifest
    from grpo_cli.train.policy import load_policy
    from grpo_cli.train.step import optimizer_step

    info = init_from_env(torch.device("cpu"), timeout_minutes=30)
    cfg = build_config(overrides=[f"model.name_or_path={ckpt}", f"distributed.num_processes={info.world_size}",
                                  "train.micro_batch_size=4", "train.prompts_per_step=2",
                                  "train.generations_per_prompt=4", *overrides])
    policy = load_policy(cfg, ckpt, device=torch.device("cpu"), info=info)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(6, policy.module.config.vocab_size, (4, 32), generator=g)
    batch = TrainBatch(ids, torch.ones_like(ids), torch.ones(4, 16), advantages=torch.randn(4, generator=g),
                       sampler_logprobs=-torch.rand(4, 16, generator=g))
    optimizer_step(policy, batch, cfg, num_items=all_reduce_sum(64.0, info), num_sequences=4 * info.world_size)
    folder = save_checkpoint(Path(out_dir) / "run", step=1, cfg=cfg, policy=policy, trainer_state={}, keep_last=1)

    def timed(fn) -> float:
        barrier(info)
        start = time.perf_counter()
        fn()
        barrier(info)
        return time.perf_counter() - start

    def fresh() -> None:  # each save starts from files without a manifest
        if info.is_main:
            (folder / "MANIFEST.json").unlink(missing_ok=True)

    times: dict[str, list[float]] = {k: [] for k in ("save_old", "save_xxh3_rank0", "save_new", "verify_old",
                                                     "verify_new")}
    for _ in range(rounds):
        fresh()
        times["save_old"].append(timed(lambda: old_manifest(folder, 1) if info.is_main else None))
        times["verify_old"].append(timed(lambda: old_verify(folder)))
        fresh()
        times["save_xxh3_rank0"].append(timed(lambda: xxh3_rank0_manifest(folder) if info.is_main else None))
        fresh()
        times["save_new"].append(timed(lambda: write_manifest(folder, step=1, info=info)))
        times["verify_new"].append(timed(lambda: verify_manifest(folder, info)))
    if info.is_main:
        files = {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*")
                 if p.is_file() and p.name != "MANIFEST.json"}
        shares = {r: sum(e["bytes"] for e in json.loads((folder / "MANIFEST.json").read_text())["files"].values()
                         if e["rank"] == r) for r in range(info.world_size)}
        (Path(out_dir) / "result.json").write_text(json.dumps({
            "files": len(files), "bytes": sum(files.values()),
            "largest": sorted(files.items(), key=lambda kv: -kv[1])[:4],
            "bytes_hashed_per_rank": shares, "times": times}))


def run_backend(ckpt: str, name: str, rounds: int, out_dir: Path) -> dict:
    torchrun_two("benchmarks.checkpoint_hashing", [ckpt, str(out_dir), str(rounds), *BACKENDS[name]], label=name,
                 timeout=3600, OMP_NUM_THREADS="1")
    return json.loads((out_dir / "result.json").read_text())


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="50m")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--backends", nargs="+", default=["ddp", "fsdp2"], choices=list(BACKENDS))
    args = ap.parse_args()
    params, results = run_each_backend(args.size, args.backends,
                                       lambda ckpt, name, folder: run_backend(ckpt, name, args.rounds, folder))
    rows = [["backend", "checkpoint", "phase", "old: SHA-256 s", "XXH3 on rank 0 alone s", "new: XXH3, split s",
             "old / new", "MB hashed by rank 0 / 1 (new)"]]
    for name, r in results.items():
        med = {k: statistics.median(v) for k, v in r["times"].items()}
        r["medians"] = med
        split = " / ".join(f"{b / 2**20:.0f}" for b in r["bytes_hashed_per_rank"].values())
        for phase, label in (("save", "save: manifest"), ("verify", "resume: verify")):
            old, new = med[f"{phase}_old"], med[f"{phase}_new"]
            alone = f"{med['save_xxh3_rank0']:.3f}" if phase == "save" else "-"
            rows.append([name, f"{r['files']} files, {r['bytes'] / 2**20:.0f} MB", label, f"{old:.3f}", alone,
                         f"{new:.3f}", f"{old / new:.1f}×", split])
    print(f"{args.size} model ({params / 1e6:.1f}M parameters), 2 gloo processes, {args.rounds} alternated rounds, "
          "medians\n")
    print(fmt_table(rows))
    RESULTS_DIR.mkdir(exist_ok=True)
    out = RESULTS_DIR / "checkpoint_hashing.json"
    out.write_text(json.dumps({"size": args.size, "params": params, "rounds": args.rounds, "results": results,
                               "machine": machine_info()}, indent=2))
    print(f"\nwritten: {out}")


if __name__ == "__main__":
    main()
