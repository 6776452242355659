"""Codecs: encode(tensor) -> Payload, decode(payloads) -> tensor. Imports nothing else of lowcomm."""

from lowcomm.compress.base import Codec, Payload

__all__ = ["Codec", "Payload"]
