"""Did-you-mean: messages for an unknown key or option that name what was probably meant and
what is allowed. Hydra overrides (:mod:`lowcomm.config.compose`) and composed configs
(:mod:`lowcomm.config.validation`) are answered in the same words.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

# The papers' letters for keys: DeMo's DCT block side s and coefficients kept per block k,
# DiLoCo's H inner steps between synchronisations. Labels write them; a key given by its letter
# (``optimizer.H=30``, as the docs and the papers say it) is answered with the key it stands for.
SHORT_NAMES = {"compression_chunk": "s", "chunk": "s", "compression_topk": "k", "topk": "k", "sync_every": "H"}


def closest(key: str, candidates: Sequence[str]) -> str | None:
    """The candidate ``key`` most likely stands for: the key a paper's letter names (``H`` for
    ``sync_every``), a close spelling, else the one candidate that contains it (``topk`` for
    ``compression_topk``)."""
    lettered = [c for c in candidates if SHORT_NAMES.get(c) == key]
    if lettered:
        return lettered[0]
    close = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.6)
    if close:
        return close[0]
    containing = [c for c in candidates if len(key) >= 3 and key in c]
    return containing[0] if len(containing) == 1 else None


def did_you_mean(key: str, candidates: Sequence[str]) -> str:
    """`` (did you mean X?)`` when a candidate is close to ``key``, else nothing."""
    match = closest(key, candidates)
    return f" (did you mean {match}?)" if match else ""


def unknown_key_message(full_key: str, allowed: Sequence[str], where: str, note: str = "") -> str:
    leaf = full_key.rsplit(".", 1)[-1]
    match = closest(leaf, allowed)
    hint = f"; did you mean {full_key[: -len(leaf)]}{match}?" if match else "."
    return f"{full_key} is not a key of {where}{hint}{note} Valid keys: {', '.join(allowed)}"
