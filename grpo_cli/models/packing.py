"""Shared-prompt packing of a [left-padded prompt | right-padded completion] batch for one forward pass.

The G completions of a prompt go into one packed row after a single copy of the prompt, [prompt | c_1 | c_2 | …],
with no right padding between them. A 4D attention mask lets each completion token see the prompt and the earlier
tokens of its own completion only, and every token keeps its original position id, so each logit equals the one
an unpacked forward pass computes. Pure index bookkeeping; no model code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Packing:
    """R packed rows of width N built from B sequences of width S = prompt_len + T.

    `src` (R, N): flat index b·S + s of the original position copied there, −1 for padding. `segment` (R, N): 0 on
    the prompt, k ≥ 1 on the row's k-th completion, −1 on padding. `row` (B,), `pos` (B, T): the packed row and
    position whose logits predict completion token t of sequence b (t = 0: the prompt's last position). `start`,
    `width` (B,): where sequence b's completion begins in its row, and its width (positions
    [start, start + width) of row `row[b]`). `prompt_start` (B,): where the `prompt_len` positions of sequence b's
    prompt begin in that row (0 when each row holds one prompt; a single row holds every group in turn).
    """

    src: torch.Tensor
    segment: torch.Tensor
    row: torch.Tensor
    pos: torch.Tensor
    start: torch.Tensor
    width: torch.Tensor
    prompt_len: int
    prompt_start: torch.Tensor


def completion_widths(completion_mask: torch.Tensor) -> torch.Tensor:
    """(B,) last unmasked completion position + 1 (0 for an empty completion); right padding is what lies after."""
    steps = completion_mask.shape[1]
    return (completion_mask * torch.arange(1, steps + 1, device=completion_mask.device)).amax(dim=1)


def prompt_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int) -> list[list[int]]:
    """The sequences of each group, groups in the order of their first sequence: sequences whose first `prompt_len`
    ids and mask entries are equal (the completions of one prompt) form one."""
    key = torch.cat([input_ids[:, :prompt_len], attention_mask[:, :prompt_len].to(input_ids.dtype)], dim=1)
    groups: dict[int, list[int]] = {}
    for b, g in enumerate(torch.unique(key, dim=0, return_inverse=True)[1].tolist()):
        groups.setdefault(g, []).append(b)
    return list(groups.values())


def _rows(groups: list[list[int]], widths: list[int], prompt_len: int, max_row: int) -> list[list[int]]:
    """Sequences per packed row: each group's sequences in order, a new row when the next would pass max_row."""
    rows = []
    for seqs in groups:
        current, length = [], prompt_len
        for b in seqs:
            if current and length + widths[b] > max_row:
                rows.append(current)
                current, length = [], prompt_len
            current.append(b)
            length += widths[b]
        rows.append(current)
    return rows


def plan_packing(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_len: int, *,
                 max_row: int | None) -> Packing:
    """Pack sequences (B, S) whose first `prompt_len` ids and mask entries are equal into shared rows of at most
    `max_row` positions, one prompt per row (a longer single sequence gets a row of its own). `max_row=None`: one
    row, [prompt₁ | its completions | prompt₂ | …], no padding between them — only for attention that keeps each
    group apart by the layout (`packed_attention`), not by a row-wide mask (`packed_mask` treats every prompt of a
    row as shared)."""
    batch, width = input_ids.shape
    groups = prompt_groups(input_ids, attention_mask, prompt_len)
    widths = completion_widths(attention_mask[:, prompt_len:]).tolist()

    if max_row is None:
        rows = [groups]
    else:
        rows = [[seqs] for seqs in _rows(groups, widths, prompt_len, max_row)]
    n = max(sum(prompt_len + sum(widths[b] for b in seqs) for seqs in row) for row in rows)
    src = torch.full((len(rows), n), -1, dtype=torch.long)
    segment = torch.full((len(rows), n), -1, dtype=torch.long)
    row_of, pos = torch.zeros(batch, dtype=torch.long), torch.full((batch, width - prompt_len), n - 1)
    starts, prompt_starts = torch.zeros(batch, dtype=torch.long), torch.zeros(batch, dtype=torch.long)
    for r, row in enumerate(rows):
        start, k = 0, 0
        for seqs in row:
            prompt_at = start
            src[r, start : start + prompt_len] = seqs[0] * width + torch.arange(prompt_len)
            segment[r, start : start + prompt_len] = 0
            start += prompt_len
            for b in seqs:
                w, k = widths[b], k + 1
                src[r, start : start + w] = b * width + prompt_len + torch.arange(w)
                segment[r, start : start + w] = k
                row_of[b], starts[b], prompt_starts[b] = r, start, prompt_at
                pos[b, 0] = prompt_at + prompt_len - 1
                pos[b, 1:w] = start + torch.arange(max(w - 1, 0))  # an empty completion (w = 0): none
                start += w
    device = input_ids.device
    return Packing(src.to(device), segment.to(device), row_of.to(device), pos.to(device), starts.to(device),
                   torch.tensor(widths, dtype=torch.long, device=device), prompt_len, prompt_starts.to(device))


def packed_mask(packing: Packing, valid: torch.Tensor) -> torch.Tensor:
    """Boolean attention mask (R, 1, N, N), True = may attend: query q sees key k ≤ q that is unmasked (`valid`
    (R, N)) and lies on the prompt or in q's own completion; every position also sees itself (no empty rows)."""
    seg, n = packing.segment, packing.segment.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool, device=seg.device).tril()
    same = (seg[:, None, :] == 0) | (seg[:, None, :] == seg[:, :, None])
    allowed = causal & same & valid[:, None, :].bool()
    return (allowed | torch.eye(n, dtype=torch.bool, device=seg.device))[:, None]


def attention_cost(rows: int, width: int, *, hidden_size: int, keys: int | None = None) -> float:
    """Relative cost of a forward pass over (rows, width) positions whose queries each attend to `keys` positions
    (default: the row width): positions × (1 + keys / (6·hidden)).

    Per position, the linear layers cost ~24·h² FLOPs (per layer) and attention ~4·keys·h (masked keys count: the
    kernel does not skip them), hence the keys / 6h term."""
    return rows * width * (1.0 + (width if keys is None else keys) / (6.0 * hidden_size))
