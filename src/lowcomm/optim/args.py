"""An algorithm's arguments: one dataclass per algorithm, handed whole to its constructor.

Each algorithm module declares ``<Name>Args``: its fields with their types (no defaults) and
its rules, :meth:`Args.errors`, one message per broken rule naming the field. The constructor
raises them (:meth:`Args.check`); the harness's strategy config, which inherits the dataclass and
adds the harness's own fields, reports the same messages before anything is launched, prefixed
with ``optimizer.`` so that they name the config key (:func:`as_config_errors`).

Defaults live in one place, ``configs/optimizer/<config_name>.yaml``. Outside the harness,
:meth:`Args.defaults` reads them::

    DeMo(model.parameters(), DeMoArgs.defaults(lr=1e-3))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from omegaconf import OmegaConf

from lowcomm.paths import config_dir

__all__ = ["Args"]


def raise_argument_errors(errors: Sequence[str]) -> None:
    if errors:
        raise ValueError("; ".join(errors))


def as_config_errors(errors: Sequence[str]) -> list[str]:
    """The same messages naming the keys of the ``optimizer`` config group."""
    return [f"optimizer.{error}" for error in errors]


def one_of_error(name: str, value: Any, allowed: Sequence[Any]) -> list[str]:
    """The message for a field that must be one of ``allowed``, or none."""
    if value in allowed:
        return []
    return [f"{name} must be one of {', '.join(map(str, allowed))}, got {value!r}"]


@dataclass(kw_only=True)
class Args:
    """Base of every algorithm's arguments. Subclasses add fields and extend :meth:`errors`
    (calling ``super().errors()``, so that a config combining several algorithms' arguments,
    such as MuLoCo's DiLoCo + Muon + AdamW, checks every rule of each once)."""

    # the optimizer config whose yaml holds these arguments' defaults
    config_name: ClassVar[str] = ""

    def errors(self) -> list[str]:
        return []

    def check(self) -> Self:
        raise_argument_errors(self.errors())
        return self

    @classmethod
    def defaults(cls, **overrides: Any) -> Self:
        """The arguments as ``configs/optimizer/<config_name>.yaml`` sets them, with
        ``overrides`` (not checked here: the algorithm checks what it is given)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise TypeError(f"{cls.__name__} has no field {', '.join(unknown)}; its fields: {', '.join(sorted(names))}")
        path = config_dir() / "optimizer" / f"{cls.config_name}.yaml"
        values = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
        return cls(**{**{k: v for k, v in values.items() if k in names}, **overrides})
