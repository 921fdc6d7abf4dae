"""A discrete-event simulator of three GRPO rollout/train schedules on N rollout engines and M training GPUs:
`sync` (generate a step's groups, train, sync), `async` (grpo-cli's `rollout.mode: async`, train/pipeline.py: batch
k+1 generates while step k trains) and `stream` (a pool of groups always generating, weights landing in flight).

Run: `python -m benchmarks.pipeline_sim [INPUTS.json] [--set workload.max_version_lag=4 ...]` (the
fields of `benchmarks.sim_core.Hardware` and `Workload`; writes benchmarks/results/pipeline_sim.json);
`benchmarks/pipeline_projection.py` runs it on published GPU rates.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

from benchmarks.sim_core import INF, Engine, Group, Hardware, Seq, Sim, Workload

__all__ = ["Hardware", "Workload", "SCHEDULES", "simulate", "table"]


# ------------------------------------------------------------------------------------------------ schedules
def spread(sim: Sim, groups: list[Group]) -> list[list[Seq]]:
    """A batch's groups split over the engines in equal contiguous chunks (the Ray manager's `submit`)."""
    n = len(sim.engines)
    per = math.ceil(len(groups) / n)
    return [[s for g in groups[i * per:(i + 1) * per] for s in g.seqs] for i in range(n)]


class SyncSchedule:
    """Server mode: generate every group of the step, train on them, push the weights (engines idle), repeat."""

    name = "sync"

    def start(self, sim: Sim) -> None:
        self.batch = [sim.new_group() for _ in range(sim.w.prompts_per_step)]
        self.left = sum(len(g.seqs) for g in self.batch)
        for e, seqs in zip(sim.engines, spread(sim, self.batch)):
            e.add(seqs)

    def seq_done(self, sim: Sim, e: Engine, s: Seq) -> None:
        self.left -= 1
        if self.left == 0:
            seconds = sim.train_seconds(self.batch)
            sim.train_busy += seconds
            sim.account(self.batch, sim.version)
            sim.at(sim.now + seconds, lambda: self._sync(sim))

    def _sync(self, sim: Sim) -> None:
        sim.pause_for_sync(lambda: self._synced(sim))

    def _synced(self, sim: Sim) -> None:
        if not sim.finish_step():
            self.start(sim)


class AsyncSchedule:
    """train/pipeline.py: at step k the batches up to k + s (s = max_version_lag, i.e. rollout.max_staleness) are
    submitted with the current weights; each engine runs its queue in order (a Ray actor: one batch at a time, the
    weight load queued behind the generations submitted before it); the trainer waits for batch k, trains, pushes
    (its own sync_s), and the engines load the push (sync_s each) when they reach it in their queue."""

    name = "async"

    def start(self, sim: Sim) -> None:
        n = len(sim.engines)
        self.queues: list[list] = [[] for _ in range(n)]
        self.current: list[int] = [0] * n  # sequences left of the item an engine runs (-1: loading weights)
        self.batches: dict[int, dict] = {}
        self.submitted = 0
        self.training = False
        self._top_up(sim, 0)

    def _top_up(self, sim: Sim, step: int) -> None:
        last = min(step + sim.w.max_version_lag, sim.w.steps - 1)
        while self.submitted <= last:
            groups = [sim.new_group() for _ in range(sim.w.prompts_per_step)]
            for g in groups:
                g.tag = self.submitted
            self.batches[self.submitted] = {"groups": groups, "left": sum(len(g.seqs) for g in groups)}
            for q, seqs in zip(self.queues, spread(sim, groups)):
                q.append(("gen", seqs))
            self.submitted += 1
        for i in range(len(sim.engines)):
            self._kick(sim, i)

    def _kick(self, sim: Sim, i: int) -> None:
        while self.current[i] == 0 and self.queues[i]:
            kind, arg = self.queues[i].pop(0)
            if kind == "gen":
                self.current[i] = len(arg)
                sim.engines[i].add(arg)
            else:
                self.current[i] = -1
                sim.engines[i].pause(sim.now, sim.hw.sync_s)
                sim.at(sim.now + sim.hw.sync_s, lambda i=i, v=arg: self._loaded(sim, i, v))

    def _loaded(self, sim: Sim, i: int, version: int) -> None:
        sim.engines[i].set_version(version)
        self.current[i] = 0
        self._kick(sim, i)

    def seq_done(self, sim: Sim, e: Engine, s: Seq) -> None:
        self.current[e.index] -= 1
        self.batches[s.group.tag]["left"] -= 1
        self._kick(sim, e.index)
        self._maybe_train(sim)

    def _maybe_train(self, sim: Sim) -> None:
        batch = self.batches.get(sim.trained_steps)
        if self.training or batch is None or batch["left"]:
            return
        self.training = True
        seconds = sim.train_seconds(batch["groups"])
        sim.train_busy += seconds
        sim.account(batch["groups"], sim.version)
        sim.at(sim.now + seconds + sim.hw.sync_s, lambda: self._pushed(sim))

    def _pushed(self, sim: Sim) -> None:
        sim.version += 1
        for i in range(len(sim.engines)):
            self.queues[i].append(("load", sim.version))
            self._kick(sim, i)
        del self.batches[sim.trained_steps]
        sim.step_ends.append(sim.now)
        sim.trained_steps += 1
        self.training = False
        if sim.trained_steps == sim.w.steps:
            sim.done = True
            return
        self._top_up(sim, sim.trained_steps)
        self._maybe_train(sim)


class StreamSchedule:
    """rollout.mode: stream. Up to max_in_flight groups generate at all times, each started on the engine with the
    fewest groups in flight; a finished group goes to the buffer (oldest first out); new groups start while the
    buffer holds fewer than max_buffered. The trainer takes prompts_per_step groups as soon as the buffer has them,
    dropping a group with a token more than max_version_lag versions behind; at the sync the engines pause with
    their requests kept (sync_s), then continue under the new weights. A group in flight that already holds a token
    too old for the new weights is aborted at once (it could only be dropped later) and counted as dropped. As the
    pool does (`train/stream_pool.StreamPipeline._room`), a group starts only if it can train within the lag bound:
    behind `ahead` pending groups it trains at the next take's version + ahead // prompts_per_step, and its first
    token is at least the version pushed now."""

    name = "stream"

    def start(self, sim: Sim) -> None:
        self.in_flight: list[Group] = []
        self.per_engine = [0] * len(sim.engines)
        self.buffer: list[Group] = []
        self.cap = sim.w.max_buffered or sim.w.prompts_per_step
        self.training = False
        self.peak_in_flight = 0
        self._fill(sim)

    def _fill(self, sim: Sim) -> None:
        while (len(self.in_flight) < sim.w.max_in_flight and len(self.buffer) < self.cap and not sim.done
               and self._admits(sim)):
            g = sim.new_group()
            i = min(range(len(sim.engines)), key=lambda k: (self.per_engine[k], k))
            g.tag = i
            self.per_engine[i] += 1
            self.in_flight.append(g)
            sim.engines[i].add(g.seqs)
        self.peak_in_flight = max(self.peak_in_flight, len(self.in_flight))

    def seq_done(self, sim: Sim, e: Engine, s: Seq) -> None:
        g = s.group
        g.left -= 1
        if g.left == 0:
            self.in_flight.remove(g)
            self.per_engine[g.tag] -= 1
            self.buffer.append(g)
            self._maybe_train(sim)
            self._fill(sim)

    def _admits(self, sim: Sim) -> bool:
        next_take = sim.version + 1 if self.training else sim.version
        ahead = len(self.buffer) + len(self.in_flight)
        return next_take + ahead // sim.w.prompts_per_step - sim.version <= sim.w.max_version_lag

    @staticmethod
    def _first_version(e: Engine, s: Seq) -> float:
        """The weight version of a sequence's first sampled token (inf: none sampled yet)."""
        if s.done:
            return min((v for v, n in s.versions.items() if n > 1e-9), default=INF)
        if s in e.waiting or e.clock <= s.start:
            return INF
        return e.version_at(s.start)

    def _lag(self, sim: Sim, g: Group) -> int:
        return max((sim.version - v for s in g.seqs for v, n in s.versions.items() if n > 1e-9), default=0)

    def _maybe_train(self, sim: Sim) -> None:
        if self.training:
            return
        fresh = [g for g in self.buffer if self._lag(sim, g) <= sim.w.max_version_lag]
        sim.dropped += len(self.buffer) - len(fresh)
        self.buffer = fresh
        if len(self.buffer) < sim.w.prompts_per_step:
            return
        batch, self.buffer = self.buffer[:sim.w.prompts_per_step], self.buffer[sim.w.prompts_per_step:]
        self.training = True
        seconds = sim.train_seconds(batch)
        sim.train_busy += seconds
        sim.account(batch, sim.version)
        sim.at(sim.now + seconds, lambda: self._sync(sim))
        self._fill(sim)

    def _sync(self, sim: Sim) -> None:
        sim.pause_for_sync(lambda: self._synced(sim))

    def _synced(self, sim: Sim) -> None:
        self.training = False
        if sim.finish_step():
            return
        for g in list(self.in_flight):
            e = sim.engines[g.tag]
            oldest = min((self._first_version(e, s) for s in g.seqs), default=sim.version)
            if sim.version - oldest > sim.w.max_version_lag:
                for s in g.seqs:
                    e.abort(s)
                self.in_flight.remove(g)
                self.per_engine[g.tag] -= 1
                sim.dropped += 1
        self._maybe_train(sim)
        self._fill(sim)


SCHEDULES = {"sync": SyncSchedule, "async": AsyncSchedule, "stream": StreamSchedule}


def simulate(hw: Hardware, w: Workload, schedules=tuple(SCHEDULES)) -> dict[str, dict]:
    out = {}
    for name in schedules:
        sim = Sim(hw, w)
        sched = SCHEDULES[name]()
        out[name] = sim.run(sched)
        if name == "stream":
            out[name]["peak_in_flight"] = sched.peak_in_flight
    return out


def table(results: dict[str, dict]) -> str:
    head = ["schedule", "tokens/s", "tokens/s/GPU", "step s", "engine idle", "trainer idle", "lag mean/max",
            "dropped"]
    rows = [head] + [[r["schedule"], f"{r['tokens_per_s']:.4g}", f"{r['tokens_per_s_per_gpu']:.4g}",
                      f"{r['step_s_median']:.4g}", f"{r['engine_idle_frac']:.1%}", f"{r['trainer_idle_frac']:.1%}",
                      f"{r['version_lag_mean']:.2f}/{r['version_lag_max']}", str(r["dropped_groups"])]
                     for r in results.values()]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows)


DEFAULTS = {
    "hardware": {"rollout_engines": 1, "train_gpus": 1, "decode_fixed_s": 0.005, "decode_per_seq_s": 0.0002,
                 "train_s_per_token": 2e-5, "sync_s": 0.05},
    "workload": {"steps": 12, "prompts_per_step": 4, "generations": 4, "prompt_len": 10, "max_in_flight": 8,
                 "max_version_lag": 2, "lengths": {"kind": "lognormal", "median": 30, "sigma": 1.0, "max": 400}},
}
"""A small heavy-tailed case (the tests' shape) for a run without inputs."""


def inputs(path: str | None, sets: list[str]) -> tuple[Hardware, Workload]:
    """DEFAULTS, overlaid by the JSON file, overlaid by `--set section.field=JSON` flags."""
    spec = json.loads(json.dumps(DEFAULTS))
    if path:
        with open(path) as f:
            for section, fields in json.load(f).items():
                spec.setdefault(section, {}).update(fields)
    for item in sets:
        key, _, value = item.partition("=")
        section, _, name = key.partition(".")
        if section not in spec or not name or not value:
            print(f"--set {item!r}: write --set hardware.FIELD=VALUE or --set workload.FIELD=VALUE "
                  "(VALUE in JSON, e.g. --set workload.lengths='{\"kind\": \"fixed\", \"value\": 50}')",
                  file=sys.stderr)
            raise SystemExit(2)
        spec[section][name] = json.loads(value)
    return Hardware(**spec["hardware"]), Workload(**spec["workload"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("inputs", nargs="?", help='JSON file: {"hardware": {Hardware fields}, "workload": {Workload '
                    'fields}}; fields left out keep DEFAULTS')
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=JSON",
                    help="override one field, e.g. --set hardware.sync_s=2 --set workload.max_version_lag=4")
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "pipeline_sim.json"))
    args = ap.parse_args()
    hw, w = inputs(args.inputs, args.set)
    results = simulate(hw, w, args.schedules)
    print(table(results))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"hardware": asdict(hw), "workload": asdict(w), "results": results},
                                         indent=1))
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
