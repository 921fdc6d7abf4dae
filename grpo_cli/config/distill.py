"""The `algorithm.distill:` section: on-policy distillation from a teacher (the formula: `grpo_cli.algo.distill`)."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field

from grpo_cli.config.base import Section


class DistillConfig(Section):
    """On-policy distillation: a teacher scores the tokens the student sampled, and the per-token signal
    −clamp(logp_student − logp_teacher, ±clip) (reverse KL on the student's own samples), times `coef`, is added to
    the reward's advantage or replaces it (docs/distillation.md)."""

    teacher: str
    """The teacher: a local checkpoint folder (or a `builtin:` model), scored by the training backend like the KL
    reference (same dtype and sharding, resident beside the policy, counted by `grpo plan`), or the http(s) URL of
    a `grpo serve-rollout` server, scored through its /score route. Its tokenizer must equal the policy's."""
    coef: float = Field(1.0, gt=0)
    """Weight of the per-token distillation signal in the advantage."""
    clip: float = Field(10.0, gt=0)
    """Bound on |logp_student − logp_teacher| per token before it enters the advantage (the metric is unclipped)."""
    mode: Literal["add", "replace"] = "add"
    """`add`: advantage = reward advantage + coef · signal; `replace`: coef · signal alone (pure distillation; the
    rewards are still computed and logged)."""
    token_env: str = "GRPO_ROLLOUT_TOKEN"
    """Environment variable holding the bearer token of a served teacher (unset: no token is sent)."""

    @property
    def served(self) -> bool:
        """Whether the teacher is a `grpo serve-rollout` URL (else a local checkpoint)."""
        return self.teacher.startswith(("http://", "https://"))

    @property
    def token(self) -> str | None:
        """The served teacher's bearer token, read once from `token_env`."""
        return os.environ.get(self.token_env) or None
