"""Build a tiny random-init reward model (a 2-layer Llama sequence classifier, one label) with the character-level
tokenizer into ./reward-model: a stand-in for a real one, built locally, nothing downloaded."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from grpo_cli.models.tiny import build_tokenizer


def main(out: str = "reward-model") -> None:
    path = Path(out)
    tok = build_tokenizer(path, chars=True)  # not the policy's tokenizer: the reward model keeps its own
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, num_labels=1, pad_token_id=tok.pad_token_id)
    LlamaForSequenceClassification(cfg).save_pretrained(path)
    print(f"reward model written to {path}")


if __name__ == "__main__":
    main(*sys.argv[1:])
