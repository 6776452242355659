"""Help text from docstrings: a module's docstring is written for the source and the API docs
(reStructuredText: ``literal``, :mod:`lowcomm.x`); ``--help`` shows it as a terminal reads it."""

from __future__ import annotations

import re

# :role:`target` and :role:`~a.b.target` (Sphinx shows the last part for ~)
_ROLE = re.compile(r":[a-z]+:`(~?)([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")


def plain(text: str | None) -> str:
    """``text`` without reStructuredText markup: roles become their target, literals their text."""
    text = _ROLE.sub(lambda match: match.group(2).rsplit(".", 1)[-1] if match.group(1) else match.group(2), text or "")
    return _LITERAL.sub(r"\1", text)
