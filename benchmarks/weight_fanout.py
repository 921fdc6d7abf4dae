"""Weight fan-out: seconds per sync of the ~100M random Llama (benchmarks/weight_sync.py builds it) to 1 and to 4
`grpo serve-rollout` servers (hf engine) on loopback, per transport and fan-out: `http` relay (the default: one
upload, each server forwards to the next), `http` direct (one upload per server) and `shm` (one file all map).
Configurations take turns within each round, so a machine whose load changes weighs on all alike; `x1` is the
median over the same transport's median with 1 server (the goal: relay ≤ 1.5). Printed as a table and written to
`benchmarks/results/weight_fanout.json`. Run: `python -m benchmarks.weight_fanout [--repeats N] [--servers K]`.

Beside each time, the CPU seconds one sync took in the trainer (this process) and in the servers (/proc/PID/stat),
medians, and the floor they set on this machine: (trainer + servers) / the cores this process may run on, the
shortest the sync could take if all of that work ran in parallel (`floor x1`: over the 1-server time). On a machine
whose cores the servers share, a `floor x1` above the goal means the goal cannot be met there."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.weight_sync import build_100m, start_server

RESULTS = Path(__file__).parent / "results" / "weight_fanout.json"


def measure(model: Path, servers: int, repeats: int, chunk_mb: int) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    from grpo_cli.rollout.remote.client import ServerEngine

    procs, urls = zip(*(start_server(model) for _ in range(servers)), strict=True)
    times: dict[tuple[str, str, int], list[float]] = {}
    cpu: dict[tuple[str, str, int], list[tuple[float, float]]] = {}
    try:
        trainer = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        nbytes = sum(p.numel() * p.element_size() for p in trainer.parameters())
        keys = [("http", "relay", 1), ("http", "relay", servers), ("http", "direct", servers), ("shm", "relay", 1),
                ("shm", "relay", servers)]  # http direct with 1 server is the same upload as relay with 1
        engines = {(t, f, k): ServerEngine(list(urls[:k]), chunk_mb=chunk_mb, transport=t, relay=f == "relay")
                   for t, f, k in keys}
        version = 0
        for _ in range(repeats):
            for key, eng in engines.items():
                version += 1
                served, own = cpu_seconds(procs[: key[2]]), time.process_time()  # read before the clock starts
                start = time.perf_counter()
                eng.update_weights(trainer.named_parameters(), version)
                times.setdefault(key, []).append(time.perf_counter() - start)
                cpu.setdefault(key, []).append((time.process_time() - own, cpu_seconds(procs[: key[2]]) - served))
        for eng in engines.values():
            eng.close()
    finally:
        for p in procs:
            p.kill()
            p.wait()
    rows = []
    cores = len(os.sched_getaffinity(0))
    for (transport, fanout, k), ts in times.items():
        steady = sorted(ts[1:] or ts)
        trainer_cpu, servers_cpu = (statistics.median(c[i] for c in cpu[transport, fanout, k][1:]) for i in (0, 1))
        rows.append({"transport": transport, "fanout": fanout, "servers": k, "bytes": nbytes, "repeats": repeats,
                     "seconds_median": steady[len(steady) // 2], "seconds_all": ts, "trainer_cpu_s": trainer_cpu,
                     "servers_cpu_s": servers_cpu, "cpu_floor_s": (trainer_cpu + servers_cpu) / cores})
    one = {r["transport"]: r["seconds_median"] for r in rows if r["servers"] == 1}
    for r in rows:
        r["x1"] = r["seconds_median"] / one[r["transport"]]
        r["floor_x1"] = r["cpu_floor_s"] / one[r["transport"]]
    return rows


def cpu_seconds(procs) -> float:
    """User + system CPU seconds the processes `procs` (all their threads) have used so far: /proc/PID/stat's
    utime and stime, the 14th and 15th fields."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for proc in procs:
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--servers", type=int, default=4)
    ap.add_argument("--chunk-mb", type=int, default=128)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_100m(Path(tmp) / "l100m")
        load_before = os.getloadavg()
        rows = measure(model, args.servers, args.repeats, args.chunk_mb)
        load_after = os.getloadavg()
    print(f"{'transport':>9} {'fan-out':>8} {'servers':>7} {'MB':>7} {'s median':>9} {'x1':>6} {'trainer cpu s':>13} "
          f"{'servers cpu s':>13} {'cpu floor s':>11} {'floor x1':>8}")
    for r in rows:
        print(f"{r['transport']:>9} {r['fanout']:>8} {r['servers']:>7} {r['bytes'] / 2**20:>7.1f} "
              f"{r['seconds_median']:>9.3f} {r['x1']:>6.2f} {r['trainer_cpu_s']:>13.3f} {r['servers_cpu_s']:>13.3f} "
              f"{r['cpu_floor_s']:>11.3f} {r['floor_x1']:>8.2f}")
    print(f"load average (1, 5, 15 min) before {load_before}, after {load_after}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"what": "random Llama ~100M, fp32, hf engine servers on 127.0.0.1",
                                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                    "load_average_before": load_before, "load_average_after": load_after,
                                    "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                                "platform": platform.platform()}, "results": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
