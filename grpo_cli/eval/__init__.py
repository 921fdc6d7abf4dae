"""`grpo eval`: a saved checkpoint evaluated held-out with an engine of its own. A command, beside launch and
diagnose: imports train (the evaluation the loop runs, `train.evaluation`), rollout, rewards, data, config, runtime."""
