"""`rollout.stream:` settings of `rollout.mode: stream` (docs/streaming.md): the pool of prompt groups generating on
`vllm serve` servers, the buffer of finished groups, and the per-token staleness bound."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from grpo_cli.config.base import Section


class StreamConfig(Section):
    max_in_flight: int = Field(16, ge=1)
    """Prompt groups (one request of `train.generations_per_prompt` samples each) generating on the servers at once,
    over all servers; a group goes to the server with the fewest in flight. Above `train.prompts_per_step` the pool
    over-provisions: groups still running when a step's are complete keep generating and feed a later step."""
    max_buffered_groups: int | None = Field(None, ge=1)
    """Finished groups the buffer may hold before the pool stops starting new ones (finished groups wait there for a
    step to take them, those with the oldest tokens first). None: `train.prompts_per_step` (one step's worth ready)."""
    max_version_lag: int = Field(1, ge=0)
    """Most weight versions a sampled token may be behind the weights that train on it. A group with an older token
    is dropped (or regenerated, `on_stale`) and counted in `stream/dropped_groups`."""
    on_stale: Literal["drop", "regenerate"] = "drop"
    """What happens to a group past `max_version_lag`: `drop` discards it (its prompt is skipped, as dynamic
    sampling skips one); `regenerate` samples the same prompt again with the current weights."""
    recompute_kv: bool = False
    """At an in-flight weight update, vLLM keeps the KV cache a resumed request computed under the old weights (what
    the peers do; the IS correction sees the sampler's logprobs). True: the requests in flight are preempted at the
    pause (`/pause?mode=keep&clear_cache=true`) and vLLM re-prefills prompt + tokens so far with the new weights
    when they resume (slower: one prefill per request per update)."""
