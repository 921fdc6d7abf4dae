"""SGLangEngine with images against grpo_cli/server/sglang_contract.py — a CONTRACT test: the fake follows SGLang's
source (sglang 0.5.23), NOT SGLang (which needs CUDA and cannot run here), and runs the library code SGLang runs
where it is installed here: transformers' Qwen2-VL processor on the decoded ids (`srt/multimodal/processors/
base_processor.py` load_mm_data / `_call_processor` / `_expand_input_ids`, `sglang_contract_mm.py`). Also
`srt/managers/io_struct.py` GenerateReqInput.image_data (one list of images per input), `srt/managers/
schedule_batch.py` (prompt logprobs at image positions are for the clamped pad-hash id vocab_size − 1) and
`srt/sampling/sampling_params.py` (`logit_bias`). The served engine is the hf engine on the built-in tiny VLM."""
from __future__ import annotations

import math

import httpx
import torch
from served_app import app_in_thread

from grpo_cli.rollout import images as wire_images
from grpo_cli.rollout.base import SamplingParams
from grpo_cli.rollout.seeds import child_seed
from grpo_cli.rollout.sglang.client import SGLangEngine
from grpo_cli.rollout.transport.http_client import Policy
from grpo_cli.server.sglang_contract import create_contract_app

FAST = Policy(connect_timeout_s=5, request_timeout_s=60, retries=0)


def _pads(served):
    cfg = served.engine.model.config
    return cfg.image_token_id, {cfg.image_token_id, cfg.video_token_id}


def test_image_data_goes_with_each_input_and_the_outputs_are_the_engines(served_vlm, tmp_path):
    """Fails before the fix: the client sent the expanded ids, which transformers' processor reads as one image
    per `<|image_pad|>` (StopIteration: HTTP 500), and no logit_bias."""
    served, ids, images = served_vlm
    pad, banned = _pads(served)
    app = create_contract_app(served, launch_args=["--enable-deterministic-inference"])
    with app_in_thread(app) as url:
        eng = SGLangEngine([url], policy=FAST, stop_token_ids=served.eos_token_ids, model_path=served.model,
                           weight_sync_dir=str(tmp_path / "sync"))
        try:
            assert eng.accepts_images
            batch = eng.generate(ids, SamplingParams(n=2, max_tokens=4, seed=5), images=images)
            req = app.state.contract["requests"][-1]
            seqs = [ids[j // 2] + c for j, c in enumerate(batch.completion_ids)]
            scores = eng.score(seqs, images=[images[j // 2] for j in range(len(seqs))])
        finally:
            eng.close()
    one_pad = [[t for k, t in enumerate(p) if not (t == pad and p[k - 1] == pad)] for p in ids]
    assert req["input_ids"] == [one_pad[0], one_pad[0], one_pad[1], one_pad[1]]  # one pad per image
    assert all(sum(t == pad for t in p) == 1 for p in req["input_ids"]) and ids[0].count(pad) > 1
    assert all(p["logit_bias"] == {str(t): -1e9 for t in sorted(banned)} for p in req["sampling_params"])
    assert len(req["image_data"]) == 4 and req["image_data"][0] == req["image_data"][1] != req["image_data"][2]
    for j, (comp, lps) in enumerate(zip(batch.completion_ids, batch.sampler_logprobs, strict=True)):
        # the client's per-input seed, which the contract uses under deterministic inference
        seed = child_seed(5, rank=0, prompt=j // 2, child=j % 2)
        own = served.engine.generate([ids[j // 2]], SamplingParams(n=1, max_tokens=4, seed=seed),
                                     images=[images[j // 2]])
        assert own.completion_ids[0] == comp and not banned & set(comp)
        assert torch.allclose(torch.tensor(own.sampler_logprobs[0]), torch.tensor(lps), atol=1e-6)
    own_scores = served.engine.score(seqs, images=[images[j // 2] for j in range(len(seqs))])
    for seq, got, own in zip(seqs, scores, own_scores, strict=True):
        assert [math.isnan(x) for x in got] == [t == pad for t in seq[1:]]  # SGLang scores another id there
        assert max(abs(a - b) for a, b in zip(got, own, strict=True) if not math.isnan(a)) <= 1e-6


def test_the_contract_decodes_and_runs_transformers_processor(served_vlm):
    """What SGLang answers to the ids it is sent: N pads for one image fail in transformers' processor; one pad is
    expanded to the trainer's ids; a placeholder count that does not match the images, or a logit_bias key outside
    the vocabulary, is a 400."""
    served, ids, images = served_vlm
    pad, _ = _pads(served)
    url_of = wire_images.to_data_url(images[0][0])
    one = [t for k, t in enumerate(ids[0]) if not (t == pad and ids[0][k - 1] == pad)]
    body = {"input_ids": one, "image_data": [url_of], "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True, "logprob_start_len": 0}
    with app_in_thread(create_contract_app(served)) as url:
        post = lambda **kw: httpx.post(f"{url}/generate", json={**body, **kw}, timeout=60)  # noqa: E731
        expanded = post(input_ids=ids[0])
        ok = post()
        short = post(input_ids=ids, image_data=[[url_of]])
        extra = post(input_ids=[one], image_data=[[url_of, url_of]])
        bias = post(sampling_params={"max_new_tokens": 1, "logit_bias": {"100000": -1e9}})
        form = post(sampling_params={"max_new_tokens": 1, "logit_bias": [pad]})
    assert expanded.status_code == 500 and "StopIteration" in expanded.text
    assert ok.status_code == 200, ok.text
    entries = ok.json()["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == [0 if t == pad else t for t in ids[0]]  # SGLang's expansion: the trainer's
    assert short.status_code == 400 and "equal to the batch size" in short.json()["error"]
    assert extra.status_code == 400 and "1 image placeholders but 2 image inputs" in extra.json()["error"]["message"]
    assert bias.status_code == 400 and "logit_bias must has keys in" in bias.json()["error"]["message"]
    assert form.status_code == 400 and "expected a map" in form.json()["error"]["message"]


def test_image_positions_score_the_clamped_pad_hash_id_and_the_sync_probe_skips_them(served_vlm, tmp_path):
    """`schedule_batch.py` clamps the pad-hash ids at image positions to vocab_size − 1 before taking their
    logprobs. Fails before the fix: the probe compared those with the trainer's `<|image_pad|>` logprobs and
    refused a correct sync."""
    from transformers import AutoModelForImageTextToText

    from grpo_cli.train.weights.weight_sync import sync_weights

    served, ids, images = served_vlm
    pad, _ = _pads(served)
    trainer = AutoModelForImageTextToText.from_pretrained(served.model, dtype=torch.float32).eval()
    with torch.no_grad():
        trainer.lm_head.weight.mul_(1.01)  # other weights than the server's: the sync must bring them over
    vision = served.engine.vision_inputs(images)
    vocab = trainer.config.get_text_config().vocab_size
    first = served.engine.vision_inputs(images[:1])
    with torch.no_grad():  # the served weights' distributions over the first prompt
        row = torch.tensor([ids[0]])
        out = served.engine.model(input_ids=row, pixel_values=first.pixel_values, image_grid_thw=first.image_grid_thw,
                                  mm_token_type_ids=(row == pad).long()).logits[0].log_softmax(-1)
    app = create_contract_app(served, launch_args=["--enable-deterministic-inference"])
    with app_in_thread(app) as url:
        eng = SGLangEngine([url], policy=FAST, model_path=served.model, weight_sync_dir=str(tmp_path / "sync"))
        try:
            raw = httpx.post(f"{url}/generate", json={
                "input_ids": eng.placeholders.collapse(ids[0]), "image_data": [wire_images.encode(images)[0]],
                "sampling_params": {"max_new_tokens": 0}, "return_logprob": True, "logprob_start_len": 0},
                timeout=60).json()["meta_info"]["input_token_logprobs"]
            metrics = sync_weights(eng, trainer, version=1, bucket_mb=1, verify=True, probe=ids,
                                   probe_images=images, probe_vision=vision)
        finally:
            eng.close()
    at = [k for k, t in enumerate(ids[0]) if t == pad]
    assert at and all(abs(raw[k][0] - out[k - 1, vocab - 1].item()) < 1e-5 for k in at)
    assert metrics["sync/max_probe_diff"] < 1e-5 and eng.weight_version == 1
