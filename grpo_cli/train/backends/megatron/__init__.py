"""The `megatron` training backend: Megatron-core models built from Hugging Face checkpoints (mbridge), tensor /
pipeline (optionally interleaved) / data parallelism, its pipeline schedule running the GRPO loss. `backend.py` holds
the seam; `build.py` the parallel state, models and optimizer; `bridge.py` the weight names; `schedule.py`,
`batches.py` and `logprobs.py` a step's data path; `export.py` bucketed HF tensors; `state.py` checkpoints;
`cpu_shims.py` the CPU stand-ins (imported only when training on CPU)."""
