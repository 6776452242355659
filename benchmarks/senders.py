"""Each method's receiving side with W senders, on one device and without a process group:
its optimizer step at W = 1, 8 and 64 and the ratio to W = 1.

At the paper's scale a DeMo or DisTrO rank decodes 64 senders' top-k lists every step, a
SparseLoCo rank averages 64 senders' entries at each outer step, a quantized all-reduce decodes
and sums 64 chunks. This benchmark runs that receiving side on one device: rank 0 of W, its
Communicator a :class:`SimulatedSenders` that hands it, at each collective, what the other W-1
ranks sent, as a backend would (an all-gather's W payloads written into its buffer, an
all-to-all's W chunks, a sum all-reduce's result).

What the others send is real: each of the W-1 senders is the same method, built over its own
copy of the parameters as rank s of W, stepped from the same state on its own gradient, and
what it sends in its last step is recorded. The gradients are ``g + spread * n_s``: one part
shared by every sender (the model's true gradient) and one of the sender's own (its batch's
noise), both standard normal times 1e-3, so the senders' top-k indices overlap as real
workers' do, partly (``--spread 0``: every sender sends what rank 0 sends; large: they hardly
overlap). Recording happens before anything is timed; a timed step copies the recorded
payloads into the receive buffers (what the backend's writes cost) and then runs the method's
own code: unpacking, aggregating, decoding, updating.

Methods (``--methods``):

- ``demo``, ``distro``: the all-gather of every parameter's DCT top-k payload and its decode;
- ``flexdemo``: FlexDeMo's inter-node part: DeMo on each parameter's row shard (1/8 of its rows:
  8 ranks to a node), the W senders being the other nodes' ranks of the same shard;
- ``sparseloco``: the outer step (H=1, so every step is one, with its inner AdamW step): the
  all-gather of the chunked top-k 2-bit payloads and their per-entry mean over senders;
- ``quantized``: DiLoCo's outer step through the quantized all-reduce (2-bit, H=1): the reduce
  phase decodes and sums W chunks, the last phase decodes W reduced chunks;
- ``powersgd``: the PowerSGD hook's P and Q all-reduces and AdamW. A sum all-reduce is the
  backend's work, not the method's: simulated as one add of the other senders' sum, a cost
  that does not grow with W (a ring's reduction is (W-1)/W of the tensor per rank).

The table gives each method's median step at each W, its ratio to W = 1, and the MB it
received per step (the Communicator's meter, as in training: the ring's rx). A step's time is the
method's own: what the simulated backend spends writing the received bytes into the buffers (a
copy of W-1 payloads; on a network the NIC's and the collective's) is timed apart and printed
as its own column, not counted in the step. The shapes are
OLMo's (``--model``: ``tiny`` on a CPU; ``olmo_300m`` or ``olmo_1b`` on a GPU, ``--blocks`` of
their transformer blocks). Last, one JSON line with every figure.

    python benchmarks/senders.py --model tiny                           # CPU, in a minute
    python benchmarks/senders.py --model olmo_300m --blocks 1 --methods demo --workers 1 64
    python benchmarks/senders.py --device cuda --model olmo_300m        # every block, every method
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from lowcomm.comm import Communicator
from lowcomm.comm.communicator import DoneWork, QuantizedExchange, nbytes
from lowcomm.comm.meter import ring_all_gather_traffic, ring_all_reduce_traffic
from lowcomm.comm.quantized import payload_bytes

SHARDS_PER_NODE = 8  # FlexDeMo: the ranks of a node, which shard each parameter's rows
GRADIENT_SCALE = 1e-3


@dataclass(frozen=True)
class Method:
    label: str
    overrides: tuple[str, ...]
    what: str


METHODS = {
    "demo": Method("DeMo", ("optimizer=demo",), "all-gather of top-32 DCT payloads, decode"),
    "distro": Method("DisTrO", ("optimizer=distro",), "all-gather of top-4 1-bit payloads, decode"),
    "flexdemo": Method("FlexDeMo (inter-node)", ("optimizer=flexdemo",),
                       f"DeMo on 1/{SHARDS_PER_NODE} row shards across nodes"),
    "sparseloco": Method("SparseLoCo", ("optimizer=sparseloco", "optimizer.sync_every=1"),
                         "outer step: all-gather of chunked top-k 2-bit, mean over senders"),
    "quantized": Method("quantized all-reduce", ("optimizer=diloco", "optimizer.sync_every=1", "compression=quantize"),
                        "DiLoCo's outer step, 2-bit: reduce W chunks, decode W"),
    "powersgd": Method("PowerSGD", ("optimizer=powersgd", "optimizer.start_powerSGD_iter=0"),
                       "P and Q all-reduced (sum by the backend), AdamW"),
}


class SimulatedSenders(Communicator):
    """Rank ``rank`` of ``world_size``, with no process group: a collective returns what the
    other ranks would have sent. ``received``: their sends, call by call of one step (from
    :meth:`received_from` over recorders); without it every other rank sends what this one
    sends. ``record``: keep what this rank sends, call by call, in :attr:`calls` (cleared by
    :meth:`begin_step`). Metered as the real collectives are (ring traffic at ``world_size``)."""

    def __init__(self, world_size: int, rank: int, device: torch.device, *,
                 received: list[tuple[str, torch.Tensor]] | None = None, record: bool = False):
        super().__init__(device=device)
        if received is not None and rank != 0:
            raise ValueError("simulated senders replay to rank 0 only")
        self.world_size, self.rank = world_size, rank
        self.received, self.record = received, record
        self.calls: list[tuple[str, torch.Tensor]] = []
        self._call = 0
        self.wire_s = 0.0

    @staticmethod
    def received_from(recorders: list[SimulatedSenders]) -> list[tuple[str, torch.Tensor]]:
        """Rank 0's view of what ranks 1..W-1 (``recorders``, in rank order) sent in their last
        step, call by call: their tensors stacked, or summed for a sum all-reduce."""
        received = []
        for index, calls in enumerate(zip(*(recorder.calls for recorder in recorders), strict=True)):
            kinds = {kind for kind, _ in calls}
            if len(kinds) != 1:
                raise RuntimeError(f"simulated senders: call {index} differs between senders: {sorted(kinds)}")
            kind = kinds.pop()
            tensors = [tensor for _, tensor in calls]
            received.append((kind, torch.stack(tensors).sum(0) if kind == "all_reduce" else torch.stack(tensors)))
        return received

    def begin_step(self) -> None:
        self.calls.clear()
        self._call = 0
        self.wire_s = 0.0

    @contextlib.contextmanager
    def wire(self) -> Iterator[None]:
        """Times what stands in for the backend (its writes into the receive buffers, a sum
        all-reduce's reduction), so that it can be told apart from the method's own work: the
        step's time less :attr:`wire_s` is the method's. On a GPU the device is synchronised
        on both sides (a cost of the measurement, not of the method)."""
        synchronise = torch.cuda.synchronize if self.device is not None and self.device.type == "cuda" else None
        if synchronise:
            synchronise()
        started = time.perf_counter()
        yield
        if synchronise:
            synchronise()
        self.wire_s += time.perf_counter() - started

    def _others(self, kind: str, sent: torch.Tensor) -> torch.Tensor | None:
        """What the other ranks sent in this call (None: what this one sends), recording this
        rank's ``sent`` first if asked to."""
        index = self._call
        self._call += 1
        if self.record:
            self.calls.append((kind, sent.detach().clone()))
        if self.received is None:
            return None
        if index >= len(self.received) or self.received[index][0] != kind:
            recorded = self.received[index][0] if index < len(self.received) else "nothing"
            raise RuntimeError(f"simulated senders: call {index} is {kind} here, but the senders recorded {recorded}")
        return self.received[index][1]

    # ---------------------------------------------------------------- collectives
    def all_gather_into_tensor(self, output: torch.Tensor, tensor: torch.Tensor, *, async_op: bool = False,
                               purpose: str = "data"):
        self._route("all_gather", purpose, output, tensor)
        self._record("all_gather", nbytes(tensor), ring_all_gather_traffic(nbytes(tensor), self.world_size), purpose)
        rows, flat = output.view(self.world_size, -1), tensor.reshape(-1)
        others = self._others("all_gather", flat)
        with self.wire():
            if others is None:
                rows.copy_(flat.expand_as(rows))
            else:
                rows[0].copy_(flat)
                rows[1:].copy_(others)
        return DoneWork([output]) if async_op else None

    def all_gather(self, tensor: torch.Tensor, *, async_op: bool = False, purpose: str = "data"):
        self._route("all_gather", purpose, tensor)
        self._record("all_gather", nbytes(tensor), ring_all_gather_traffic(nbytes(tensor), self.world_size), purpose)
        others = self._others("all_gather", tensor)
        with self.wire():
            rest = ([tensor.clone() for _ in range(self.world_size - 1)] if others is None
                    else [row.clone() for row in others])
            gathered = [*rest[:self.rank], tensor.clone(), *rest[self.rank:]]
        return (gathered, DoneWork(gathered)) if async_op else gathered

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", *, async_op: bool = False, purpose: str = "data"):
        self._route("all_reduce", purpose, tensor)
        self._record("all_reduce", nbytes(tensor), ring_all_reduce_traffic(nbytes(tensor), self.world_size), purpose)
        if op in ("sum", "avg") and purpose == "data":
            others = self._others("all_reduce", tensor)
            with self.wire():  # the backend's reduction
                if others is None:
                    tensor.mul_(self.world_size)
                else:
                    tensor.add_(others)
            if op == "avg":
                tensor.div_(self.world_size)
        # control traffic (flags, maxima) and max / min: every rank holds the same value
        return DoneWork([tensor]) if async_op else None

    def _quantized_exchange(self, group, codec, sent, out) -> QuantizedExchange:
        return _SimulatedExchange(self, group, codec, sent, out)

    def _unsimulated(self, name: str):
        raise NotImplementedError(f"SimulatedSenders: {name} is not simulated (no method of this benchmark calls it)")

    def reduce_scatter(self, *args, **kwargs):  # noqa: ARG002
        self._unsimulated("reduce_scatter")

    def broadcast(self, *args, **kwargs):  # noqa: ARG002
        self._unsimulated("broadcast")

    def exchange(self, *args, **kwargs):  # noqa: ARG002
        self._unsimulated("exchange")

    def split(self, *args, **kwargs):  # noqa: ARG002
        self._unsimulated("split")


class _SimulatedExchange(QuantizedExchange):
    """The quantized all-reduce's two transfers, simulated: the all-to-all brings this rank
    its chunk from every sender, the all-gather every rank's reduced chunk."""

    comm: SimulatedSenders

    def _all_to_all(self, received: torch.Tensor, send: torch.Tensor):
        rank, world = self.comm.rank, self.comm.world_size
        start = sum(self.chunk_bytes[:rank])
        mine = send[start:start + self.chunk_bytes[rank]]
        # what this rank sends rank 0 is the first of its parts: what a recorder gives rank 0
        others = self.comm._others("all_to_all", send[:self.chunk_bytes[0]])  # noqa: SLF001 - its own class's
        rows = received.view(world, -1)
        with self.comm.wire():
            if others is None:
                rows.copy_(mine.expand_as(rows))
            else:
                rows[0].copy_(mine)
                rows[1:].copy_(others)
        return DoneWork([received])

    def _all_gather(self, gathered: torch.Tensor, buffer: torch.Tensor) -> None:
        rank, world = self.comm.rank, self.comm.world_size
        rows = gathered.view(world, -1)
        others = self.comm._others("all_gather_reduced", buffer)  # noqa: SLF001
        if others is not None:
            with self.comm.wire():
                rows[0].copy_(buffer)
                rows[1:].copy_(others)
            return
        # every rank's reduced chunk j read as what this rank sent as chunk j: well-formed bytes
        for j in range(world):
            if j == rank:
                rows[j].copy_(buffer)
                continue
            parts = [payload_bytes(payloads[j]) for payloads in self.sent if payloads[j] is not None]
            flat = torch.cat(parts) if parts else buffer.new_empty(0)
            rows[j].zero_()
            rows[j][:flat.numel()].copy_(flat)


# ------------------------------------------------------------------------ methods
@dataclass
class _Built:
    step: Callable[[], None]
    params: list[torch.nn.Parameter]


def _config(name: str, model: str, blocks: int | None, extra: tuple[str, ...] = ()):
    from omegaconf import OmegaConf

    from lowcomm.config import validate_optimizer
    from lowcomm.config.compose import compose

    overrides = [*METHODS[name].overrides, f"model={model}", *extra]
    if blocks is not None:
        overrides.append(f"model.n_layers={blocks}")
    raw = OmegaConf.to_container(compose(overrides), resolve=True)
    strategy_class, optimizer_cfg = validate_optimizer(raw)
    return raw, strategy_class, optimizer_cfg


def _build(name: str, model: torch.nn.Module, raw: dict, strategy_class, cfg, comm: Communicator) -> _Built:
    """The method's step over ``model``'s parameters (their ``.grad`` set by the caller),
    sending through ``comm``."""
    if name == "powersgd":
        from lowcomm.optim.grouping import adamw
        from lowcomm.optim.powersgd import PowerSGDReducer

        reducer = PowerSGDReducer(comm, model.named_parameters(), cfg)
        optimizer = adamw(model, cfg)
        named = [(name_, param) for name_, param in model.named_parameters() if param.requires_grad]

        def step() -> None:
            reducer.average_([(name_, param.grad) for name_, param in named])
            reducer.iteration += 1
            optimizer.step()

        return _Built(step, [param for _, param in named])
    strategy = strategy_class(cfg, raw.get("compression") or {}, comm)
    if name == "flexdemo":
        from lowcomm.optim import FlexDeMo

        optimizer = strategy.make_optimizer(model, comm, FlexDeMo)
    else:
        _, optimizer = strategy.build(model)
    return _Built(optimizer.step, [param for param in model.parameters() if param.requires_grad])


def _model(name: str, raw: dict, device: torch.device) -> torch.nn.Module:
    from lowcomm.models import ModelSpec, build_model

    model = build_model(ModelSpec(**raw["model"]), device, seed=0)
    if name == "flexdemo":
        # this rank's row shard of every parameter, as FSDP leaves it on one of a node's ranks
        for param in model.parameters():
            rows = -(-param.shape[0] // SHARDS_PER_NODE)
            param.data = param.data[:rows].clone()
    return model


def _gradients(params: list[torch.nn.Parameter], sender: int, spread: float) -> list[torch.Tensor]:
    """Sender ``sender``'s gradients: the shared part plus ``spread`` times its own noise (drawn
    on the CPU, so the same on every device)."""
    shared = torch.Generator().manual_seed(0)
    own = torch.Generator().manual_seed(1000 + sender)
    grads = []
    for param in params:
        grad = torch.randn(param.shape, generator=shared)
        if spread:
            grad.add_(torch.randn(param.shape, generator=own), alpha=spread)
        grads.append(grad.mul_(GRADIENT_SCALE).to(param.device))
    return grads


def _set_grads(params: list[torch.nn.Parameter], grads: list[torch.Tensor]) -> None:
    for param, grad in zip(params, grads, strict=True):
        if param.grad is None:
            param.grad = grad.clone()
        else:
            param.grad.copy_(grad)


@dataclass
class Setup:
    """One method's configuration and model, and the parameters every W starts from."""

    name: str
    raw: dict
    strategy_class: type
    cfg: object
    model: torch.nn.Module
    initial: list[torch.Tensor]

    @classmethod
    def of(cls, name: str, model_name: str = "tiny", blocks: int | None = None, device: str = "cpu",
           overrides: tuple[str, ...] = ()) -> Setup:
        """``overrides``: Hydra overrides after the method's own (``optimizer.wire=compact``)."""
        raw, strategy_class, cfg = _config(name, model_name, blocks, overrides)
        model = _model(name, raw, torch.device(device))
        return cls(name, raw, strategy_class, cfg, model, [param.detach().clone() for param in model.parameters()])

    def build(self, comm: Communicator) -> _Built:
        return _build(self.name, self.model, self.raw, self.strategy_class, self.cfg, comm)

    def restore(self) -> None:
        with torch.no_grad():
            for param, value in zip(self.model.parameters(), self.initial, strict=True):
                param.copy_(value)
                param.grad = None


def with_senders(setup: Setup, world: int, *, steps: int = 5, warmup: int = 2, spread: float = 1.0,
                 profile: bool = False) -> dict:
    """Rank 0's step with ``world`` senders (1: a plain Communicator, no exchange), from the
    setup's parameters: the other senders recorded first (``warmup`` + 1 steps each, the last
    recorded: the state rank 0's first timed step starts from), then ``warmup`` and ``steps``
    timed steps of rank 0, each receiving what the senders sent in that recorded step. Returns the median ``ms``,
    the MB received per step (``rx_MB``) and the ``params`` rank 0 ends with; leaves the setup's
    parameters as they were. ``ms`` is the method's own: the step's time less what the
    simulated backend spent writing the received bytes (``wire_ms``). With ``profile``,
    ``profile``: one more step under torch.profiler, its operators by their own time (a table)."""
    from lowcomm.train.loop import DeviceClock

    device = setup.initial[0].device
    clock = DeviceClock(device)
    received = None
    if world > 1:
        recorders = []
        for sender in range(1, world):
            comm = SimulatedSenders(world, sender, device, record=True)
            built = setup.build(comm)
            _set_grads(built.params, _gradients(built.params, sender, spread))
            for _ in range(warmup + 1):  # the last recorded: the step rank 0's first timed one matches
                comm.begin_step()
                built.step()
            recorders.append(comm)
            setup.restore()
        received = SimulatedSenders.received_from(recorders)
        del recorders, comm, built  # what they sent is in `received`; their copies are not timed beside it
    comm = Communicator(device=device) if world == 1 else SimulatedSenders(world, 0, device, received=received)
    built = setup.build(comm)
    own = _gradients(built.params, 0, spread)
    times, wire, rx = [], [], []
    for index in range(warmup + steps):
        _set_grads(built.params, own)
        if isinstance(comm, SimulatedSenders):
            comm.begin_step()
        started = clock()
        built.step()
        elapsed = clock() - started
        rx.append(comm.meter.step_bytes("rx"))
        comm.meter.end_step()
        if index >= warmup:
            wire.append(getattr(comm, "wire_s", 0.0))
            times.append(elapsed - wire[-1])
    table = None
    if profile:
        _set_grads(built.params, own)
        if isinstance(comm, SimulatedSenders):
            comm.begin_step()
        activities = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with torch.profiler.profile(activities=activities) as profiled:
            built.step()
            clock()
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        table = profiled.key_averages().table(sort_by=sort, row_limit=12)
    params = [param.detach().clone() for param in built.params]
    setup.restore()
    return {"ms": statistics.median(times) * 1e3, "wire_ms": statistics.median(wire) * 1e3,
            "rx_MB": statistics.median(rx) / 1e6, "params": params, "profile": table}


def measure(name: str, workers: list[int], *, model_name: str = "tiny", blocks: int | None = None,
            steps: int = 5, warmup: int = 2, spread: float = 1.0, device: str = "cpu",
            overrides: tuple[str, ...] = (), profile: bool = False,
            progress: Callable[[str], None] = print) -> dict[int, dict[str, float]]:
    """Method ``name``'s step at each W of ``workers`` (:func:`with_senders`), each from the
    same parameters: ``{W: {"ms": median, "rx_MB": received per step}}``."""
    setup = Setup.of(name, model_name, blocks, device, overrides)
    results = {}
    for world in workers:
        began = time.perf_counter()
        result = with_senders(setup, world, steps=steps, warmup=warmup, spread=spread, profile=profile)
        results[world] = {key: result[key] for key in ("ms", "wire_ms", "rx_MB")}
        if result["profile"]:
            progress(f"[senders] {name} W={world}: one more step, by operator (the simulated backend's writes are "
                     f"aten::copy_ / aten::add_ inside SimulatedSenders)\n{result['profile']}")
        progress(f"[senders] {name} W={world}: {result['ms']:.1f} ms/step, {result['rx_MB']:.3f} MB received "
                 f"(the simulated backend's writes: {result['wire_ms']:.1f} ms more; "
                 f"{time.perf_counter() - began:.0f} s)")
    return results


def table(results: dict[str, dict[int, dict[str, float]]], workers: list[int]) -> str:
    """The markdown table: per method, its own ms and x the first W at each W, the MB received
    per step, and the ms the simulated backend spent writing them (not in the method's)."""
    first, more = workers[0], workers[1:]
    head = ["method", *(f"W={w} ms" + ("" if w == first else f" (x W={first})") for w in workers),
            *(f"MB rx W={w}" for w in workers), *(f"writes ms W={w}" for w in more)]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for name, by_world in results.items():
        base = by_world[first]["ms"]
        cells = [f"{by_world[w]['ms']:.1f}" + ("" if w == first else f" ({by_world[w]['ms'] / base:.2f}x)")
                 for w in workers]
        cells += [f"{by_world[w]['rx_MB']:.3f}" for w in workers]
        cells += [f"{by_world[w]['wire_ms']:.1f}" for w in more]
        lines.append(f"| {METHODS[name].label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--workers", nargs="+", type=int, default=[1, 8, 64], metavar="W",
                        help="senders, the first the reference of the ratios (default 1 8 64)")
    parser.add_argument("--model", default="tiny", help="a configs/model name: tiny, olmo_300m, olmo_1b")
    parser.add_argument("--blocks", type=int, default=None, help="transformer blocks (default: the model's)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per W (the median is reported)")
    parser.add_argument("--spread", type=float, default=1.0,
                        help="each sender's own gradient noise against the shared part (0: identical senders)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads on the CPU (default: torch's)")
    parser.add_argument("--profile", action="store_true",
                        help="after each W's timing, one more step under torch.profiler: its operators by time")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides after each method's own, e.g. "
                                                     "optimizer.wire=compact (with --methods demo)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps is at least 1, got {args.steps}")
    if any(w < 1 for w in args.workers):
        parser.error(f"--workers are at least 1, got {args.workers}")
    if args.blocks is not None and args.blocks < 1:
        parser.error(f"--blocks is at least 1, got {args.blocks}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU is visible")
    if args.threads:
        torch.set_num_threads(args.threads)
    began = time.perf_counter()
    results = {name: measure(name, args.workers, model_name=args.model, blocks=args.blocks, steps=args.steps,
                             spread=args.spread, device=args.device, overrides=tuple(args.overrides),
                             profile=args.profile)
               for name in args.methods}
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    shapes = args.model + ("" if args.blocks is None else f", {args.blocks} blocks") + "".join(
        f", {override}" for override in args.overrides)
    print(f"\nOptimizer step with W senders (rank 0 of W, the others simulated), {shapes}, {device}; median of "
          f"{args.steps} steps; spread {args.spread}; {time.perf_counter() - began:.0f} s in all\n")
    print(table(results, args.workers))
    print(json.dumps({"model": args.model, "blocks": args.blocks, "device": device, "spread": args.spread,
                      "steps": {name: {str(w): round(r["ms"], 3) for w, r in by.items()} for name, by in results.items()},
                      "rx_MB": {name: {str(w): round(r["rx_MB"], 6) for w, r in by.items()}
                                for name, by in results.items()},
                      "writes_ms": {name: {str(w): round(r["wire_ms"], 3) for w, r in by.items()}
                                    for name, by in results.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
