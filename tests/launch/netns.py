"""Two network namespaces joined by a veth pair, each with its own address: two "hosts" on one machine for the
multi-node tests (the sessions and CI run as root). Traffic stays inside the namespaces the test made."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


def make_namespaces(tag: str, subnet: str = "10.231.7") -> tuple[list[str], list[str]] | None:
    """Two namespaces joined by a veth pair: ([addresses], [namespace names]); None where they cannot be made."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        return None
    names, addrs = [f"grpo{tag}n0", f"grpo{tag}n1"], [f"{subnet}.1", f"{subnet}.2"]
    try:
        for ns in names:
            _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", f"vg{tag}a", "type", "veth", "peer", "name", f"vg{tag}b")
        for ns, dev, addr in zip(names, (f"vg{tag}a", f"vg{tag}b"), addrs):
            _run("ip", "link", "set", dev, "netns", ns)
            _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _run("ip", "-n", ns, "link", "set", dev, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", ns, "route", "add", "default", "dev", dev)  # a host's own address is found by its route
    except (subprocess.CalledProcessError, OSError):
        drop_namespaces(names)
        return None
    return addrs, names


def drop_namespaces(names: list[str]) -> None:
    for ns in names:
        pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
        for pid in pids:  # only processes this test started can live in a namespace it made
            os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
