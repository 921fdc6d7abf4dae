"""Per-process peak memory of the training backends on a ~50M-parameter model: ddp vs fsdp2 vs DeepSpeed ZeRO-3.

Each backend runs in fresh `torchrun` processes (2 gloo ranks on CPU): load the policy through the backend, take
`--steps` AdamW steps on a fixed random batch, then report every rank's peak RSS (`getrusage`), the parameter
elements it holds and its weights + gradients + optimizer bytes, beside what `grpo plan` predicts for them.

Run: `python -m benchmarks.sharding_memory [--size 50m] [--steps 2] [--backends ddp fsdp2 zero3]`.
Results: `benchmarks/results/sharding_memory.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.compare import RESULTS_DIR, build_checkpoint, fmt_table, machine_info

BACKENDS = {
    "ddp": ["rollout.engine=vllm"],
    "fsdp2": ["distributed.backend=fsdp2", "rollout.engine=vllm"],
    "zero3": ["distributed.backend=deepspeed", "distributed.deepspeed.zero_stage=3", "rollout.engine=vllm"],
}


def worker(ckpt: str, out_dir: str, steps: int, overrides: list[str]) -> None:
    """One rank: load through the backend, train `steps` steps on a fixed batch, print this rank's numbers."""
    import torch

    from grpo_cli.config.load import build_config
    from grpo_cli.config.plan import model_shape, training_state_bytes
    from grpo_cli.launch.dist import all_reduce_sum, init_from_env
    from grpo_cli.train.batch import TrainBatch
    from grpo_cli.train.policy import load_policy
    from grpo_cli.train.step import optimizer_step

    info = init_from_env(torch.device("cpu"), timeout_minutes=10)
    cfg = build_config(overrides=[f"model.name_or_path={ckpt}", f"distributed.num_processes={info.world_size}",
                                  "train.micro_batch_size=4", "train.prompts_per_step=2",
                                  "train.generations_per_prompt=4", *overrides])
    policy = load_policy(cfg, ckpt, device=torch.device("cpu"), info=info)
    after_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    g = torch.Generator().manual_seed(0)
    rows, prompt, completion = 4, 16, 16
    ids = torch.randint(6, policy.module.config.vocab_size, (rows, prompt + completion), generator=g)
    cmask = torch.ones(rows, completion)
    batch = TrainBatch(ids, torch.ones_like(ids), cmask, advantages=torch.randn(rows, generator=g),
                       sampler_logprobs=-torch.rand(rows, completion, generator=g))
    for _ in range(steps):
        num_items = all_reduce_sum(float(cmask.sum()), info)
        optimizer_step(policy, batch, cfg, num_items=num_items, num_sequences=rows * info.world_size)
    local, total = policy.backend.param_numel()
    plan = training_state_bytes(cfg, model_shape(ckpt).params)
    (Path(out_dir) / f"rank{info.rank}.json").write_text(json.dumps({"rank": info.rank, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                             / 1024, "peak_after_load_mb": after_load, "param_numel_local": local,
                             "param_numel_total": total, "plan_state_mb": sum(plan.values()) / 2**20}))


def run_backend(ckpt: str, name: str, steps: int, out_dir: Path) -> list[dict]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "MASTER_ADDR": "127.0.0.1", "DS_ACCELERATOR": "cpu"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
           "-m", "benchmarks.sharding_memory", "--worker", ckpt, str(out_dir), str(steps), *BACKENDS[name]]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"{name} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="50m")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt, params = build_checkpoint(args.size, Path(tmp))
        results = {}
        for name in args.backends:
            (Path(tmp) / name).mkdir()
            results[name] = run_backend(ckpt, name, args.steps, Path(tmp) / name)
    rows = [["backend", "params held / total", "peak RSS rank 0 (MB)", "peak RSS rank 1 (MB)",
             "plan: weights+grads+optimizer per rank (MB)"]]
    for name, ranks in results.items():
        r0 = ranks[0]
        rows.append([name, f"{r0['param_numel_local'] / r0['param_numel_total']:.2f}",
                     *(f"{r['peak_rss_mb']:.0f}" for r in ranks), f"{r0['plan_state_mb']:.0f}"])
    print(f"{args.size} model ({params / 1e6:.1f}M parameters), 2 gloo processes, {args.steps} AdamW steps\n")
    print(fmt_table(rows))
    RESULTS_DIR.mkdir(exist_ok=True)
    out = RESULTS_DIR / "sharding_memory.json"
    out.write_text(json.dumps({"size": args.size, "params": params, "steps": args.steps, "results": results,
                               "machine": machine_info()}, indent=2))
    print(f"\nwritten: {out}")


if __name__ == "__main__":
    main()
