"""Strategies: a named optimizer config -> (wrapped model, optimizer). Importing this package
registers every strategy; ``STRATEGIES`` maps config names to classes."""

from lowcomm.strategies import ddp, demo, every_step, flexdemo, local, muloco  # noqa: F401  (register the strategies)
from lowcomm.strategies.base import STRATEGIES, AdamWFields, OptimizerConfig, Strategy, register

__all__ = ["STRATEGIES", "AdamWFields", "OptimizerConfig", "Strategy", "register"]
