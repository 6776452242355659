"""Every key and option lowcomm's messages, help texts and docstrings name exists (issue 26: a
hint named ``data.paths.dtype``, which OmegaConf then refused with a traceback).

The walk reads every string in ``src/lowcomm`` (messages are built from them) and checks each
``section.key`` against the schema, the strategies' and codecs' arguments, and each
``group=option`` against ``configs/``: a renamed key cannot leave a hint behind that names it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import lowcomm
from lowcomm.config.schema import SECTIONS
from lowcomm.config.validation import sections_with_key
from lowcomm.paths import group_options

SOURCE = Path(lowcomm.__file__).parent
_SECTION = "|".join(SECTIONS)
# ``optimizer.lr``, ``data.paths``; not a file (``model.pt``), a call (``model.parameters()``),
# a path (``configs/model.x``), or a placeholder (``<section>.key``, ``{model.name}``)
KEY = re.compile(rf"(?<![\w./<{{-])({_SECTION})\.([A-Za-z_]\w*)(?![\w(])(?:\.([A-Za-z_]\w*))?")
OPTION = re.compile(rf"(?<![\w./<{{-])({_SECTION})=([A-Za-z_]\w*)")
FILE_SUFFIXES = {"pt", "json", "jsonl", "yaml", "md", "csv", "png", "bin"}


def _strings() -> list[tuple[str, str]]:
    found = []
    for path in sorted(SOURCE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.append((str(path.relative_to(SOURCE)), node.value))
    return found


def _named() -> tuple[set, set]:
    keys, options = set(), set()
    for where, text in _strings():
        for section, key, sub in KEY.findall(text):
            if key not in FILE_SUFFIXES:
                keys.add((section, key, sub, where))
        for group, option in OPTION.findall(text):
            options.add((group, option, where))
    return keys, options


KEYS, OPTIONS = _named()


def test_the_walk_finds_the_messages_it_is_meant_to_check():
    """A walk that found nothing would pass anything."""
    named = {(section, key) for section, key, _, _ in KEYS}
    assert {("optimizer", "compression_topk"), ("data", "paths"), ("model", "vocab_size"),
            ("cluster", "collective_timeout_s")} <= named
    assert len(KEYS) > 50 and len(OPTIONS) > 20


@pytest.mark.parametrize("section, key, sub, where", sorted(KEYS), ids=lambda v: str(v))
def test_every_named_key_exists(section, key, sub, where):
    homes = {dotted for dotted, _ in sections_with_key(key)}
    assert f"{section}.{key}" in homes, f"{where} names {section}.{key}, which no {section} option has"
    # data.paths.dtype: a key inside a value that holds none (only cluster's SLURM extras do)
    if sub and sub not in FILE_SUFFIXES:
        assert (section, key) == ("cluster", "additional_parameters"), f"{where} names {section}.{key}.{sub}"


@pytest.mark.parametrize("group, option, where", sorted(OPTIONS), ids=lambda v: str(v))
def test_every_named_option_exists(group, option, where):
    assert option in group_options()[group], f"{where} names {group}={option}: no configs/{group}/{option}.yaml"
