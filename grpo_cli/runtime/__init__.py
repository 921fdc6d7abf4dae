"""The process's runtime: devices (the only CUDA-specific calls), process groups, torch.compile settings, quiet
third-party logging."""
