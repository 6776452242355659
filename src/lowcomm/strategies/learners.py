"""The methods whose workers are independent learners around a synchronizer (Decoupled DiLoCo,
asynchronous DiLoCo): what they share as strategies.

Each worker is a learner on its own clock: no collective joins it to the others, not even the
loop's agreement at a step boundary (:mod:`lowcomm.train.learners`); its only exchange is with
the synchronizer, a process of its own that holds the global parameters and the outer
optimizer (:mod:`lowcomm.train.synchronizer`), over a TCP hub whose every byte is metered
(:mod:`lowcomm.comm.hub`). A strategy of this kind says how to build its learner's optimizer
around the link (:meth:`LearnerStrategy.build`) and how to build its synchronizer's state
(:meth:`LearnerStrategy.make_synchronizer`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import ClassVar, Protocol

import torch

from lowcomm.comm.hub import Hub, HubLink, frame_overhead
from lowcomm.comm.meter import WireBytes
from lowcomm.strategies.base import Strategy, StrategyConfig, parameter_bytes, trainable_parameters


class Synchronizer(Protocol):
    """A synchronizer's state and its serving loop, as :mod:`lowcomm.train.synchronizer` runs it."""

    def serve(self, hub, *, learners: int, before: Callable[[int], None], idle_timeout_s: float) -> None:
        """Serve ``learners`` learners through ``hub`` until each is done; ``before(step)`` is
        called before each change of the global state, with the latest learner step it holds."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def embedding_indices(model: torch.nn.Module) -> list[int]:
    """Indices, among the trainable parameters, of the token embedding (OLMo's ``wte``; tied, it
    is also the output head)."""
    named = [name for name, p in model.named_parameters() if p.requires_grad]
    return [index for index, name in enumerate(named) if name.endswith("wte.weight") or "embed" in name]


class LearnerStrategy(Strategy):
    """A method of learners around a synchronizer. The harness :meth:`connect` s the learner to
    its synchronizer before :meth:`build`, and calls :meth:`finish` when the learner's loop ends
    (it leaves the synchronizer, taking what it is still owed)."""

    learners: ClassVar[bool] = True
    replicated_optimizer_state = False  # every learner's state is its own; the shared state is the synchronizer's
    replica_groups_refusal = (
        "its learners already leave and rejoin on their own around its synchronizer (a lost learner holds up no "
        "merge, and one started again resumes and takes the newer global parameters): it runs without torchft")

    def __init__(self, cfg: StrategyConfig, compression, comm):
        super().__init__(cfg, compression, comm)
        self.link: HubLink | None = None
        self.learner, self.tokens_per_step = 0, 0

    def connect(self, address: str, learner: int, *, tokens_per_step: int, timeout_s: float = 60.0) -> None:
        """Connect this learner (index ``learner``, training ``tokens_per_step`` tokens a step) to
        the synchronizer at ``address``; its bytes go to this strategy's Communicator's meter."""
        self.learner, self.tokens_per_step = learner, tokens_per_step
        self.link = HubLink(address, learner, self.comm.meter, connect_timeout_s=timeout_s)

    def _link(self) -> HubLink:
        if self.link is None:
            raise RuntimeError(f"optimizer={self.name} is a learner of a synchronizer: connect() it before build() "
                               "(lowcomm.train.loop does; a synchronizer is started by lowcomm.train.synchronizer)")
        return self.link

    def finish(self, optimizer: torch.optim.Optimizer) -> None:
        if self.link is not None:
            optimizer.finish()

    @classmethod
    def make_synchronizer(cls, cfg: StrategyConfig, model: torch.nn.Module, learners: int) -> Synchronizer:
        raise NotImplementedError

    @classmethod
    def elastic_rule(cls, written_by: int) -> str:
        return (f"learner r resumes from its own checkpoint, and one without (r >= {written_by}) from learner "
                f"(r mod {written_by})'s; the synchronizer from its state saved at that step, and a learner takes any "
                "newer global parameters as it says hello")

    # ------------------------------------------------------------------ bytes, from shapes
    def sent_per_step(self, model: torch.nn.Module) -> tuple[float, float, float]:
        """(payload, tx, rx) per learner and step: what :meth:`analytic_traffic` reports at any W
        (a learner's traffic goes to the synchronizer, whatever the number of learners)."""
        raise NotImplementedError

    def analytic_payload_bytes(self, model: torch.nn.Module) -> float:
        return self.sent_per_step(model)[0]

    def wire_collective(self) -> str:
        return "hub"

    def analytic_traffic(self, model: torch.nn.Module, world_size: int, *, warmup: bool = False,  # noqa: ARG002
                         ) -> WireBytes:
        """A learner's pushes and pulls, each a hub frame (its tensors and a header whose size
        is taken from a header of the same fields); all of it crosses to the synchronizer's node
        (``direct``)."""
        payload, tx, rx = self.sent_per_step(model)
        return WireBytes(payload, tx, rx, tx)

    def optimizer_state_bytes(self, model: torch.nn.Module, local_world_size: int) -> tuple[float, float]:  # noqa: ARG002
        """None replicated (the global state is the synchronizer's, in its own file); per learner,
        the inner AdamW's two moments and the parameters it last pulled."""
        return 0.0, 3 * parameter_bytes(model)


def _no_snapshots(step: int) -> None:  # noqa: ARG001 - the serving loop's hook, unused in a thread
    """A synchronizer in a thread saves no state (the harness's process does)."""


class LocalSynchronizer:
    """A synchronizer served by a thread of this process, for a loop of one's own or a test (the
    harness runs it as a process: :mod:`lowcomm.train.synchronizer`)::

        with LocalSynchronizer(Strategy, cfg, model, learners=1) as sync:
            strategy.connect(sync.address, 0, tokens_per_step=...)
            model, optimizer = strategy.build(model)
            ...  # train
            strategy.finish(optimizer)

    ``model``: the learners' initial parameters (the same seed). Learners in other processes
    reach it at :attr:`address` too. Leaving the block waits for every learner to finish (at
    most ``wait_s``), then closes the hub."""

    def __init__(self, strategy: type[LearnerStrategy], cfg: StrategyConfig, model: torch.nn.Module, *,
                 learners: int, wait_s: float = 120.0):
        self.role = strategy.make_synchronizer(cfg, model, learners)
        self.hub = Hub("127.0.0.1", 0)
        self.address = f"127.0.0.1:{self.hub.port}"
        self.wait_s = wait_s
        self._thread = threading.Thread(target=self.role.serve, name="synchronizer", daemon=True, kwargs=dict(
            hub=self.hub, learners=learners, before=_no_snapshots, idle_timeout_s=wait_s))

    def __enter__(self) -> LocalSynchronizer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._thread.join(timeout=self.wait_s)
        self.hub.close()


def frame_bytes(header: dict, tensors: list[torch.Tensor]) -> int:
    """A hub frame's size for ``tensors`` (shapes and dtypes: meta tensors do) under ``header``."""
    return frame_overhead(header, tensors) + sum(t.numel() * t.element_size() for t in tensors)


__all__ = ["LearnerStrategy", "LocalSynchronizer", "Synchronizer", "embedding_indices", "frame_bytes", "trainable_parameters"]
