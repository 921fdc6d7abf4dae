"""`grpo diagnose-mismatch`: the trainer's and the engine's logprobs of the same samples, the mismatch metrics and a
verdict."""
