"""`grpo serve-rollout`: the HTTP app around an engine, its weight-update routes and wire codec, the SGLang
launcher and contract server. The middle layer: imports rollout, models, config, runtime; never train."""
