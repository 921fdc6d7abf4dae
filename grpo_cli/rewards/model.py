"""The `reward_model` reward: a sequence-classification checkpoint (its own tokenizer and chat template, which may
differ from the policy's) scores prompt + completion at its last non-pad token, in batches, on the CPU."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=4)
def _load(path: str):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, torch_dtype=torch.float32).eval()
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    tokenizer.padding_side = "right"
    return model, tokenizer


def _text(tokenizer, prompt: str, messages, completion: str) -> str:
    """The conversation in the reward model's own template when the prompt was chat messages (and the model has
    a template), else the policy's prompt text followed by the completion."""
    if isinstance(messages, list) and tokenizer.chat_template:
        return tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": completion}],
                                             tokenize=False)
    return prompt + completion


def reward_model(prompts, completions, *, model: str, batch_size: int = 16, prompt_messages: list | None = None,
                 **_columns) -> list[float]:
    """Score r_j = head(h_j[last non-pad token]) of prompt j + completion j (the checkpoint's single logit), batches
    of `batch_size`, right-padded so a sequence's score does not depend on what it is batched with. Written as a
    `rewards.functions` entry `{model: PATH}` (or `{name: reward_model, kwargs: {model: PATH}}`)."""
    import torch

    net, tokenizer = _load(model)
    messages = prompt_messages or [None] * len(prompts)
    texts = [_text(tokenizer, p, m, c) for p, m, c in zip(prompts, messages, completions, strict=True)]
    out: list[float] = []
    with torch.no_grad():
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(texts[start:start + batch_size], return_tensors="pt", padding=True,
                              add_special_tokens=False)
            logits = net(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            out += [float(x) for x in logits[:, 0]]
    return out
