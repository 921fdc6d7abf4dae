"""Models as the trainer sees them: the tiny random-init checkpoints the default run and the tests build locally,
checkpoint files, expert (MoE) names, the names a parameter syncs under (`weight_names`), and the trainer's logprob code
(`logprobs`: chunked completion logprobs and entropy, packing of shared prompts, packed attention)."""
