"""`grpo serve-rollout`: the HTTP app around an engine, its weight-update routes (the wire codec and the NCCL receiver
they use come from `rollout.transport`), the SGLang launcher and contract server."""
