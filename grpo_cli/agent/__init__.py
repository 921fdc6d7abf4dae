"""Multi-turn tool calling during rollouts (`agent:`): tools and their schemas, the call parser, isolated execution with
timeouts, the chat template's tool tokens, and the token-in token-out turn loop around any engine."""
