"""Async mode's one-step-ahead pipeline: keep the batches of steps k .. k+s in flight while step k trains.

At step k (policy at weight version k) the pipeline submits every batch up to step `k + s` (s =
`rollout.max_staleness`) with the current weights, then waits for batch k. A batch submitted at step k for
step j is trained at version j, so its staleness j − (version that sampled it) never exceeds s. The weight
push after step k is queued on the actors behind the generations already submitted, so batch k+1 is being
generated while step k's reward, loss and optimizer step run. s = 0 is the synchronous schedule.

Checkpoints keep the batches in flight (token ids, sampler logprobs, weight version, and the cursor position
their prompts were taken from), so a resumed run trains on exactly the batches the uninterrupted one would.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from grpo_cli.data.prompts import Prompt, PromptCursor, images_of
from grpo_cli.rollout.base import RolloutBatch, RolloutError


@dataclass
class InFlight:
    """A submitted batch: its step, its prompts and the cursor state before they were taken."""

    step: int
    prompts: list[Prompt]
    cursor_before: dict
    batch: RolloutBatch | None = None


def take_step_prompts(cursor: PromptCursor, *, prompts_per_step: int, rank: int, world_size: int) -> list[Prompt]:
    """This rank's share of the next step's prompts (every rank advances the cursor by the whole step)."""
    per_rank = prompts_per_step // world_size
    return cursor.take(prompts_per_step)[rank * per_rank : (rank + 1) * per_rank]


class RolloutPipeline:
    """Drives an engine with `submit(key, ...)`/`collect(key)` (the Ray rollout manager) `max_staleness` steps
    ahead. `sampling_for(step)` gives a step's sampling parameters (its seed is a function of the step)."""

    def __init__(self, engine, cursor: PromptCursor, *, max_staleness: int, total_steps: int, prompts_per_step: int,
                 rank: int, world_size: int, sampling_for) -> None:
        self.engine, self.cursor, self.ahead, self.total = engine, cursor, max_staleness, total_steps
        self._take = dict(prompts_per_step=prompts_per_step, rank=rank, world_size=world_size)
        self.sampling_for = sampling_for
        self.flight: dict[int, InFlight] = {}
        self.next_step = 0

    def start_at(self, step: int) -> None:
        """Nothing is in flight before `step` (a fresh run or a resume without saved batches)."""
        self.next_step = max(self.next_step, step)

    def top_up(self, step: int) -> None:
        """Submit every batch for steps up to `step + max_staleness` not yet submitted."""
        last = min(step + self.ahead, self.total - 1)
        while self.next_step <= last:
            j = self.next_step
            before = self.cursor.state_dict()
            prompts = take_step_prompts(self.cursor, **self._take)
            self.engine.submit(j, [p.ids for p in prompts], self.sampling_for(j), [dict(p.columns) for p in prompts],
                               images_of(prompts))
            self.flight[j] = InFlight(j, prompts, before)
            self.next_step += 1

    def take(self, step: int, version: int) -> tuple[list[Prompt], RolloutBatch]:
        """Batch of `step`, waiting for it if needed; checks the staleness bound (`max_staleness`) against the
        trainer's current weight `version`."""
        item = self.flight[step]
        batch = item.batch if item.batch is not None else self.engine.collect(step)
        del self.flight[step]  # only once it arrived: a failed batch stays for `state_dict` to account for
        lag = version - batch.weight_version
        if lag > self.ahead or lag < 0:
            raise RolloutError(
                f"the batch for step {step} was sampled with weight version {batch.weight_version} but the "
                f"trainer is at version {version} (staleness {lag}, bound rollout.max_staleness="
                f"{self.ahead}); the rollout actors missed a weight push. Resume from the last checkpoint."
            )
        return item.prompts, batch

    def step_metrics(self, rollout: RolloutBatch) -> dict[str, float]:
        """`async/*` of the step that trained on `rollout`."""
        return {"async/actor_generate_s": rollout.timings.get("generate", 0.0),
                "async/in_flight": float(len(self.flight))}

    def close(self) -> None:
        """Nothing of its own to stop (the actors belong to the engine)."""

    def restored(self) -> str:
        """What a resume restored, for its log line."""
        return f"{len(self.flight)} rollout batch(es) in flight restored"

    # ---- checkpoints -----------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """`{"in_flight": [...], "cursor": ...}`: the batches in flight, waited for and made JSON-ready (ints,
        floats, strings), and the cursor position to save. When a batch cannot be had (its actor died), it
        and every later one are left out and the cursor is rewound to where their prompts began, so a resumed
        run generates them again."""
        saved = []
        for step in sorted(self.flight):
            item = self.flight[step]
            if item.batch is None:
                try:
                    item.batch = self.engine.collect(step)
                except RolloutError:
                    return {"in_flight": saved, "cursor": item.cursor_before}
            saved.append({"step": step, "cursor_before": item.cursor_before, "batch": asdict(item.batch)})
        return {"in_flight": saved, "cursor": self.cursor.state_dict()}

    def load_state_dict(self, saved: list[dict]) -> None:
        """Restore saved in-flight batches: re-take their prompts from the saved cursor positions and mark them
        ready. The cursor ends where it was on entry (the checkpoint's position, which is past these prompts and
        past any prompts taken after them, e.g. by dynamic sampling's extra rounds)."""
        end = self.cursor.state_dict()
        for entry in saved:
            self.cursor.load_state_dict(entry["cursor_before"])
            prompts = take_step_prompts(self.cursor, **self._take)
            batch = RolloutBatch(**entry["batch"])
            if [p.ids for p in prompts] != batch.prompt_ids:
                raise RolloutError(
                    f"checkpoint: the saved rollout batch of step {entry['step']} does not match the prompts at "
                    "its cursor position; the data changed since the checkpoint (data.source, data.shuffle or "
                    "train.seed). Resume with the same data settings."
                )
            self.flight[entry["step"]] = InFlight(entry["step"], prompts, entry["cursor_before"], batch)
            self.next_step = max(self.next_step, entry["step"] + 1)
        self.cursor.load_state_dict(end)
