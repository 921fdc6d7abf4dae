"""Training: the loop (run, loop, step, pipeline, batch, loss, policy, checkpoint) at the top, and one folder per role:
backends (ddp/fsdp2/deepspeed), weights (sync, offload, LoRA), scoring (the reward phase), supervise (signals, watchdog,
alarms, timing, trackers, run folder). Also the held-out evaluation the loop runs (`evaluation`, `eval_metrics`)."""
