"""The `algorithm:` config section: defaults, loss presets, explicit fields over presets, aliases, rejections."""

import pytest
from pydantic import BaseModel, ValidationError

from grpo_cli.config.algorithm import (
    PRESETS,
    AdvantageConfig,
    AlgorithmConfig,
    ISCorrectionConfig,
    KLConfig,
    ObjectiveConfig,
)

MODELS = [AdvantageConfig, ObjectiveConfig, KLConfig, ISCorrectionConfig, AlgorithmConfig]


def test_defaults():
    cfg = AlgorithmConfig()
    assert cfg.loss is None and cfg.aggregation == "token_mean" and cfg.num_iterations == 1
    assert cfg.advantage == AdvantageConfig(scale_rewards="group", epsilon=1e-4)
    assert cfg.objective == ObjectiveConfig(kind="clip", epsilon_low=0.2, epsilon_high=0.2, dual_clip_c=None)
    assert cfg.kl == KLConfig(beta=0.0, estimator="k3")
    assert cfg.is_correction == ISCorrectionConfig(enabled=True, level="token", action="truncate", threshold=2.0,
                                                   lower=None)
    assert cfg.off_policy_sequence_mask_delta is None


@pytest.mark.parametrize(
    ("loss", "expected"),
    [
        ("grpo", {"aggregation": "seq_mean_token_mean", "kind": "clip", "eps": (0.2, 0.2), "scale": "group"}),
        ("bnpo", {"aggregation": "token_mean_local", "kind": "clip", "eps": (0.2, 0.2), "scale": "group"}),
        ("dr_grpo", {"aggregation": "seq_mean_token_sum_norm", "kind": "clip", "eps": (0.2, 0.2), "scale": "none"}),
        ("dapo", {"aggregation": "token_mean", "kind": "clip", "eps": (0.2, 0.28), "scale": "group"}),
        ("gspo", {"aggregation": "seq_mean_token_mean", "kind": "gspo", "eps": (3e-4, 4e-4), "scale": "group"}),
    ],
)
def test_presets_expand(loss, expected):
    cfg = AlgorithmConfig(loss=loss)
    assert cfg.loss == loss
    assert cfg.aggregation == expected["aggregation"]
    assert cfg.objective.kind == expected["kind"]
    assert (cfg.objective.epsilon_low, cfg.objective.epsilon_high) == expected["eps"]
    assert cfg.advantage.scale_rewards == expected["scale"]
    assert AlgorithmConfig.model_validate(cfg.model_dump()) == cfg  # the saved resolved config reloads the same


def test_every_preset_is_documented_in_the_loss_field():
    doc = AlgorithmConfig.model_fields["loss"].description
    assert set(PRESETS) == {"grpo", "bnpo", "dr_grpo", "dapo", "gspo"}
    assert all(f"`{name}`" in doc for name in PRESETS)


def test_explicit_fields_win_over_the_preset():
    cfg = AlgorithmConfig(loss="dapo", aggregation="seq_mean_token_mean", objective={"epsilon_high": 0.3})
    assert cfg.aggregation == "seq_mean_token_mean"
    assert cfg.objective.epsilon_high == 0.3 and cfg.objective.kind == "clip"
    cfg = AlgorithmConfig(loss="dr_grpo", advantage={"epsilon": 1e-6})  # partial sub-section: preset fills the rest
    assert cfg.advantage == AdvantageConfig(scale_rewards="none", epsilon=1e-6)
    cfg = AlgorithmConfig(loss="gspo", objective=ObjectiveConfig(epsilon_high=1e-3))  # a model instance too
    assert (cfg.objective.kind, cfg.objective.epsilon_low, cfg.objective.epsilon_high) == ("gspo", 3e-4, 1e-3)
    cfg = AlgorithmConfig(loss="dr_grpo", advantage={"scale_rewards": "group"})
    assert cfg.advantage.scale_rewards == "group"


@pytest.mark.parametrize(
    ("mode", "level", "action"),
    [
        ("token_truncate", "token", "truncate"),
        ("token_mask", "token", "mask"),
        ("sequence_truncate", "sequence_product", "truncate"),
        ("sequence_mask", "sequence_product", "mask"),
    ],
)
def test_is_mode_aliases(mode, level, action):
    cfg = AlgorithmConfig(is_correction={"mode": mode, "threshold": 3.0})
    assert (cfg.is_correction.level, cfg.is_correction.action, cfg.is_correction.threshold) == (level, action, 3.0)
    assert "mode" not in cfg.is_correction.model_dump()
    assert ISCorrectionConfig(mode=mode, level=level).action == action  # agreeing explicit field is fine


@pytest.mark.parametrize(
    ("section", "match"),
    [
        ({"is_correction": {"mode": "token_clip"}}, "mode must be one of"),
        ({"is_correction": {"mode": "token_mask", "action": "truncate"}}, "sets action"),
        ({"is_correction": {"action": "mask", "threshold": 0.5}}, "bounds"),
        ({"is_correction": {"lower": 3.0}}, "bounds"),
        ({"is_correction": {"lower": -0.1}}, "bounds"),
        ({"is_correction": {"threshold": 0}}, "greater than 0"),
        ({"objective": {"dual_clip_c": 1.0}}, "must be > 1"),
        ({"objective": {"dual_clip_c": 0.5}}, "must be > 1"),
        ({"objective": {"kind": "cispo", "dual_clip_c": 3.0}}, "cispo"),
        ({"objective": {"kind": "ppo"}}, "kind"),
        ({"objective": {"epsilon_low": -0.1}}, "epsilon_low"),
        ({"loss": "ppo"}, "loss"),
        ({"aggregation": "sum"}, "aggregation"),
        ({"advantage": {"scale_rewards": "rank"}}, "scale_rewards"),
        ({"advantage": {"epsilon": 0}}, "epsilon"),
        ({"kl": {"beta": -1}}, "beta"),
        ({"kl": {"estimator": "k4"}}, "estimator"),
        ({"num_iterations": 0}, "num_iterations"),
        ({"off_policy_sequence_mask_delta": -1}, "off_policy_sequence_mask_delta"),
        ({"loss_type": "dapo"}, "Extra inputs"),
        ({"objective": {"epsilon": 0.2}}, "Extra inputs"),
        ({"objective": {"cispo_epsilon_low": 0.2}}, "applies to kind 'cispo' only"),
        ({"objective": {"kind": "cispo", "epsilon_low": 0.3}}, "cispo_epsilon_low for a lower clamp"),
        ({"objective": {"kind": "cispo", "cispo_epsilon_low": 1.5}}, "cispo_epsilon_low"),
        ({"advantage": {"estimator": "rloo", "scale_rewards": "batch"}}, "no effect with advantage.estimator 'rloo'"),
        ({"advantage": {"estimator": "rloo", "epsilon": 1e-3}}, "advantage.epsilon has no effect"),
        ({"advantage": {"estimator": "reinforce_pp", "scale_rewards": "none"}}, "reinforce_pp"),
        ({"loss": "dr_grpo", "advantage": {"estimator": "rloo"}}, "dr_grpo sets scale_rewards"),
        ({"advantage": {"estimator": "gae"}}, "estimator"),
        ({"entropy_coef": -0.1}, "entropy_coef"),
    ],
)
def test_bad_values_are_rejected(section, match):
    with pytest.raises(ValidationError, match=match):
        AlgorithmConfig.model_validate(section)


def test_accepted_edge_values():
    assert AlgorithmConfig(objective={"kind": "cispo", "cispo_epsilon_low": 0.5}).objective.cispo_epsilon_low == 0.5
    assert AlgorithmConfig(objective={"kind": "cispo", "epsilon_high": 4.0}).objective.cispo_epsilon_low is None
    assert AlgorithmConfig(advantage={"estimator": "reinforce_pp", "epsilon": 1e-6}).advantage.epsilon == 1e-6
    assert AlgorithmConfig(objective={"dual_clip_c": 3.0}).objective.dual_clip_c == 3.0
    assert ISCorrectionConfig(action="truncate", threshold=0.9).lower is None  # truncate: upper side only
    assert ISCorrectionConfig(action="mask", threshold=1.002, lower=0.999).lower == 0.999


def test_models_are_frozen_strict_and_documented():
    cfg = AlgorithmConfig()
    with pytest.raises(ValidationError):
        cfg.aggregation = "token_mean_local"
    for model in MODELS:
        assert model.model_config["extra"] == "forbid" and model.model_config["frozen"]
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no attribute docstring"
    for name, field in AlgorithmConfig.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            assert field.default_factory is not None, name


def test_dynamic_sampling_refuses_vllm_sleep_level_2():
    from grpo_cli.config.schema import GRPOConfig

    base = {"rollout": {"engine": "vllm", "vllm": {"sleep_level": 2}}, "train": {"dynamic_sampling": {"enabled": True}}}
    with pytest.raises(ValidationError, match="sleep_level 1"):
        GRPOConfig.model_validate(base)
    base["rollout"]["vllm"]["sleep_level"] = 1
    assert GRPOConfig.model_validate(base).train.dynamic_sampling.max_extra_rounds == 4
