"""grpo-cli's own decode loop over the transformers model: the engine (`engine.HFEngine`), its bf16 generation copy,
the KV-cached decode, the lean static-shape step (CUDA graphs on CUDA) and the sampler."""
