"""Multi-turn tool calling during rollouts (`agent:`): tools and their schemas, the call parser, isolated
execution with timeouts, the chat template's tool tokens, and the token-in token-out turn loop around any engine.
Layer 3, above rollout: imports rollout (the engine protocol), rewards (the function resolver), config."""
