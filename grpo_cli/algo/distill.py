"""On-policy distillation: a teacher's per-token signal on the student's own samples, added to (or replacing) the
reward's advantage.

For completion i and token t (sampled by the student), with ℓˢ_it the student's logprob and ℓᵀ_it the teacher's,
both of the sampled token and at the rollout temperature:

    x_it = ℓˢ_it − ℓᵀ_it                              the per-token reverse-KL sample, KL(π_S ‖ π_T) ≈ E_{y~π_S}[x]
    s_it = −clamp(x_it, −clip, clip) · m_it           the distillation signal (0 where the mask m is 0)
    add:     Â_it = A_i + coef · s_it                 A_i the reward's (sequence-level, or per-token) advantage
    replace: Â_it = coef · s_it

ℓˢ is the *behaviour* logprob: the student's logprob of the token under the weights that sampled it, detached
(a constant of the loss, like the reward), as in Tinker's on-policy distillation (advantage = −coef ·
(sampled logprob − teacher logprob), thinkingmachines.ai/blog/on-policy-distillation) and slime's OPD
(Â_t = A_t − λ·KL_t on the rollout's log-probs, docs/en/advanced/on-policy-distillation.md); verl's recipes use
its `old_log_prob`, the same quantity. The loss's policy gradient then moves the student's logprob of each
token by the teacher's verdict on it: minimising the reverse KL on the student's own samples. The clip bounds
one token's say when the teacher finds a token near-impossible (ℓᵀ → −∞); it does not touch the metric.
The sequence advantage is broadcast over the row's tokens before the per-token signal is added; masked
positions (padding, environment tokens of a multi-turn rollout) get Â = 0, as `numerics.token_advantages`
gives them, so a fully masked row contributes nothing.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from grpo_cli.algo.numerics import masked_log_ratio, masked_values, token_advantages, token_mean

DistillMode = Literal["add", "replace"]


def distill_signal(student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor, *, clip: float) -> Tensor:
    """s = −clamp(ℓˢ − ℓᵀ, −clip, clip) on valid positions, 0 elsewhere; (b, T) fp32, detached. A non-finite
    log-ratio at a valid position raises ValueError (a broken teacher score must not become a silent 0)."""
    x = masked_log_ratio(student_logprobs.detach(), teacher_logprobs.detach(), mask, name="student - teacher logprobs")
    return masked_values(-x.clamp(-clip, clip), mask)


def distill_advantages(advantages: Tensor, signal: Tensor, mask: Tensor, *, coef: float, mode: DistillMode) -> Tensor:
    """Â (b, T) fp32: A broadcast per token (`add`) or dropped (`replace`), plus coef · s; 0 at masked positions."""
    if mode not in ("add", "replace"):
        raise ValueError(f"distill mode must be 'add' or 'replace', got {mode!r}")
    base = token_advantages(advantages, mask) if mode == "add" else torch.zeros_like(signal)
    return masked_values(base + coef * signal, mask)


def distill_metrics(student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor, *, advantages: Tensor,
                    signal: Tensor, coef: float, mode: DistillMode, clip: float) -> dict[str, Tensor]:
    """Token means over valid tokens: `reverse_kl` = mean of x = ℓˢ − ℓᵀ (unclipped; the k1 estimate of
    KL(student ‖ teacher) on the student's samples), `teacher_logprob` = mean of ℓᵀ, `clipped_frac` = share of
    tokens with |x| > clip, and `advantage_share` = Σ|coef·s| / (Σ|coef·s| + Σ|A|) (the share of the final
    advantage's magnitude the teacher contributes; 1 with mode `replace`, 0 when both are 0)."""
    x = masked_log_ratio(student_logprobs.detach(), teacher_logprobs.detach(), mask, name="student - teacher logprobs")
    teacher = masked_values(teacher_logprobs.detach(), mask)
    dense = (coef * signal).abs().sum()
    reward = token_advantages(advantages, mask).abs().sum() if mode == "add" else torch.zeros_like(dense)
    total = dense + reward
    share = torch.where(total > 0, dense / total.clamp(min=torch.finfo(total.dtype).tiny), torch.zeros_like(total))
    return {"reverse_kl": token_mean(x, mask), "teacher_logprob": token_mean(teacher, mask),
            "clipped_frac": token_mean((x.abs() > clip).float(), mask), "advantage_share": share}
