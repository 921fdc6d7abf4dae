"""`grpo diagnose-mismatch`: sample with the rollout engine, recompute the logprobs with the training-side model and
turn both into the `rollout_correction/` metrics, verdicts, worst cases, a log-ratio histogram and a recommendation.
torch loads inside the functions that need it, so the CLI can check metric names before any model loads.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal, NamedTuple

from grpo_cli.config.errors import UserError
from grpo_cli.train.alarms import K3_KL_ALARM

if TYPE_CHECKING:
    import torch

    from grpo_cli.config.schema import GRPOConfig

SCHEMA_PATH = Path(__file__).with_name("diagnose_schema.json")
Verdict = Literal["ok", "watch", "correct", "info"]
VERDICT_ORDER = ("info", "ok", "watch", "correct")


class Rule(NamedTuple):
    """Verdict rule of one metric: `kind` above (x), abs (|x|), dev1 (|x − 1|) grow with mismatch, below (x)
    shrinks with it; `watch`/`correct` are where the verdict turns; `info` metrics get no verdict."""

    kind: Literal["above", "abs", "dev1", "below", "info"]
    watch: float
    correct: float
    meaning: str


# Defaults chosen so that the same weights in the same dtype read OK, a bf16 engine on a dense model reads
# OK-to-watch (reported k1/k3 of healthy bf16 runs are ~1e-4..2e-3), and "correct it" starts where the training
# alarm fires (K3_KL_ALARM); χ² ≈ 2·KL for small mismatch, hence the doubled bounds.
RULES: dict[str, Rule] = {
    "kl": Rule("abs", 1e-3, K3_KL_ALARM, "k1 estimate of KL(rollout‖train), mean over tokens"),
    "k3_kl": Rule("above", 1e-3, K3_KL_ALARM, "k3 estimate of KL(rollout‖train), ≥ 0"),
    "chi2_token": Rule("above", 2e-3, 2 * K3_KL_ALARM, "variance of the token IS ratio (mean ρ² − 1)"),
    "chi2_seq": Rule("above", 0.1, 1.0, "variance of the sequence (product) IS ratio; grows with length"),
    "chi2_seq_geo": Rule("above", 2e-3, 2 * K3_KL_ALARM, "variance of the per-sequence geometric-mean ratio"),
    "ess": Rule("below", 0.99, 0.9, "effective sample size of the token weights, fraction of tokens"),
    "ess_seq": Rule("below", 0.99, 0.9, "effective sample size of the per-sequence weights"),
    "is_weight_mean": Rule("dev1", 1e-2, 5e-2, "mean IS weight the configured correction would apply"),
    "clipped_frac": Rule("above", 1e-3, 1e-2, "tokens the configured correction would truncate or mask"),
    "log_ppl_diff": Rule("abs", 1e-2, 5e-2, "mean per-sequence log(PPL_train / PPL_rollout): a bias"),
    "log_ppl_abs_diff": Rule("above", 1e-2, 5e-2, "mean per-sequence |log PPL difference|"),
    "log_ppl_diff_max": Rule("abs", 5e-2, 0.2, "largest per-sequence log PPL difference"),
    "log_ppl_diff_min": Rule("abs", 5e-2, 0.2, "smallest per-sequence log PPL difference"),
    "ppl_ratio": Rule("dev1", 1e-2, 5e-2, "mean per-sequence PPL_train / PPL_rollout"),
    "training_ppl": Rule("info", 0, 0, "perplexity of the samples under the trainer"),
    "training_log_ppl": Rule("info", 0, 0, "mean NLL per token under the trainer"),
    "rollout_ppl": Rule("info", 0, 0, "perplexity of the samples under the engine"),
    "rollout_log_ppl": Rule("info", 0, 0, "mean NLL per token under the engine"),
}
METRIC_NAMES: tuple[str, ...] = tuple(RULES)
"""The `rollout_correction/` metric names (without the prefix); a test pins them to the algorithm core's."""

# Grids the recommendation searches; the geometric mean of per-token ratios lives close to 1 (NeMo/verl presets
# use 0.999–1.002), so its grid is much tighter than the token and product ones.
OPTION_GRID: dict[str, tuple[float, ...]] = {
    "token": (1.5, 2.0, 3.0, 5.0),
    "sequence_product": (2.0, 3.0, 5.0, 10.0),
    "sequence_geometric": (1.001, 1.002, 1.01, 1.05, 1.1),
}
MASK_BUDGET_TOKENS = 0.01
"""A token mask is recommended only at a threshold that drops at most this fraction of tokens."""
MASK_BUDGET_SEQUENCES = 0.10
"""A sequence mask is recommended only at a threshold that drops at most this fraction of sequences."""


def report_schema() -> dict:
    """The documented JSON schema of the `--json` report (draft 2020-12; every object closed to extra keys)."""
    return json.loads(SCHEMA_PATH.read_text())


# ---- verdicts and gates ----------------------------------------------------------------------------------


def verdict(name: str, value: float) -> Verdict:
    """OK / watch / correct of one metric per `RULES`."""
    rule = RULES[name]
    if rule.kind == "info":
        return "info"
    if rule.kind == "below":
        return "ok" if value >= rule.watch else "watch" if value >= rule.correct else "correct"
    x = {"above": value, "abs": abs(value), "dev1": abs(value - 1.0)}[rule.kind]
    return "ok" if x < rule.watch else "watch" if x < rule.correct else "correct"


def rule_text(name: str) -> str:
    rule = RULES[name]
    if rule.kind == "info":
        return "-"
    if rule.kind == "below":
        return f"OK ≥ {rule.watch:g} > watch ≥ {rule.correct:g}"
    x = {"above": "x", "abs": "|x|", "dev1": "|x−1|"}[rule.kind]
    return f"{x}: OK < {rule.watch:g} ≤ watch < {rule.correct:g}"


def worst(verdicts: list[Verdict]) -> Verdict:
    return max(verdicts, key=VERDICT_ORDER.index, default="ok")


def parse_gates(items: list[str] | None, *, flag: str) -> dict[str, float]:
    """`metric=value` items (prefix `rollout_correction/` optional) -> {metric: limit}; UserError names the fix."""
    out: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        name = name.strip().removeprefix("rollout_correction/")
        if not sep or name not in RULES:
            raise UserError(f"{flag} {item!r}: expected METRIC=VALUE with METRIC one of: {', '.join(METRIC_NAMES)}.")
        try:
            out[name] = float(value)
        except ValueError:
            raise UserError(f"{flag} {item!r}: {value!r} is not a number.") from None
    return out


def check_gates(metrics: dict[str, float], *, above: dict[str, float], below: dict[str, float]) -> list[dict]:
    """One entry per gate; a gate fails when the metric is strictly above (below) its limit."""
    gates = [dict(metric=m, op="above", limit=v, value=metrics[m], failed=metrics[m] > v) for m, v in above.items()]
    return gates + [dict(metric=m, op="below", limit=v, value=metrics[m], failed=metrics[m] < v)
                    for m, v in below.items()]


# ---- sampling and recomputation --------------------------------------------------------------------------


@dataclass
class Sample:
    """What was sampled and both sides' logprobs: (B, T) fp32 CPU tensors, padded with 0 where `mask` is False."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    group_size: int
    train: torch.Tensor
    rollout: torch.Tensor
    mask: torch.Tensor


def checkpoint_model_path(folder: str | Path) -> str:
    """The Hugging Face model folder of `--checkpoint`: the folder itself or its policy/model/hf subfolder."""
    folder = Path(folder)
    for cand in (folder, folder / "policy", folder / "model", folder / "hf"):
        if (cand / "config.json").is_file():
            if not any((cand / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
                raise UserError(f"--checkpoint {folder}: {cand} holds a model but no tokenizer; save the tokenizer "
                                "next to it (tokenizer.save_pretrained) so both sides tokenise alike.")
            return str(cand)
    raise UserError(f"--checkpoint {folder}: no Hugging Face model found (config.json missing in it and in its "
                    "policy/, model/ and hf/ subfolders); pass a folder written by save_pretrained.")


def load_training_model(cfg: GRPOConfig, model_path: str, device: torch.device):
    """The policy exactly as `train` loads it (model.dtype, model.attn_implementation, train mode), frozen."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=getattr(torch, cfg.model.dtype), attn_implementation=cfg.model.attn_implementation
    ).to(device)
    return model.train().requires_grad_(False)


def sample(cfg: GRPOConfig, *, num_prompts: int, engine=None) -> tuple[Sample, object, dict]:
    """Sample `num_prompts` × G completions with `engine` (default: the configured one, closed afterwards) and
    recompute their logprobs with the training-side model. Returns the sample, the tokenizer and the setup."""
    from grpo_cli.data.prompts import PromptCursor, tokenize_prompts
    from grpo_cli.data.sources import load_rows
    from grpo_cli.rollout.factory import EngineContext, make_engine, sampling_params
    from grpo_cli.train.batch import build_batch
    from grpo_cli.train.policy import eos_token_ids, load_tokenizer, pick_device
    from grpo_cli.train.step import batch_logprobs
    from grpo_cli.train.tiny_model import resolve_model_path

    start = time.perf_counter()
    model_path = resolve_model_path(cfg.model.name_or_path)
    device = pick_device(cfg, 0)
    tokenizer = load_tokenizer(model_path)
    model = load_training_model(cfg, model_path, device)
    prompts, _ = tokenize_prompts(
        load_rows(cfg.data.source, seed=cfg.train.seed), tokenizer, prompt_column=cfg.data.prompt_column,
        max_prompt_length=cfg.data.max_prompt_length, overlong_prompts=cfg.data.overlong_prompts,
    )
    prompts = PromptCursor(prompts, seed=cfg.train.seed, shuffle=cfg.data.shuffle).take(num_prompts)
    own = engine is None
    if own:
        ctx = EngineContext(model_path, eos_token_ids(tokenizer, model), tokenizer.pad_token_id)
        engine = make_engine(cfg, ctx, policy=model)
    try:
        rollout = engine.generate([p.ids for p in prompts], sampling_params(cfg, seed=cfg.train.seed))
        rollout_dtype = _engine_dtype(engine, cfg)
    finally:
        if own:
            engine.close()
    if rollout.sampler_logprobs is None:
        raise UserError(f"the {cfg.rollout.engine} engine ({cfg.rollout.mode}) reported no sampler logprobs, so "
                        "there is nothing to compare; use an engine that returns them (hf, vllm, grpo serve-rollout).")
    g = cfg.train.generations_per_prompt
    batch = build_batch(rollout, group_size=g, pad_token_id=tokenizer.pad_token_id).to(device)
    train = batch_logprobs(model, batch, micro_batch_size=cfg.train.micro_batch_size,
                           temperature=cfg.rollout.temperature)
    smp = Sample(rollout.prompt_ids, rollout.completion_ids, g, train.float().cpu(),
                 batch.sampler_logprobs.float().cpu(), batch.completion_mask.cpu() != 0)
    setup = dict(
        model=model_path, engine=cfg.rollout.engine, mode=cfg.rollout.mode, rollout_dtype=rollout_dtype,
        training_dtype=cfg.model.dtype, attn_implementation=cfg.model.attn_implementation,
        temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k, seed=cfg.train.seed,
        num_prompts=len(prompts), generations_per_prompt=g, num_sequences=len(smp.completion_ids),
        num_tokens=int(smp.mask.sum()), is_correction=cfg.algorithm.is_correction.model_dump(),
        seconds=round(time.perf_counter() - start, 3),
    )
    return smp, tokenizer, setup


def _engine_dtype(engine, cfg: GRPOConfig) -> str:
    """The dtype the engine actually ran in when it says (vLLM, hf copy), else what the config asked for."""
    model = getattr(engine, "model", None)
    dtype = getattr(engine, "dtype", None) or (next(model.parameters()).dtype if model is not None else None)
    if dtype is not None:
        return str(dtype).removeprefix("torch.")
    if cfg.rollout.mode == "server":
        return "as served"
    return cfg.model.dtype if cfg.rollout.dtype == "auto" else cfg.rollout.dtype
