"""Every-step data parallelism, the machinery the DDP methods share (AdamW-DDP, Muon-DDP,
PowerSGD): PyTorch's DistributedDataParallel with its gradient buckets all-reduced through the
Communicator, followed by a local optimizer step.

DDP keeps its bucketing and its overlap of communication with the backward pass; the comm
hook only replaces the transport, so every gradient byte is metered. DDP is built with
``init_sync=False`` (every rank builds the model from the same seed, or loads the same
checkpoint, so the initial broadcast would be an unmetered no-op). What DDP still sends
outside the hook is one-time metadata: its C++ reducer broadcasts the bucket order once after
the first backward (one int per parameter). It is not gradient traffic and does not recur.
"""

# No `from __future__ import annotations`: DDP checks a comm hook's annotations at runtime.
import contextlib
import inspect
import math
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel

from lowcomm.comm import Communicator
from lowcomm.strategies.base import Strategy, StrategyConfig

WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def metered_allreduce_hook(
    comm: Communicator, bucket: torch.distributed.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook: average the bucket's flat gradient buffer over the workers."""
    work = comm.all_reduce(bucket.buffer(), op="avg", async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def metered_bf16_allreduce_hook(
    comm: Communicator, bucket: torch.distributed.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average in bfloat16 on the wire (half the bytes), then back into the fp32 buffer: what
    PyTorch's ``bf16_compress_hook`` does, through the meter."""
    buffer = bucket.buffer()
    wire = buffer.to(torch.bfloat16)
    work = comm.all_reduce(wire, op="avg", async_op=True)

    def unpack(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return work.get_future().then(unpack)


# No per-forward buffer broadcast (OLMo registers no buffers). torch 2.13 renamed the flag and
# warns on the old name; torch <= 2.12, as in many clusters' images, knows only the old one.
_NO_BUFFER_SYNC = ({"forward_sync_buffers": False}
                   if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
                   else {"broadcast_buffers": False})


@dataclass(kw_only=True)
class DDPConfig(StrategyConfig):
    """The fields of every DDP method's config. ``bucket_cap_mb``: the size of DDP's gradient
    buckets in MiB (25 in every yaml: the size lowcomm always passed, and the one torch documents
    as its default). Each bucket is all-reduced, or handed to the comm hook, as soon as the
    backward pass has filled it: smaller buckets overlap more of the exchange with the backward,
    larger ones make fewer, larger calls and let PowerSGD's hook batch the matrices of one shape
    that a bucket holds (at 25 MiB no bucket of OLMo-300M holds two)."""

    bucket_cap_mb: float

    def errors(self) -> list[str]:
        errors = super().errors()
        if not (self.bucket_cap_mb > 0 and math.isfinite(self.bucket_cap_mb)):
            errors.append(f"bucket_cap_mb must be a finite number > 0 (MiB of gradients per DDP bucket), "
                          f"got {self.bucket_cap_mb}")
        return errors


class DDPStrategy(Strategy):
    """Base for strategies that all-reduce gradients every step; subclasses pick the optimizer
    (``make_optimizer``) and may replace the hook (``register_hook``)."""

    cfg: DDPConfig
    # between replica groups that may leave and rejoin the gradients are averaged once per step,
    # after the backward, by ExchangedGradients: DDP cannot run over a group whose members change
    replica_groups_refusal = None

    @classmethod
    def comm_overlap(cls, cfg: DDPConfig, parameters: int, compression=None) -> float:  # noqa: ARG003
        """DDP all-reduces each bucket of ``bucket_cap_mb`` MiB of fp32 gradients as soon as the
        backward pass has filled it, so the traffic of every bucket but the last can hide behind
        the backward, about 2/3 of a step's FLOPs (forward 2N, backward 4N per token): 2/3 x
        (buckets - 1) / buckets. A model whose gradients fit one bucket (the tiny one) overlaps
        nothing; OLMo-300M's 1.28 GB in 49 buckets of 25 MiB, 0.65 (a model of the bucket count:
        DDP never splits a parameter, so its buckets are a few fewer and fuller)."""
        buckets = max(1, math.ceil(4 * parameters / (cfg.bucket_cap_mb * 2**20)))
        return 2 / 3 * (buckets - 1) / buckets

    def build(self, model: torch.nn.Module):
        if self.comm.replica_groups:
            self.exchanged = ExchangedGradients(self.make_optimizer(model), self.comm,
                                                WIRE_DTYPES[self.cfg.wire_dtype])
            return model, self.exchanged
        device_ids = [model.device.index] if getattr(model, "device", torch.device("cpu")).type == "cuda" else None
        ddp = DistributedDataParallel(
            model, device_ids=device_ids, bucket_cap_mb=self.cfg.bucket_cap_mb, init_sync=False,
            gradient_as_bucket_view=True, **_NO_BUFFER_SYNC,
        )
        self.register_hook(ddp)
        return ddp, self.make_optimizer(ddp.module)

    def register_hook(self, ddp: DistributedDataParallel) -> None:
        """The metered all-reduce, in the config's ``wire_dtype``."""
        bf16 = self.cfg.wire_dtype == "bfloat16"
        ddp.register_comm_hook(self.comm, metered_bf16_allreduce_hook if bf16 else metered_allreduce_hook)

    def make_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        raise NotImplementedError

    def no_sync(self, model: torch.nn.Module):
        # (between replica groups no DDP: gradients accumulate locally until the step's exchange)
        return model.no_sync() if isinstance(model, DistributedDataParallel) else contextlib.nullcontext()

    def clip_grad_norm(self, model: torch.nn.Module, max_norm: float) -> float:
        """Clip the averaged gradients, as under DDP: between replica groups they are averaged
        here first (the step that follows does not average them again)."""
        if self.comm.replica_groups:
            self.exchanged.exchange()
        return super().clip_grad_norm(model, max_norm)


class ExchangedGradients(torch.optim.Optimizer):
    """Data parallelism between replica groups that may leave and rejoin (lowcomm.comm.ft): at
    each step, before the clip or the update, whichever comes first, the quorum of the groups
    alive forms (a group behind takes a live peer's model and optimizer state there), every
    gradient is averaged over the groups that contribute in one metered all-reduce in
    ``wire_dtype``, and ``inner`` steps only where every group in the quorum finished the
    exchange. Its state is ``inner``'s."""

    def __init__(self, inner: torch.optim.Optimizer, comm: Communicator, wire_dtype: torch.dtype):
        self.inner, self.comm, self.wire_dtype = inner, comm, wire_dtype
        self.defaults = inner.defaults
        self.param_groups = inner.param_groups  # the LR schedule drives the inner lr
        self.state = inner.state
        self._committed: bool | None = None  # this step's exchange, once done

    @torch.no_grad()
    def exchange(self) -> bool:
        """Average this step's gradients over the groups (once a step); whether to apply them."""
        if self._committed is None:
            self.comm.begin_exchange()
            params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads]).to(self.wire_dtype)
            self.comm.all_reduce(flat, op="avg")
            offset = 0
            for param, grad in zip(params, grads, strict=True):
                param.grad = grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
                offset += grad.numel()
            self._committed = self.comm.commit()
        return self._committed

    def step(self, closure=None):
        committed, self._committed = self.exchange(), None
        return self.inner.step(closure) if committed else None  # dropped: every group skips it

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.inner.load_state_dict(state_dict)
        self.param_groups, self.state = self.inner.param_groups, self.inner.state


def dense_gradient_bytes(model: torch.nn.Module, wire_dtype: torch.dtype | None = None) -> int:
    """Payload of one uncompressed gradient all-reduce: every trainable element once, in
    ``wire_dtype`` (default: the parameters' own)."""
    return sum(
        p.numel() * (wire_dtype.itemsize if wire_dtype is not None else p.element_size())
        for p in model.parameters()
        if p.requires_grad
    )


def wire_dtype_errors(wire_dtype: str) -> list[str]:
    """The rule of a DDP config's ``wire_dtype``: the dtype its gradients travel in."""
    if wire_dtype not in WIRE_DTYPES:
        return [f"wire_dtype must be one of {', '.join(WIRE_DTYPES)}, got {wire_dtype!r}"]
    return []
