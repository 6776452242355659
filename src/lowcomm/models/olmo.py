"""OLMo models from lowcomm's ``model`` config group, built with ai2-olmo.

The schema below holds only what the paper's models vary; everything else is fixed to the
OLMo-1B recipe the DeMo paper trained (SwiGLU, RoPE, no biases, non-affine layer norm, weight
tying, sequential blocks, no dropout).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ModelSpec:
    name: str = "tiny"
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    mlp_ratio: int = 8
    max_sequence_length: int = 128
    tokenizer: str = "bytes"
    vocab_size: int = 257
    embedding_size: int = 384
    eos_token_id: int = 256
    pad_token_id: int = 256
    weight_tying: bool = True
    init_fn: str = "mitchell"
    init_std: float = 0.02

    def validate(self) -> list[str]:
        errors = []
        for key in ("d_model", "n_heads", "n_layers", "mlp_ratio", "max_sequence_length", "vocab_size"):
            if getattr(self, key) <= 0:
                errors.append(f"model.{key} must be positive, got {getattr(self, key)}")
        if self.n_heads > 0 and self.d_model % self.n_heads:
            errors.append(f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads})")
        if self.embedding_size < self.vocab_size:
            errors.append(
                f"model.embedding_size ({self.embedding_size}) must be >= model.vocab_size ({self.vocab_size})"
            )
        return errors


def olmo_config(spec: ModelSpec, init_device: str = "cpu"):
    from olmo.config import ActivationType, BlockType, LayerNormType
    from olmo.config import ModelConfig as OLMoModelConfig

    return OLMoModelConfig(
        d_model=spec.d_model,
        n_heads=spec.n_heads,
        n_layers=spec.n_layers,
        mlp_ratio=spec.mlp_ratio,
        weight_tying=spec.weight_tying,
        alibi=False,
        rope=True,
        flash_attention=False,
        attention_dropout=0.0,
        attention_layer_norm=False,
        clip_qkv=None,
        include_bias=False,
        block_type=BlockType.sequential,
        layer_norm_type=LayerNormType.default,
        layer_norm_with_affine=False,
        bias_for_layer_norm=False,
        activation_type=ActivationType.swiglu,
        residual_dropout=0.0,
        embedding_dropout=0.0,
        max_sequence_length=spec.max_sequence_length,
        vocab_size=spec.vocab_size,
        embedding_size=spec.embedding_size,
        eos_token_id=spec.eos_token_id,
        pad_token_id=spec.pad_token_id,
        init_device=init_device,
        init_fn=spec.init_fn,
        init_std=spec.init_std,
    )


def build_model(spec: ModelSpec, device: str | torch.device = "cpu", *, seed: int | None = 0):
    """An ``olmo.model.OLMo``. On ``meta`` nothing is allocated (for counting and comm tables);
    elsewhere the weights are initialised from ``seed`` so every rank starts identical."""
    from olmo.model import OLMo

    device = torch.device(device)
    if device.type == "meta":
        return OLMo(olmo_config(spec, "meta"), init_params=False)
    if seed is not None:
        torch.manual_seed(seed)
    model = OLMo(olmo_config(spec, "cpu"), init_params=True)
    return model.to(device)


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@dataclass(frozen=True)
class FlopsPerToken:
    """Training FLOPs per token (forward and backward) by the two conventions the field reports
    MFU with.

    ``six_n``: 6 x parameters (Kaplan et al.), every parameter once.
    ``olmo_core``: OLMo-core's ``Transformer.num_flops_per_token`` (allenai/OLMo-core,
    src/olmo_core/nn/transformer/model.py): 6 x the non-embedding parameters + 12 x layers x
    heads x head dim x sequence length, the attention score and value matmuls (forward 2,
    backward 4, 2 FLOPs each; causal sparsity not discounted, flash attention's recomputation
    not counted). The embedding lookup costs no matmul; the output head does, and with weight
    tying the one matrix is both, so here it counts once, as the head (OLMo-core's models are
    untied: its head is a non-embedding parameter)."""

    six_n: int
    olmo_core: int


def flops_per_token(spec: ModelSpec, parameters: int, seq_len: int) -> FlopsPerToken:
    """:class:`FlopsPerToken` of ``spec`` with ``parameters`` parameters at ``seq_len``."""
    head_dim = spec.d_model // spec.n_heads
    matmul_parameters = parameters if spec.weight_tying else parameters - spec.embedding_size * spec.d_model
    attention = 12 * spec.n_layers * spec.n_heads * head_dim * seq_len
    return FlopsPerToken(six_n=6 * parameters, olmo_core=6 * matmul_parameters + attention)
