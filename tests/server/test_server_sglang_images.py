"""SGLangEngine with images against grpo_cli/server/sglang_contract.py — a CONTRACT test: the fake follows SGLang's
source, NOT SGLang (which needs CUDA and cannot run here): `srt/managers/io_struct.py` GenerateReqInput.image_data
(one list of images per input, the list as long as the batch, data URLs decoded by `srt/utils` load_image) and
`srt/multimodal/processors/qwen_vl.py` (a Qwen-VL image placeholder is `<|vision_start|>(<|image_pad|>)+
<|vision_end|>`, so the trainer's processor-expanded ids go as they are). The served engine is the hf engine on the
built-in tiny VLM: completions and scores equal the same engine's with the same images."""
from __future__ import annotations

import torch
from served_app import app_in_thread

from grpo_cli.rollout.base import SamplingParams
from grpo_cli.rollout.seeds import child_seed
from grpo_cli.rollout.sglang.client import SGLangEngine
from grpo_cli.rollout.transport.http_client import Policy
from grpo_cli.server.sglang_contract import create_contract_app

FAST = Policy(connect_timeout_s=5, request_timeout_s=60, retries=0)


def test_image_data_goes_with_each_input_and_the_outputs_are_the_engines(served_vlm, tmp_path):
    served, ids, images = served_vlm
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
    assert req["input_ids"] == [ids[0], ids[0], ids[1], ids[1]]  # n inputs per prompt (distinct seeds)
    assert len(req["image_data"]) == 4 and req["image_data"][0] == req["image_data"][1] != req["image_data"][2]
    for j, (comp, lps) in enumerate(zip(batch.completion_ids, batch.sampler_logprobs, strict=True)):
        # the client's per-input seed, which the contract uses under deterministic inference
        seed = child_seed(5, rank=0, prompt=j // 2, child=j % 2)
        own = served.engine.generate([ids[j // 2]], SamplingParams(n=1, max_tokens=4, seed=seed),
                                     images=[images[j // 2]])
        assert own.completion_ids[0] == comp
        assert torch.allclose(torch.tensor(own.sampler_logprobs[0]), torch.tensor(lps), atol=1e-6)
    own_scores = served.engine.score(seqs, images=[images[j // 2] for j in range(len(seqs))])
    assert max(abs(a - b) for s, t in zip(scores, own_scores) for a, b in zip(s, t)) <= 1e-6


def test_the_contract_refuses_image_data_that_does_not_match_the_inputs(served_vlm):
    import httpx

    from grpo_cli.rollout import images as wire_images

    served, ids, images = served_vlm
    url_of = wire_images.to_data_url(images[0][0])
    with app_in_thread(create_contract_app(served)) as url:
        short = httpx.post(f"{url}/generate", json={"input_ids": ids, "image_data": [[url_of]],
                                                    "sampling_params": {"max_new_tokens": 1}})
        extra = httpx.post(f"{url}/generate", json={"input_ids": ids, "image_data": [[url_of, url_of], [url_of]],
                                                    "sampling_params": {"max_new_tokens": 1}})
    assert short.status_code == 400 and "equal to the batch size" in short.json()["error"]
    assert extra.status_code == 400 and "1 image placeholders for 2 images" in extra.json()["error"]
