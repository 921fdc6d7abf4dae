"""How weights move: weight sync to the engine (gathers, buckets, rank-0 pushes), training-state offload,
LoRA merging. Imports rollout (the engine protocol), config, runtime."""
