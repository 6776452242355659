"""DeMo as a strategy: no DDP wrapper; each worker's local gradient goes to
:class:`lowcomm.optim.DeMo`, which sends its compressed momentum through the Communicator.

The optimizer config (``configs/optimizer/demo.yaml``) holds all of DeMo's settings, chunk,
top-k and wire format included, so ``optimizer=demo`` alone is the paper's setup. The
``compression`` group is optional: ``compression=dct_topk`` replaces ``compression_chunk``,
``compression_topk`` and ``wire`` with its ``chunk``, ``topk`` and ``wire``, so sweeps can vary
the codec through the same keys as for the other optimizers; ``compression=none`` (the
default) keeps the optimizer config's values. DeMo always compresses: "none" does not mean
dense gradients here.

Momentum is per worker, so checkpoints keep one optimizer file per rank. As with DDP, every
rank builds the model from the same seed (or loads the same checkpoint) and the workers stay
identical because they all apply the same aggregate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowcomm.optim.demo import DeMo, demo_errors, demo_payload_bytes
from lowcomm.optim.grouping import weight_decay_groups
from lowcomm.optim.rules import as_config_errors
from lowcomm.strategies.base import OptimizerConfig, Strategy, parameter_bytes, register


@dataclass
class DeMoConfig(OptimizerConfig):
    """``configs/optimizer/demo.yaml``; the fields are :class:`~lowcomm.optim.DeMo`'s arguments."""

    lr: float = 4e-4
    compression_decay: float = 0.999
    compression_topk: int = 32
    compression_chunk: int = 64
    weight_decay: float = 0.0
    momentum_subtraction: float = 1.0
    projection: str = "dct"
    base: str = "sign"
    wire: str = "paper"
    bucket_numel: int | None = None

    def validate(self) -> list[str]:
        return super().validate() + as_config_errors(demo_errors(
            compression_decay=self.compression_decay, compression_topk=self.compression_topk,
            compression_chunk=self.compression_chunk, weight_decay=self.weight_decay,
            momentum_subtraction=self.momentum_subtraction, projection=self.projection, base=self.base,
            wire=self.wire, bucket_numel=self.bucket_numel,
        ))


def topk_block_errors(chunk: int, topk: int, topk_key: str, chunk_key: str) -> list[str]:
    """A top-k that is not smaller than the block (chunk x chunk coefficients) compresses
    nothing: the codec would clamp it and send the whole block in the paper's 12 bytes per
    coefficient, three times a dense fp32 gradient. Such a config is an error, not a clamp."""
    if topk >= chunk * chunk:
        return [f"{topk_key}={topk} is not smaller than the {chunk} x {chunk} block ({chunk_key}={chunk}: "
                f"{chunk * chunk} coefficients): it would send every coefficient; choose "
                f"{topk_key} < {chunk * chunk}"]
    return []


@register
class DeMoStrategy(Strategy):
    name = "demo"
    Config = DeMoConfig
    # DeMo's codec is set one way, by its own fields (compression_chunk, compression_topk, wire):
    # the compression group is for what an optimizer sends through a separate codec (DiLoCo).
    accepts_compression = ("none",)
    replicated_optimizer_state = False  # the momentum is each worker's own

    @classmethod
    def check_compression(cls, cfg: DeMoConfig, compression: dict) -> list[str]:  # noqa: ARG003
        return topk_block_errors(cfg.compression_chunk, cfg.compression_topk, "optimizer.compression_topk",
                                 "optimizer.compression_chunk")

    def codec_settings(self) -> dict[str, int | str]:
        """chunk, topk and wire of the DCT top-k codec, from the optimizer config."""
        cfg = self.cfg
        return {"chunk": cfg.compression_chunk, "topk": cfg.compression_topk, "wire": cfg.wire}

    def make_optimizer(self, model: torch.nn.Module, comm, optimizer_class: type[DeMo] = DeMo) -> DeMo:
        """DeMo (or a subclass, for FlexDeMo) over the model's trainable parameters, sending
        through ``comm``, with this config's settings."""
        cfg, codec = self.cfg, self.codec_settings()
        return optimizer_class(
            weight_decay_groups(model, weight_decay=cfg.weight_decay, decay_embeddings=cfg.decay_embeddings),
            lr=cfg.lr,
            compression_decay=cfg.compression_decay,
            compression_topk=codec["topk"],
            compression_chunk=codec["chunk"],
            weight_decay=cfg.weight_decay,
            momentum_subtraction=cfg.momentum_subtraction,
            projection=cfg.projection,
            base=cfg.base,
            wire=codec["wire"],
            comm=comm,
            bucket_numel=cfg.bucket_numel,
        )

    def build(self, model: torch.nn.Module) -> tuple[torch.nn.Module, DeMo]:
        return model, self.make_optimizer(model, self.comm)

    def wire_collective(self) -> str:
        return "all_gather"

    def optimizer_state_bytes(self, model: torch.nn.Module, local_world_size: int) -> tuple[float, float]:  # noqa: ARG002
        """The momentum: one copy of the parameters per rank."""
        return 0.0, parameter_bytes(model)

    def analytic_payload_bytes(self, model: torch.nn.Module) -> int:
        """Per step and worker: the DCT top-k payload of every trainable parameter."""
        params = [p for p in model.parameters() if p.requires_grad]
        return demo_payload_bytes([p.shape for p in params], dtype=params[0].dtype, **self.codec_settings())
