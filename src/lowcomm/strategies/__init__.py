"""Strategies: a named optimizer config -> (wrapped model, optimizer). Importing this package
registers every strategy; ``STRATEGIES`` maps config names to classes."""

from lowcomm.strategies import ddp, demo, local  # noqa: F401  (register adamw_ddp, demo, diloco, desloc)
from lowcomm.strategies.base import STRATEGIES, OptimizerConfig, Strategy, register

__all__ = ["STRATEGIES", "OptimizerConfig", "Strategy", "register"]
