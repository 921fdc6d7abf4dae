"""Registries match the config Literals; algo keyword-only names match config fields; house-style limits."""

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path
from typing import get_args

import pytest

import grpo_cli.algo
import grpo_cli.train.loss
from grpo_cli.algo.advantages import ADVANTAGE_ESTIMATORS, REWARD_SCALES, group_advantages, process_advantages
from grpo_cli.algo.aggregation import AGGREGATIONS, aggregate_loss
from grpo_cli.algo.distill import distill_advantages, distill_signal
from grpo_cli.algo.importance import IS_ACTIONS, IS_LEVELS, off_policy_sequence_mask, rollout_correction
from grpo_cli.algo.kl import KL_ESTIMATORS, kl_penalty
from grpo_cli.algo.objectives import OBJECTIVES, policy_objective
from grpo_cli.config.distill import DistillConfig
from grpo_cli.config.algorithm import (
    AdvantageConfig,
    AlgorithmConfig,
    ISCorrectionConfig,
    KLConfig,
    ObjectiveConfig,
)

ALGO_DIR = Path(grpo_cli.algo.__file__).parent
MODULES = [importlib.import_module(f"grpo_cli.algo.{m.name}") for m in pkgutil.iter_modules([str(ALGO_DIR)])]
BATCH_FACTS = {"num_items_in_batch", "num_sequences_in_batch", "max_completion_length"}


def literal_values(model, field):
    return set(get_args(model.model_fields[field].annotation))


def kw_only(fn):
    return {p.name for p in inspect.signature(fn).parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY}


@pytest.mark.parametrize(
    ("registry", "model", "field"),
    [
        (REWARD_SCALES, AdvantageConfig, "scale_rewards"),
        (ADVANTAGE_ESTIMATORS, AdvantageConfig, "estimator"),
        (OBJECTIVES, ObjectiveConfig, "kind"),
        (AGGREGATIONS, AlgorithmConfig, "aggregation"),
        (KL_ESTIMATORS, KLConfig, "estimator"),
        (IS_LEVELS, ISCorrectionConfig, "level"),
        (IS_ACTIONS, ISCorrectionConfig, "action"),
    ],
)
def test_registry_keys_equal_config_literal(registry, model, field):
    assert set(registry) == literal_values(model, field)


@pytest.mark.parametrize(
    ("fn", "fields"),
    [
        (group_advantages, set(AdvantageConfig.model_fields)),
        (process_advantages, set(AdvantageConfig.model_fields)),
        (policy_objective, set(ObjectiveConfig.model_fields)),
        (kl_penalty, set(KLConfig.model_fields)),
        (rollout_correction, set(ISCorrectionConfig.model_fields)),
        (off_policy_sequence_mask, {"off_policy_sequence_mask_delta"}),
        (aggregate_loss, {"aggregation"} | BATCH_FACTS),
    ],
)
def test_keyword_only_names_equal_config_fields(fn, fields):
    assert kw_only(fn) == fields
    assert fields - BATCH_FACTS <= set(AlgorithmConfig.model_fields) | set(ObjectiveConfig.model_fields) | set(
        AdvantageConfig.model_fields) | set(KLConfig.model_fields) | set(ISCorrectionConfig.model_fields)


def test_registry_entries_share_one_signature():
    assert all(kw_only(f) == set(ObjectiveConfig.model_fields) - {"kind"} for f in OBJECTIVES.values())
    assert all(kw_only(f) == BATCH_FACTS for f in AGGREGATIONS.values())
    assert all(kw_only(f) == {"threshold", "lower"} for f in IS_ACTIONS.values())
    assert all(kw_only(f) == set(AdvantageConfig.model_fields) - {"estimator"} for f in ADVANTAGE_ESTIMATORS.values())


def test_public_algo_functions_have_no_keyword_defaults_and_a_docstring():
    for module in MODULES:
        for name, fn in inspect.getmembers(module, inspect.isfunction):
            if fn.__module__ != module.__name__ or name.startswith("_"):
                continue
            assert fn.__doc__, f"{module.__name__}.{name} has no docstring"
            for p in inspect.signature(fn).parameters.values():
                assert p.default is inspect.Parameter.empty, f"{module.__name__}.{name}({p.name}=...) has a default"


def test_algo_modules_respect_size_limits_and_imports():
    for path in sorted(ALGO_DIR.glob("*.py")):
        source = path.read_text()
        tree = ast.parse(source)
        assert len(source.splitlines()) <= 400, path
        assert ast.get_docstring(tree), f"{path} has no module docstring"
        assert ".item()" not in source, path
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                statements = sum(isinstance(n, ast.stmt) for n in ast.walk(node)) - 1
                assert statements <= 50, f"{path}:{node.name} has {statements} statements"
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                for mod in names:
                    top = (mod or "").split(".")[0]
                    assert top in {"torch", "grpo_cli", "__future__", "collections", "typing", "math"}, (path, mod)
                    assert not (mod or "").startswith("grpo_cli.") or mod.startswith("grpo_cli.algo"), (path, mod)


def test_every_algorithm_setting_reaches_a_function():
    """Each leaf of `algorithm:` is a keyword of an algo function, or read by name in the train/loss.py bridge or
    the loop (listed here with where); a new setting must be added to one of them."""
    consumed = set().union(*(kw_only(f) for f in (group_advantages, policy_objective, kl_penalty,
                                                   rollout_correction, off_policy_sequence_mask, aggregate_loss,
                                                   distill_signal, distill_advantages)))
    bridge = {"loss": "preset expansion", "advantage": "section", "objective": "section", "kl": "section",
              "is_correction": "section", "num_iterations": "train/loop.py", "entropy_coef": "compute_loss",
              "mask_truncated_completions": "trained_mask", "distill": "section",
              "teacher": "train/distill.py make_teacher", "token_env": "train/distill.py served_teacher"}
    leaves = set(AlgorithmConfig.model_fields) | set(AdvantageConfig.model_fields) | set(
        ObjectiveConfig.model_fields) | set(KLConfig.model_fields) | set(ISCorrectionConfig.model_fields) | set(
        DistillConfig.model_fields)
    assert leaves - {"kind"} - set(bridge) <= consumed, leaves - {"kind"} - set(bridge) - consumed
    source = Path(grpo_cli.train.loss.__file__).read_text()
    assert all(f"algorithm.{name}" in source for name in ("entropy_coef", "mask_truncated_completions"))


def test_dynamic_sampling_keywords_equal_config_fields():
    from grpo_cli.config.sections import DynamicSamplingConfig
    from grpo_cli.train.scoring.dynamic_sampling import fill_step

    assert set(DynamicSamplingConfig.model_fields) - {"enabled"} <= kw_only(fill_step)
    assert kw_only(fill_step) - set(DynamicSamplingConfig.model_fields) == {"weights", "group_size", "dist"}
