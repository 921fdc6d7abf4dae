"""The output layer a chunk of positions at a time (`algo.chunked_logprobs` inside the model's forward): logprobs,
entropy and every gradient equal the full-logits path in float32, for untied and tied embeddings, LoRA with the head
in `modules_to_save`, packed and plain rows, tempered or not; and the measured peak memory of a forward + backward
does not grow with the vocabulary beyond one chunk (the full-logits path grows by the whole (B, T, V))."""

from __future__ import annotations

import json

import pytest
import torch

from grpo_cli.algo import chunked_logprobs as chunked
from grpo_cli.algo.chunk_size import rows_per_chunk
from grpo_cli.models import logprobs as scoring
from grpo_cli.models.logprobs import completion_logprobs, completion_logprobs_entropy

T = 12


def batch(vocab: int, *, rows: int = 8, prompt: int = 5, seed: int = 0):
    """[left-padded prompt | right-padded completion], two prompts shared by four rows each (so packing pays)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, vocab, (rows, prompt + T), generator=g)
    ids[rows // 2 :, :prompt] = ids[rows // 2, :prompt]
    ids[: rows // 2, :prompt] = ids[0, :prompt]
    mask = torch.ones_like(ids)
    mask[: rows // 2, :2] = 0  # a shorter prompt, left-padded
    for r in range(rows):
        mask[r, prompt + 1 + (r * 5) % T :] = 0  # completions of different lengths
    return ids, mask


def full_logits_path(monkeypatch) -> None:
    """The reference: no stand-in head, so the model builds the (B, T, V) logits as before."""
    monkeypatch.setattr(scoring._HeadStats, "install", classmethod(lambda cls, *a, **k: None))


def run(model, ids, mask, *, temperature: float, entropy: bool):
    model.zero_grad(set_to_none=True)
    weights = torch.linspace(-1, 1, ids.shape[0] * T).view(-1, T)
    if entropy:
        lp, h = completion_logprobs_entropy(model, ids, mask, logits_to_keep=T, temperature=temperature,
                                            entropy_grad=True)
        loss = (lp * weights).sum() + 0.3 * (h * weights.flip(0)).sum()
    else:
        lp, h = completion_logprobs(model, ids, mask, logits_to_keep=T, temperature=temperature), None
        loss = (lp * weights).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp.detach(), None if h is None else h.detach(), grads


def assert_equal_paths(model, ids, mask, monkeypatch, *, temperature=0.7, entropy=True, packed=True):
    monkeypatch.setattr(scoring, "MIN_SAVING", 0.1 if packed else 2.0)
    calls = five_positions_a_chunk(monkeypatch)
    fast = run(model, ids, mask, temperature=temperature, entropy=entropy)
    assert calls and calls[0] == (model.config.vocab_size, "cpu")  # the chunked path ran, sized for the CPU
    with monkeypatch.context() as m:
        full_logits_path(m)
        ref = run(model, ids, mask, temperature=temperature, entropy=entropy)
    # float32 to 1e-6 of each value's scale: the chunk's matmul rounds like the whole batch's up to a few ulps
    torch.testing.assert_close(fast[0], ref[0], rtol=1e-6, atol=1e-6)
    if entropy:
        torch.testing.assert_close(fast[1], ref[1], rtol=1e-6, atol=1e-6)
    assert fast[2].keys() == ref[2].keys() and ref[2]
    for name, g in ref[2].items():
        assert (fast[2][name] - g).abs().max() <= 1e-6 * max(1.0, g.abs().max().item()), name


def five_positions_a_chunk(monkeypatch) -> list:
    """The head's chunk lowered to 5 positions (several chunks per pass); returns the (vocab, device) it is asked
    for."""
    calls = []
    monkeypatch.setattr(scoring, "chunk_rows", lambda vocab, *, device: calls.append((vocab, device)) or 5)
    return calls


def load(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").train()


def spy_on_weight(monkeypatch, *, module_call: bool) -> list:
    """What `_HeadStats` hands `chunked_logprobs` as the plain weight; `module_call` forces the layer's own forward
    under checkpointing (the path of PEFT wrappers and ZeRO-3)."""
    seen, real = [], scoring._HeadStats._plain_weight

    def spy(self):
        seen.append(None if module_call else real(self))
        return seen[-1]

    monkeypatch.setattr(scoring._HeadStats, "_plain_weight", spy)
    return seen


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("module_call", [False, True])
def test_untied_head_equals_full_logits(tiny_checkpoint, monkeypatch, packed, temperature, module_call):
    model = load(tiny_checkpoint)
    seen = spy_on_weight(monkeypatch, module_call=module_call)
    assert_equal_paths(model, *batch(model.config.vocab_size), monkeypatch, temperature=temperature, packed=packed)
    assert seen and all((w is None) == module_call for w in seen)  # the hand-written backward, or checkpointing


def test_bf16_autocast_follows_the_full_logits_path(tiny_checkpoint, monkeypatch):
    """bf16 compute over float32 weights (ddp's `model.dtype: bfloat16`): the hand-written backward rebuilds the
    logits under the forward's autocast, so values and gradients agree with the full path to bf16 rounding."""
    model = load(tiny_checkpoint)
    ids, mask = batch(model.config.vocab_size)
    five_positions_a_chunk(monkeypatch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast = run(model, ids, mask, temperature=0.7, entropy=True)
        with monkeypatch.context() as m:
            full_logits_path(m)
            ref = run(model, ids, mask, temperature=0.7, entropy=True)
    torch.testing.assert_close(fast[0], ref[0], rtol=0, atol=2e-2)
    torch.testing.assert_close(fast[1], ref[1], rtol=0, atol=2e-2)
    for name, g in ref[2].items():
        assert (fast[2][name] - g).abs().max() <= 3e-2 * max(1.0, g.abs().max().item()), name


def test_logprobs_alone_equal_full_logits(tiny_checkpoint, monkeypatch):
    model = load(tiny_checkpoint)
    assert_equal_paths(model, *batch(model.config.vocab_size), monkeypatch, entropy=False)


@pytest.mark.parametrize("arch", ["qwen2", "gemma"])
def test_tied_embeddings_equal_full_logits(tmp_path, monkeypatch, arch):
    """Tied head (Qwen2; Gemma with its embedding scale): the embedding's gradient sums both uses alike."""
    from grpo_cli.models.tiny import build_tiny_checkpoint

    model = load(str(build_tiny_checkpoint(tmp_path / arch, arch=arch)))
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert_equal_paths(model, *batch(model.config.vocab_size), monkeypatch)


def test_lora_with_the_head_in_modules_to_save(tiny_checkpoint, monkeypatch):
    """With `modules_to_save: [lm_head]` the head is PEFT's wrapper: it is called as a module, so the trained copy
    projects (and gets the gradient), and with the adapter disabled the original head does."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(load(tiny_checkpoint), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                            modules_to_save=["lm_head"], init_lora_weights=False))
    ids, mask = batch(model.config.vocab_size)
    seen = spy_on_weight(monkeypatch, module_call=False)
    assert_equal_paths(model, ids, mask, monkeypatch)
    assert seen and all(w is None for w in seen)  # PEFT's wrapper projects as a module
    with torch.no_grad(), model.disable_adapter():
        base = completion_logprobs(model, ids, mask, logits_to_keep=T, temperature=1.0)
        full_logits_path(monkeypatch)
        ref = completion_logprobs(model, ids, mask, logits_to_keep=T, temperature=1.0)
    torch.testing.assert_close(base, ref, rtol=0, atol=1e-6)


def test_lora_all_linear_runs_the_frozen_head_without_its_gradient(tiny_checkpoint, monkeypatch):
    """`target_modules: all-linear` leaves `lm_head` a plain frozen `nn.Linear`: it runs the hand-written backward,
    which computes no (V, H) gradient for it (tests/algo/test_chunked_head.py counts the GEMMs), while the adapters
    below it get the full-logits path's gradients."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(load(tiny_checkpoint), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                            init_lora_weights=False))
    seen = spy_on_weight(monkeypatch, module_call=False)
    real = chunked._LinearHead.backward
    asked = []

    def backward(ctx, *grads):
        asked.append(ctx.needs_input_grad[:2])
        return real(ctx, *grads)

    monkeypatch.setattr(chunked._LinearHead, "backward", staticmethod(backward))
    assert_equal_paths(model, *batch(model.config.vocab_size), monkeypatch)
    assert seen and all(w is not None and not w.requires_grad for w in seen)  # the plain, frozen head
    assert asked == [(True, False)]  # ∂/∂h wanted, ∂/∂W not


def test_a_logit_transform_keeps_the_full_logits_path(tiny_checkpoint, monkeypatch):
    """A model whose forward changes the head's output (Gemma 2's soft cap, here a patched scale) must not read
    the stand-in's statistics: the result equals the full-logits path of the same model."""
    model = load(tiny_checkpoint)
    ids, mask = batch(model.config.vocab_size)
    real_forward = type(model).forward

    def scaled(self, *a, **kw):
        out = real_forward(self, *a, **kw)
        out.logits = out.logits * 0.5
        return out

    monkeypatch.setattr(type(model), "forward", scaled)
    with torch.no_grad():
        got = completion_logprobs(model, ids, mask, logits_to_keep=T, temperature=1.0)
        full_logits_path(monkeypatch)
        ref = completion_logprobs(model, ids, mask, logits_to_keep=T, temperature=1.0)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_empty_rows_give_empty_results():
    lp, h = chunked.chunked_logprobs(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long), project=lambda x: x,
                                     weight=None, temperature=1.0, chunk=4, with_entropy=True, entropy_grad=False,
                                     shard=None)
    assert lp.shape == h.shape == (0,)


# ---- memory ---------------------------------------------------------------------------------------------------
def peak_bytes(fn) -> int:
    """Peak bytes allocated by torch's CPU allocator during `fn`, above what was allocated when it started: the
    profiler's memory events carry the allocator's running total ("Total Allocated")."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    path = f"/tmp/grpo-peak-{id(prof)}.json"
    prof.export_chrome_trace(path)
    import os

    try:
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    finally:
        os.remove(path)
    totals = [e["args"]["Total Allocated"] for e in events
              if e.get("name") == "[memory]" and e["args"].get("Device Type") == 0]
    assert totals, "the profiler recorded no CPU allocation"
    return max(totals)


def forward_backward_peak(vocab: int, ids, mask) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                                         tie_word_embeddings=False, attn_implementation="sdpa"))

    def step():
        lp, h = completion_logprobs_entropy(model, ids, mask, logits_to_keep=T, temperature=0.7, entropy_grad=True)
        (lp.sum() + h.sum()).backward()

    step()  # warm-up: lazy initialisations out of the measurement
    model.zero_grad(set_to_none=True)
    return peak_bytes(step)


@pytest.mark.parametrize("module_call", [False, True])
def test_peak_memory_does_not_grow_with_the_vocabulary_beyond_one_chunk(monkeypatch, module_call):
    """192 completion positions, vocabulary 1,024 → 16,384: the full-logits path's peak grows by several whole
    (B, T, V) float32 tensors (measured ~86 MB, each 12 MB); the chunked path's by no more than the gradients of
    the vocabulary-sized parameters (embedding and head, 2 MB each) and a few chunks of 32 positions (2 MB each).
    The hand-written backward adds every chunk's head gradient into one buffer: its growth stays within the two
    gradients and one chunk (measured 0.6 chunk over them; 1.4 when each chunk returned its own (V, H) gradient
    for autograd to add up, one head gradient more)."""
    small_vocab, large_vocab, rows = 1024, 16384, 32
    spy_on_weight(monkeypatch, module_call=module_call)
    monkeypatch.setattr(scoring, "MIN_SAVING", 2.0)  # plain rows: the same positions at both sizes
    monkeypatch.setattr(scoring, "chunk_rows", lambda vocab, *, device: rows_per_chunk(vocab, rows * large_vocab))
    ids, mask = batch(small_vocab, rows=16, prompt=4)
    mask = torch.ones_like(mask)
    small, large = (forward_backward_peak(v, ids, mask) for v in (small_vocab, large_vocab))
    grown = large_vocab - small_vocab
    gradients, chunk = 2 * grown * 32 * 4, rows * large_vocab * 4
    assert large - small <= (2 * gradients + 8 * chunk if module_call else gradients + chunk), (small, large)
    with monkeypatch.context() as m:
        full_logits_path(m)
        full_small, full_large = (forward_backward_peak(v, ids, mask) for v in (small_vocab, large_vocab))
    assert full_large - full_small > 2 * gradients + 8 * chunk, (full_small, full_large)  # the test can tell


def test_word_level_tokenizer_padded_to_a_vocabulary(tmp_path):
    """`build_tokenizer(vocab_size=N)` (benchmarks/compare.py `--vocab N`): N entries, every id decodes to a word
    that encodes back to the same id; below the base words it refuses."""
    from grpo_cli.models.tiny import build_tokenizer

    tok = build_tokenizer(tmp_path / "tok", vocab_size=500)
    assert len(tok) == 500
    ids = [7, 100, 499]
    text = tok.decode(ids)
    assert text.split()[-1] == tok.convert_ids_to_tokens(499) and text.split()[-1].startswith("w")
    assert tok(text, add_special_tokens=False)["input_ids"] == ids
    with pytest.raises(ValueError, match="vocab_size 10"):
        build_tokenizer(tmp_path / "small", vocab_size=10)
