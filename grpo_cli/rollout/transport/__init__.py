"""Weight transports: how a rollout client hands the trainer's weights to its servers. `base` holds the contract
(`WeightTransport.send(named_tensors, version) -> Sent`: bytes and seconds) and the registry of names
(`rollout.server.weight_transport`, per client); one module per transport holds its client-side wire code (`http`,
`shm`, `nccl`, `sglang` with `sglang_payload`, `vllm_rl` for stock `vllm serve`'s two over vLLM's RL API), `codec`
the frame format both sides share,
`http_client` the HTTP plumbing (timeouts, retries, errors) of the clients. `grpo serve-rollout` (server/) imports
the receiving halves from here; nothing here imports server/."""
