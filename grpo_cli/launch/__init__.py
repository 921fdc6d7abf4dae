"""Launching: accelerate/torchrun command lines, process groups, device capability checks."""
