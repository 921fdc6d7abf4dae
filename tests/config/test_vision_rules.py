"""Vision-language models before anything loads (`config/rules_vision.py`): the (engine, mode) rows that cannot take
images and the megatron backend refuse a VLM with a message naming the field and the fix; the rows that can take
images accept it; a text model is not affected."""

from __future__ import annotations

import json

import pytest

from grpo_cli.config.engine_modes import MODES
from grpo_cli.config.load import ConfigError, build_config
from grpo_cli.config.model_shape import is_vision_model

VLM = ["model.name_or_path=builtin:tiny-vlm"]
SERVER = ["rollout.mode=server", "rollout.server.urls=[\"http://127.0.0.1:1\"]"]


def test_a_vlm_is_recognised_by_builtin_name_local_config_or_hub_name(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_vl", "vision_config": {}}))
    assert is_vision_model("builtin:tiny-vlm") and is_vision_model(str(tmp_path))
    assert is_vision_model("Qwen/Qwen2.5-VL-3B-Instruct")
    assert not is_vision_model("builtin:tiny") and not is_vision_model("Qwen/Qwen2.5-0.5B-Instruct")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert not is_vision_model(str(tmp_path))  # the local config decides over the name


@pytest.mark.parametrize(("overrides", "match"), [
    (["rollout.engine=vllm"], r"rollout.engine 'vllm' with rollout.mode 'colocate' cannot generate with images: "
                              r".*imports torchvision.*Set rollout.engine/rollout.mode to one that can: hf \(colocate\)"),
    (["rollout.engine=vllm", *SERVER], r"rollout.engine 'vllm' with rollout.mode 'server'"),
    (["rollout.engine=vllm-serve", *SERVER], r"vllm-serve client sends no images"),
    (["distributed.backend=megatron", "train.micro_batch_size=1"],
     r"distributed.backend 'megatron' builds Megatron-core GPT models .*set distributed.backend to ddp, fsdp2"),
])
def test_what_cannot_take_images_refuses_a_vlm(overrides, match):
    with pytest.raises(ConfigError, match=match):
        build_config(None, None, [*VLM, *overrides])
    build_config(None, None, [o for o in overrides if "vllm" not in o and "megatron" not in o])  # a text model: fine


@pytest.mark.parametrize("row", [k for k, v in MODES.items() if v.images])
def test_the_rows_that_take_images_accept_a_vlm(row):
    engine, mode = row
    build_config(None, None, [*VLM, f"rollout.engine={engine}", f"rollout.mode={mode}",
                        *(SERVER[1:] if mode == "server" else [])])
