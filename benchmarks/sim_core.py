"""The parts of `benchmarks/pipeline_sim.py`'s discrete-event simulator: its inputs (hardware rates, workload), the
rollout engine model and the event loop; the schedules that drive them live in pipeline_sim.py.

Pure Python, deterministic: the completion lengths are drawn once from a seeded RNG, group by group, so every
schedule sees the same groups in the same order. The engine model is batched decode as a fluid: with `c` sequences
decoding, one decode step (one token for each of them) takes `decode_fixed_s + decode_per_seq_s * c`; all sequences
on an engine advance together, so the simulator jumps from one event (a sequence ends, a prefill ends, a pause ends,
the trainer finishes) to the next. A group's prompt is prefilled once (its G samples share it, vLLM's prefix cache).
`benchmarks/pipeline_projection.py` feeds it published GPU rates; `benchmarks/stream_mode.py` feeds it CPU
measurements and checks it against them.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
import statistics
from dataclasses import dataclass, field

INF = float("inf")


@dataclass(frozen=True)
class Hardware:
    """Rates of one rollout engine and one training GPU, and how many of each."""

    rollout_engines: int
    train_gpus: int
    decode_fixed_s: float
    """Time of one decode step of an engine that does not grow with the sequences in it (weights read once)."""
    decode_per_seq_s: float
    """What each concurrent sequence adds to a decode step (its KV reads, its share of the matmuls)."""
    train_s_per_token: float
    """Seconds one training GPU spends per trained token (prompt + completion; logprob recompute, forward,
    backward, optimizer step), so a step of T tokens trains in T * this / train_gpus."""
    sync_s: float
    """A weight update: the engines hold still (paused, loading), the trainer pushes."""
    decode_per_ctx_s: float = 0.0
    """What each token of a sequence's context (prompt + tokens so far) adds to a decode step: its KV-cache reads,
    which dominate at long context. The step then grows as the sequences do; the simulator integrates it."""
    prefill_s_per_token: float = 0.0
    max_seqs: int = 1 << 30
    """Sequences an engine decodes at once (vLLM's max_num_seqs / KV capacity); the rest wait in its queue."""
    train_fixed_s: float = 0.0
    """Per training step, whatever its size (optimizer step, rewards, Python)."""
    gpus_per_engine: int = 1
    colocated: bool = False
    """The engines and the trainer time-share the same GPUs (colocated sync, e.g. NeMo-RL's published sync runs):
    tokens/s per GPU divides by the larger of the two counts, not their sum. Meaningful for `sync` only."""

    def step_s(self, c: int) -> float:
        return self.decode_fixed_s + self.decode_per_seq_s * c

    @property
    def gpus(self) -> int:
        rollout = self.rollout_engines * self.gpus_per_engine
        return max(rollout, self.train_gpus) if self.colocated else rollout + self.train_gpus


@dataclass(frozen=True)
class Workload:
    steps: int
    prompts_per_step: int
    generations: int
    prompt_len: int
    lengths: dict
    """Completion-length distribution: {"kind": "geometric", "mean", "max"}, {"kind": "lognormal", "median",
    "sigma", "min", "max"} or {"kind": "fixed", "value"}."""
    seed: int = 0
    max_in_flight: int = 16
    """stream: most groups generating at once, over all engines."""
    max_version_lag: int = 1
    """stream: most versions a trained token may be behind the trainer's weights; async: rollout.max_staleness."""
    max_buffered: int | None = None
    """stream: finished groups the buffer holds before the pool stops starting groups (None: prompts_per_step)."""


def draw_length(rng: random.Random, spec: dict) -> int:
    kind = spec["kind"]
    if kind == "fixed":
        return int(spec["value"])
    if kind == "geometric":  # the number of tokens up to and including EOS when each token is EOS with p = 1/mean
        p = 1.0 / spec["mean"]
        n = 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - p)) if p < 1 else 1
        return min(n, int(spec["max"]))
    if kind == "lognormal":
        n = int(round(rng.lognormvariate(math.log(spec["median"]), spec["sigma"])))
        return max(int(spec.get("min", 1)), min(n, int(spec["max"])))
    raise ValueError(f"unknown length distribution {kind!r}")


class Groups:
    """Group i's completion lengths, drawn lazily in order from one seeded RNG (same for every schedule)."""

    def __init__(self, w: Workload) -> None:
        self.w, self.rng, self.drawn = w, random.Random(w.seed), []

    def __getitem__(self, i: int) -> list[int]:
        while len(self.drawn) <= i:
            self.drawn.append([draw_length(self.rng, self.w.lengths) for _ in range(self.w.generations)])
        return self.drawn[i]


@dataclass(eq=False)
class Seq:
    group: Group
    length: int
    start: float = 0.0
    """The engine's token clock when it was admitted; it ends at start + length."""
    versions: dict = field(default_factory=dict)
    done: bool = False
    aborted: bool = False


@dataclass(eq=False)
class Group:
    index: int
    seqs: list[Seq] = field(default_factory=list)
    tag: object = None
    left: int = 0
    prompt_len: int = 0
    prefilled: bool = False

    @property
    def tokens(self) -> int:
        return sum(s.length for s in self.seqs)


class Engine:
    """One rollout engine: a token clock that every decoding sequence follows, one token per decode step. A step
    takes A + B * clock seconds (`step_now`): the context term grows with the clock, so time and tokens are related
    by the integral of the step over the clock (exact for this linear cost, a quadratic)."""

    def __init__(self, hw: Hardware, index: int, prompt_len: int = 0) -> None:
        self.hw, self.index, self.prompt_len = hw, index, prompt_len
        self.clock = 0.0
        self.heap: list[tuple[float, int, Seq]] = []
        self.active = 0
        self.starts = 0.0  # sum of the active sequences' start clocks: their contexts sum to c*(prompt+clock) - this
        self.waiting: list[Seq] = []
        self.prefill_left = 0.0
        self.paused_until = 0.0
        self.version = 0
        self.marks, self.mark_versions = [0.0], [0]  # clock values where the version changed
        self.busy = 0.0
        self.tokens = 0.0
        self._n = 0

    def add(self, seqs: list[Seq]) -> None:
        self.waiting.extend(seqs)
        self._admit()

    def _admit(self) -> None:
        while self.waiting and self.active < self.hw.max_seqs:
            s = self.waiting.pop(0)
            if not s.group.prefilled:  # once per group: its samples share the prompt (prefix cache)
                s.group.prefilled = True
                self.prefill_left += self.hw.prefill_s_per_token * s.group.prompt_len
            s.start = self.clock
            self.starts += s.start
            self._n += 1
            heapq.heappush(self.heap, (self.clock + s.length, self._n, s))
            self.active += 1

    def set_version(self, v: int) -> None:
        self.version = v
        self.marks.append(self.clock)
        self.mark_versions.append(v)

    def pause(self, now: float, seconds: float) -> None:
        self.paused_until = max(self.paused_until, now) + seconds

    def next_time(self, now: float) -> float:
        if now < self.paused_until:
            return self.paused_until
        if self.prefill_left > 1e-12:
            return now + self.prefill_left
        self.prefill_left = 0.0
        self._drop_aborted()
        if not self.heap:
            return INF
        u = self.heap[0][0] - self.clock
        return now + self.step_now() * u + self._slope() / 2 * u * u

    def _slope(self) -> float:
        return self.hw.decode_per_ctx_s * self.active

    def step_now(self) -> float:
        """Seconds of the decode step at the current clock, for the sequences decoding now."""
        hw, c = self.hw, self.active
        ctx = c * (self.prompt_len + self.clock) - self.starts
        return hw.step_s(c) + hw.decode_per_ctx_s * ctx

    def _drop_aborted(self) -> None:
        while self.heap and self.heap[0][2].aborted:
            heapq.heappop(self.heap)

    def advance(self, now: float, t: float) -> None:
        """Run from `now` to `t` (no event of this engine lies strictly between)."""
        start = max(now, self.paused_until)
        dt = t - start
        if dt <= 0:
            return
        used = min(dt, self.prefill_left)
        self.prefill_left -= used
        self.busy += used
        dt -= used
        if dt > 0 and self.active:
            s0, b = self.step_now(), self._slope()
            u = 2 * dt / (s0 + math.sqrt(s0 * s0 + 2 * b * dt))  # the root of s0*u + b/2*u^2 = dt
            self.clock += u
            self.tokens += u * self.active
            self.busy += dt

    def finished(self) -> list[Seq]:
        out = []
        self._drop_aborted()
        while self.heap and self.heap[0][0] <= self.clock + 1e-9 * max(1.0, self.clock):
            _, _, s = heapq.heappop(self.heap)
            self.clock = max(self.clock, s.start + s.length)
            self.active -= 1
            self.starts -= s.start
            self._close(s, s.start + s.length)
            s.done = True
            out.append(s)
            self._drop_aborted()
        if out:
            self._admit()
        return out

    def abort(self, s: Seq) -> None:
        if not s.done and not s.aborted:
            s.aborted = True
            if s in self.waiting:
                self.waiting.remove(s)
            else:
                self.active -= 1
                self.starts -= s.start
                self._close(s, self.clock)
        self._admit()

    def version_at(self, clock: float) -> int:
        return self.mark_versions[bisect.bisect_right(self.marks, clock) - 1]

    def _close(self, s: Seq, end: float) -> None:
        """Tokens of `s` per weight version: its clock span cut at the engine's version marks."""
        i = max(0, bisect.bisect_right(self.marks, s.start) - 1)
        while i < len(self.marks):
            lo = max(s.start, self.marks[i])
            hi = min(end, self.marks[i + 1] if i + 1 < len(self.marks) else INF)
            if hi > lo:
                s.versions[self.mark_versions[i]] = s.versions.get(self.mark_versions[i], 0.0) + hi - lo
            if hi >= end:
                break
            i += 1


# ------------------------------------------------------------------------------------------- the event loop
class Sim:
    """The clock, the engines, timers, and the trainer's bookkeeping; a schedule (below) drives it."""

    def __init__(self, hw: Hardware, w: Workload) -> None:
        self.hw, self.w = hw, w
        self.engines = [Engine(hw, i, w.prompt_len) for i in range(hw.rollout_engines)]
        self.groups = Groups(w)
        self.next_group = 0
        self.now = 0.0
        self.timers: list[tuple[float, int, object]] = []
        self._n = 0
        self.version = 0
        self.trained_steps = 0
        self.train_busy = 0.0
        self.trained_completion = 0
        self.step_tokens: list[int] = []
        """Trained completion tokens of each step, in order."""
        self.generated = 0
        self.step_ends: list[float] = []
        self.lags: dict[int, float] = {}
        self.mixed_rows = 0
        self.dropped = 0
        self.done = False

    def new_group(self) -> Group:
        lengths = self.groups[self.next_group]
        g = Group(self.next_group)
        g.prompt_len = self.w.prompt_len
        g.seqs = [Seq(g, n) for n in lengths]
        g.left = len(g.seqs)
        self.next_group += 1
        return g

    def at(self, t: float, fn) -> None:
        self._n += 1
        heapq.heappush(self.timers, (t, self._n, fn))

    def pause_for_sync(self, then) -> None:
        """Every engine pauses `sync_s` (its requests kept) for the weight load; `then()` runs when it is in."""
        for e in self.engines:
            e.pause(self.now, self.hw.sync_s)
        self.at(self.now + self.hw.sync_s, then)

    def finish_step(self) -> bool:
        """The new weights are in: every engine samples with the next version, one more step is trained. Returns
        whether that was the last step."""
        self.version += 1
        for e in self.engines:
            e.set_version(self.version)
        self.step_ends.append(self.now)
        self.trained_steps += 1
        self.done = self.trained_steps == self.w.steps
        return self.done

    def train_seconds(self, groups: list[Group]) -> float:
        tokens = sum(g.tokens + len(g.seqs) * self.w.prompt_len for g in groups)
        return self.hw.train_fixed_s + tokens * self.hw.train_s_per_token / self.hw.train_gpus

    def account(self, groups: list[Group], version: int) -> None:
        """Per-token lag of a trained step against the weights it trains (`version`)."""
        self.step_tokens.append(sum(s.length for g in groups for s in g.seqs))
        for g in groups:
            for s in g.seqs:
                self.trained_completion += s.length
                vs = [v for v, n in s.versions.items() if n > 1e-9]
                self.mixed_rows += len(vs) > 1
                for v in vs:
                    self.lags[version - v] = self.lags.get(version - v, 0.0) + s.versions[v]

    def run(self, schedule) -> dict:
        schedule.start(self)
        guard = 0
        while not self.done:
            t = min([e.next_time(self.now) for e in self.engines] + [self.timers[0][0] if self.timers else INF])
            if t == INF:
                raise RuntimeError(f"{schedule.name}: nothing left to happen at t={self.now:.3f} (a stuck schedule)")
            for e in self.engines:
                e.advance(self.now, t)
            self.now = t
            for e in self.engines:
                for s in e.finished():
                    schedule.seq_done(self, e, s)
            while self.timers and self.timers[0][0] <= self.now:
                heapq.heappop(self.timers)[2]()
            guard += 1
            if guard > 50_000_000:
                raise RuntimeError(f"{schedule.name}: the simulation did not end")
        return self.report(schedule.name)

    def report(self, name: str) -> dict:
        total = self.step_ends[-1]
        steps = [b - a for a, b in zip([0.0] + self.step_ends, self.step_ends)]
        busy = sum(e.busy for e in self.engines)
        lag_tokens = sum(self.lags.values())
        return {
            "schedule": name, "seconds": total, "steps": len(steps),
            "step_s_median": statistics.median(steps[1:] or steps),
            "trained_completion_tokens": self.trained_completion,
            "trained_tokens": self.trained_completion + self.trained_steps * self.w.prompts_per_step
            * self.w.generations * self.w.prompt_len,
            "tokens_per_s": self.trained_completion / total,
            "tokens_per_s_per_gpu": self.trained_completion / total / self.hw.gpus,
            "generated_tokens": round(sum(e.tokens for e in self.engines)),
            "engine_idle_frac": 1.0 - busy / (total * len(self.engines)),
            "trainer_idle_frac": 1.0 - self.train_busy / total,
            "version_lag_mean": sum(k * n for k, n in self.lags.items()) / lag_tokens if lag_tokens else 0.0,
            "version_lag_max": max((k for k, n in self.lags.items() if n > 1e-9), default=0),
            "mixed_version_rows": self.mixed_rows, "dropped_groups": self.dropped,
            "step_seconds": steps, "step_tokens": list(self.step_tokens),
        }


def after_warmup(report: dict, skip: int) -> dict[str, float]:
    """A report's trained completion tokens/s and step time (median, mean) over the steps after the first `skip`, as a
    benchmark measures a run (its first steps fill the pipeline); all steps when there are no more than `skip`."""
    seconds, tokens = report["step_seconds"][skip:], report["step_tokens"][skip:]
    seconds = seconds or report["step_seconds"]
    tokens = tokens or report["step_tokens"]
    return {"tokens_per_s": sum(tokens) / sum(seconds), "step_s_median": statistics.median(seconds),
            "step_s_mean": sum(seconds) / len(seconds)}
