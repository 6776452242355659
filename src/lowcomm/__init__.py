"""lowcomm: communication-efficient LLM pretraining, reproduced and compared on one harness."""

__version__ = "0.1.0"
