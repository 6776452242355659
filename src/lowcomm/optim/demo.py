"""DeMo: Decoupled Momentum Optimization (Peng, Quesnelle, Kingma 2024, arXiv 2411.19870).

Each worker keeps its own momentum of its own (local, never all-reduced) gradient and sends
only the fast components of it. Per parameter p with gradient g, learning rate lr::

    p     <- p (1 - lr wd)                                   # decoupled weight decay
    delta <- beta delta + lr g                               # lr folded in, as the reference does
    q      = top-k per block of P(delta)                     # P: block DCT-II (or see projection)
    delta <- delta - alpha P^-1(q)                           # keep what was not sent
    Q      = mean, over the workers that sent it, of each coefficient of q_1 .. q_W   # all-gather
    p     <- p - lr T(P^-1(Q))                               # T: sign (default), identity, or Newton-Schulz

Blocks follow DeMo's chunk rule per dimension (:mod:`lowcomm.compress.dct`); a parameter with
more than two dimensions is treated as the matrix ``shape[0] x prod(shape[1:])`` and a 1-D one
as a single row of 1-D chunks. The top-k, wire formats and mean-over-senders aggregation are
:class:`~lowcomm.compress.dct_topk.DCTTopK`'s.

With a fixed basis (``projection="dct"`` or ``"identity"``) the momentum is kept in the
transformed domain: the transform is linear and orthonormal, so ``P(beta delta + lr g) =
beta P(delta) + lr P(g)`` and the subtraction of the sent coefficients is sparse. A step then
costs one forward transform (of g) and one inverse (of Q) instead of three dense transforms;
the result equals the parameter-domain computation up to rounding. The random projection
draws a new basis every step and works in the parameter domain.

Every worker must call ``step()`` with gradients for the same parameters; parameters whose
``grad`` is None are skipped, as by every torch optimizer. Parameters are exchanged in buckets:
one all-gather per wire dtype of the bucket's concatenated payloads into one W x n buffer, and
one aggregation pass over all of them (:meth:`DCTTopK.aggregate_gathered`). Per-parameter
all-gathers and per-worker decoding cost O(W x parameters) small kernels per step (about 50,000
for OLMo-1B at W = 64); the bucketed exchange gives the bit-identical result with a few kernels
per bucket and parameter. The workers' parameters stay identical because every worker applies the same
aggregate; the momentum differs per worker and is in ``state_dict()``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch.profiler import record_function

from lowcomm.comm import Communicator
from lowcomm.compress.base import Payload
from lowcomm.compress.dct import (
    BlockLayout,
    block_transform,
    dct_transform,
    random_orthonormal_basis,
)
from lowcomm.compress.dct_topk import WIRES, DCTTopK
from lowcomm.optim.args import Args, one_of_error
from lowcomm.optim.closure import closure_loss

__all__ = ["DeMo", "DeMoArgs", "demo_payload_bytes"]

PROJECTIONS = ("dct", "random", "identity")
BASES = ("sign", "sgd", "muon")
_NEWTON_SCHULZ = (3.4445, -4.7750, 2.0315)
_Bases = tuple[torch.Tensor | None, torch.Tensor | None]


def newton_schulz(matrix: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Approximately orthogonalise ``matrix`` (push its singular values towards 1), Muon's
    quintic Newton-Schulz iteration: X <- X / ||X||_F, then ``steps`` times
    X <- a X + (b A + c A^2) X with A = X X^T and (a, b, c) = (3.4445, -4.7750, 2.0315)."""
    a, b, c = _NEWTON_SCHULZ
    x = matrix / (matrix.norm() + eps)
    transposed = x.shape[0] > x.shape[1]
    if transposed:  # iterate on the smaller Gram matrix
        x = x.T
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if transposed else x


def demo_payload_bytes(
    shapes: Iterable[torch.Size | Sequence[int]],
    chunk: int = 64,
    topk: int = 32,
    wire: str = "paper",
    dtype: torch.dtype = torch.float32,
) -> int:
    """Payload bytes one worker sends per DeMo step for parameters of these shapes (the paper's
    "Tx MB/step" x 1e6): e.g. OLMo-1B, chunk 64, k 32, paper wire: 110,321,664."""
    codec = DCTTopK(chunk=chunk, topk=topk, wire=wire)
    return sum(codec.payload_nbytes(tuple(shape), dtype) for shape in shapes)


@dataclass
class _Sent:
    """One parameter's part of a bucket: what its update needs once the payloads are back."""

    param: torch.nn.Parameter
    layout: BlockLayout
    bases: _Bases
    lr: float | torch.Tensor  # a 0-d tensor in a captured step (:class:`_Graphs`)
    payload: Payload
    offset: int  # where its coefficients start in the bucket's aggregate


@dataclass
class _Stack:
    """Parameters of one bucket and parameter group whose blocks have one geometry (chunk rows,
    chunk columns) and whose matrices one width. Row over row they form one ``rows x cols``
    matrix whose blocks are exactly theirs, so a transform, a top-k, a subtraction and an
    inverse transform run once for all of them, not once per parameter: in OLMo every block's
    ``att_proj``, ``attn_out`` and ``ff_proj`` (1024 wide) are one stack, its ``ff_out``
    (4096 wide) another. Their momenta are one buffer, each parameter's state a view of it.
    (Under the random projection the stack's members also share a step count: the basis is
    drawn per step.)"""

    params: list[torch.nn.Parameter]
    layouts: list[BlockLayout]
    group: dict[str, Any]

    @property
    def key(self) -> tuple[int, ...]:
        return tuple(id(param) for param in self.params)

    @functools.cached_property
    def layout(self) -> BlockLayout:
        return stacked_layout(self.layouts)

    def rows(self, matrix: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's rows of a stacked ``rows x cols`` matrix (views)."""
        return list(matrix.view(self.layout.rows, self.layout.cols).split([part.rows for part in self.layouts]))

    def block_spans(self) -> list[tuple[int, int]]:
        """Each parameter's blocks in the stacked matrix's numbering: ``[first, last)``."""
        spans, first = [], 0
        for part in self.layouts:
            spans.append((first, first + part.num_blocks))
            first += part.num_blocks
        return spans


def stacked_layout(layouts: Sequence[BlockLayout]) -> BlockLayout:
    """The layout of matrices of one block geometry and width stacked row over row: its blocks
    are theirs (each has a whole number of block rows)."""
    first = layouts[0]
    if any((part.chunk_rows, part.chunk_cols, part.cols) != (first.chunk_rows, first.chunk_cols, first.cols)
           for part in layouts):
        raise ValueError(f"only layouts of one block geometry and width stack, got {layouts}")
    rows = sum(part.rows for part in layouts)
    return BlockLayout((rows, first.cols), rows, first.cols, first.chunk_rows, first.chunk_cols)


@dataclass
class _Encoded:
    """A bucket encoded: its parameters' parts and their payloads laid end to end, one flat
    tensor per wire dtype, ready to be all-gathered."""

    sent: list[_Sent]
    numel: int
    flats: dict[torch.dtype, torch.Tensor]
    # per wire dtype: [(entry, payload key, start, shape)]
    segments: dict[torch.dtype, list[tuple[int, str, int, torch.Size]]]


@dataclass
class _InFlight:
    """A bucket whose payloads are being all-gathered while the next bucket is encoded."""

    sent: list[_Sent]
    numel: int
    # per wire dtype: (W x n gathered buffer, [(entry, payload key, start, shape)])
    gathered: dict[torch.dtype, tuple[torch.Tensor, list[tuple[int, str, int, torch.Size]]]]
    works: list[Any]



_GRAPH_WARMUP = 2  # eager steps before a capture
# DeMo's default bucket on a GPU (``DeMoArgs.bucket_numel``): its work space (3 x the bucket,
# 2.4 GB in float32) and two buckets' gathered payloads (2 x W x 18.75 MB at k=32 of 64 x 64,
# 2.4 GB at W=64) stay small beside a 1B model's training state, and OLMo-300M is one bucket
GPU_BUCKET_NUMEL = 200_000_000


@dataclass
class _Graphs:
    """DeMo's step captured as CUDA graphs (``DeMoArgs.cuda_graph``). Each bucket is two graphs:
    its encoding (weight decay, transform, top-k, what is sent subtracted, the payloads
    concatenated) and its decoding (aggregation, inverse transform, sign, update). A replay
    runs them in the eager step's order with each bucket's all-gathers between them, through
    the Communicator as always (the same calls, bytes and meter). A step costs a few graph
    launches instead of hundreds of kernel launches and their host work.

    A graph reads and writes memory by address, and its arithmetic's constants are fixed at the
    capture. What changes from step to step is brought to it: the learning rates (0-d tensors,
    filled from the groups before each replay) and the gradients (a new gradient tensor is
    copied into the captured one: with ``zero_grad(set_to_none=True)``, as lowcomm's loop calls
    it, one gradient-sized copy per step and one gradient-sized buffer held). The rest is in
    :meth:`DeMo._signature`: which parameters step and where they and their momenta lie, the
    groups and their other settings. A step whose signature is not the capture's drops it (a
    loaded checkpoint, a parameter without a gradient, a changed weight decay): two eager steps
    later the step is captured anew. The work space, the DCT bases and the index tables stay
    where they are as long as the signature does."""

    signature: tuple  # DeMo._signature of the captured step
    params: list[torch.nn.Parameter]  # those with a gradient at the capture, in order
    grads: list[torch.Tensor]  # the gradient tensors the graphs read
    lrs: dict[int, torch.Tensor]  # id(group) -> its lr, 0-d float64 on the device
    encoded: list[_Encoded]  # per bucket: the flat payloads the encoding graph writes
    gathered: list[dict[torch.dtype, torch.Tensor]]  # per bucket: its all-gathers' outputs
    encode: list[Any]  # per bucket: a torch.cuda.CUDAGraph (or what the runtime makes)
    decode: list[Any]


class CudaGraphRuntime:
    """What DeMo's captured step needs of CUDA, in one place: a side stream for the warm-up
    steps and the captures, one memory pool per capture that its graphs share, and the graphs
    (each replayed by ``graph.replay()``). ``DeMo.graph_runtime`` names the class: the tests put
    one that records and re-runs Python in its place, to check the captured step's bookkeeping
    where there is no GPU (CI)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.pool = None

    @staticmethod
    def serves(params: Sequence[torch.Tensor]) -> bool:
        return all(param.is_cuda for param in params)

    def warm_up(self, step) -> None:
        """``step()`` run eagerly on the side stream, ordered after and before the current stream's work."""
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            step()
        current.wait_stream(self.stream)

    def new_pool(self) -> None:
        """The memory pool the next captures share (a capture replaced starts its own)."""
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, function, *args) -> tuple[Any, Any]:
        """``function(*args)`` recorded, not run: the graph and what the call returned."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            result = function(*args)
        return graph, result


@dataclass
class _Run:
    """Consecutive entries of a bucket, from ``first`` on, that one inverse transform decodes:
    one block geometry and width, one basis and one lr. Each stack of :meth:`DeMo._stacks` is
    one (stacks of two parameter groups with the same lr and geometry that follow each other
    join), so a checkpoint's in-flight bucket (DisTrO) needs no record of its stacks."""

    first: int
    items: list[_Sent]

    @functools.cached_property
    def layout(self) -> BlockLayout:
        return stacked_layout([item.layout for item in self.items])

    @property
    def entries(self) -> range:
        return range(self.first, self.first + len(self.items))


def _pipelined(buckets: Sequence[Any], send, apply) -> None:
    """The order of a DeMo step, one place for the eager step, its capture and its replay (the
    captured graphs share one memory pool, which is safe only if they replay in the order they
    were captured): ``send`` each bucket, and ``apply`` what the previous one sent after the next
    one is sent. One bucket in flight: its all-gather overlaps the next bucket's encoding, and
    at most two buckets' gathered payloads are held at once."""
    pending = None
    for bucket in buckets:
        sent = send(bucket)
        if pending is not None:
            apply(pending)
        pending = sent
    if pending is not None:
        apply(pending)


def _same_lr(a: float | torch.Tensor, b: float | torch.Tensor) -> bool:
    """Equal learning rates: equal numbers, or one group's tensor (comparing two tensors'
    values would wait for the device)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    return a == b


def _add_scaled_(target: torch.Tensor, tensor: torch.Tensor, scale: float | torch.Tensor, sign: int = 1) -> None:
    """``target += sign * scale * tensor``, ``scale`` a number or a 0-d tensor on the target's
    device (a captured step's lr: ``alpha=`` would read it back to the host)."""
    if isinstance(scale, torch.Tensor):
        target.addcmul_(tensor, scale, value=sign)
    else:
        target.add_(tensor, alpha=sign * scale)


def _runs(sent: list[_Sent]) -> list[_Run]:
    runs: list[_Run] = []
    for entry, item in enumerate(sent):
        if runs:
            last = runs[-1].items[-1]
            if ((item.layout.chunk_rows, item.layout.chunk_cols, item.layout.cols)
                    == (last.layout.chunk_rows, last.layout.chunk_cols, last.layout.cols)
                    and _same_lr(item.lr, last.lr)
                    and all(a is b for a, b in zip(item.bases, last.bases, strict=True))):
                runs[-1].items.append(item)
                continue
        runs.append(_Run(entry, [item]))
    return runs


@dataclass(kw_only=True)
class DeMoArgs(Args):
    """DeMo's arguments (and FlexDeMo's); defaults in ``configs/optimizer/demo.yaml``.

    lr: learning rate; also scales the gradient entering the momentum.
    compression_decay: momentum decay beta, in [0, 1).
    compression_topk: coefficients kept per block (clamped to the block's size).
    compression_chunk: target block side (DeMo's chunk rule per dimension).
    weight_decay: decoupled weight decay (multiplied by lr).
    momentum_subtraction: alpha, the fraction of the sent components removed from the
        momentum (the paper ablates [0, 1]; the reference uses 1).
    projection: ``dct`` (block DCT-II), ``random`` (a random orthonormal block basis, drawn
        from the step number so all workers share it, new every step) or ``identity`` (top-k
        of the raw momentum, per block).
    base: the transform of the aggregate before the update: ``sign`` (signum, the paper's),
        ``sgd`` (none) or ``muon`` (Newton-Schulz orthogonalisation of the parameter's matrix).
    wire: the payload format: ``paper``, ``compact``, ``sign`` or ``signbit`` (see
        :mod:`lowcomm.compress.dct_topk`). With a rounding format the momentum loses what
        receivers decode, so rounding errors stay in it; with ``signbit`` (receivers decode
        +-1) it loses the selected values.
    bucket_numel: the most parameter elements whose payloads share one all-gather per wire
        dtype and one aggregation pass. None: on the CPU the largest parameter's size, so the
        aggregate reuses the per-parameter work space; on a GPU ``GPU_BUCKET_NUMEL`` (200M, or
        the largest parameter's if larger), where a step's time is its kernel launches: one
        bucket of OLMo-300M's 117.4M block parameters steps in 5.5 ms on an H200, buckets of the
        largest parameter in 33.1 ms. A parameter larger than the bucket is a bucket of its own;
        the updates and bytes are the same at any size, the all-gather calls not.
    cuda_graph: on a GPU, replay the step's arithmetic as CUDA graphs (see :class:`_Graphs`);
        the all-gathers run and are metered as without. Ignored on the CPU, so that a laptop's
        config runs unchanged. Needs a fixed basis (``projection`` ``dct`` or ``identity``).
    """

    config_name: ClassVar[str] = "demo"

    lr: float
    compression_decay: float
    compression_topk: int
    compression_chunk: int
    weight_decay: float
    momentum_subtraction: float
    projection: str
    base: str
    wire: str
    bucket_numel: int | None
    cuda_graph: bool

    def errors(self) -> list[str]:
        errors = super().errors()
        if not self.lr >= 0:
            errors.append(f"lr must be >= 0, got {self.lr}")
        if not 0 <= self.compression_decay < 1:
            errors.append(f"compression_decay must be in [0, 1), got {self.compression_decay}")
        for name in ("compression_topk", "compression_chunk"):
            if getattr(self, name) < 1:
                errors.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.weight_decay < 0:
            errors.append(f"weight_decay must be >= 0, got {self.weight_decay}")
        if not 0 <= self.momentum_subtraction <= 1:
            errors.append(f"momentum_subtraction must be in [0, 1], got {self.momentum_subtraction}")
        errors += one_of_error("projection", self.projection, PROJECTIONS)
        errors += one_of_error("base", self.base, BASES)
        errors += one_of_error("wire", self.wire, WIRES)
        if self.bucket_numel is not None and self.bucket_numel < 1:
            errors.append(f"bucket_numel={self.bucket_numel} must be None (the default size: the largest "
                          "parameter's on the CPU, 200M elements on a GPU) or >= 1")
        if self.cuda_graph and self.projection == "random":
            errors.append("cuda_graph needs a fixed basis: projection=random draws a new one every step")
        if self.cuda_graph and self.config_name != "demo":
            errors.append(f"cuda_graph is DeMo's alone, not {self.config_name}'s (its step is not DeMo's)")
        return errors


class DeMo(torch.optim.Optimizer):
    """DeMo as a ``torch.optim.Optimizer``: drop it into any loop, with or without
    torch.distributed (a world of one needs no process group). Do not wrap the model in DDP:
    each worker's local gradient is the input.

    Args:
        params: parameters or param groups (``lr``, ``weight_decay``, ``compression_decay``
            and ``momentum_subtraction`` may differ per group).
        args: :class:`DeMoArgs` (``DeMoArgs.defaults(...)``: the paper's settings).
        comm: the Communicator to send through (its meter counts every byte); None: the default
            process group when torch.distributed is initialised, else this one process (for a
            sub-group, pass ``Communicator(group)``).
    """

    # whether the step can be captured (``cuda_graph``): not where a subclass changes what a step
    # reads (FlexDeMo re-points its shards) or when it applies the aggregate (DisTrO)
    graphable: ClassVar[bool] = True
    # how many steps' all-gather buffers are in use at once (see _receive_buffers)
    _receive_sets: ClassVar[int] = 1
    graph_runtime: ClassVar[type] = CudaGraphRuntime

    def __init__(self, params, args: DeMoArgs, comm: Communicator | None = None):
        args.check()
        if args.cuda_graph and not self.graphable:
            raise ValueError(f"cuda_graph is DeMo's alone; {type(self).__name__}'s step cannot be captured")
        defaults = {
            "lr": args.lr,
            "weight_decay": args.weight_decay,
            "compression_decay": args.compression_decay,
            "momentum_subtraction": args.momentum_subtraction,
        }
        super().__init__(params, defaults)
        self.codec = DCTTopK(chunk=args.compression_chunk, topk=args.compression_topk, wire=args.wire)
        self.projection = args.projection
        self.base = args.base
        self.comm = comm if comm is not None else Communicator()
        self.bucket_numel = args.bucket_numel
        # A fixed basis lets the momentum live in the coefficient domain (see the module doc);
        # the parameter-domain path stays for the random basis (and for tests to compare).
        self._momentum_in_coefficients = args.projection != "random"
        # Three flat buffers per (device, dtype), as large as the largest parameter or bucket,
        # reused by every parameter and step: fresh multi-MB temporaries cost a page fault per
        # page on CPU.
        self._workspace: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._random_bases: dict[tuple[int, int, torch.device, torch.dtype], torch.Tensor] = {}
        self._stacked: dict[tuple[int, ...], torch.Tensor] = {}  # each stack's momenta (see _Stack)
        # on the CPU, each bucket's all-gather buffers (W x its payload, per wire dtype), kept
        # between steps for the same reason: at W = 64 a bucket of OLMo-300M receives 1.2 GB a
        # step, and fresh buffers cost their page faults and their unmapping every step
        # (benchmarks/senders.py). A GPU's caching allocator reuses freed memory already, and
        # keeping every bucket's would hold them all at once (a 1B model's six: 7 GB at W = 64)
        self._received: dict[tuple[int, torch.dtype, int], torch.Tensor] = {}
        self._turn = 0  # steps begun: which of the _receive_sets sets of buffers a step's all-gathers fill
        self.cuda_graph = args.cuda_graph
        self._graphs: _Graphs | None = None  # the captured step, once there is one
        self._warm_steps = 0  # eager warm-up steps in a row with one signature (see _graphed_step)
        self._warm_signature: tuple | None = None  # the signature the last warm-up step left
        # each group's lr as a 0-d tensor (keyed by id(group)) while a step is captured
        self._lrs: dict[int, torch.Tensor] | None = None
        self._runtime: CudaGraphRuntime | None = None  # made at the first captured step

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        self._random_bases.clear()
        self._turn += 1
        buckets = self._buckets()
        params = [param for bucket in buckets for param, _ in bucket] if self.cuda_graph else []
        if params and self.graph_runtime.serves(params):
            self._graphed_step(buckets, params)
        else:
            self._eager_step(buckets)
        return loss

    def _eager_step(self, buckets: list[list[tuple[torch.nn.Parameter, dict[str, Any]]]]) -> None:
        _pipelined(buckets, self._send_bucket, self._apply_bucket)

    # ------------------------------------------------------------ CUDA graphs
    def _graphed_step(self, buckets: list[list[tuple[torch.nn.Parameter, dict[str, Any]]]],
                      params: list[torch.nn.Parameter]) -> None:
        """The step as CUDA graphs (:class:`_Graphs`): ``_GRAPH_WARMUP`` eager steps in a row
        with one signature (:meth:`_signature`) on the capture stream first (they build the
        momenta, work space and tables the graphs then read, and leave them where the capture
        finds them), then one capture, replayed while the signature holds."""
        signature = self._signature(params)
        if self._graphs is not None and self._graphs.signature != signature:
            self._graphs = None
        if self._graphs is None:
            if any(param.dtype not in (torch.float32, torch.float64) for param in params):
                raise ValueError("cuda_graph needs float32 or float64 parameters: a captured step's learning rate "
                                 "is a tensor, which a bf16 parameter's arithmetic would round to bf16")
            if self._runtime is None or self._runtime.device != params[0].device:
                self._runtime = self.graph_runtime(params[0].device)
            if signature != self._warm_signature:
                self._warm_steps = 0
            if self._warm_steps < _GRAPH_WARMUP:
                self._runtime.warm_up(lambda: self._eager_step(buckets))
                self._warm_steps += 1
                self._warm_signature = self._signature(params)
                return
            self._graphs = self._capture(buckets, params, signature, self._runtime)
        self._replay(self._graphs)

    def _signature(self, params: list[torch.nn.Parameter]) -> tuple:
        """What a captured step takes as fixed: the parameters that step, in order, and where
        they and their momenta lie; the parameter groups and the settings a graph holds as
        constants (all but the lr, which each replay brings)."""
        key = self._momentum_key
        return (tuple((id(param), param.data_ptr(),
                       self.state[param][key].data_ptr() if key in self.state[param] else 0) for param in params),
                tuple((id(group), group["weight_decay"], group["compression_decay"], group["momentum_subtraction"])
                      for group in self.param_groups))

    def _capture(self, buckets, params: list[torch.nn.Parameter], signature: tuple,
                 runtime: CudaGraphRuntime) -> _Graphs:
        """Record each bucket's encoding and decoding as graphs, in the order the eager step
        runs them (so that the graphs, which share one memory pool, reuse each other's
        temporaries only as that order allows). Nothing runs: the replay that follows is the
        step. A bucket's all-gathers write into one of two sets of buffers, by the bucket's
        parity: bucket i + 2's all-gather starts after bucket i is decoded."""
        device, world = params[0].device, self.comm.world_size
        lrs = {id(group): torch.zeros((), dtype=torch.float64, device=device) for group in self.param_groups}
        runtime.new_pool()
        encode, decode, encoded, gathered = [], [], [], []
        spare: list[dict[torch.dtype, torch.Tensor]] = [{}, {}]

        def gather_buffer(parity: int, flat: torch.Tensor) -> torch.Tensor:
            """The parity's buffer for ``flat``'s dtype (a larger one where it is too small)."""
            buffer = spare[parity].get(flat.dtype)
            if buffer is None or buffer.numel() < world * flat.numel():
                buffer = spare[parity][flat.dtype] = flat.new_empty(world * flat.numel())
            return buffer[: world * flat.numel()]

        def send(bucket) -> _InFlight:
            graph, bucket_encoded = runtime.capture(self._encode_bucket, bucket)
            encode.append(graph)
            encoded.append(bucket_encoded)
            # the all-gathers' outputs: outside the pool, written between the graphs
            gathered.append({dtype: gather_buffer(len(encoded) % 2, flat) for dtype, flat in bucket_encoded.flats.items()})
            return self._flight(bucket_encoded, gathered[-1], [])  # (the replay gathers)

        self._lrs = lrs
        try:
            _pipelined(buckets, send, lambda flight: decode.append(runtime.capture(self._decode_bucket, flight)[0]))
        finally:
            self._lrs = None
        if self._signature(params) != signature:
            raise RuntimeError("DeMo's capture moved a parameter or momentum it reads; the warm-up steps should "
                               "have left them in place (a bug in lowcomm)")
        return _Graphs(signature=signature, params=params, grads=[param.grad for param in params], lrs=lrs,
                       encoded=encoded, gathered=gathered, encode=encode, decode=decode)

    def _replay(self, graphs: _Graphs) -> None:
        """One step: this step's learning rates and gradients into the tensors the graphs read,
        then each bucket's graphs with its all-gather between them, as the eager step orders them."""
        for group in self.param_groups:
            graphs.lrs[id(group)].fill_(group["lr"])
        moved = [(kept, param.grad) for kept, param in zip(graphs.grads, graphs.params, strict=True)
                 if param.grad is not kept]
        if moved:  # a backward pass that made new gradient tensors (zero_grad(set_to_none=True))
            torch._foreach_copy_([kept for kept, _ in moved], [grad for _, grad in moved])
        for param in graphs.params:
            self.state[param]["step"] += 1

        def send(bucket: tuple) -> tuple[_InFlight, Any]:
            encode, decode, encoded, gathered = bucket
            encode.replay()
            return self._gather(encoded, into=gathered), decode

        def apply(sent: tuple[_InFlight, Any]) -> None:
            self._wait(sent[0])
            sent[1].replay()

        _pipelined(list(zip(graphs.encode, graphs.decode, graphs.encoded, graphs.gathered, strict=True)), send, apply)

    def _buckets(self) -> list[list[tuple[torch.nn.Parameter, dict[str, Any]]]]:
        """The parameters with a gradient, in order, cut into buckets of one (device, dtype)
        and at most ``bucket_numel`` elements (its default: :class:`DeMoArgs`)."""
        buckets: list[list[tuple[torch.nn.Parameter, dict[str, Any]]]] = []
        key, filled, caps = None, 0, {}
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if (param.device, param.dtype) not in caps:
                    caps[(param.device, param.dtype)] = self.bucket_numel or (
                        max(GPU_BUCKET_NUMEL, self._largest(param)) if param.is_cuda else self._largest(param))
                cap = caps[(param.device, param.dtype)]
                if not buckets or (param.device, param.dtype) != key or filled + param.numel() > cap:
                    buckets.append([])
                    key, filled = (param.device, param.dtype), 0
                buckets[-1].append((param, group))
                filled += param.numel()
        return buckets

    def _send_bucket(self, bucket: list[tuple[torch.nn.Parameter, dict[str, Any]]]) -> _InFlight:
        """Encode every parameter of the bucket, then start one all-gather per wire dtype of
        the concatenated payloads (into one W x n buffer each: no per-worker copies)."""
        return self._gather(self._encode_bucket(bucket))

    def _encode_bucket(self, bucket: list[tuple[torch.nn.Parameter, dict[str, Any]]]) -> _Encoded:
        """Every parameter of the bucket encoded, the payloads concatenated per wire dtype."""
        sent, offset = [], 0
        for stack in self._stacks(bucket):
            bases, payloads = self._encode(stack)
            for param, layout, payload in zip(stack.params, stack.layouts, payloads, strict=True):
                sent.append(_Sent(param, layout, bases, self._lr(stack.group), payload, offset))
                offset += layout.numel
        segments: dict[torch.dtype, list[tuple[int, str, int, torch.Size]]] = {}
        pieces: dict[torch.dtype, list[torch.Tensor]] = {}
        filled: dict[torch.dtype, int] = {}
        # key by key, then entry by entry: a run's payloads of one key lie side by side (sign
        # bits after all the indices, though both are bytes), so the run is aggregated as one
        for key in sent[0].payload.tensors:
            for entry, item in enumerate(sent):
                tensor = item.payload.tensors[key]
                start = filled.get(tensor.dtype, 0)
                segments.setdefault(tensor.dtype, []).append((entry, key, start, tensor.shape))
                pieces.setdefault(tensor.dtype, []).append(tensor.reshape(-1))
                filled[tensor.dtype] = start + tensor.numel()
        flats = {dtype: torch.cat(parts) if len(parts) > 1 else parts[0] for dtype, parts in pieces.items()}
        return _Encoded(sent, offset, flats, segments)

    def _gather(self, encoded: _Encoded, *, into: dict[torch.dtype, torch.Tensor] | None = None) -> _InFlight:
        """Start the bucket's all-gathers, one per wire dtype, into one W x n buffer each (no
        per-worker copies): new ones, or ``into`` (a captured step's)."""
        buffers = into if into is not None else self._receive_buffers(encoded)
        with record_function("DeMo.communicate"):
            works = [self.comm.all_gather_into_tensor(buffers[dtype], flat, async_op=True)
                     for dtype, flat in encoded.flats.items()]
        return self._flight(encoded, buffers, works)

    def _receive_buffers(self, encoded: _Encoded) -> dict[torch.dtype, torch.Tensor]:
        """The bucket's all-gather buffers, one per wire dtype, flat (as gloo wants them): on the
        CPU those of ``_receive_sets`` steps ago where the sizes still match (a bucket is known
        by its first parameter), else new ones. DeMo decodes a bucket within its step: one set; an
        optimizer that decodes a step's buckets in the next (DisTrO) keeps two."""
        world, buffers = self.comm.world_size, {}
        for dtype, flat in encoded.flats.items():
            if flat.device.type != "cpu":
                buffers[dtype] = flat.new_empty(world * flat.numel())
                continue
            key = (id(encoded.sent[0].param), dtype, self._turn % self._receive_sets)
            kept = self._received.get(key)
            if kept is None or kept.numel() != world * flat.numel() or kept.device != flat.device:
                kept = self._received[key] = flat.new_empty(world * flat.numel())
            buffers[dtype] = kept
        return buffers

    def _flight(self, encoded: _Encoded, buffers: dict[torch.dtype, torch.Tensor], works: list[Any]) -> _InFlight:
        """The bucket with its all-gathers' output buffers (each seen as W x n) and their works."""
        world = self.comm.world_size
        gathered = {dtype: (buffer.view(world, -1), encoded.segments[dtype]) for dtype, buffer in buffers.items()}
        return _InFlight(encoded.sent, encoded.numel, gathered, works)

    def _stacks(self, bucket: list[tuple[torch.nn.Parameter, dict[str, Any]]]) -> list[_Stack]:
        """The bucket's parameters in stacks (see :class:`_Stack`), in order of first appearance."""
        stacks: dict[tuple, _Stack] = {}
        for param, group in bucket:
            layout = self.codec.layout(param.shape)
            # a random basis is drawn per step: a parameter that missed a step has another one
            step = self.state[param].get("step", 0) if self.projection == "random" else None
            key = (id(group), step, layout.chunk_rows, layout.chunk_cols, layout.cols)
            if key not in stacks:
                stacks[key] = _Stack([], [], group)
            stacks[key].params.append(param)
            stacks[key].layouts.append(layout)
        return list(stacks.values())

    def _encode(self, stack: _Stack) -> tuple[_Bases, list[Payload]]:
        """Weight decay, momentum, top-k, subtraction of what is sent, for the whole stack at
        once; return the (shared) bases and each parameter's payload."""
        group, layout, params = stack.group, stack.layout, stack.params
        lr, alpha = self._lr(group), group["momentum_subtraction"]
        if self._lrs is None:  # (a captured step's counts are kept by its replay)
            for param in params:
                state = self.state[param]
                state["step"] = state.get("step", 0) + 1
        momentum = self._stacked_momentum(stack)
        bases = self._bases(layout, self.state[params[0]]["step"], params[0])
        work, scratch, spare = self._work_buffers(params[0], layout.numel)

        with record_function("DeMo.transform"):
            if group["weight_decay"]:
                torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
            grads = [param.grad for param in params]
            decay = group["compression_decay"]
            selected, subtracted = None, False
            if self._momentum_in_coefficients and isinstance(lr, torch.Tensor):
                # a captured step's lr is a tensor: the transform's own scaling takes numbers
                transformed = self._transform(grads, layout, bases, out=work, scratch=scratch)
                momentum.mul_(decay).addcmul_(transformed, lr)
                self._momenta_ready(stack, momentum, bases)
                coefficients = momentum
            elif self._momentum_in_coefficients:
                # momentum <- decay * momentum + lr * P(grad), accumulated by the transform itself;
                # on the CPU kernels with the top-k of each tile taken while it is in cache, and
                # what is sent subtracted there too where nothing reads the momentum before that
                if self.projection == "dct":
                    subtract = alpha if self._subtracts_while_selecting() else 0.0
                    selected = self.codec.transform_select(grads, layout, momentum, beta=decay, alpha=lr,
                                                           subtract=subtract)
                    subtracted = selected is not None and subtract != 0.0
                if selected is None:
                    self._transform(grads, layout, bases, out=momentum, scratch=scratch, beta=decay, alpha=lr)
                self._momenta_ready(stack, momentum, bases)
                coefficients = momentum
            else:
                for part, grad in zip(stack.rows(momentum), grads, strict=True):
                    _add_scaled_(part.mul_(decay), grad.reshape(part.shape), lr)
                self._momenta_ready(stack, momentum, bases)  # before ``work`` holds the coefficients
                coefficients = self._transform(momentum, layout, bases, out=work, scratch=scratch)

        with record_function("DeMo.topk"):
            index, positions, values = selected or self.codec.select(coefficients, layout, scratch=scratch)
            payloads = [self.codec.pack(index[first:last], values[first:last], part)
                        for part, (first, last) in zip(stack.layouts, stack.block_spans(), strict=True)]
            if alpha and not subtracted:
                sent = self.codec.removed(values)
                if self._momentum_in_coefficients:  # a sparse update of the coefficients
                    momentum.view(-1).index_add_(0, positions.view(-1), sent.reshape(-1), alpha=-alpha)
                else:
                    sparse = scratch.zero_().index_put_((positions.view(-1),), sent.reshape(-1))
                    own = self._transform(sparse, layout, bases, inverse=True, out=spare, scratch=work)
                    momentum.sub_(own.view(layout.rows, layout.cols), alpha=alpha)
        return bases, payloads

    def _stacked_momentum(self, stack: _Stack) -> torch.Tensor:
        """The stack's momenta as one ``rows x cols`` buffer, each parameter's state a view of
        its rows. Built (from the parameters' momenta: new, restored from a checkpoint or kept
        in the other domain) when the stack is new or a state no longer points into it."""
        key, itemsize = self._momentum_key, stack.params[0].element_size()
        buffer = self._stacked.get(stack.key)
        if buffer is not None:
            start = buffer.data_ptr()
            for param, layout in zip(stack.params, stack.layouts, strict=True):
                kept = self.state[param].get(key)
                if kept is None or kept.data_ptr() != start:
                    buffer = None
                    break
                start += layout.numel * itemsize
        if buffer is None:
            first = stack.params[0]
            buffer = torch.empty(stack.layout.numel, device=first.device, dtype=first.dtype)
            start = 0
            for param, layout in zip(stack.params, stack.layouts, strict=True):
                state = self.state[param]
                rows = buffer[start : start + layout.numel]
                rows.copy_(self._momentum(state, layout, param).reshape(-1))
                state[self._momentum_key] = rows.view(param.shape)
                start += layout.numel
            # a stack whose members changed (a parameter without a gradient this step) leaves
            # its old buffer behind: nothing points into it any more
            members = set(stack.key)
            for stale in [other for other in self._stacked if members.intersection(other)]:
                del self._stacked[stale]
            self._stacked[stack.key] = buffer
        return buffer.view(stack.layout.rows, stack.layout.cols)

    def _subtracts_while_selecting(self) -> bool:
        """May the encode's kernel subtract what is sent from the momentum itself, in the pass
        that selects it? Where what is sent is the selected values (:attr:`DCTTopK.removes_selected_values`)
        and no subclass reads the momentum before the subtraction (:meth:`_momenta_ready`,
        DisTrO's lookahead)."""
        return self.codec.removes_selected_values and type(self)._momenta_ready is DeMo._momenta_ready

    def _momenta_ready(self, stack: _Stack, momentum: torch.Tensor, bases: _Bases) -> None:
        """Called with the stack's new momentum (its ``rows x cols``, in the coefficient domain
        when ``_momentum_in_coefficients``, else the parameters'), before the sent components
        are removed from it, while the work space is free. DeMo needs nothing of it; DisTrO
        keeps its sign for the lookahead (:mod:`lowcomm.optim.distro`)."""

    def _apply_bucket(self, flight: _InFlight) -> None:
        """Wait for the bucket's payloads, then :meth:`_decode_bucket`."""
        self._wait(flight)
        self._decode_bucket(flight)

    def _wait(self, flight: _InFlight) -> None:
        with record_function("DeMo.communicate"):
            for handle in flight.works:
                handle.wait()

    def _decode_bucket(self, flight: _InFlight) -> None:
        """Aggregate the bucket's gathered payloads in one pass, then inverse-transform and
        update each parameter; on the CPU kernels (DCT projection, sign or sgd base) all of
        that per run in one pass (:meth:`DCTTopK.decode_add`)."""
        runs = _runs(flight.sent)
        payloads, layouts, offsets, members = self._gathered_runs(flight, runs)
        targets = [[item.param for item in items] for items in members]
        if self.projection == "dct" and self.base != "muon" and self._lrs is None and all(
                self.codec.decodes_into(payload, params) for payload, params in zip(payloads, targets, strict=True)):
            with record_function("DeMo.decode"):  # the inverse, the base and the update, in one pass
                for payload, layout, params, items in zip(payloads, layouts, targets, members, strict=True):
                    if not self.codec.decode_add(payload, layout, params, alpha=-items[0].lr,
                                                 sign=self.base == "sign"):
                        raise RuntimeError("DCTTopK.decode_add refused a payload decodes_into accepted")
            return
        sums, counts, spare = self._work_buffers(flight.sent[0].param, flight.numel)
        with record_function("DeMo.decode"):
            coefficients = self.codec.aggregate_gathered(payloads, layouts, offsets, out=sums, counts=counts)
        for run in runs:
            layout, first = run.layout, run.items[0].offset
            with record_function("DeMo.decode"):
                # the counts are spent: their space is the inverse transform's scratch
                update = self._transform(
                    coefficients[first : first + layout.numel], layout, run.items[0].bases, inverse=True,
                    out=spare[: layout.numel], scratch=counts[: layout.numel],
                ).view(-1)
            with record_function("DeMo.update"):
                if self.base == "sign":
                    update = update.sign_()
                for item in run.items:
                    part = update[item.offset - first : item.offset - first + item.layout.numel]
                    if self.base == "muon":
                        part = newton_schulz(part.view(item.layout.rows, item.layout.cols))
                    _add_scaled_(item.param, part.view(item.param.shape), item.lr, sign=-1)

    def _gathered_runs(
        self, flight: _InFlight, runs: list[_Run]
    ) -> tuple[list[Payload], list[BlockLayout], list[int], list[list[_Sent]]]:
        """The gathered payloads as :meth:`DCTTopK.aggregate_gathered` takes them, with the
        parameters each covers: one per run
        (its parameters' payloads lie side by side in the gathered buffers, so one view of each
        covers them all, as if one stacked matrix had been sent), or one per parameter of a
        run whose payloads cannot be read as one (sign bits of a parameter before the last that
        end inside a byte: :meth:`DCTTopK.stackable`)."""
        where: list[dict[str, tuple[torch.Tensor, int, torch.Size]]] = [{} for _ in flight.sent]
        for buffer, segments in flight.gathered.values():
            for entry, key, start, shape in segments:
                where[entry][key] = (buffer, start, shape)

        def view(buffer: torch.Tensor, start: int, shape: tuple[int, ...]) -> torch.Tensor:
            # a row per sender: this world's, or the one an exchange restored from a checkpoint
            # was sent in (DisTrO's, resumed at another world size)
            return buffer[:, start : start + math.prod(shape)].view(buffer.shape[0], *shape)

        payloads, layouts, offsets, members = [], [], [], []
        for run in runs:
            merged = self._merged(run, where) if len(run.items) > 1 else None
            if merged is not None:
                tensors = {key: view(*spec) for key, spec in merged.items()}
                meta = {"shape": run.layout.shape, "dtype": run.items[0].payload.meta["dtype"]}
                payloads.append(Payload(tensors, meta))
                layouts.append(run.layout)
                offsets.append(run.items[0].offset)
                members.append(run.items)
                continue
            for entry, item in zip(run.entries, run.items, strict=True):
                tensors = {key: view(buffer, start, tuple(shape)) for key, (buffer, start, shape) in where[entry].items()}
                payloads.append(Payload(tensors, item.payload.meta))
                layouts.append(item.layout)
                offsets.append(item.offset)
                members.append([item])
        return payloads, layouts, offsets, members

    def _merged(
        self, run: _Run, where: list[dict[str, tuple[torch.Tensor, int, torch.Size]]]
    ) -> dict[str, tuple[torch.Tensor, int, tuple[int, ...]]] | None:
        """For each payload key, the one (buffer, start, shape) that covers the run's tensors
        laid end to end, first dimension joined; None if some are not adjacent or the codec
        cannot read them as one (:meth:`DCTTopK.stackable`)."""
        if not self.codec.stackable([item.layout for item in run.items]):
            return None
        merged = {}
        for key, (buffer, start, shape) in where[run.first].items():
            end, rows = start + shape.numel(), shape[0]
            for entry in run.entries[1:]:
                other, at, more = where[entry][key]
                if other is not buffer or at != end or more[1:] != shape[1:]:
                    return None
                end, rows = end + more.numel(), rows + more[0]
            merged[key] = (buffer, start, (rows, *shape[1:]))
        return merged

    # --------------------------------------------------------------- internals
    def _lr(self, group: dict[str, Any]) -> float | torch.Tensor:
        """The group's learning rate: its number, or while a step is captured the 0-d tensor
        that each replay fills with it."""
        return group["lr"] if self._lrs is None else self._lrs[id(group)]

    @property
    def _momentum_key(self) -> str:
        """State key of the momentum: ``momentum`` (parameter domain, which for the identity
        projection is also its coefficient domain) or ``momentum_dct`` (block DCT domain)."""
        return "momentum_dct" if self._momentum_in_coefficients and self.projection == "dct" else "momentum"

    def _momentum(self, state: dict[str, Any], layout: BlockLayout, param: torch.Tensor) -> torch.Tensor:
        """The momentum buffer, created at zero, or converted from a checkpoint written in the
        other domain (a run resumed with another projection)."""
        key = self._momentum_key
        if key not in state:
            other = "momentum" if key == "momentum_dct" else "momentum_dct"
            if other in state:
                stored = state.pop(other)
                state[key] = dct_transform(stored.contiguous(), layout, inverse=other == "momentum_dct").view(param.shape)
            else:
                state[key] = torch.zeros_like(param, memory_format=torch.contiguous_format)
        return state[key]

    def _bases(self, layout: BlockLayout, step: int, param: torch.Tensor) -> _Bases:
        if self.projection == "identity":
            return None, None
        if self.projection == "dct":
            return self.codec.bases(layout, param.device, param.dtype)
        return tuple(
            self._random_basis(size, step, param.device, param.dtype) if size > 1 else None
            for size in (layout.chunk_rows, layout.chunk_cols)
        )

    def _random_basis(self, size: int, step: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        key = (size, step, device, dtype)
        if key not in self._random_bases:
            # the seed depends only on (step, size): every worker draws the same basis
            self._random_bases[key] = random_orthonormal_basis(size, 1_000_003 * step + size, device, dtype)
        return self._random_bases[key]

    def _transform(
        self,
        matrix: torch.Tensor | Sequence[torch.Tensor],
        layout: BlockLayout,
        bases: _Bases,
        *,
        inverse: bool = False,
        out: torch.Tensor,
        scratch: torch.Tensor,
        beta: float = 0.0,
        alpha: float = 1.0,
    ) -> torch.Tensor:
        """:func:`block_transform` (:func:`~lowcomm.compress.dct.dct_transform` for the DCT
        projection: its CPU kernel when it can); the identity without accumulation returns
        ``matrix`` as it is, saving a copy."""
        if bases[0] is None and bases[1] is None and not beta and alpha == 1 and isinstance(matrix, torch.Tensor):
            return matrix.view(layout.rows, layout.cols)
        if self.projection == "dct":
            return dct_transform(matrix, layout, inverse=inverse, out=out, scratch=scratch, beta=beta, alpha=alpha)
        return block_transform(
            matrix, layout, *bases, inverse=inverse, out=out, scratch=scratch, beta=beta, alpha=alpha
        )

    def _largest(self, param: torch.Tensor) -> int:
        key = (param.device, param.dtype)
        return max(p.numel() for group in self.param_groups for p in group["params"] if (p.device, p.dtype) == key)

    def _work_buffers(
        self, param: torch.Tensor, size: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Three slices of ``size`` elements (default: the parameter's) of the work space of
        the parameter's (device, dtype)."""
        key = (param.device, param.dtype)
        size = param.numel() if size is None else size
        buffer = self._workspace.get(key)
        if buffer is None or buffer.numel() < 3 * size:
            largest = max(self._largest(param), size)
            buffer = self._workspace[key] = torch.empty(3 * largest, device=param.device, dtype=param.dtype)
        return buffer[:size], buffer[size : 2 * size], buffer[2 * size : 3 * size]
