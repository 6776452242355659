"""NoLoCo (Kolehmainen et al. 2025, arXiv 2506.10911): DiLoCo without any collective.

Every worker i runs ``sync_every`` (H) steps of its own inner optimizer from its outer weights
phi_i to theta_i. At each outer step t the workers meet in random pairs (drawn afresh every
outer step), each pair exchanges its outer weights and its current weights, and every worker
takes the modified Nesterov step of the reference code (jkolehm/noloco
``src/noloco/sparse_optimizer_c.py``, ``outer_step``; the paper's equation)::

    Delta_j = phi_j - theta_j                            # pseudo-gradient, DiLoCo's sign
    delta_i <- alpha delta_i - beta mean_g(Delta_j) - gamma (phi_i - mean_g(phi_j))
    phi_i   <- phi_i + delta_i
    theta_i <- phi_i                                     # the next inner phase starts there

with mean_g the mean over worker i's group (itself and its peer). The last term pulls a
replica toward its peer's outer weights: nothing else keeps the replicas together, since no
step averages over all W of them. The reference uses the outer lr for gamma (``outer_lr *
(mean - p_old)``); here it is its own argument, ``pull``, whose default is that value.
Unlike DiLoCo, phi_i and delta_i differ from worker to worker: every piece of state is the
worker's own.

What travels: each worker sends phi_i and theta_i (two copies of the parameters, in their
dtype) to its peer and receives the peer's, by point-to-point sends
(:meth:`lowcomm.comm.Communicator.exchange`), never a collective: a worker's bytes per outer
step are the same at W = 4 or W = 4096. The exchange is waited for inside the outer step
(nothing is in flight between steps): the reference's sends are blocking too.

The pairing: a permutation of the W ranks drawn from a ``torch.Generator`` seeded by (``seed``,
outer step), so every rank computes the same pairs with no communication, and a resumed run
draws the ones it would have drawn. Consecutive entries of the permutation are paired; with
an odd W the last rank joins the last pair, a group of three whose members each exchange with
both others (every replica mixes at every outer step, as in the reference's groups of
``local_group_size`` > 2), rather than one rank sitting the round out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from lowcomm.comm import Communicator
from lowcomm.optim.args import Args
from lowcomm.optim.diloco import outer_step_errors

__all__ = ["NoLoCo", "NoLoCoArgs", "peer_groups"]

InnerOptimizer = torch.optim.Optimizer | Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


def peer_groups(world_size: int, seed: int, outer_step: int) -> list[list[int]]:
    """The groups of ranks that average at outer step ``outer_step``: pairs of a permutation
    drawn from (``seed``, ``outer_step``), the last rank of an odd W in the last pair (a group
    of three); W = 1 is one group of one. The same on every rank that asks."""
    state = np.random.SeedSequence([seed % 2**64, outer_step]).generate_state(1, dtype=np.uint64)[0]
    order = torch.randperm(world_size, generator=torch.Generator().manual_seed(int(state))).tolist()
    groups = [order[index:index + 2] for index in range(0, world_size - 1, 2)]
    if world_size % 2:
        if groups:
            groups[-1].append(order[-1])
        else:
            groups.append(order)
    return groups


@dataclass(kw_only=True)
class NoLoCoArgs(Args):
    """NoLoCo's outer loop; defaults in ``configs/optimizer/noloco.yaml``.

    sync_every: H, the inner steps between outer steps.
    outer_lr: beta, the step along the group's mean pseudo-gradient (not scheduled).
    outer_momentum: alpha, the decay of delta.
    pull: gamma, the step toward the group's mean outer weights.
    """

    config_name: ClassVar[str] = "noloco"

    sync_every: int
    outer_lr: float
    outer_momentum: float
    pull: float

    def errors(self) -> list[str]:
        errors = super().errors() + outer_step_errors(self.sync_every, self.outer_lr, self.outer_momentum)
        if not self.pull >= 0:
            errors.append(f"pull must be >= 0, got {self.pull}")
        return errors


class NoLoCo(torch.optim.Optimizer):
    """NoLoCo around any inner optimizer.

    Args:
        params: the parameters; every worker must start from identical values.
        inner: the inner optimizer over exactly these parameters, or a callable building it
            from the parameter list. Its ``param_groups`` are this optimizer's, so an LR
            schedule drives the inner learning rate.
        args: :class:`NoLoCoArgs`.
        comm: the workers' Communicator (None: the default process group, or one process).
        seed: the pairing's seed, the same on every rank (the harness passes the run's seed).

    Bytes on the wire: nothing between outer steps; at each one, two copies of the parameters
    to the peer (two peers for the members of an odd W's group of three).
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        inner: InnerOptimizer,
        args: NoLoCoArgs,
        *,
        comm: Communicator | None = None,
        seed: int = 0,
    ):
        params = list(params)
        args.check()
        super().__init__(params, dict(outer_lr=args.outer_lr, outer_momentum=args.outer_momentum, pull=args.pull,
                                      sync_every=args.sync_every))
        self.inner = inner(params) if callable(inner) else inner
        inner_ids = {id(p) for group in self.inner.param_groups for p in group["params"]}
        if inner_ids != {id(p) for p in params}:
            raise ValueError("the inner optimizer must be built over exactly the parameters given to NoLoCo")
        self.param_groups = self.inner.param_groups  # the schedule drives the inner lr

        self.args = args
        self.comm = comm if comm is not None else Communicator()
        self.seed = seed
        self._params = params
        with torch.no_grad():
            self._outer = [p.detach().clone() for p in params]  # phi_i
        self._momentum = [torch.zeros_like(p) for p in self._outer]  # delta_i
        self.local_step = 0

    # ------------------------------------------------------------------ stepping
    def step(self, closure: Callable[[], float] | None = None):
        """One inner step; every ``sync_every``-th call also takes the outer step."""
        loss = self.inner.step(closure)
        self.local_step += 1
        if self.local_step % self.args.sync_every == 0:
            self._outer_step(self.local_step // self.args.sync_every)
        return loss

    def peers(self, outer_step: int) -> list[int]:
        """The ranks this worker averages with at ``outer_step`` (one, or two in a group of three)."""
        rank = self.comm.rank
        group = next(group for group in peer_groups(self.comm.world_size, self.seed, outer_step) if rank in group)
        return [peer for peer in group if peer != rank]

    @torch.no_grad()
    def _outer_step(self, outer_step: int) -> None:
        peers = self.peers(outer_step)
        count = len(self._params)
        # blocking: the step below needs the peer's weights, and the next inner phase its result
        received = self.comm.exchange([*self._outer, *(p.detach() for p in self._params)], peers)
        size = len(peers) + 1
        alpha, beta, gamma = self.args.outer_momentum, self.args.outer_lr, self.args.pull
        for index, (local, outer, momentum) in enumerate(zip(self._params, self._outer, self._momentum, strict=True)):
            mean_outer = outer.clone()
            mean_local = local.detach().clone()
            for tensors in received:
                mean_outer.add_(tensors[index])
                mean_local.add_(tensors[count + index])
            mean_outer.div_(size)
            mean_local.div_(size)
            pseudo_gradient = mean_outer.sub(mean_local)  # mean_g(phi_j - theta_j)
            momentum.mul_(alpha).sub_(pseudo_gradient, alpha=beta)
            momentum.sub_(outer.sub(mean_outer), alpha=gamma)
            outer.add_(momentum)
            local.copy_(outer)

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """This worker's state, all of it its own: inner state, its outer weights and momentum,
        the local step (where the next outer step falls and which pairing it draws), the
        pairing's seed and, between outer steps, its parameters (they differ from rank 0's,
        which is all a checkpoint's model file holds; right after an outer step they are the
        outer weights, and :meth:`load_state_dict` restores them from those)."""
        state = {
            "inner": self.inner.state_dict(),
            "local_step": self.local_step,
            "outer_params": list(self._outer),
            "outer_momentum": list(self._momentum),
            "seed": self.seed,
        }
        if self.local_step % self.args.sync_every:
            state["local_params"] = [p.detach() for p in self._params]
        return state

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        at_boundary = int(state_dict["local_step"]) % self.args.sync_every == 0
        local = state_dict.get("local_params", self._outer if at_boundary else None)
        if local is None:
            raise ValueError("NoLoCo state has no 'local_params', which it needs between outer steps")
        for key, mine, saved in (("outer_params", self._outer, state_dict["outer_params"]),
                                 ("outer_momentum", self._momentum, state_dict["outer_momentum"]),
                                 ("local_params", self._params, local)):
            if len(saved) != len(mine):
                raise ValueError(f"NoLoCo state {key!r} holds {len(saved)} tensors, this optimizer {len(mine)}")
            for target, source in zip(mine, saved, strict=True):
                target.copy_(source)
        self.inner.load_state_dict(state_dict["inner"])
        self.param_groups = self.inner.param_groups  # share the new groups with the schedule again
        self.local_step = int(state_dict["local_step"])
        self.seed = int(state_dict["seed"])

    # ------------------------------------------------------------------ accounting
    @staticmethod
    def payload_bytes_per_sync(shapes: Iterable[torch.Size | tuple[int, ...]],
                               dtype: torch.dtype = torch.float32) -> int:
        """What a worker sends each peer at an outer step: its outer weights and its current
        weights, two copies of the parameters."""
        return 2 * sum(torch.Size(shape).numel() for shape in shapes) * dtype.itemsize
