"""Stream mode's rollout pool (`rollout.mode: stream`, docs/streaming.md), behind the same interface as async mode's
`RolloutPipeline` (start_at / top_up / take / state_dict / load_state_dict), so the loop has one rollout path.

A background thread keeps up to `rollout.stream.max_in_flight` prompt groups (one request of G samples each)
generating on the `vllm serve` servers, each sent to the server with the fewest in flight, while the buffer holds
fewer than `max_buffered_groups` finished ones, and only groups that can train within the lag bound. A step takes
the finished groups with the oldest tokens; a group with a token more than `max_version_lag` versions behind the
weights that train on it is dropped (or regenerated) and counted. Groups still generating when a step's are complete
stay in the pool and feed a later step (partial rollouts, APRIL).
Weight updates land in flight (the client pauses every server with its requests kept, pushes, resumes)."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import asdict, dataclass

from grpo_cli.data.prompts import Prompt, PromptCursor
from grpo_cli.rollout.base import RolloutBatch, RolloutError
from grpo_cli.rollout.routing import least_loaded
from grpo_cli.rollout.vllm_serve.stream import Group
from grpo_cli.train.stream_metrics import IdleClock, batch_metrics

WAIT_S = 1.0
"""How often a waiting step re-checks the pool (an error in a request thread wakes it at once)."""
ADMIT_POLL_S = 0.05
"""How often the pool re-checks whether a weight push let it start a group (the push does not notify it)."""


@dataclass
class Flight:
    """A group in flight: its index (seed, order), its prompt and the cursor state before its prompt was taken."""

    index: int
    prompt: Prompt
    cursor_before: dict
    url: str = ""


class StreamPipeline:
    """`engine`: a streaming `VLLMServeEngine` (`generate_group`, `abort`, `in_flight.paused_seconds`);
    `sampling_for(index)`: the sampling parameters of group `index` (its seed follows from the index)."""

    def __init__(self, engine, cursor: PromptCursor, *, prompts_per_step: int, max_in_flight: int,
                 max_buffered: int, max_version_lag: int, on_stale: str, sampling_for) -> None:
        self.engine, self.cursor, self.per_step = engine, cursor, prompts_per_step
        self.max_in_flight, self.max_buffered, self.lag, self.on_stale = (max_in_flight, max_buffered,
                                                                          max_version_lag, on_stale)
        self.sampling_for = sampling_for
        self.flight: dict[int, Flight] = {}
        self.buffer: deque[tuple[Group, Prompt]] = deque()
        self.retake: deque[Flight] = deque()
        """Groups to sample (again) before new prompts: restored from a checkpoint, or stale with `regenerate`."""
        self.next_index = 0
        self.peak_in_flight = 0
        self.error: BaseException | None = None
        self.dropped = 0
        self.clock = IdleClock(list(engine.urls))
        engine.in_flight.count_requests = lambda: len(self.flight)
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._first_step = 0
        self.last_take: int | None = None
        """The weight version of the last step that took its groups (the next one trains at that + 1)."""
        self.taking: int | None = None
        """The weight version of a step waiting for its groups now (it trains at that version)."""

    # ---- the interface the loop drives ---------------------------------------------------------------

    def start_at(self, step: int) -> None:
        self._first_step = step

    def top_up(self, step: int) -> None:
        """Start the pool's thread at the first step (after the first weight push): it then runs by itself."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="stream-pool", daemon=True)
            self._thread.start()

    def take(self, step: int, version: int) -> tuple[list[Prompt], RolloutBatch]:
        """The step's `prompts_per_step` oldest finished groups trainable at weights `version` (older ones dropped
        or re-queued, counted), waiting for them if needed."""
        start = time.perf_counter()
        with self._cond:
            dropped_before = self.dropped
            while True:
                if self.error is not None:
                    raise self.error
                self.taking = version
                self._drop_stale(version)
                if len(self.buffer) >= self.per_step:
                    taken = self._oldest(self.per_step)
                    self.taking, self.last_take = None, version
                    break
                self._cond.wait(WAIT_S)
            self._cond.notify_all()  # room in the buffer: the pool may start more groups
            groups = [g for g, _ in taken]
            batch = assemble(groups, timings={"generate": time.perf_counter() - start})
            self.last_metrics = {
                **batch_metrics(groups, version), "stream/dropped_groups": float(self.dropped - dropped_before),
                "stream/buffer_depth": float(len(self.buffer)), "stream/in_flight": float(len(self.flight)),
                "stream/in_flight_at_sync": float(self.engine.in_flight.requests_at_pause),
                "stream/engine_idle_frac": self.clock.idle_fraction(self.engine.in_flight.paused_seconds)}
        return [p for _, p in taken], batch

    def step_metrics(self, rollout: RolloutBatch) -> dict[str, float]:
        return dict(self.last_metrics)

    def close(self) -> None:
        """Stop starting groups and abort the requests in flight (their threads then return at once)."""
        with self._cond:
            self._closed = True
            ids = {f.url: [] for f in self.flight.values()}
            for f in self.flight.values():
                ids[f.url].append(request_id(f.index))
            self._cond.notify_all()
        for url, rids in ids.items():
            self.engine.abort(url, rids)

    # ---- the pool's thread ---------------------------------------------------------------------------

    def _drop_stale(self, version: int) -> None:
        kept: deque[tuple[Group, Prompt]] = deque()
        for group, prompt in self.buffer:
            oldest = group.oldest()
            if oldest is None or version - oldest <= self.lag:
                kept.append((group, prompt))
                continue
            self.dropped += 1
            if self.on_stale == "regenerate":
                self.retake.append(Flight(group.index, prompt, group.cursor_before))
        if len(kept) < len(self.buffer):
            self._cond.notify_all()  # room in the buffer (and groups to sample again): wake the pool
        self.buffer = kept

    def _oldest(self, count: int) -> list[tuple[Group, Prompt]]:
        """Remove and return the `count` buffered groups whose oldest token is oldest (in finish order among equals).
        A long group finishes late but holds early tokens: taken first, it trains before it passes the lag bound;
        taken in finish order it would be the one dropped, a bias against long completions."""
        order = sorted(range(len(self.buffer)), key=lambda i: _oldest_version(self.buffer[i][0]))[:count]
        taken = [self.buffer[i] for i in order]
        chosen = set(order)
        self.buffer = deque(item for i, item in enumerate(self.buffer) if i not in chosen)
        return taken

    def _room(self) -> bool:
        """Whether to start a group now: below `max_in_flight` and `max_buffered`, and only if it can train within
        the lag bound. Groups train in order, `per_step` a step: a group started now behind `ahead` pending ones
        trains at the next take's version + ahead // per_step, and its tokens are at least the version pushed now;
        a group past the bound would be sampled only to be dropped (what the peers call staleness-aware admission).
        So the pool keeps generating while the trainer trains, never more than the bound lets it use."""
        if len(self.flight) >= self.max_in_flight or len(self.buffer) >= self.max_buffered:
            return False
        pushed = self.engine.weight_version
        following = self.taking if self.taking is not None else (
            pushed if self.last_take is None else self.last_take + 1)
        next_take = max(pushed, following)
        ahead = len(self.buffer) + len(self.flight)
        return next_take + ahead // self.per_step - pushed <= self.lag

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and self.error is None and not self._room():
                    self._cond.wait(ADMIT_POLL_S)  # a weight push (no notify) may make room
                if self._closed or self.error is not None:
                    return
                flight = self._next_flight()
                counts = list(self._counts().values())  # in the engine's URL order
                flight.url = self.engine.urls[least_loaded(counts)]  # the fewest groups in flight: never round-robin
                self.flight[flight.index] = flight
                self.peak_in_flight = max(self.peak_in_flight, len(self.flight))
                self.clock.set(flight.url, self._counts()[flight.url])
            threading.Thread(target=self._one, args=(flight,), name=f"stream-group-{flight.index}",
                             daemon=True).start()

    def _next_flight(self) -> Flight:
        if self.retake:
            return self.retake.popleft()
        before = self.cursor.state_dict()
        prompt = self.cursor.take(1)[0]
        self.next_index += 1
        return Flight(self.next_index - 1, prompt, before)

    def _counts(self) -> dict[str, int]:
        counts = dict.fromkeys(self.engine.urls, 0)
        for f in self.flight.values():
            counts[f.url] += 1
        return counts

    def _one(self, flight: Flight) -> None:
        try:
            group = self.engine.generate_group(flight.url, flight.prompt.ids, self.sampling_for(flight.index),
                                               index=flight.index, request_id=request_id(flight.index))
            group.cursor_before = flight.cursor_before
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer's thread, which raises it
            with self._cond:
                del self.flight[flight.index]
                if not self._closed and self.error is None:
                    self.error = exc
                self._cond.notify_all()
            return
        with self._cond:
            del self.flight[flight.index]
            self.clock.set(flight.url, self._counts()[flight.url])
            self.buffer.append((group, flight.prompt))
            self._cond.notify_all()

    # ---- checkpoints -----------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """`{"in_flight": {...}, "cursor": ...}`: the buffer's finished groups with every token's version, the cursor
        positions of the groups still generating (regenerated after a resume, with the same seeds), and the
        cursor's own position."""
        with self._cond:
            regen = sorted([*self.flight.values(), *self.retake], key=lambda f: f.index)
            return {"in_flight": {"buffer": [asdict(g) for g, _ in self.buffer],
                                  "regenerate": [{"index": f.index, "cursor_before": f.cursor_before} for f in regen],
                                  "next_index": self.next_index, "dropped": self.dropped},
                    "cursor": self.cursor.state_dict()}

    def load_state_dict(self, saved) -> None:
        """Restore a checkpoint's buffer (prompts re-taken from their cursor positions, checked against the saved
        ids) and queue its in-flight groups to be sampled again first; the cursor ends where it was saved."""
        if not saved:
            return
        if not isinstance(saved, dict):
            raise RolloutError("checkpoint: its rollouts in flight were saved by rollout.mode async; resume it with "
                               "rollout.mode async (a stream run's checkpoint holds the stream pool's buffer)")
        end = self.cursor.state_dict()
        for entry in saved["buffer"]:
            group = Group(**entry)
            prompt = self._prompt_at(group.cursor_before)
            if prompt.ids != group.prompt_ids:
                raise RolloutError(
                    f"checkpoint: the saved group {group.index} of the stream buffer does not match the prompt at its "
                    "cursor position; the data changed since the checkpoint (data.source, data.shuffle or "
                    "train.seed). Resume with the same data settings.")
            self.buffer.append((group, prompt))
        for entry in saved["regenerate"]:
            self.retake.append(Flight(entry["index"], self._prompt_at(entry["cursor_before"]), entry["cursor_before"]))
        self.next_index, self.dropped = saved["next_index"], saved.get("dropped", 0)
        self.cursor.load_state_dict(end)

    def restored(self) -> str:
        """What a resume restored, for its log line."""
        return (f"{len(self.buffer)} finished stream group(s) restored, {len(self.retake)} in flight to generate "
                "again")

    def _prompt_at(self, cursor_before: dict) -> Prompt:
        self.cursor.load_state_dict(cursor_before)
        return self.cursor.take(1)[0]


def _oldest_version(group: Group) -> float:
    """The version of the group's oldest token (a group without tokens sorts last)."""
    oldest = group.oldest()
    return float("inf") if oldest is None else oldest


def request_id(index: int) -> str:
    """vLLM's request id of group `index` (unique per process: `/abort_requests` names it at close)."""
    return f"grpo-stream-{_RUN}-{index}"


_RUN = f"{int(time.time() * 1000):x}"
"""This process's tag in its request ids (a resumed run's regenerated group must not reuse a dead one's id)."""


def assemble(groups: list[Group], *, timings: dict[str, float]) -> RolloutBatch:
    """A step's RolloutBatch from its groups, group-contiguous; `weight_version`: the oldest token's version (the
    newest submission's when no token was sampled), `token_versions`: every token's."""
    oldest = [v for v in (g.oldest() for g in groups) if v is not None]
    return RolloutBatch(
        prompt_ids=[g.prompt_ids for g in groups],
        completion_ids=[c for g in groups for c in g.completion_ids],
        finish_reasons=[r for g in groups for r in g.finish_reasons],
        sampler_logprobs=[lp for g in groups for lp in g.sampler_logprobs],
        weight_version=min(oldest) if oldest else max(g.submitted_version for g in groups),
        token_versions=[v for g in groups for v in g.token_versions],
        timings=timings)
