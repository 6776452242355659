"""Launching workers: locally (subprocesses), under torchrun, or on SLURM via submitit."""
