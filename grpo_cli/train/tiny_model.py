"""The built-in tiny checkpoint: a 2-layer Llama and a word-level tokenizer, built locally, never downloaded.
The same builder makes the benchmarks' random-init models (Llama or Qwen2, word- or character-level tokenizer)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

TINY_NAME = "builtin:tiny"
TINY_VERSION = 1
SPECIAL = ["<pad>", "<eos>", "<unk>", "<system>", "<user>", "<assistant>"]
WORDS = (
    "zero one two three four five six seven eight nine ten plus minus times is what the a cat dog sun moon "
    "red blue green big small run jump sing write count say hello world yes no and or to of in on up down "
    "left right fast slow word words story tell me please answer number = ? . , !"
).split()
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def cache_dir() -> Path:
    """Where built-in artefacts live: $GRPO_CLI_CACHE or ~/.cache/grpo-cli."""
    return Path(os.environ.get("GRPO_CLI_CACHE", Path.home() / ".cache" / "grpo-cli"))


CHARS = ["Ġ"] + [chr(c) for c in range(33, 127)]
"""The character tokenizer's alphabet: printable ASCII in byte-level form (space is "Ġ"), as byte-level BPE
tokenizers (Qwen2's, which transformers substitutes for a qwen2 checkpoint) spell it."""


def build_tokenizer(path: Path, *, chars: bool = False):
    """Write a fast tokenizer with a chat template: word-level (whitespace split, space-joined decode), or with
    `chars` one token per printable ASCII character (decode concatenates); the chat roles are special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if chars:  # byte-level BPE without merges: one token per character
        core = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(SPECIAL + CHARS)}, merges=[],
                                    unk_token="<unk>"))
        core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        core.add_special_tokens(SPECIAL)
        core.decoder = decoders.ByteLevel()
    else:
        core = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(SPECIAL + WORDS)}, unk_token="<unk>"))
        core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        core.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>", padding_side="left"
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return tok


def build_tiny_checkpoint(
    path: str | Path, *, hidden_size: int = 64, num_layers: int = 2, head_dim: int = 32, seed: int = 0,
    arch: str = "llama", kv_heads: int | None = None, chars: bool = False,
) -> Path:
    """Build a random-init causal LM (fp32, head_dim 32 so vLLM accepts it; MLP width 2·hidden) and its tokenizer
    at `path`: `arch` "llama" or "qwen2" (q/k/v biases), `kv_heads` (default: one per head), `chars` for the
    character-level tokenizer."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(path, chars=chars)
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    config = config_cls(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=hidden_size // head_dim,
        num_key_value_heads=kv_heads or hidden_size // head_dim,
        head_dim=head_dim,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = model_cls(config)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    # Written file by file: `save_pretrained` writes nothing on a rank other than 0 once torch.distributed is
    # initialised (transformers 5), and every rank of a launched job may build this checkpoint.
    from safetensors.torch import save_file

    config.save_pretrained(path)
    model.generation_config.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    (path / "grpo_cli_tiny.json").write_text(json.dumps({"version": TINY_VERSION, "seed": seed}))
    return path


def resolve_model_path(name: str) -> str:
    """Map `builtin:tiny` to its cached folder (built once, atomically); other names pass through."""
    if name != TINY_NAME:
        return name
    target = cache_dir() / f"tiny-v{TINY_VERSION}"
    if (target / "grpo_cli_tiny.json").exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
    try:
        build_tiny_checkpoint(tmp)
        missing = [f for f in ("config.json", "model.safetensors", "tokenizer.json") if not (tmp / f).is_file()]
        if missing:
            raise RuntimeError(f"building {TINY_NAME} left out {missing} (in {tmp})")
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race; its copy is identical
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)
