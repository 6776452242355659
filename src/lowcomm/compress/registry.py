"""Codecs by name, for the ``compression`` config group (``configs/compression/<name>.yaml``).

Each codec module registers a factory taking the group's fields (minus ``name``) as keyword
arguments. ``none`` means "send the tensor as it is" and has no codec. A codec class may also
define ``config_errors(**fields) -> list[str]``: settings it could run but that a config should
not ask for (DCT top-k keeping a whole block), each message naming its ``compression.`` key.
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


def codec_config_errors(cfg: dict[str, Any] | None) -> list[str]:
    """What the codec a ``compression`` config names refuses in it beyond its constructor's
    checks (its ``config_errors``, when it has one)."""
    if not cfg or cfg.get("name", "none") == "none":
        return []
    fields = dict(cfg)
    rule = getattr(CODECS[fields.pop("name")], "config_errors", None)
    return rule(**fields) if rule is not None else []
