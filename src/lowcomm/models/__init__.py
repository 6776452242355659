"""OLMo models built from lowcomm's model config with ai2-olmo."""

from lowcomm.models.olmo import FlopsPerToken, ModelSpec, build_model, count_parameters, flops_per_token
from lowcomm.models.tokenizer import load_tokenizer

__all__ = ["FlopsPerToken", "ModelSpec", "build_model", "count_parameters", "flops_per_token", "load_tokenizer"]
