"""Codecs: encode(tensor) -> Payload, decode(payloads) -> tensor. Imports nothing else of lowcomm.

Importing the package imports every module in it, which registers its codecs under their
``compression`` config names (there is no list to edit): a codec is its module, its
``configs/compression/<name>.yaml`` and its tests."""

import importlib
import pkgutil

from lowcomm.compress.base import Codec, Payload
from lowcomm.compress.error_feedback import ErrorFeedback
from lowcomm.compress.quantize import Quantize
from lowcomm.compress.registry import CODECS, build_codec, codec_config_errors
from lowcomm.compress.topk import TopK

for _module_info in sorted(pkgutil.iter_modules(__path__), key=lambda info: info.name):
    importlib.import_module(f"{__name__}.{_module_info.name}")

__all__ = ["CODECS", "Codec", "ErrorFeedback", "Payload", "Quantize", "TopK", "build_codec", "codec_config_errors"]
