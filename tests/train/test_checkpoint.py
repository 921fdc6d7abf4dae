"""Checkpoints are atomic and verified: partial or corrupt ones never load, earlier ones survive failures."""

from __future__ import annotations

import dataclasses
import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from grpo_cli.config.load import build_config
from grpo_cli.train import checkpoint as ckpt
from grpo_cli.train.policy import load_policy


@pytest.fixture()
def setup(tiny_checkpoint):
    cfg = build_config(overrides=[f"model.name_or_path={tiny_checkpoint}"])
    return cfg, load_policy(cfg, tiny_checkpoint, device=torch.device("cpu"))


def _state(step):
    return {"step": step, "weight_version": step, "nonfinite_streak": 0, "skipped_steps": 0,
            "reward_history": [], "cursor": {"epoch": 0, "index": step}}


def test_roundtrip_restores_weights_optimizer_and_state(tmp_path, setup):
    cfg, policy = setup
    loss = policy.module(torch.tensor([[7, 8, 9]]), labels=torch.tensor([[7, 8, 9]])).loss
    loss.backward()
    policy.optimizer.step()
    policy.scheduler.step()
    path = ckpt.save_checkpoint(tmp_path, step=3, cfg=cfg, policy=policy, trainer_state=_state(3), keep_last=2)
    before = {k: v.clone() for k, v in policy.module.state_dict().items()}
    with torch.no_grad():
        for p in policy.module.parameters():
            p.add_(1.0)
    state = ckpt.load_checkpoint(path, cfg=cfg, policy=policy)
    assert state["cursor"] == {"epoch": 0, "index": 3}
    for k, v in policy.module.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert policy.scheduler.last_epoch == 1


def test_keep_last_prunes_and_latest_is_found(tmp_path, setup):
    cfg, policy = setup
    for step in (1, 2, 3):
        ckpt.save_checkpoint(tmp_path, step=step, cfg=cfg, policy=policy, trainer_state=_state(step), keep_last=2)
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-3"]
    assert ckpt.resolve_resume("auto", tmp_path).name == "checkpoint-3"


def test_disk_full_keeps_previous_checkpoint(tmp_path, setup, monkeypatch):
    cfg, policy = setup
    good = ckpt.save_checkpoint(tmp_path, step=1, cfg=cfg, policy=policy, trainer_state=_state(1), keep_last=2)

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt.torch, "save", full)
    with pytest.raises(OSError, match="No space"):
        ckpt.save_checkpoint(tmp_path, step=2, cfg=cfg, policy=policy, trainer_state=_state(2), keep_last=2)
    assert ckpt.resolve_resume("auto", tmp_path) == good
    assert not list(tmp_path.glob(".tmp-*"))
    monkeypatch.undo()
    ckpt.load_checkpoint(good, cfg=cfg, policy=policy)


def test_corrupt_or_partial_checkpoint_fails_loudly(tmp_path, setup):
    cfg, policy = setup
    path = ckpt.save_checkpoint(tmp_path, step=1, cfg=cfg, policy=policy, trainer_state=_state(1), keep_last=2)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ckpt.CheckpointError, match="model.safetensors is corrupt"):
        ckpt.load_checkpoint(path, cfg=cfg, policy=policy)
    (path / "MANIFEST.json").unlink()
    with pytest.raises(ckpt.CheckpointError, match="partial checkpoint"):
        ckpt.verify_checkpoint(path)
    assert ckpt.resolve_resume("auto", tmp_path) is None


def test_mismatched_config_is_refused(tmp_path, setup):
    cfg, policy = setup
    path = ckpt.save_checkpoint(tmp_path, step=1, cfg=cfg, policy=policy, trainer_state=_state(1), keep_last=2)
    other = build_config(overrides=[f"model.name_or_path={cfg.model.name_or_path}", "train.learning_rate=0.1"])
    with pytest.raises(ckpt.CheckpointError, match="different settings in: train"):
        ckpt.load_checkpoint(path, cfg=other, policy=policy)
    longer = build_config(overrides=[f"model.name_or_path={cfg.model.name_or_path}", "train.steps=999"])
    ckpt.load_checkpoint(path, cfg=longer, policy=policy)  # only train.steps changed: allowed


WRITER = """
import sys, torch
from grpo_cli.config.load import build_config
from grpo_cli.train import checkpoint as ckpt
from grpo_cli.train.policy import load_policy
cfg = build_config(overrides=[f"model.name_or_path={sys.argv[1]}"])
policy = load_policy(cfg, sys.argv[1], device=torch.device("cpu"))
state = lambda s: {"step": s, "weight_version": s, "nonfinite_streak": 0, "skipped_steps": 0, "reward_history": [],
                   "cursor": {"epoch": 0, "index": s}}
for step in range(1, 10_000):
    ckpt.save_checkpoint(__import__("pathlib").Path(sys.argv[2]), step=step, cfg=cfg, policy=policy,
                         trainer_state=state(step), keep_last=2)
    print(step, flush=True)
"""


def test_kill_during_checkpoint_writes_leaves_a_loadable_one(tmp_path, setup, tiny_checkpoint):
    cfg, policy = setup
    proc = subprocess.Popen([sys.executable, "-c", WRITER, tiny_checkpoint, str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
    first = next(line for line in proc.stdout if line.strip().isdigit())  # libraries may log to stdout first
    assert first.strip() == "1"
    time.sleep(0.7)  # several more saves are under way; kill lands at an arbitrary point of one
    os.kill(proc.pid, 9)
    proc.wait()
    latest = ckpt.resolve_resume("auto", tmp_path)
    assert latest is not None
    ckpt.load_checkpoint(latest, cfg=cfg, policy=policy)


def test_two_ranks_hash_their_share_once_and_restore_their_own_rng(tmp_path):
    """2 gloo processes: at save each rank hashes a share of the files (every file once, by one rank, both ranks
    busy); the resume hashes every file once in all (not each rank the whole checkpoint twice); each rank gets its
    own generators back (not rank 0's); a corrupted file in either rank's share fails on both ranks, named."""
    import json

    from dist_env import clean_env, free_port

    worker = str(Path(__file__).with_name("checkpoint_worker.py"))
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                    f"--master_port={free_port()}", "--master_addr=127.0.0.1", worker, str(tmp_path)],
                   check=True, timeout=300, env=clean_env(MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1"))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    files = ranks[0]["manifest_files"]
    assert {"shards/__0_0.bin", "shards/__1_0.bin", "optimizer.pt", "rng-0.pt", "rng-1.pt",
            "trainer_state.json"} <= set(files)
    manifest = json.loads((tmp_path / "run" / "checkpoint-3" / "MANIFEST.json").read_text())
    assert manifest["hash"] == "xxh3_128"
    for phase in ("saved", "resumed"):
        done = ranks[0][phase] + ranks[1][phase]
        assert sorted(done) == files, phase  # every file exactly once, across the ranks
        assert ranks[0][phase] and ranks[1][phase], phase  # both ranks hashed
    assert {n: e["rank"] for n, e in manifest["files"].items()} == {
        n: r for r in range(2) for n in ranks[r]["saved"]}
    assert [r["rng_restored"] for r in ranks] == [True, True]
    assert ranks[0]["errors"].keys() == {ranks[0]["resumed"][0], ranks[1]["resumed"][0]}
    for name, error in ranks[0]["errors"].items():
        assert f"{name} is corrupt (checksum mismatch)" in error, error
        assert ranks[1]["errors"][name] == error  # the same error on both ranks: neither waits for the other


def test_cuda_generator_is_saved_and_restored(tmp_path, setup, monkeypatch):
    """On CUDA the device's generator (dropout draws from it) is saved and restored with the CPU ones (CUDA calls
    faked: the branch runs on CPU)."""
    cfg, policy = setup
    restored = []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda d: torch.tensor([d.index, 42], dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, d: restored.append((s.tolist(), d)))
    on_cuda = dataclasses.replace(policy, device=torch.device("cuda", 1))
    path = ckpt.save_checkpoint(tmp_path, step=1, cfg=cfg, policy=on_cuda, trainer_state=_state(1), keep_last=2)
    assert torch.load(path / "rng-0.pt", weights_only=True)["cuda"].tolist() == [1, 42]
    ckpt.load_checkpoint(path, cfg=cfg, policy=on_cuda)
    assert restored == [([1, 42], torch.device("cuda", 1))]


def test_checkpoint_with_sha256_manifest_and_one_rng_file_still_loads(tmp_path, setup):
    """Checkpoints written before the XXH3 manifest and per-rank RNG files (`files: {name: sha256}`, rng.pt)
    verify with SHA-256 and resume; corruption in them is still caught."""
    import hashlib
    import json

    cfg, policy = setup
    path = ckpt.save_checkpoint(tmp_path, step=1, cfg=cfg, policy=policy, trainer_state=_state(1), keep_last=2)
    (path / "rng-0.pt").rename(path / "rng.pt")
    files = {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
             for p in sorted(path.rglob("*")) if p.is_file() and p.name != "MANIFEST.json"}
    (path / "MANIFEST.json").write_text(json.dumps({"step": 1, "files": files}))
    draws = torch.rand(3)
    ckpt.load_checkpoint(path, cfg=cfg, policy=policy)
    torch.rand(1)
    ckpt.load_checkpoint(path, cfg=cfg, policy=policy)
    assert torch.equal(torch.rand(3), draws)  # rng.pt's CPU state
    state = path / "scheduler.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
    state.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match="scheduler.pt is corrupt"):
        ckpt.verify_checkpoint(path)


def test_resume_hashes_each_file_once(tmp_path, monkeypatch):
    """`grpo train --set checkpoint.resume=auto` reads the checkpoint's bytes for hashing once (it verified before
    loading, and then again inside the load)."""
    from grpo_cli.train import manifest
    from grpo_cli.train.run import run_training

    base = ["train.steps=1", "train.prompts_per_step=2", "train.generations_per_prompt=2", "train.micro_batch_size=4",
            "rollout.max_completion_length=4", "eval.every_steps=0"]
    run_training(build_config(overrides=base), output_dir=str(tmp_path))
    saved = tmp_path / "checkpoint-1"
    files = sorted(manifest.read_manifest(saved)[1])
    hashed = []
    digest = manifest.file_digest
    monkeypatch.setattr(manifest, "file_digest", lambda p, *a, **k: hashed.append(Path(p)) or digest(p, *a, **k))
    summary = run_training(build_config(overrides=[*base, "train.steps=2", "checkpoint.resume=auto"]),
                           output_dir=str(tmp_path))
    assert summary["steps"] == 2
    assert sorted(str(p.relative_to(saved)) for p in hashed if saved in p.parents) == files


def test_rng_files_load_without_unpickling_code(tmp_path, setup):
    """Every generator (Python, NumPy, torch) resumes exactly from a file `torch.load(weights_only=True)` reads; a
    file that needs the unrestricted unpickler (the old format, or a crafted one that would run code) is refused
    with a CheckpointError naming it, and its code never runs."""
    import os
    import pickle
    import random

    import numpy as np

    cfg, policy = setup
    path = ckpt.save_checkpoint(tmp_path, step=1, cfg=cfg, policy=policy, trainer_state=_state(1), keep_last=2)
    draws = (random.random(), np.random.rand(), torch.rand(1).item())
    ckpt.set_rng_state(ckpt.load_rng_file(path / "rng-0.pt"), policy.device)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == draws

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    crafted = tmp_path / "rng-crafted.pt"
    with open(crafted, "wb") as f:
        pickle.dump({"python": Payload()}, f)
    with pytest.raises(ckpt.CheckpointError, match="rng-crafted.pt is not a random-generator file this version"):
        ckpt.load_rng_file(crafted)
    assert not (tmp_path / "pwned").exists()


def _old_format_rng(path: Path) -> None:
    """An RNG file as grpo-cli wrote it before: the generators' own state objects, pickled (NumPy's holds an array)."""
    import random

    import numpy as np

    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}, path)


@pytest.mark.parametrize("kind", ["crafted", "old format", "damaged", "other layout"])
def test_resume_from_an_unsafe_rng_file_is_exit_2_before_any_model_loads(tmp_path, setup, tiny_checkpoint,
                                                                        monkeypatch, kind):
    """`grpo train --set checkpoint.resume=FOLDER` on a checkpoint whose RNG file needs the unrestricted unpickler
    (a crafted one, torch.save's zip format with a manifest rehashed to match: the checksums prove nothing) or is
    not one this version wrote: exit 2 with one paragraph and the way out, checked before any model is built, and
    the file's code never runs."""
    from typer.testing import CliRunner

    from grpo_cli.cli.main import app
    from grpo_cli.runtime.dist import DistInfo
    from grpo_cli.train import manifest, run

    cfg, policy = setup
    path = ckpt.save_checkpoint(tmp_path / "run", step=1, cfg=cfg, policy=policy, trainer_state=_state(1), keep_last=2)
    rng = path / "rng-0.pt"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    if kind == "crafted":
        torch.save({"python": Payload(), "numpy": {}, "torch": torch.zeros(1)}, rng)
    elif kind == "old format":
        _old_format_rng(rng)
    elif kind == "damaged":
        rng.write_bytes(b"")
    else:
        torch.save({"python": [1, 2]}, rng)
    (path / manifest.MANIFEST).unlink()
    manifest.write_manifest(path, step=1, info=DistInfo())
    monkeypatch.setattr(run, "build_trainer", lambda *a, **k: pytest.fail("a model was built"))
    result = CliRunner().invoke(app, ["train", "--set", f"model.name_or_path={tiny_checkpoint}", "--set",
                                      f"checkpoint.resume={path}", "--output-dir", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    assert "rng-0.pt is not a random-generator file this version can read safely" in result.output
    assert "Resume from a checkpoint this version wrote" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "pwned").exists()
