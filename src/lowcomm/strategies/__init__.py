"""Strategies: a named optimizer config -> (wrapped model, optimizer). Importing this package
imports every module in it, which registers its strategies (there is no list to edit);
``STRATEGIES`` maps config names to classes, in the order of the names."""

import importlib
import pkgutil

from lowcomm.strategies.base import (
    METHOD_SWEEPS,
    STRATEGIES,
    Cycle,
    Display,
    Point,
    Row,
    Strategy,
    StrategyConfig,
    register,
)

for _module_info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module_info.name}")
# by name, whatever order the modules (which import each other) registered in
_registered = sorted(STRATEGIES.items())
STRATEGIES.clear()
STRATEGIES.update(_registered)

__all__ = ["METHOD_SWEEPS", "STRATEGIES", "Cycle", "Display", "Point", "Row", "Strategy", "StrategyConfig",
           "register"]
