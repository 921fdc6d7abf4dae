"""Process supervision in the reward phase: score steps, place each step's end on a token, and turn outcome and step
rewards into (B, T) advantages (an outcome reward is a step that ends at the completion's last token)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from grpo_cli.config.schema import GRPOConfig
from grpo_cli.rewards.process import score_steps, split_steps, step_end_tokens
from grpo_cli.rewards.resolve import RewardFn
from grpo_cli.rollout.base import RolloutBatch
from grpo_cli.train.loss import compute_process_advantages


@dataclass
class StepRewards:
    """`values[k][j][s]`: reward of step s of completion j by the k-th process function; `ends[j][s]`: the token
    index where that step ends; `last[j]`: the last token index of completion j."""

    values: list[list[list[float]]]
    ends: list[list[int]]
    last: list[int]

    @classmethod
    def score(cls, cfg: GRPOConfig, fns: list[RewardFn], prompts: list[str], completions: list[str],
              columns: dict[str, list], rollout: RolloutBatch, tokenizer) -> StepRewards:
        if tokenizer is None:
            raise ValueError("process reward functions need the tokenizer to place step ends on tokens")
        split = [split_steps(c, cfg.rewards.step_separator) for c in completions]
        steps = [s for s, _ in split]

        def decode(ids: list[int]) -> str:
            return tokenizer.decode(ids, skip_special_tokens=True)

        ends = [step_end_tokens(decode, ids, e) for ids, (_, e) in zip(rollout.completion_ids, split, strict=True)]
        values = [score_steps(f, prompts, completions, steps, columns) for f in fns if f.kind == "process"]
        return cls(values, ends, [max(0, len(ids) - 1) for ids in rollout.completion_ids])

    def rows(self, idx: list[int]) -> StepRewards:
        """The given completions, in that order (dynamic sampling keeps informative groups)."""
        return StepRewards([[fn_rows[j] for j in idx] for fn_rows in self.values], [self.ends[j] for j in idx],
                           [self.last[j] for j in idx])

    @staticmethod
    def cat(parts: list[StepRewards]) -> StepRewards:
        """Completions of several generation rounds, in order."""
        return StepRewards([[row for p in parts for row in p.values[k]] for k in range(len(parts[0].values))],
                           [e for p in parts for e in p.ends], [x for p in parts for x in p.last])

    def merge(self, fns: list[RewardFn], outcome: list[RewardFn], outcome_table: torch.Tensor) -> torch.Tensor:
        """(B, F) per-function reward of each completion: outcome values as scored, process functions the mean
        of their valid step rewards (NaN without any)."""
        cols, o, p = [], 0, 0
        for f in fns:
            if f.kind == "outcome":
                cols.append(outcome_table[:, o])
                o += 1
                continue
            means = []
            for row in self.values[p]:
                ok = [v for v in row if not math.isnan(v)]
                means.append(sum(ok) / len(ok) if ok else math.nan)
            cols.append(torch.tensor(means, dtype=torch.float32))
            p += 1
        assert o == len(outcome)
        return torch.stack(cols, dim=1)

    def advantages(self, cfg: GRPOConfig, fns: list[RewardFn], per_func: torch.Tensor, *, num_tokens: int
                   ) -> torch.Tensor:
        """(B, num_tokens) advantages from every weighted step reward (outcome rewards end at the last token)."""
        rows = []
        for j, last in enumerate(self.last):
            entries, p = [], 0
            for k, f in enumerate(fns):
                if f.kind == "outcome":
                    entries.append((f.weight * float(per_func[j, k]), last))
                else:
                    entries += [(f.weight * r, e) for r, e in zip(self.values[p][j], self.ends[j], strict=True)]
                    p += 1
            rows.append(entries)
        width = max(1, *map(len, rows))
        rewards = torch.full((len(rows), width), math.nan)
        ends = torch.zeros((len(rows), width), dtype=torch.long)
        for j, entries in enumerate(rows):
            for s, (r, e) in enumerate(entries):
                rewards[j, s], ends[j, s] = r, e
        return compute_process_advantages(rewards, ends, group_size=cfg.train.generations_per_prompt,
                                          num_tokens=num_tokens, algorithm=cfg.algorithm)
