"""`algorithm.distill`: the teacher (a local checkpoint the backend holds, or a `grpo serve-rollout` server), its
tokenizer check at start, and the step's distillation phase (math in `grpo_cli.algo.distill`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from grpo_cli.algo.distill import distill_advantages, distill_metrics, distill_signal
from grpo_cli.config.errors import UserError
from grpo_cli.config.schema import GRPOConfig
from grpo_cli.models.tiny import resolve_model_path
from grpo_cli.runtime.dist import DistInfo
from grpo_cli.train.batch import TrainBatch
from grpo_cli.train.loss import trained_mask
from grpo_cli.train.weights.sync_ranks import attempt, gather_outcomes

TeacherScore = Callable[[TrainBatch], torch.Tensor]
"""The teacher's logprobs (B, T) of a batch's completion tokens (0 after each row's completion)."""
PREFIX = "distill/"


def tokenizer_difference(student, teacher) -> str | None:
    """What differs between two tokenizers (vocabulary, special tokens and their ids), None when nothing does."""
    a, b = student.get_vocab(), teacher.get_vocab()
    if a != b:
        only = sorted(set(a.items()) ^ set(b.items()), key=str)[:3]
        return f"vocabularies differ ({len(a)} vs {len(b)} entries; e.g. {only})"
    for what in ("all_special_tokens", "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        x, y = getattr(student, what, None), getattr(teacher, what, None)
        if (sorted(x) if isinstance(x, list) else x) != (sorted(y) if isinstance(y, list) else y):
            return f"{what} differ ({x!r} vs {y!r})"
    return None


def _refuse_tokenizers(student_path: str, teacher: str, difference: str) -> None:
    raise UserError(
        f"algorithm.distill.teacher {teacher} does not share the policy's tokenizer ({student_path}): {difference}. "
        "The teacher scores the student's token ids, so both must use one tokenizer: pick a teacher of the "
        "policy's model family (same tokenizer files)."
    )


def _teacher_hint(path: Path) -> str:
    """The command that makes a missing `RUN/final-model` teacher: the run that writes it (tiny-cpu-distill's teacher
    is the default preset's run, so a new user who never read the preset's header learns it here)."""
    if path.name != "final-model":
        return ""
    return (f"Train the teacher first: `grpo train --output-dir {path.parent}` writes {path} when it ends (add the "
            "teacher's --preset or --config; the tiny-cpu-distill preset's teacher is the default preset, about a "
            "minute on a laptop), run from this folder. ")


def local_teacher(cfg: GRPOConfig) -> str | None:
    """The resolved folder of a local teacher (`builtin:` names built on first use), None when there is none."""
    d = cfg.algorithm.distill
    if d is None or d.served:
        return None
    return resolve_model_path(d.teacher)


def check_local_teacher(student_path: str, teacher_path: str) -> None:
    """Refuse (UserError, exit 2) a teacher folder whose tokenizer differs from the policy's."""
    from transformers import AutoTokenizer

    if not Path(teacher_path).is_dir():
        raise UserError(f"algorithm.distill.teacher {teacher_path} is not a folder. {_teacher_hint(Path(teacher_path))}"
                        "Or give another checkpoint folder (--set algorithm.distill.teacher=PATH) or the URL of a "
                        "`grpo serve-rollout` server.")
    load = AutoTokenizer.from_pretrained
    diff = tokenizer_difference(load(student_path), load(teacher_path))
    if diff:
        _refuse_tokenizers(student_path, teacher_path, diff)


def served_teacher(cfg: GRPOConfig, student_path: str, student_tokenizer) -> TeacherScore:
    """Connect to the teacher's `grpo serve-rollout` server and check its tokenizer: fully when the folder its
    /info names exists here, else by vocabulary size and EOS ids. Returns the batch scorer (its /score route)."""
    from grpo_cli.rollout.base import RolloutError
    from grpo_cli.rollout.http_engine import model_identity
    from grpo_cli.rollout.remote.client import ServerEngine

    d = cfg.algorithm.distill
    try:
        server = ServerEngine([d.teacher], token=d.token, start_hint="grpo serve-rollout --engine hf --model TEACHER")
    except RolloutError as exc:
        raise UserError(f"algorithm.distill.teacher {d.teacher} is not a ready `grpo serve-rollout` server ({exc}). "
                        "A served teacher is scored through serve-rollout's /score route: start it with `grpo "
                        "serve-rollout --model TEACHER`; a stock `vllm serve` (prompt logprobs) is not supported as a "
                        "teacher yet.") from exc
    info = server.info[server.urls[0]]
    where = f"{d.teacher} (serving {info.get('model')})"
    if info.get("model") and Path(info["model"]).is_dir():
        from transformers import AutoTokenizer

        diff = tokenizer_difference(AutoTokenizer.from_pretrained(student_path),
                                    AutoTokenizer.from_pretrained(info["model"]))
    elif info.get("vocab_size") != (want := model_identity(student_path).get("vocab_size")):
        diff = f"vocabulary sizes differ ({want} vs {info.get('vocab_size')})"
    else:
        eos = student_tokenizer.eos_token_id
        diff = None if eos in (info.get("eos_token_ids") or [eos]) else f"EOS id {eos} not in {info['eos_token_ids']}"
    if diff:
        _refuse_tokenizers(student_path, where, diff)

    def score(batch: TrainBatch) -> torch.Tensor:
        ids, rows = batch.input_ids.cpu(), batch.attention_mask.cpu().bool()
        widths = rows[:, -batch.num_completion_tokens:].sum(dim=1).tolist()
        logprobs = server.score([ids[j][rows[j]].tolist() for j in range(len(batch))])
        out = torch.zeros(batch.completion_mask.shape, dtype=torch.float32)
        for j, (w, lp) in enumerate(zip(widths, logprobs, strict=True)):
            if w:
                out[j, :w] = torch.tensor(lp[-w:], dtype=torch.float32)
        return out.to(batch.completion_mask.device)

    return score


def make_teacher(cfg: GRPOConfig, student_path: str, student_tokenizer, backend) -> TeacherScore | None:
    """The step's teacher scorer (None without `algorithm.distill`): the backend's `teacher_model` (loaded with the
    policy, checked here) or a served one."""
    d = cfg.algorithm.distill
    if d is None:
        return None
    if d.served:
        return served_teacher(cfg, student_path, student_tokenizer)
    temp, micro = cfg.rollout.temperature, cfg.train.micro_batch_size
    return lambda batch: backend.batch_logprobs(batch, micro_batch_size=micro, temperature=temp, teacher=True)


def distill_phase(cfg: GRPOConfig, batch: TrainBatch, teacher: TeacherScore, student: Callable[[], torch.Tensor],
                  *, info: DistInfo) -> dict[str, float]:
    """Score the batch with the teacher and replace `batch.advantages` by the (B, T) distilled advantages. The
    student's logprobs are the behaviour ones: `batch.old_logprobs` when μ > 1 computed them, else `student()` (the
    policy's no-grad pass before this step's update). Masks: the tokens the loss trains on (`trained_mask`).

    Collective: the ranks agree on the teacher's outcome (`sync_ranks.gather_outcomes`), so a teacher failing for
    one rank's request (its server down, a row it refuses) raises on every rank, the same kind of error (a server
    that went away lets every rank save its checkpoint together), instead of leaving the others in the step's
    next collective."""
    d = cfg.algorithm.distill
    mask = trained_mask(batch.completion_mask, batch.truncated, algorithm=cfg.algorithm)
    behaviour = batch.old_logprobs if batch.old_logprobs is not None else student()
    teacher_lp, error = attempt(lambda: teacher(batch))
    gather_outcomes(None, error, info)
    signal = distill_signal(behaviour, teacher_lp, mask, clip=d.clip)
    metrics = distill_metrics(behaviour, teacher_lp, mask, advantages=batch.advantages, signal=signal, coef=d.coef,
                              mode=d.mode, clip=d.clip)
    batch.advantages = distill_advantages(batch.advantages, signal, mask, coef=d.coef, mode=d.mode)
    return {PREFIX + name: float(value) for name, value in metrics.items()}
