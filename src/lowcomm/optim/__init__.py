"""Optimizers as ``torch.optim.Optimizer`` subclasses that communicate through a Communicator,
each with its arguments as one dataclass (:mod:`lowcomm.optim.args`).

Every module's ``__all__`` is exported here (``from lowcomm.optim import DeMo, DeMoArgs``), so
a new algorithm is its own module and nothing else.
"""

import importlib
import pkgutil

__all__: list[str] = []
for _module_info in pkgutil.iter_modules(__path__):
    _module = importlib.import_module(f"{__name__}.{_module_info.name}")
    for _name in getattr(_module, "__all__", ()):
        globals()[_name] = getattr(_module, _name)
        __all__.append(_name)
