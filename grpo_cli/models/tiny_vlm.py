"""The built-in tiny vision-language models (`builtin:tiny-vlm`, `builtin:tiny-vlm-qwen2.5`): a Qwen2-VL or a
Qwen2.5-VL with a tiny config (a 2-block vision tower, a 2-layer language model, head_dim 32 in both so vLLM
accepts it), a word-level tokenizer with Qwen2-VL's vision tokens and a chat template that emits them, and the PIL image processor's config — written to disk like a
real checkpoint, built locally, never downloaded."""

from __future__ import annotations

from pathlib import Path


VISION_SPECIAL = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
"""Qwen2-VL's vision tokens: an image is `<|vision_start|>` + one `<|image_pad|>` per merged patch group +
`<|vision_end|>` (the prompt holds one `<|image_pad|>` until the processor expands it)."""
VISION_WORDS = "how many shape shapes colour circle square triangle there are".split()
"""Words of the built-in image task (`builtin:shapes`) the text model lacks."""
VLM_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}> "
    "{% if m['content'] is string %}{{ m['content'] }} "
    "{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|> "
    "{% elif part['type'] == 'text' %}{{ part['text'] }} {% endif %}"
    "{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
"""A message's content is a string or a list of parts (`{"type": "image"}` / `{"type": "text", "text": ...}`), as
Qwen2-VL's template reads them; each image part becomes one placeholder."""
PATCH, MERGE, TEMPORAL = 14, 2, 2
"""Qwen2-VL's patch size, spatial merge (2×2 patches → one token) and temporal patch (an image repeated twice)."""
MIN_PIXELS, MAX_PIXELS = 28 * 28, 56 * 56
"""The image processor resizes every image to a multiple of 28 with area in [MIN_PIXELS, MAX_PIXELS]: the tiny
model sees at most 4 × 4 patches (4 image tokens) per image."""


def build_vlm_tokenizer(path: Path, *, special: list[str], words: list[str]):
    """Word-level tokenizer: the tiny model's roles (`special`, `<pad>` and `<eos>` among them) and `words`, the
    vision tokens (special) and the image task's words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = special + VISION_SPECIAL
    vocab = special + words + [w for w in VISION_WORDS if w not in words]
    core = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(vocab)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.add_special_tokens(special)
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>",
                                  padding_side="left")
    tok.chat_template = VLM_TEMPLATE
    tok.save_pretrained(path)
    return tok


VLM_ARCHITECTURES = {"qwen2_vl": "Qwen2VLForConditionalGeneration",
                     "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}
"""Tiny VLM architecture → transformers class. Qwen2.5-VL shares Qwen2-VL's image processor, vision tokens and
M-RoPE; its vision tower differs (RMSNorm, a gated SiLU MLP, window attention except in `fullatt_block_indexes`)."""
WINDOW = 28
"""The tiny Qwen2.5-VL's attention window in pixels (one merged 2×2 patch group): a 4 × 4-patch image is 4 windows,
so block 0 attends within windows and block 1 (`fullatt_block_indexes`) across the whole image."""


def vlm_config(tok, *, arch: str = "qwen2_vl", hidden_size: int = 64, num_layers: int = 2, head_dim: int = 32,
               vision_dim: int = 64, vision_depth: int = 2):
    """A Qwen2VLConfig or Qwen2_5_VLConfig (`arch`: `VLM_ARCHITECTURES`): text (hidden, layers, head_dim; M-RoPE
    sections summing to head_dim / 2) and vision tower (vision_dim wide, head_dim 32, `vision_depth` blocks, output
    projected to the text width; Qwen2.5-VL: windows of `WINDOW` pixels, the last block full attention)."""
    import transformers

    if arch not in VLM_ARCHITECTURES:
        raise ValueError(f"unknown tiny VLM architecture {arch!r}; expected one of {tuple(VLM_ARCHITECTURES)}")
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_SPECIAL}
    half = head_dim // 2
    section = [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]  # [4, 6, 6] at head_dim 32
    text = dict(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=hidden_size * 2,
                num_hidden_layers=num_layers, num_attention_heads=hidden_size // head_dim,
                num_key_value_heads=max(1, hidden_size // head_dim // 2), head_dim=head_dim,
                max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section},
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None)
    vision = dict(depth=vision_depth, num_heads=vision_dim // 32, patch_size=PATCH, spatial_merge_size=MERGE,
                  temporal_patch_size=TEMPORAL, in_channels=3)
    if arch == "qwen2_vl":
        vision.update(embed_dim=vision_dim, hidden_size=hidden_size, mlp_ratio=2)
        cls = transformers.Qwen2VLConfig
    else:
        vision.update(hidden_size=vision_dim, intermediate_size=vision_dim * 2, out_hidden_size=hidden_size,
                      window_size=WINDOW, fullatt_block_indexes=[vision_depth - 1], tokens_per_second=2)
        cls = transformers.Qwen2_5_VLConfig
    return cls(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
               video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
               vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=True, torch_dtype="float32")


def build_image_processor(path: Path):
    """Qwen2-VL's image processor, PIL backend (torchvision is not needed), sized for the tiny model."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    proc = Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL,
                                    size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})
    proc.save_pretrained(path)
    return proc


def build_tiny_vlm(path: str | Path, *, special: list[str], words: list[str], seed: int = 0, arch: str = "qwen2_vl",
                   **shape) -> Path:
    """Write the random-init tiny Qwen2-VL or Qwen2.5-VL (`arch`; fp32; `shape`: `vlm_config`'s sizes), its tokenizer
    (`build_vlm_tokenizer`) and image processor to `path`; biases and norm weights random too, so a weight sync
    that misses one shows. `models.tiny.build_tiny_checkpoint(arch="qwen2_vl" | "qwen2_5_vl")` calls it with the tiny vocabulary."""
    import torch
    import transformers
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_vlm_tokenizer(path, special=special, words=words)
    build_image_processor(path)
    config = vlm_config(tok, arch=arch, **shape)
    torch.manual_seed(seed)
    model = getattr(transformers, VLM_ARCHITECTURES[arch])(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.normal_(1.0 if "norm" in name else 0.0, 0.1)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    config.architectures = [type(model).__name__]
    config.save_pretrained(path)
    model.generation_config.save_pretrained(path)
    # tied weights once, under the name `named_parameters()` lists (as `save_pretrained` writes them)
    save_file({n: p.detach().contiguous() for n, p in model.named_parameters()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    return path
