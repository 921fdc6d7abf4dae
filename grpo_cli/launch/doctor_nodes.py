"""`grpo doctor --mode multi-node`: what one node can check of a multi-node job: every node's manifest in the shared
directory (same grpo-cli, Python, torch, model), the rendezvous port reachable, the shared directory writable, and
NCCL/Gloo interface advice."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path

import grpo_cli


@dataclass
class Check:
    """One line of the report: `ok` False fails the command (exit 1)."""

    name: str
    ok: bool
    detail: str


def model_fingerprint(name_or_path: str) -> str:
    """A short hash of a local checkpoint's config.json and weight files' names and sizes: a folder, a built-in, or a
    hub id already in the local Hugging Face cache ('missing' otherwise; nothing is downloaded)."""
    from grpo_cli.models.tiny import resolve_model_path

    path = Path(resolve_model_path(name_or_path))
    if not path.is_dir():
        try:
            from huggingface_hub import snapshot_download

            path = Path(snapshot_download(name_or_path, local_files_only=True))
        except Exception:  # not cached, not a repo id: reported as missing
            return "missing"
    if not (path / "config.json").is_file():
        return "missing"
    h = hashlib.sha256((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


def manifest(model: str) -> dict[str, str]:
    """What this node runs: host, grpo-cli, Python, torch, and the model's fingerprint."""
    from importlib.metadata import version

    return {"host": socket.gethostname(), "grpo_cli": grpo_cli.__version__, "python": platform.python_version(),
            "torch": version("torch"), "model": model, "model_fingerprint": model_fingerprint(model)}


def write_manifest(path: Path, model: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest(model), indent=1))


def _compare_manifests(shared: Path) -> Check:
    files = sorted((shared / "manifests").glob("*.json"))
    if not files:
        return Check("manifests", False, f"no node manifest in {shared / 'manifests'}: the rendered script writes one "
                                         "per node (`grpo doctor --mode multi-node --write-manifest`)")
    seen = {f.stem: json.loads(f.read_text()) for f in files}
    diffs = []
    for key in ("grpo_cli", "python", "torch", "model", "model_fingerprint"):
        values = {node: m.get(key) for node, m in seen.items()}
        if len(set(values.values())) > 1:
            diffs.append(f"{key} differs: " + ", ".join(f"{n}={v}" for n, v in values.items()))
    missing = [n for n, m in seen.items() if m.get("model_fingerprint") == "missing"]
    if missing:
        diffs.append(f"model not found locally on {', '.join(missing)}")
    return Check("manifests", not diffs, "; ".join(diffs) or f"{len(seen)} nodes agree ({', '.join(seen)})")


def _writable(shared: Path) -> Check:
    probe = shared / f".doctor-{uuid.uuid4().hex}"
    try:
        shared.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        return Check("shared dir", False, f"{shared} is not writable: {exc}")
    return Check("shared dir", True, f"{shared} is writable")


def _port(addr: str, port: int) -> Check:
    try:
        with socket.create_connection((addr, port), timeout=3):
            return Check("rendezvous", True, f"{addr}:{port} accepts connections (a rendezvous is listening)")
    except OSError as exc:
        if addr in ("127.0.0.1", "localhost") or addr == socket.gethostname():
            return Check("rendezvous", True, f"{addr}:{port} is this node's; nothing listens yet ({exc.strerror})")
        reach = "refused: the host is reachable, start node 0 first" if isinstance(exc, ConnectionRefusedError) else (
            f"unreachable ({exc}): check the address and the firewall")
        return Check("rendezvous", isinstance(exc, ConnectionRefusedError), f"{addr}:{port} {reach}")


def interface_advice() -> Check:
    """Which interface NCCL and Gloo will use: unset variables let them pick, often a docker or loopback one."""
    names = sorted(n for _, n in socket.if_nameindex())
    set_ = {k: os.environ[k] for k in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME") if k in os.environ}
    if len(set_) == 2:
        return Check("interfaces", True, ", ".join(f"{k}={v}" for k, v in set_.items()))
    return Check("interfaces", True, "advice: set NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME to the interface the "
                 f"nodes share (this node has {', '.join(names)}), else they may pick a docker or loopback one")


def multi_node_checks(shared: Path, master_addr: str | None, master_port: int) -> list[Check]:
    checks = [_writable(shared), _compare_manifests(shared)]
    if master_addr:
        checks.append(_port(master_addr, master_port))
    return [*checks, interface_advice()]
