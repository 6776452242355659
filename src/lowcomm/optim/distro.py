"""DisTrO as Psyche runs it (PsycheFoundation/psyche, ``shared/modeling/src/distro.rs`` and
``shared/modeling/src/trainer.rs``): DeMo whose exchange runs behind the next step's compute.

Per parameter, with DeMo's momentum delta and learning rate lr (read in the reference, see
``results/paper/README.md`` for the lines)::

    step t:  p <- p + lr_{t-1} sign(delta_{t-1})          # undo step t-1's lookahead
             p <- p (1 - lr wd)                           # decoupled weight decay
             delta <- beta delta + lr g                   # DeMo's momentum (of the local gradient)
             s_t = sign(delta)                            # this step's lookahead direction
             q_t = top-k per block of DCT(delta); delta <- delta - IDCT(q_t)   # the selected values
             start the all-gather of q_t (1-bit: receivers decode +-1)        # async_op=True
             wait for step t-1's all-gather; p <- p - lr_{t-1} sign(IDCT(Q_{t-1}))
             p <- p - lr_t s_t                            # lookahead: a guess at the update in flight

``Q`` is the mean over the workers that sent each coefficient (DeMo's aggregation, Psyche's
``scatter_reduce(mean)``); with the ``signbit`` wire each sent value decodes to +1 or -1 with no
scale, and the sender removes from its momentum the unquantized values it selected (Psyche
subtracts its own unquantized result, one step later; the momentum is the same, since nothing
else touches it in between). Step 1 has nothing to apply; the last step's aggregate is still in
flight when training stops (Psyche applies it at the start of a round that never comes).

Where Psyche puts each part, and why the order above is the same: Psyche's round r applies the
aggregate of round r-2 (received while round r-1 trained), then moves every worker to its
lookahead point ``p - lr sign(delta)`` for the forward/backward, then takes the lookahead back
and computes round r's momentum and payload. Here the loop's one hook is ``step()`` after the
backward pass, so the lookahead of step t is applied at the end of step t's ``step()`` and taken
back at the start of step t+1's: the forward/backward of step t+1 runs at the same point as
Psyche's, and the parameters between steps (validation, checkpoints) are the lookahead point
too. Each worker's lookahead is its own, so the workers' parameters differ between steps by
``lr (s_r - s_r')``. Taking it back restores a copy of the parameters kept from before it, not
``p + lr s``: in floating point ``(p - x) + x`` is not always ``p``, and the workers, each with its
own x, would drift apart by rounding (Psyche adds it back; the copy costs one more parameter-sized
buffer per worker, the same on every worker). ``lookahead=False`` drops it: the plain
one-step-delayed DeMo.

The learning rate of an update is the one of the step that computed it (the schedule's value
when its momentum was formed), for the lookahead and for the delayed aggregate alike; Psyche
applies the aggregate with the schedule's value at the step that applies it (a difference of one
step of the schedule).

Checkpoints: the momentum, the lookahead direction (int8) and its lr are per-parameter state,
each worker's own; ``state_dict()["base_params"]`` (the parameters without the lookahead) and
``["in_flight"]`` (the gathered payloads of every worker, waited for first, with what each
parameter's update needs) are the same on every worker. Loaded, they put each worker back at
its own lookahead point and apply exactly the aggregate it would have: a checkpoint's model file
holds one worker's parameters, lookahead included, which another worker cannot use as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from lowcomm.comm import Communicator
from lowcomm.compress.base import Payload
from lowcomm.optim.closure import closure_loss
from lowcomm.optim.demo import DeMo, DeMoArgs, _Bases, _InFlight, _Sent, _Stack

__all__ = ["DisTrO", "DisTrOArgs"]


@dataclass(kw_only=True)
class DisTrOArgs(DeMoArgs):
    """DisTrO's arguments: DeMo's (defaults in ``configs/optimizer/distro.yaml``, Psyche's 40B run)
    and ``lookahead``: whether each worker moves its parameters by ``-lr sign(momentum)``
    while its exchange is in flight (Psyche's ``error_correction``; see the module doc)."""

    config_name: ClassVar[str] = "distro"

    lookahead: bool


class DisTrO(DeMo):
    """:class:`~lowcomm.optim.DeMo` with its aggregate applied one step late, the all-gather in
    flight across the next forward/backward, and Psyche's lookahead. Use it as DeMo:
    ``DisTrO(model.parameters(), DisTrOArgs.defaults(), comm)``."""

    graphable = False  # its step applies the last step's aggregate: DeMo's captured order does not hold

    _receive_sets = 2  # a step's buckets are decoded by the next step, after its own all-gathers

    def __init__(self, params, args: DisTrOArgs, comm: Communicator | None = None):
        super().__init__(params, args, comm)
        self.lookahead = args.lookahead
        # the buckets sent by the last step, applied by the next one
        self._in_flight: list[_InFlight] = []
        # the parameters as they were before the lookahead moved them (the same on every worker)
        self._base: dict[torch.nn.Parameter, torch.Tensor] = {}

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        self._random_bases.clear()
        self._turn += 1
        self._take_back_lookahead()
        sent = [self._send_bucket(bucket) for bucket in self._buckets()]
        for flight in self._in_flight:
            self._apply_bucket(flight)
        self._in_flight = sent
        if self.lookahead:
            for flight in sent:
                for item in flight.sent:
                    if item.param not in self._base:
                        self._base[item.param] = torch.empty_like(item.param)
                    self._base[item.param].copy_(item.param)
                    self._look_ahead(item.param, item.lr)
        return loss

    def _look_ahead(self, param: torch.nn.Parameter, lr: float) -> None:
        """Move the parameter (kept in ``_base``) by ``-lr sign(momentum)``."""
        state = self.state[param]
        param.copy_(self._base[param]).sub_(state["lookahead"], alpha=lr)  # int8 signs, promoted in place
        state["lookahead_lr"] = lr

    def _momenta_ready(self, stack: _Stack, momentum: torch.Tensor, bases: _Bases) -> None:
        """Keep sign(momentum) in the parameters' domain, before the sent part leaves it: the
        direction of the lookahead (Psyche's ``delta.sign()``, taken before it subtracts). One
        inverse transform for the whole stack, in the work space DeMo's step leaves free here
        (fresh parameter-sized temporaries at every step cost a page fault per page on CPU)."""
        if not self.lookahead:
            return
        work, _scratch, spare = self._work_buffers(stack.params[0], stack.layout.numel)
        if self._momentum_in_coefficients:  # (the identity transform hands back the momentum itself)
            momentum = self._transform(momentum, stack.layout, bases, inverse=True, out=work, scratch=spare)
        signs = torch.sign(momentum.reshape(-1), out=spare)
        for param, part in zip(stack.params, stack.rows(signs), strict=True):
            state = self.state[param]
            kept = state.get("lookahead")  # (int8 signs, also after a restore: load_state_dict)
            if kept is None or kept.shape != param.shape or kept.dtype != torch.int8:
                state["lookahead"] = torch.empty(param.shape, dtype=torch.int8, device=param.device)
            state["lookahead"].view(-1).copy_(part.reshape(-1))

    def _take_back_lookahead(self) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                state = self.state.get(param, {})
                if state.pop("lookahead_lr", None) is not None:
                    param.copy_(self._base[param])

    # ------------------------------------------------------------------ checkpoint
    def _ordered_params(self) -> list[torch.nn.Parameter]:
        """The parameters in ``state_dict``'s numbering (torch's: group by group, in order)."""
        return [param for group in self.param_groups for param in group["params"]]

    def state_dict(self) -> dict[str, Any]:
        """DeMo's state (momentum, lookahead per parameter) and the exchange in flight: every
        worker's gathered payloads, waited for here, with each parameter's index, lr and offset."""
        state = super().state_dict()
        number = {id(param): index for index, param in enumerate(self._ordered_params())}
        flights = []
        for flight in self._in_flight:
            for handle in flight.works:
                handle.wait()
            flight.works = []
            flights.append({
                "params": [number[id(item.param)] for item in flight.sent],
                "lrs": [item.lr for item in flight.sent],
                "offsets": [item.offset for item in flight.sent],
                "numel": flight.numel,
                "gathered": [(buffer, segments) for buffer, segments in flight.gathered.values()],
            })
        state["in_flight"] = flights
        state["base_params"] = [self._base.get(param) for param in self._ordered_params()]
        return state

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        flights = state_dict.pop("in_flight", [])
        bases = state_dict.pop("base_params", [])
        super().load_state_dict(state_dict)
        params = self._ordered_params()
        self._base = {param: base.to(param.device, param.dtype).clone()
                      for param, base in zip(params, bases, strict=False) if base is not None}
        for param in params:
            state = self.state.get(param, {})
            if "lookahead" in state:  # torch's load_state_dict cast the signs to the parameter's dtype
                state["lookahead"] = state["lookahead"].to(torch.int8)
            lr = state.get("lookahead_lr")
            if lr is not None:  # this worker's own lookahead point, from the parameters without it
                self._look_ahead(param, lr)
        self._in_flight = []
        for flight in flights:
            sent = []
            for index, lr, offset in zip(flight["params"], flight["lrs"], flight["offsets"], strict=True):
                param = params[index]
                layout = self.codec.layout(param.shape)
                bases = self._bases(layout, self.state[param]["step"], param)
                meta = {"shape": layout.shape, "dtype": param.dtype}
                sent.append(_Sent(param, layout, bases, lr, Payload({}, meta), offset))
            gathered = {buffer.dtype: (buffer.to(sent[0].param.device), list(segments))
                        for buffer, segments in flight["gathered"]}
            self._in_flight.append(_InFlight(sent, flight["numel"], gathered, []))
