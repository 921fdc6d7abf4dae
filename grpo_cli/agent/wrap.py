"""The rollout loop `agent:` or `rollout.custom` puts around an engine, built where the engine generates: in the
trainer process, or in each Ray actor in async mode (the trainer's engine there only submits and collects, so
wrapping it too would run a second loop around the actors' loops)."""

from __future__ import annotations

from grpo_cli.config.schema import GRPOConfig


def wrap_rollout(engine, cfg: GRPOConfig, tokenizer):
    """`engine` with multi-turn tool calling (`agent:`, with `agent.chat_template` set on `tokenizer`) or the
    user's `rollout.custom` function (the config rules allow one of them at most); `engine` itself otherwise."""
    if cfg.agent is not None:
        from grpo_cli.agent.rollout import wrap_engine

        if cfg.agent.chat_template:
            tokenizer.chat_template = cfg.agent.chat_template
        return wrap_engine(engine, cfg.agent, tokenizer)
    if cfg.rollout.custom:
        from grpo_cli.agent.custom import wrap_custom

        return wrap_custom(engine, cfg.rollout.custom, tokenizer)
    return engine
