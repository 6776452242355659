"""Codecs by name, for the ``compression`` config group (``configs/compression/<name>.yaml``).

Each codec module registers a factory taking the group's fields (minus ``name``) as keyword
arguments. ``none`` means "send the tensor as it is" and has no codec.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lowcomm.compress.base import Codec

CODECS: dict[str, Callable[..., Codec]] = {}


def register_codec(name: str):
    def wrap(factory):
        if name in CODECS:
            raise ValueError(f"codec {name!r} registered twice")
        CODECS[name] = factory
        return factory

    return wrap


def build_codec(cfg: dict[str, Any] | None) -> Codec | None:
    """The codec a ``compression`` config names; None for ``none``."""
    if not cfg or cfg.get("name", "none") == "none":
        return None
    fields = dict(cfg)
    name = fields.pop("name")
    if name not in CODECS:
        raise ValueError(f"compression.name={name!r} is not a codec; available: none, {', '.join(sorted(CODECS))}")
    return CODECS[name](**fields)
