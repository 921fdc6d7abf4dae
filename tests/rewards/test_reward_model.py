"""A local reward model (`{model: PATH}`): its own tokenizer and chat template, the score at the last non-pad
token, the same whatever a sequence is batched with; weighted with function rewards."""

from __future__ import annotations

import pytest
import torch

from grpo_cli.config.schema import RewardFunctionConfig
from grpo_cli.rewards.resolve import build_reward_fns, score


@pytest.fixture(scope="module")
def reward_ckpt(tmp_path_factory):
    """A random-init Llama sequence classifier (1 label) with the character-level tokenizer: not the policy's."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from grpo_cli.models.tiny import build_tokenizer

    path = tmp_path_factory.mktemp("rm")
    tok = build_tokenizer(path, chars=True)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, num_labels=1, pad_token_id=tok.pad_token_id)
    LlamaForSequenceClassification(cfg).save_pretrained(path)
    return str(path), tok


def _by_hand(path: str, tok, text: str) -> float:
    from transformers import AutoModelForSequenceClassification

    net = AutoModelForSequenceClassification.from_pretrained(path).eval()
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        hidden = net.model(input_ids=ids).last_hidden_state[0, -1]  # the last token, no padding at all
        return float(net.score(hidden)[0])


def test_scores_are_the_last_token_score_in_the_models_own_template(reward_ckpt):
    path, tok = reward_ckpt
    fns = build_reward_fns([RewardFunctionConfig.model_validate({"model": path, "batch_size": 2})])
    messages = [[{"role": "user", "content": "say hi"}], [{"role": "user", "content": "a much longer question ?"}]]
    completions = ["hi", "an answer that is long"]
    table, _ = score(fns, ["<policy text>"] * 2, completions, {}, on_error="raise",
                     extras={"prompt_messages": messages})
    for (value,), m, c in zip(table, messages, completions, strict=True):
        text = tok.apply_chat_template([*m, {"role": "assistant", "content": c}], tokenize=False)
        assert value == pytest.approx(_by_hand(path, tok, text), abs=1e-5)
    alone, _ = score(fns, ["<policy text>"], completions[:1], {}, on_error="raise",
                     extras={"prompt_messages": messages[:1]})
    assert alone[0][0] == pytest.approx(table[0][0], abs=1e-5)  # batched with a longer one or alone: the same


def test_model_and_function_rewards_are_weighted_and_summed(reward_ckpt):
    from grpo_cli.algo.advantages import weighted_rewards

    path, _ = reward_ckpt
    fns = build_reward_fns([RewardFunctionConfig.model_validate({"model": path, "weight": 0.5, "alias": "rm"}),
                            RewardFunctionConfig(name="length", weight=2.0, kwargs={"target": 1})])
    table, _ = score(fns, ["q "] * 2, ["one", "one two"], {}, on_error="raise")
    total = weighted_rewards(torch.tensor(table), [f.weight for f in fns])
    expected = [0.5 * rm + 2.0 * length for rm, length in table]
    assert total.tolist() == pytest.approx(expected) and [row[1] for row in table] == [0.0, -1.0]
    assert fns[0].label == "rm"
