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
TOOLS_NAME = "builtin:tiny-tools"
"""The built-in tiny model whose tokenizer can call tools (`tiny-cpu-tools`)."""
MOE_NAME = "builtin:tiny-moe"
"""A tiny Qwen3-MoE with the built-in tokenizer (4 experts, top 2, in both layers): the stand-in a MoE preset's
`--rehearse` trains with expert parallelism."""
VLM_NAME = "builtin:tiny-vlm"
"""A tiny Qwen2-VL (`models/tiny_vlm.py`): a 2-block vision tower, the 2-layer language model, Qwen2-VL's vision
tokens in the tokenizer and a PIL image processor; the built-in image task is `builtin:shapes`."""
VLM25_NAME = "builtin:tiny-vlm-qwen2.5"
"""Its Qwen2.5-VL twin (same tokenizer, image processor and language model; Qwen2.5-VL's vision tower: RMSNorm,
gated MLP, window attention in block 0, full attention in block 1): the stand-in a Qwen2.5-VL preset's
`--rehearse` trains."""
BUILTINS = {TINY_NAME: ("tiny", {}), TOOLS_NAME: ("tiny-tools", {"tools": True}),
            MOE_NAME: ("tiny-moe", {"arch": "qwen3_moe"}), VLM_NAME: ("tiny-vlm", {"arch": "qwen2_vl"}),
            VLM25_NAME: ("tiny-vlm-qwen2.5", {"arch": "qwen2_5_vl"})}
"""Built-in model name → (cache folder stem, `build_tiny_checkpoint` arguments)."""
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


TOOL_SPECIAL = ["<tool>"]
"""The tool role of `TOOLS_TEMPLATE` (a special token, like the other roles)."""
TOOL_WORDS = (["<tool_call>", "</tool_call>", '{"name":', '"calculator",', '"arguments":', '{"a":', '"b":', "tools",
               "calculator"] + [f"{d}," for d in range(10)] + [f"{d}}}}}" for d in range(10)]
              + [str(n) for n in range(21)])
"""Words a hermes call to the built-in `calculator` is made of, so that the word-level model can write one
(`<tool_call> {"name": "calculator", "arguments": {"a": 2, "b": 3}} </tool_call>` decodes to valid JSON), and the
numbers its results are. Plain (not special) tokens: decoding keeps them, as Qwen's tokenizer keeps `<tool_call>`."""
TOOLS_TEMPLATE = (
    "{% if tools %}<system> tools {% for t in tools %}{{ t['function']['name'] }} {% endfor %}<eos> {% endif %}"
    "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} <eos> {% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
"""ChatML-like: every message ends with the end-of-turn `<eos>`, a tool result is a `<tool>` message, and a
conversation with one more turn renders as the shorter one plus that turn (prefix-preserving)."""


def cache_dir() -> Path:
    """Where built-in artefacts live: $GRPO_CLI_CACHE or ~/.cache/grpo-cli."""
    return Path(os.environ.get("GRPO_CLI_CACHE", Path.home() / ".cache" / "grpo-cli"))


CHARS = ["Ġ"] + [chr(c) for c in range(33, 127)]
"""The character tokenizer's alphabet: printable ASCII in byte-level form (space is "Ġ"), as byte-level BPE
tokenizers (Qwen2's, which transformers substitutes for a qwen2 checkpoint) spell it."""


def build_tokenizer(path: Path, *, chars: bool = False, tools: bool = False, vocab_size: int | None = None):
    """Write a fast tokenizer with a chat template: word-level (whitespace split, space-joined decode), or with
    `chars` one token per printable ASCII character (decode concatenates); the chat roles are special tokens.
    `tools` (word-level): the tool role, the words of a calculator call and `TOOLS_TEMPLATE`. `vocab_size`
    (word-level): filler words `w0`, `w1`, … up to that many entries, so a model of a real vocabulary's size
    decodes every id it samples."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if chars:  # byte-level BPE without merges: one token per character
        core = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(SPECIAL + CHARS)}, merges=[],
                                    unk_token="<unk>"))
        core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        core.add_special_tokens(SPECIAL)
        core.decoder = decoders.ByteLevel()
    else:
        special = SPECIAL + (TOOL_SPECIAL if tools else [])
        vocab = special + WORDS + ([w for w in TOOL_WORDS if w not in WORDS] if tools else [])
        if vocab_size is not None:
            if vocab_size < len(vocab):
                raise ValueError(f"vocab_size {vocab_size} is below the word-level tokenizer's {len(vocab)} words")
            vocab += [f"w{i}" for i in range(vocab_size - len(vocab))]
        core = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
        core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        core.add_special_tokens(special)
        core.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>", padding_side="left"
    )
    tok.chat_template = TOOLS_TEMPLATE if tools else CHAT_TEMPLATE
    tok.save_pretrained(path)
    return tok


ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma", "mistral", "qwen3_moe", "qwen2_vl", "qwen2_5_vl")
"""Tiny architectures `build_tiny_checkpoint` can write: Llama untied (the built-in), Qwen2 tied with q/k/v
biases, Qwen3 tied with q/k norms, Gemma tied with its embedding scale (√hidden) and (1 + w) norms, Mistral untied
with sliding-window attention (`SLIDING_WINDOW` positions, shorter than the long sequences of the tests and
benchmarks, as gpt-oss's 128 and Gemma 3's 512–1024 are at real lengths: its rows never run packed), Qwen3-MoE
untied with 4 routed experts (top 2) in every layer and no router auxiliary loss, Qwen2-VL and Qwen2.5-VL tied with a
vision tower (`tiny_vlm.build_tiny_vlm`; the shape arguments other than `seed` do not apply)."""

SLIDING_WINDOW = 64
"""Attention window of the tiny Mistral (positions)."""


def _config(arch: str, *, vocab: int, hidden_size: int, num_layers: int, head_dim: int, eos: int, pad: int):
    import transformers

    common = dict(
        vocab_size=vocab, hidden_size=hidden_size, intermediate_size=hidden_size * 2, num_hidden_layers=num_layers,
        num_attention_heads=hidden_size // head_dim, head_dim=head_dim, max_position_embeddings=512,
        bos_token_id=None, eos_token_id=eos, pad_token_id=pad, torch_dtype="float32",
    )
    if arch == "llama":
        return transformers.LlamaConfig(**common, num_key_value_heads=hidden_size // head_dim,
                                        tie_word_embeddings=False)
    kv = max(1, hidden_size // head_dim // 2)  # grouped-query attention, as the real ones
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, num_key_value_heads=kv, tie_word_embeddings=True)
    if arch == "qwen3":
        return transformers.Qwen3Config(**common, num_key_value_heads=kv, tie_word_embeddings=True)
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, num_key_value_heads=kv, tie_word_embeddings=False, num_experts=4,
                                           num_experts_per_tok=2, moe_intermediate_size=hidden_size,
                                           norm_topk_prob=True, router_aux_loss_coef=0.0)
    if arch == "mistral":
        return transformers.MistralConfig(**common, num_key_value_heads=kv, tie_word_embeddings=False,
                                          sliding_window=SLIDING_WINDOW)
    if arch == "gemma":
        return transformers.GemmaConfig(**common, num_key_value_heads=kv, tie_word_embeddings=True,
                                        hidden_activation="gelu_pytorch_tanh")
    raise ValueError(f"unknown tiny architecture {arch!r}; expected one of {ARCHITECTURES}")


def build_tiny_checkpoint(
    path: str | Path, *, hidden_size: int = 64, num_layers: int = 2, head_dim: int = 32, seed: int = 0,
    arch: str = "llama", kv_heads: int | None = None, chars: bool = False, tools: bool = False,
    vocab_size: int | None = None,
) -> Path:
    """Build a random-init model of `arch` (fp32, head_dim 32 so vLLM accepts it) and its tokenizer at `path`;
    `kv_heads` overrides the architecture's K/V head count, `chars` picks the character-level tokenizer,
    `vocab_size` pads the word-level one with filler words to that many entries (the model's vocabulary)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if arch in ("qwen2_vl", "qwen2_5_vl"):
        from grpo_cli.models.tiny_vlm import build_tiny_vlm

        build_tiny_vlm(path, special=SPECIAL, words=WORDS, seed=seed, arch=arch)
        (path / "grpo_cli_tiny.json").write_text(json.dumps({"version": TINY_VERSION, "seed": seed, "arch": arch}))
        return path
    tok = build_tokenizer(path, chars=chars, tools=tools, vocab_size=vocab_size)
    config = _config(arch, vocab=len(tok), hidden_size=hidden_size, num_layers=num_layers, head_dim=head_dim,
                     eos=tok.eos_token_id, pad=tok.pad_token_id)
    if kv_heads is not None:
        config.num_key_value_heads = kv_heads
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    if arch != "llama":  # random biases/norm weights, so a sync that misses them shows
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.ndim == 1:  # norms scale by w (Gemma: by 1 + w); biases are added
                    p.normal_(1.0 if "norm" in name and arch != "gemma" else 0.0, 0.1)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    # Written file by file: `save_pretrained` writes nothing on a rank other than 0 once torch.distributed is
    # initialised (transformers 5), and every rank of a launched job may build this checkpoint. Tied weights
    # are stored once, under the name `named_parameters()` lists (as `save_pretrained` does).
    from safetensors.torch import save_file

    config.architectures = [type(model).__name__]  # vLLM picks its model class (and runner) from this
    config.save_pretrained(path)
    model.generation_config.save_pretrained(path)
    save_file(checkpoint_tensors(model), str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "grpo_cli_tiny.json").write_text(json.dumps({"version": TINY_VERSION, "seed": seed, "arch": arch}))
    return path


def checkpoint_tensors(model) -> dict:
    """The model's tensors under checkpoint names (`named_parameters()`, fused MoE experts per expert:
    `models.experts.expert_parts`), the layout `save_pretrained` writes and vLLM and mbridge read."""
    from grpo_cli.models.experts import expert_parts

    return {part: t.contiguous() for name, p in model.named_parameters()
            for part, t in expert_parts(name, p.detach())}


def model_folder(name: str) -> str:
    """Where `resolve_model_path` keeps the built-in `name` (built or not: nothing is built, no RNG drawn); other
    names as they are."""
    return str(cache_dir() / f"{BUILTINS[name][0]}-v{TINY_VERSION}") if name in BUILTINS else name


def resolve_model_path(name: str) -> str:
    """Map a built-in name (`BUILTINS`: `builtin:tiny`, `builtin:tiny-tools`, `builtin:tiny-moe`,
    `builtin:tiny-vlm`, `builtin:tiny-vlm-qwen2.5`) to its cached
    folder (built once, atomically); other names pass through."""
    if name not in BUILTINS:
        return name
    target = Path(model_folder(name))
    if (target / "grpo_cli_tiny.json").exists():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
    try:
        build_tiny_checkpoint(tmp, **BUILTINS[name][1])
        missing = [f for f in ("config.json", "model.safetensors", "tokenizer.json") if not (tmp / f).is_file()]
        if missing:
            raise RuntimeError(f"building {name} left out {missing} (in {tmp})")
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race; its copy is identical
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)
