"""DiLoCo with its outer synchronisation overlapped with the next inner phase: the eager
updates of Kale, Douillard and Donchev 2025 (arXiv 2502.12996).

DiLoCo blocks at every outer step until the all-reduce of the pseudo-gradients is done. Here
the all-reduce started at outer step t is waited for only at outer step t + 1, H inner steps
later, so a link that moves one model's bytes in the time of H inner steps costs no waiting at
all. Each worker m keeps its own outer parameters theta_m (and outer momentum). With W workers,
at outer step t (after H inner steps from theta_m^(t-1))::

    Delta_m^t = theta_m^(t-1) - theta_m(local)            # this worker's fresh pseudo-gradient
    start the all-reduce of Delta_m^t                     # its mean arrives at outer step t + 1
    Dbar^(t-1) = mean_j Delta_j^(t-1)                     # waited for now (started H steps ago)
    eager:   D_m = Dbar^(t-1) + (Delta_m^t - Delta_m^(t-1)) / W
                 = (Delta_m^t + sum_{j != m} Delta_j^(t-1)) / W
    delayed: D_m = Dbar^(t-1)                             # the paper's naive one-step delay
    b_m <- mu b_m + D_m;  theta_m^t = theta_m^(t-1) - lr_out (D_m + mu b_m)    # outer Nesterov SGD
    theta_m(local) <- theta_m^t

The eager direction is the delayed mean with the worker's own stale term replaced by its fresh
one: its own inner phase counts at once, the others' one outer step late. At the first outer
step no mean has arrived (Delta^0 = 0): eager applies Delta_m^1 / W, delayed applies nothing.
Under ``delayed`` every worker applies the same direction, so the outer parameters stay equal
on every worker; under ``eager`` they differ by the workers' own terms.

The exchange is DiLoCo's (:class:`lowcomm.optim.diloco.PendingMean`: a dense all-reduce, the
quantized all-reduce or an all-gather of a codec's payloads), started asynchronously. The fresh
and stale own terms are the worker's exact Delta_m, not its encoded form. Error feedback is not
offered: its accumulator would have to be updated with a delayed decode.

State per worker (:meth:`state_dict`): DiLoCo's (inner state, local and outer parameters, outer
momentum, local step), Delta_m^t of the last outer step (and the W it was divided by) and the
mean of the exchange in flight (waited for when saved, so a resume applies it at the same outer
step as an uninterrupted run).

Between replica groups that leave and rejoin (:mod:`lowcomm.comm.ft`) W is the ranks that
contribute to the exchange begun at the outer step. The exchange of step t is committed at step
t + 1, before the quorum of t + 1 forms. One a peer died inside is dropped: its mean is taken as
zero, so the worker takes back its own eager term of step t: the step's mean is never applied
(its own term lingers only in the outer momentum). A group that resumed with an exchange in
flight drops it and heals from a peer at the next quorum (which its peers may have applied). A group
behind its peers heals in the quorum of t + 1 (its global copy, own term and received mean become
the peer's, its parameters the global copy): its fresh Delta is zero, and it applies the peer's
delayed mean less the peer's own term.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from lowcomm.comm import Communicator
from lowcomm.compress.base import Codec
from lowcomm.optim.args import one_of_error
from lowcomm.optim.diloco import DiLoCo, DiLoCoArgs, InnerOptimizer, PendingMean, outer_direction_

__all__ = ["EagerDiLoCo", "EagerDiLoCoArgs"]

MODES = ("eager", "delayed")


@dataclass(kw_only=True)
class EagerDiLoCoArgs(DiLoCoArgs):
    """DiLoCo's arguments and ``mode``: ``eager`` (the worker's fresh pseudo-gradient replaces its
    own stale one in the delayed mean) or ``delayed`` (the delayed mean alone). Defaults in
    ``configs/optimizer/eager_diloco.yaml``."""

    config_name: ClassVar[str] = "eager_diloco"

    mode: str

    def errors(self) -> list[str]:
        errors = super().errors() + one_of_error("mode", self.mode, MODES)
        if self.error_feedback is not None:
            errors.append(f"error_feedback must be null (eager DiLoCo has no error feedback), got "
                          f"{self.error_feedback}")
        return errors


class EagerDiLoCo(DiLoCo):
    """DiLoCo whose all-reduce of outer step t is applied at outer step t + 1 (module doc).

    Args: as :class:`lowcomm.optim.DiLoCo`'s, with :class:`EagerDiLoCoArgs`.
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        inner: InnerOptimizer,
        args: EagerDiLoCoArgs,
        *,
        compressor: Codec | None = None,
        comm: Communicator | None = None,
    ):
        super().__init__(params, inner, args, compressor=compressor, comm=comm)
        self.mode = args.mode
        self._own: list[torch.Tensor] | None = None  # Delta_m of the last outer step (eager)
        self._own_world = self.comm.world_size  # the ranks it was divided by
        self._pending: PendingMean | None = None  # the mean of the last outer step's exchange
        self._pending_here = False  # begun by this process (not restored from a checkpoint)

    @torch.no_grad()
    def _synchronise(self) -> None:
        # The last outer step's mean has had H inner steps to arrive; waited for (and, between
        # replica groups, committed) before the next exchange starts, so that no two are in
        # flight at once. One a peer died inside is dropped by every group alike: this worker
        # then takes back its own eager term of that step (below), and the step's mean is never
        # applied. Restored from a checkpoint, no quorum holds it: plainly it is applied, as it
        # would have been; between replica groups it is dropped, and the group heals from a peer
        # at this quorum (its peers may have applied it; where all resumed alike, none heals).
        if self._pending is not None:
            self._pending.wait()
            committed = self.comm.commit() if self._pending_here else not self.comm.replica_groups
            if not committed:
                if not self._pending_here:  # peers may have applied it: take their state at this quorum
                    self.comm.fall_behind()
                self._pending = None
        # Between replica groups a quorum forms now. A group behind its peers takes a live
        # peer's state here (its global copy, own term and the mean it received; its
        # parameters, at this outer boundary, the global copy), so its fresh pseudo-gradient
        # below is zero: it applies the peer's delayed mean less the peer's own stale term,
        # which that global copy holds already.
        self.comm.begin_exchange()
        world = self.comm.averaged_over
        fresh = [global_ - local for global_, local in zip(self._global, self._params, strict=True)]
        arrived = self._pending.wait() if self._pending is not None else None
        self._pending = PendingMean.start(self.comm, [delta.clone() for delta in fresh], self.compressor,
                                          self.exchange)
        self._pending_here = True
        for index, (local, global_) in enumerate(zip(self._params, self._global, strict=True)):
            direction = self._direction(index, fresh[index], arrived, world)
            momentum = self._momentum[index] if self._momentum is not None else None
            outer_direction_(direction, momentum, self.outer_momentum, self.nesterov)
            global_.sub_(direction, alpha=self.outer_lr)
            local.copy_(global_)
        # this worker's own term, and the world it was divided by (a quorum's may change)
        self._own = fresh if self.mode == "eager" else None
        self._own_world = world

    def _direction(self, index: int, fresh: torch.Tensor, arrived: list[torch.Tensor] | None,
                   world: int) -> torch.Tensor:
        """D_m for one tensor (a new tensor): the arrived mean, eagerly corrected by this worker's
        fresh pseudo-gradient in place of its stale one (divided by the world it was applied
        over)."""
        direction = arrived[index].clone() if arrived is not None else torch.zeros_like(fresh)
        if self.mode == "eager":
            direction.add_(fresh, alpha=1 / world)
            if self._own is not None:
                direction.sub_(self._own[index], alpha=1 / self._own_world)
        return direction

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """DiLoCo's state, this worker's last pseudo-gradient (and the world it was divided by)
        and the mean in flight (received here: it is the same whenever it is waited for; None
        after a dropped one)."""
        return {
            **super().state_dict(),
            "own_delta": list(self._own) if self._own is not None else None,
            "own_world": self._own_world,
            "in_flight_mean": list(self._pending.wait()) if self._pending is not None else None,
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        own, mean = state_dict["own_delta"], state_dict["in_flight_mean"]
        # (between replica groups a dropped exchange leaves an own term and no mean)
        if own is not None and self.mode != "eager" or own is None and self.mode == "eager" and mean is not None:
            raise ValueError(f"EagerDiLoCo state 'own_delta' does not match mode {self.mode!r}")
        for saved in (own, mean):
            if saved is not None and len(saved) != len(self._params):
                raise ValueError("EagerDiLoCo state does not match this optimizer's parameters")
        self._own = [t.clone() for t in own] if own is not None else None
        self._own_world = int(state_dict.get("own_world", self.comm.world_size))  # (older checkpoints: the run's W)
        self._pending = PendingMean.done([t.clone() for t in mean]) if mean is not None else None
        self._pending_here = False
