"""OLMo models built from lowcomm's model config with ai2-olmo."""

from lowcomm.models.olmo import ModelSpec, build_model, count_parameters
from lowcomm.models.tokenizer import load_tokenizer

__all__ = ["ModelSpec", "build_model", "count_parameters", "load_tokenizer"]
