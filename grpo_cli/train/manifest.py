"""A checkpoint's MANIFEST.json: every file's size and XXH3-128 checksum, hashed by all ranks in parallel.

Why in parallel: the other ranks wait in a collective while the manifest is made, and a collective that waits longer
than the process group's timeout (`distributed.timeout_minutes`; NCCL's own is 10 minutes) kills the job. Rank 0
alone SHA-256-ing a 72B ZeRO-3 checkpoint (fp32 masters + Adam ≈ 0.86 TB) at ~1.7 GB/s takes ~8.5 minutes of
hashing before any disk limit. Now rank 0 lists the folder, the files are split between the ranks balanced by size
(largest first, each to the least-loaded rank), each rank hashes (threads: xxhash releases the GIL on large
buffers) and fsyncs its share, and rank 0 merges the per-rank lists. XXH3-128 (the weight frames' checksum,
`server/codec.py`) runs at ~24 GB/s on one core here against SHA-256's ~1.7 GB/s, so reading the files is the cost.
The checksum guards against truncation and corruption, not tampering (a checkpoint is trusted input either way).

Format (readable JSON):
    {"step": 3, "hash": "xxh3_128",
     "files": {"model.safetensors": {"digest": "<hex>", "bytes": 123, "rank": 1}, ...}}
`rank` is the rank that hashed the file at save time. Manifests written before this format (`"files": {name:
"<sha256 hex>"}`, no `hash` key) verify with SHA-256, so existing checkpoints still resume.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash

from grpo_cli.config.errors import UserError
from grpo_cli.runtime.dist import DistInfo, all_gather_object, broadcast_object

MANIFEST = "MANIFEST.json"
HASH = "xxh3_128"
"""The checksum new manifests use."""
HASHES = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}
HASH_THREADS = 4
"""Files hashed at once within a rank: more requests in flight for the disk; beyond a few, the disk is the limit."""
_CHUNK = 512 << 10
"""Read size: a buffer under the 1 MiB mmap threshold fsdp2/ZeRO-3 set (`backends/cpu_heap.py`) comes from the heap;
an 8 MiB (mmap-backed) one read the page cache 2.5x slower there (0.065 vs 0.025 s for a 296 MB shard)."""


class CheckpointError(UserError):
    """A checkpoint is partial, corrupt, or belongs to a different run; the message says which file or field."""


def file_digest(path: Path, algo: str, *, fsync: bool = False) -> str:
    """Hex digest of `path` with `algo`; with `fsync`, also flush the file to disk (the same open file)."""
    h = HASHES[algo]()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            h.update(view[:n])
        if fsync:
            os.fsync(f.fileno())
    return h.hexdigest()


def split_by_size(sizes: dict[str, int], parts: int) -> list[list[str]]:
    """`sizes`' names in `parts` lists of near-equal total bytes: largest first, each to the least-loaded part
    (ties: the lower part, so equal per-rank shards `__0_0`, `__1_0`, … land on their own ranks). Deterministic."""
    loads, out = [0] * parts, [[] for _ in range(parts)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        i = min(range(parts), key=lambda j: (loads[j], j))
        out[i].append(name)
        loads[i] += sizes[name]
    return out


def _hash_share(folder: Path, names: list[str], algo: str, *, fsync: bool) -> tuple[dict[str, str], str | None]:
    """Digests of this rank's files, or the first error as text (so every rank learns of it, none waits)."""
    if not names:
        return {}, None
    try:
        with ThreadPoolExecutor(min(HASH_THREADS, len(names))) as pool:
            digests = list(pool.map(lambda n: file_digest(folder / n, algo, fsync=fsync), names))
    except OSError as exc:
        return {}, f"{type(exc).__name__}: {exc}"
    return dict(zip(names, digests, strict=True)), None


def _listing(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def write_manifest(folder: Path, *, step: int, info: DistInfo) -> None:
    """Collective, after every rank has written its files under `folder` (a barrier before): rank 0 lists the
    files, each rank hashes and fsyncs its share, rank 0 writes MANIFEST.json (fsynced) from the merged lists.
    Raises OSError on every rank when any rank could not read its share."""
    listing = broadcast_object(_listing(folder) if info.is_main else None, info)  # one view of the folder for all
    mine = split_by_size(listing, info.world_size)[info.rank]
    digests, error = _hash_share(folder, mine, HASH, fsync=True)
    shares = all_gather_object((digests, error), info)
    errors = [f"rank {r}: {e}" for r, (_, e) in enumerate(shares) if e]
    if errors:
        raise OSError(f"checkpoint {folder}: could not hash every file ({'; '.join(errors)})")
    if info.is_main:
        files = {name: {"digest": d, "bytes": listing[name], "rank": r}
                 for r, (share, _) in enumerate(shares) for name, d in share.items()}
        body = json.dumps({"step": step, "hash": HASH, "files": dict(sorted(files.items()))}, indent=2)
        with open(folder / MANIFEST, "w") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())


def read_manifest(path: Path) -> tuple[str, dict[str, dict]]:
    """(hash name, {file: {"digest", "bytes" (absent in old manifests)}}) of checkpoint `path`; raises ValueError
    for a manifest that is not one (unreadable JSON, unknown hash)."""
    raw = json.loads((path / MANIFEST).read_text())
    algo = raw.get("hash", "sha256")  # manifests without a `hash` key predate it: SHA-256, digests as strings
    if algo not in HASHES:
        raise ValueError(f"unknown checksum {algo!r} (this grpo-cli knows {sorted(HASHES)})")
    files = {n: (e if isinstance(e, dict) else {"digest": e}) for n, e in raw["files"].items()}
    return algo, files


def _plan(path: Path) -> dict:
    """Rank 0's view of what to verify: the manifest and each file's size on disk, or the first problem found."""
    if not (path / MANIFEST).exists():
        return {"error": f"{path} is a partial checkpoint (no {MANIFEST}); resume from an earlier one."}
    try:
        algo, files = read_manifest(path)
    except (ValueError, KeyError, AttributeError) as exc:
        return {"error": f"{path / MANIFEST} is unreadable ({exc}); resume from an earlier checkpoint."}
    sizes = {}
    for name, entry in files.items():
        f = path / name
        if not f.is_file():
            return {"error": f"{path} is missing {name}; the checkpoint is incomplete, use an earlier one."}
        sizes[name] = f.stat().st_size
        if entry.get("bytes", sizes[name]) != sizes[name]:
            return {"error": f"{f} is corrupt ({sizes[name]} bytes, the manifest says {entry['bytes']}); "
                             "resume from an earlier checkpoint."}
    return {"algo": algo, "files": files, "sizes": sizes}


def verify_manifest(path: Path, info: DistInfo) -> None:
    """Collective: check every file of checkpoint `path` against its manifest, each file hashed once by one rank
    (the shares balanced by size, in parallel), the result agreed by all. Raises the same message on every rank:
    the first bad file, in name order (CheckpointError)."""
    plan = broadcast_object(_plan(path) if info.is_main else None, info)
    if "error" in plan:
        raise CheckpointError(plan["error"])
    mine = split_by_size(plan["sizes"], info.world_size)[info.rank]
    digests, error = _hash_share(path, mine, plan["algo"], fsync=False)
    bad = [f"{path}: {error}"] if error else [
        f"{path / n} is corrupt (checksum mismatch); resume from an earlier checkpoint."
        for n in mine if digests[n] != plan["files"][n]["digest"]]
    found = sorted(msg for msgs in all_gather_object(bad, info) for msg in msgs)
    if found:
        more = f" ({len(found) - 1} more file(s) bad)" if len(found) > 1 else ""
        raise CheckpointError(found[0] + more)
