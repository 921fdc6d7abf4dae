"""The `algorithm:` config section: advantages, objective, aggregation, KL and IS correction (DESIGN.md §5).

Each Literal below is the key set of one registry in `grpo_cli.algo`; tests/algo asserts they match.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from grpo_cli.config.base import Section
from grpo_cli.config.distill import DistillConfig

ScaleRewards = Literal["group", "batch", "none"]
AdvantageEstimator = Literal["grpo", "rloo", "reinforce_pp"]
ObjectiveKind = Literal["clip", "gspo", "gspo_token", "cispo"]
KLEstimator = Literal["k1", "k2", "k3"]
ISLevel = Literal["token", "sequence_product", "sequence_geometric"]
ISAction = Literal["truncate", "mask"]
ISMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
Aggregation = Literal["token_mean", "token_mean_local", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
LossPreset = Literal["grpo", "bnpo", "dr_grpo", "dapo", "gspo"]


class AdvantageConfig(Section):
    """Group-relative advantage A = (R - mean_group) / (std + epsilon) (outcome and process rewards)."""

    estimator: AdvantageEstimator = "grpo"
    """Baseline of the advantage: `grpo` = (R - group mean) / scale (see scale_rewards); `rloo` = R - mean of
    the other rewards of the group (leave-one-out, no scaling); `reinforce_pp` = R - group mean, then whitened
    over the batch (divided by its std + epsilon; REINFORCE++ baseline). Groups of identical rewards get 0."""
    scale_rewards: ScaleRewards = "group"
    """How centred rewards are scaled (estimator grpo): `group` divides by the group's std (Bessel) + epsilon,
    `batch` by the std of all rewards of the step (mean still per group), `none` does not divide (Dr. GRPO)."""
    epsilon: float = Field(1e-4, gt=0)
    """Added to the std before dividing (estimators grpo and reinforce_pp)."""

    @model_validator(mode="after")
    def _check_estimator(self) -> AdvantageConfig:
        unused = {"rloo": ("scale_rewards", "epsilon"), "reinforce_pp": ("scale_rewards",)}.get(self.estimator, ())
        given = [name for name in unused if name in self.model_fields_set]
        if given:
            raise ValueError(
                f"advantage.{given[0]} has no effect with advantage.estimator '{self.estimator}' (it applies to "
                "estimator grpo only" + (" and reinforce_pp" if given[0] == "epsilon" else "") + "); remove it "
                "(a loss preset such as dr_grpo sets scale_rewards: pick another preset or estimator grpo)."
            )
        return self


class ObjectiveConfig(Section):
    """Per-token policy objective and its clip ranges."""

    kind: ObjectiveKind = "clip"
    """Policy objective: `clip` (PPO clipped surrogate per token), `gspo` (clipped surrogate on the sequence
    ratio, geometric mean of token ratios), `gspo_token` (GSPO value with per-token gradients, allows token
    advantages), `cispo` (REINFORCE weighted by the detached clipped ratio; every token keeps its gradient)."""
    epsilon_low: float = Field(0.2, ge=0)
    """Lower clip range: the ratio is clipped at 1 - epsilon_low."""
    epsilon_high: float = Field(0.2, ge=0)
    """Upper clip range: the ratio is clipped at 1 + epsilon_high (DAPO's clip-higher uses 0.28)."""
    dual_clip_c: float | None = None
    """Dual clip: for negative advantages the per-token loss is capped at -c*A (c > 1); None disables it."""
    cispo_epsilon_low: float | None = Field(None, ge=0, le=1)
    """CISPO only: also clamp its weight from below at 1 - cispo_epsilon_low. None (default) is CISPO as
    published: the weight is min(ratio, 1 + epsilon_high), with no lower clamp."""

    @model_validator(mode="after")
    def _check_dual_clip(self) -> ObjectiveConfig:
        if self.dual_clip_c is not None and self.dual_clip_c <= 1.0:
            raise ValueError(
                f"objective.dual_clip_c={self.dual_clip_c} must be > 1 (it caps the loss of negative-advantage "
                "tokens at c times the advantage; typical 3.0), or null to disable it."
            )
        if self.dual_clip_c is not None and self.kind == "cispo":
            raise ValueError("objective.dual_clip_c has no effect with kind 'cispo' (no min to cap); set it to null.")
        if self.cispo_epsilon_low is not None and self.kind != "cispo":
            raise ValueError(
                f"objective.cispo_epsilon_low applies to kind 'cispo' only, but kind is '{self.kind}'; remove it "
                "(the clip objectives use epsilon_low)."
            )
        if self.kind == "cispo" and "epsilon_low" in self.model_fields_set:
            raise ValueError(
                "objective.epsilon_low has no effect with kind 'cispo' (CISPO clips its weight from above only, "
                "at 1 + epsilon_high); remove it, or set objective.cispo_epsilon_low for a lower clamp."
            )
        return self


class KLConfig(Section):
    """KL penalty to the reference model, added per token (not IS-weighted)."""

    beta: float = Field(0.0, ge=0)
    """Weight of the per-token KL penalty to the reference model; 0 means no reference model is loaded."""
    estimator: KLEstimator = "k3"
    """KL estimator with x = ref - logp: `k1` = -x, `k2` = x^2/2, `k3` = exp(x) - x - 1 (unbiased, >= 0)."""


_MODE_ALIASES: dict[str, tuple[str, str]] = {
    "token_truncate": ("token", "truncate"),
    "token_mask": ("token", "mask"),
    "sequence_truncate": ("sequence_product", "truncate"),
    "sequence_mask": ("sequence_product", "mask"),
}


class ISCorrectionConfig(Section):
    """Training/inference mismatch correction. Also accepts `mode:` token_truncate | token_mask |
    sequence_truncate | sequence_mask (names used by TRL/ms-swift; sequence_* = sequence_product), which sets
    `level` and `action`."""

    enabled: bool = True
    """Weight the per-token surrogate by the training/inference IS weight pi_old/pi_sampler when the engine
    reports sampler logprobs. Mismatch metrics are logged either way."""
    level: ISLevel = "token"
    """`token`: one ratio per token; `sequence_product`: product of token ratios (exact sequence ratio);
    `sequence_geometric`: their geometric mean. Sequence weights apply to every token of the sequence."""
    action: ISAction = "truncate"
    """`truncate` clamps the weight into [lower, threshold]; `mask` zeroes it outside [lower, threshold].
    Masked tokens stay in the token_mean denominator."""
    threshold: float = Field(2.0, gt=0)
    """Upper bound of the IS weight."""
    lower: float | None = None
    """Lower bound of the IS weight. None: 1/threshold for `mask`; no lower clamp for `truncate`."""

    @model_validator(mode="before")
    @classmethod
    def _expand_mode(cls, data: Any) -> Any:
        if not isinstance(data, dict) or "mode" not in data:
            return data
        data = dict(data)
        mode = data.pop("mode")
        if mode is None:
            return data
        if mode not in _MODE_ALIASES:
            raise ValueError(f"is_correction.mode must be one of {sorted(_MODE_ALIASES)}, got {mode!r}")
        for key, value in zip(("level", "action"), _MODE_ALIASES[mode], strict=True):
            if key in data and data[key] != value:
                raise ValueError(f"is_correction.mode={mode!r} sets {key}={value!r} but {key}={data[key]!r} was given")
            data[key] = value
        return data

    @model_validator(mode="after")
    def _check_bounds(self) -> ISCorrectionConfig:
        low = 1.0 / self.threshold if self.lower is None and self.action == "mask" else self.lower
        if low is not None and not 0 <= low < self.threshold:
            raise ValueError(
                f"is_correction bounds [{low}, {self.threshold}] are empty or negative: need 0 <= lower < threshold "
                "(with action 'mask' and no lower, lower = 1/threshold, so threshold must be > 1)."
            )
        return self


PRESETS: dict[str, dict[str, Any]] = {
    "grpo": {"aggregation": "seq_mean_token_mean", "objective": {"kind": "clip"}},
    "bnpo": {"aggregation": "token_mean_local", "objective": {"kind": "clip"}},
    "dr_grpo": {
        "aggregation": "seq_mean_token_sum_norm",
        "objective": {"kind": "clip"},
        "advantage": {"scale_rewards": "none"},
    },
    "dapo": {"aggregation": "token_mean", "objective": {"kind": "clip", "epsilon_high": 0.28}},
    "gspo": {
        "aggregation": "seq_mean_token_mean",
        "objective": {"kind": "gspo", "epsilon_low": 3e-4, "epsilon_high": 4e-4},
    },
}
"""What each `algorithm.loss` preset sets (explicitly given fields win)."""


def _user_dict(value: Any) -> Any:
    """A sub-section as the dict of what the user set (a model instance keeps only its explicit fields)."""
    if isinstance(value, BaseModel):
        return value.model_dump(exclude_unset=True)
    return value


def _merge(preset: dict[str, Any], user: dict[str, Any]) -> dict[str, Any]:
    merged = dict(user)
    for key, value in preset.items():
        given = _user_dict(merged.get(key))
        if key not in merged:
            merged[key] = value
        elif isinstance(value, dict) and isinstance(given, dict):
            merged[key] = _merge(value, given)
    return merged


class AlgorithmConfig(Section):
    """The GRPO algorithm: advantages, objective, aggregation, KL and IS correction (DESIGN.md section 5)."""

    loss: LossPreset | None = None
    """Named loss preset filling the fields below that are not set explicitly:
    `grpo` = seq_mean_token_mean + clip (DeepSeekMath); `bnpo` = token_mean_local (mean over the micro-batch's
    tokens); `dr_grpo` = seq_mean_token_sum_norm + scale_rewards none (Dr. GRPO); `dapo` = token_mean +
    epsilon_high 0.28 (clip-higher); `gspo` = objective gspo + seq_mean_token_mean + epsilon 3e-4/4e-4.
    The other four also set objective.kind clip."""
    aggregation: Aggregation = "token_mean"
    """How per-token losses become the step loss: `token_mean` = sum / valid tokens of the whole step (all
    micro-batches and ranks); `token_mean_local` = mean over each micro-batch's valid tokens (bnpo);
    `seq_mean_token_mean` = mean over sequences of each sequence's token mean; `seq_mean_token_sum_norm` =
    sum / (sequences x max_completion_length) (Dr. GRPO)."""
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig)
    """Group-relative advantage normalisation."""
    objective: ObjectiveConfig = Field(default_factory=ObjectiveConfig)
    """Per-token policy objective and its clip ranges."""
    kl: KLConfig = Field(default_factory=KLConfig)
    """KL penalty to the reference model."""
    distill: DistillConfig | None = None
    """On-policy distillation from a teacher model (per-token advantages); None (default) disables it."""
    is_correction: ISCorrectionConfig = Field(default_factory=ISCorrectionConfig)
    """Importance-sampling correction of the training/inference mismatch (needs sampler logprobs)."""
    off_policy_sequence_mask_delta: float | None = Field(None, ge=0)
    """DeepSeek-V3.2 off-policy sequence masking: drop a negative-advantage sequence whose mean
    (sampler - current) logprob exceeds this delta (e.g. 0.5); None disables it."""
    num_iterations: int = Field(1, ge=1)
    """Optimizer updates (mu) per generated batch; above 1 the PPO ratio departs from 1 and clipping acts."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus: subtract entropy_coef x the policy's token entropy from each token's loss (not IS-weighted).
    0 disables it; the `entropy` metric is logged either way."""
    mask_truncated_completions: bool = False
    """Leave completions that hit rollout.max_completion_length (finish reason `length`) out of the loss: their
    tokens leave the token counts (token_mean), the rows still count as sequences (seq_mean_token_mean, Dr. GRPO).
    They stay in the reward, length and entropy metrics."""

    @model_validator(mode="before")
    @classmethod
    def _expand_preset(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("loss") is None:
            return data
        if not isinstance(data["loss"], str) or data["loss"] not in PRESETS:
            return data  # the Literal check reports the valid names (a mapping there is not hashable)
        return _merge(PRESETS[data["loss"]], data)
