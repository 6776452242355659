"""Decoupled DiLoCo's synchronizer (Douillard et al. 2026, arXiv 2604.21428): the global fragments
and their outer optimizer, which learners on their own clocks send fragments to (the rules:
:mod:`lowcomm.optim.synchronizer`; the transport: :mod:`lowcomm.comm.hub`).

The parameters are split into P fragments (:func:`~lowcomm.optim.synchronizer.balanced_fragments`).
A learner sends fragment p after each of its inner steps t with ``t % H == t_p`` (the offsets of
Streaming DiLoCo, ``t_p = p H // P``): its parameters of the fragment, the tokens and inner steps
it trained since it last received the fragment. The synchronizer keeps, per fragment, the latest
such offer of each learner since the fragment's last merge; once ``quorum`` learners have offered
(0: every learner still training, a lost one included: a barrier), it waits at most the grace
window for the others, then merges:

    v_m = Theta_p - theta_{m,p}                                    # learner m's outer gradient
    Delta_p = RDA_m(v_m; w_m)  per tensor (the embeddings: the weighted mean), w_m = tokens^2 / steps
    b_p <- mu b_p + Delta_p;  Theta_p <- Theta_p - lr_out (Delta_p + mu b_p)     # Nesterov SGD

and sends ``Theta_p`` (its version: the merges of fragment p so far) to every connected learner,
which replaces its own fragment with it and starts its counters of the fragment again. A learner
that is lost offers nothing and holds up nothing; one that was slow offers what it trained, with
the weight of the tokens it trained.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from lowcomm.comm.hub import BYE, DONE
from lowcomm.optim.args import Args, raise_argument_errors
from lowcomm.optim.diloco import InnerOptimizer, outer_direction_, outer_step_errors
from lowcomm.optim.streaming_diloco import fragment_errors, fragment_offsets
from lowcomm.optim.synchronizer import (
    grace_window_s,
    radial_directional_average,
    seconds_field,
    token_weight,
    weighted_average,
)

__all__ = ["DecoupledDiLoCoArgs", "DecoupledLearner", "FragmentSynchronizer", "Offer"]


@dataclass(kw_only=True)
class DecoupledDiLoCoArgs(Args):
    """Decoupled DiLoCo's arguments; defaults in ``configs/optimizer/decoupled_diloco.yaml``.

    sync_every: H, the period of each fragment's offers (fragment p after steps t % H == t_p).
    num_fragments: P, fragments of balanced size (:func:`~lowcomm.optim.synchronizer.balanced_fragments`).
    overlap: tau, inner steps a learner trains on before it waits for a merge (``wait``).
    quorum: offers a merge needs at least (0: every learner still training).
    grace: gamma, the share of a step's slack the grace window waits for the others.
    wait: whether a learner waits, ``overlap`` steps after an offer, for the merge it offered to.
    outer_lr, outer_momentum, nesterov: the synchronizer's outer SGD.
    """

    config_name: ClassVar[str] = "decoupled_diloco"

    sync_every: int
    num_fragments: int
    overlap: int
    quorum: int
    grace: float
    wait: bool
    outer_lr: float
    outer_momentum: float
    nesterov: bool

    def errors(self) -> list[str]:
        errors = super().errors() + fragment_errors(self.num_fragments, self.sync_every)
        if self.sync_every >= 1 and not 0 <= self.overlap < self.sync_every:
            errors.append(f"overlap must be in [0, sync_every), got {self.overlap}")
        if self.quorum < 0:
            errors.append(f"quorum must be >= 0 learners (0: every learner), got {self.quorum}")
        if not 0 <= self.grace <= 1:
            errors.append(f"grace must be in [0, 1], got {self.grace}")
        # (fragment_errors above checks H >= 1 already)
        return errors + outer_step_errors(max(self.sync_every, 1), self.outer_lr, self.outer_momentum)


@dataclass
class Offer:
    """A learner's fragment as it sent it: its parameters, and the tokens and inner steps it
    trained since it last received the fragment."""

    tensors: list[torch.Tensor]
    tokens: int
    steps: int
    step: int = 0  # the learner's inner step it was sent after

    @property
    def weight(self) -> float:
        return token_weight(self.tokens, self.steps)


class FragmentSynchronizer:
    """The synchronizer's state: the global parameters (``parameters``, float32 copies, one per
    tensor), cut into ``fragments`` (tensor indices per fragment), each fragment's outer momentum
    and version, and the offers waiting for each fragment's next merge. ``embeddings``: the
    tensor indices merged by the plain weighted mean. ``quorum``: how many offers a merge needs
    at least (0: every learner still training: a barrier, which a lost learner holds up)."""

    def __init__(self, parameters: Sequence[torch.Tensor], fragments: Sequence[Sequence[int]], *,
                 outer_lr: float, outer_momentum: float, nesterov: bool = True, quorum: int = 1,
                 embeddings: Sequence[int] = ()):
        covered = sorted(i for fragment in fragments for i in fragment)
        if covered != list(range(len(parameters))):
            raise ValueError(f"the fragments must hold every tensor once, got {[list(f) for f in fragments]} "
                             f"for {len(parameters)} tensors")
        if quorum < 0:
            raise ValueError(f"the quorum is >= 0 learners (0: all), got {quorum}")
        self.parameters = [p.detach().float().clone() for p in parameters]
        self.fragments = [list(fragment) for fragment in fragments]
        self.embeddings = set(embeddings)
        self.outer_lr, self.outer_momentum, self.nesterov = outer_lr, outer_momentum, nesterov
        self.quorum = quorum
        self.momentum = [torch.zeros_like(p) if outer_momentum else None for p in self.parameters]
        self.versions = [0] * len(self.fragments)
        self.offers: list[dict[int, Offer]] = [{} for _ in self.fragments]
        self.contributors: list[list[int]] = []  # per merge, in order: (fragment, learners...)

    # ---------------------------------------------------------------- offers and the quorum
    def offer(self, learner: int, fragment: int, tensors: Sequence[torch.Tensor], tokens: int, steps: int,
              step: int = 0) -> None:
        """Learner ``learner``'s fragment; a later offer of the same learner before the merge
        replaces its earlier one (its counters ran on: it covers what the earlier covered)."""
        expected = [self.parameters[i].shape for i in self.fragments[fragment]]
        if [t.shape for t in tensors] != expected:
            raise ValueError(f"learner {learner}'s fragment {fragment} has shapes {[tuple(t.shape) for t in tensors]}, "
                             f"the synchronizer's {[tuple(s) for s in expected]}")
        self.offers[fragment][learner] = Offer([t.detach().float() for t in tensors], int(tokens), int(steps), int(step))

    def needed(self, training: int) -> int:
        """Offers a merge needs while ``training`` learners have not finished (a learner that
        finished holds up no quorum; a lost one is still counted: the quorum waits for it)."""
        return max(1, training if self.quorum == 0 else min(self.quorum, training))

    def quorum_met(self, fragment: int, training: int) -> bool:
        offered = [o for o in self.offers[fragment].values() if o.steps > 0]
        return len(offered) >= self.needed(training)

    def everyone_offered(self, fragment: int, learners: Sequence[int]) -> bool:
        return all(m in self.offers[fragment] for m in learners)

    # ---------------------------------------------------------------- the merge
    @torch.no_grad()
    def merge(self, fragment: int) -> tuple[int, list[torch.Tensor]]:
        """Merge fragment ``fragment``'s offers (those of learners that took a step) into one
        outer step; returns its new version and global tensors."""
        offers = {m: o for m, o in sorted(self.offers[fragment].items()) if o.steps > 0}
        if not offers:
            raise ValueError(f"fragment {fragment} has no offer of a learner that took a step")
        weights = [o.weight for o in offers.values()]
        for position, index in enumerate(self.fragments[fragment]):
            theta = self.parameters[index]
            deltas = [theta - o.tensors[position] for o in offers.values()]
            average = weighted_average if index in self.embeddings else radial_directional_average
            direction = average(deltas, weights)
            outer_direction_(direction, self.momentum[index], self.outer_momentum, self.nesterov)
            theta.sub_(direction, alpha=self.outer_lr)
        self.offers[fragment] = {}
        self.versions[fragment] += 1
        self.contributors.append([fragment, *offers])
        return self.versions[fragment], [self.parameters[i] for i in self.fragments[fragment]]

    # ---------------------------------------------------------------- resume
    def state_dict(self) -> dict:
        return {"parameters": [p.clone() for p in self.parameters],
                "momentum": [None if m is None else m.clone() for m in self.momentum],
                "versions": list(self.versions), "contributors": [list(c) for c in self.contributors]}

    def load_state_dict(self, state: dict) -> None:
        self.parameters = [p.clone() for p in state["parameters"]]
        self.momentum = [None if m is None else m.clone() for m in state["momentum"]]
        self.versions = list(state["versions"])
        self.contributors = [list(c) for c in state["contributors"]]
        # offers wait for no checkpoint: one not merged when the state was saved is lost with it,
        # and its learner's counters run on into its next offer
        self.offers = [{} for _ in self.fragments]


# ---------------------------------------------------------------------------- the serving loop
# The messages between learners and the synchronizer (headers of hub messages):
OFFER = "offer"  # learner -> synchronizer: {kind, fragment, tokens, steps, step, step_s} + the fragment's tensors
GLOBAL = "global"  # synchronizer -> learner: {kind, fragment, version} + the global fragment's tensors
HELLO = "hello"  # learner -> synchronizer, before its first step here: {kind, versions} (the versions it holds)
# (a learner leaving says hub.DONE and is answered hub.BYE: lowcomm.comm.hub)

# How much of a new measurement a smoothed time takes
SMOOTHING = 0.3


def _smoothed(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new


@dataclass
class Timings:
    """What the grace window is computed from: each learner's step time as it reports it
    (smoothed per learner; the window takes the slowest learner's) and the synchronizer's own
    time to merge and send a fragment (smoothed)."""

    steps_s: dict[int, float] = field(default_factory=dict)
    sync_s: float = 0.0

    @property
    def step_s(self) -> float:
        return max(self.steps_s.values(), default=0.0)

    def saw_step(self, learner: int, seconds: float) -> None:
        if seconds > 0:  # 0: not measured (a learner's first step holds its start)
            self.steps_s[learner] = _smoothed(self.steps_s.get(learner), seconds)

    def forget(self, learner: int) -> None:
        self.steps_s.pop(learner, None)

    def saw_sync(self, seconds: float) -> None:
        self.sync_s = _smoothed(self.sync_s or None, seconds)


def serve(hub, synchronizer: FragmentSynchronizer, *, learners: int, overlap_steps: int, gamma: float,
          idle_timeout_s: float = 300.0, on_merge=None, before_merge=None) -> Timings:
    """Serve ``learners`` learners through ``hub`` until each has said it is done (or, lost, has
    not come back within ``idle_timeout_s`` of the last message): take their offers, merge each
    fragment once its quorum is met and its grace window has passed (or every connected learner
    has offered), and send the new global fragment to every connected learner. A learner's hello
    (its first word after it starts or resumes) is answered with every global fragment newer than
    the versions it holds. ``before_merge(step)``: called before each merge with the latest inner
    step its offers were sent after (the harness saves the synchronizer's state as of a checkpoint
    step there); ``on_merge(fragment, version)``: after each merge."""
    timings = Timings()
    done: set[int] = set()
    finishing: set[int] = set()  # said DONE, with an offer still to merge: counted until it is merged
    round_started: dict[int, float] = {}  # fragment -> its round's first offer
    deadline: dict[int, float] = {}  # fragment -> when its grace window closes
    given: dict[tuple[int, int], int] = {}  # (learner, fragment) -> the newest version sent to it
    last_message = time.monotonic()
    while len(done) < learners:
        now = time.monotonic()
        wait = min([d - now for d in deadline.values()] + [0.5])
        try:
            learner, message = hub.next(timeout=max(0.0, wait))
            last_message = time.monotonic()
        except queue.Empty:
            message = None
            if time.monotonic() - last_message > idle_timeout_s:
                break
        kind = None if message is None else message.header.get("kind", "joined" if "joined" in message.header else None)
        if kind == "joined":  # a connection anew (a learner started again): it holds what its hello says
            given = {key: v for key, v in given.items() if key[0] != learner}
        elif kind == HELLO:
            # a learner (re)starting takes the global fragments merged since the versions it holds
            # before it offers: its outer gradient is then against them, not against what it
            # started from (one that resumes where the synchronizer's state was saved is sent none)
            held = list(message.header.get("versions", []))
            for fragment, version in enumerate(synchronizer.versions):
                # (nor one it was sent already: a merge after it connected, before its hello)
                if version > max(held[fragment] if fragment < len(held) else 0, given.get((learner, fragment), 0)):
                    given[learner, fragment] = version
                    hub.send(learner, {"kind": GLOBAL, "fragment": fragment, "version": version},
                             [synchronizer.parameters[i] for i in synchronizer.fragments[fragment]])
        elif kind == OFFER:
            header = message.header
            fragment = int(header["fragment"])
            synchronizer.offer(learner, fragment, message.tensors, header["tokens"], header["steps"],
                               header.get("step", 0))
            round_started.setdefault(fragment, time.monotonic())
            timings.saw_step(learner, float(header.get("step_s", 0.0)))
        elif kind == DONE:
            finishing.add(learner)
        for m in list(finishing):
            if not any(m in offers for offers in synchronizer.offers):
                finishing.discard(m)
                done.add(m)
                timings.forget(m)
                hub.send(m, {"kind": BYE})  # nothing is sent to it after this
        connected = [m for m in hub.learners() if m not in done]
        for fragment in range(len(synchronizer.fragments)):
            if not synchronizer.offers[fragment] or not synchronizer.quorum_met(fragment, learners - len(done)):
                continue
            now = time.monotonic()
            if fragment not in deadline:
                quorum_s = now - round_started[fragment]
                deadline[fragment] = now + grace_window_s(overlap_steps, timings.step_s, quorum_s, timings.sync_s,
                                                          gamma)
            if now < deadline[fragment] and not synchronizer.everyone_offered(fragment, connected):
                continue
            if before_merge is not None:
                before_merge(max(o.step for o in synchronizer.offers[fragment].values()))
            version, tensors = synchronizer.merge(fragment)
            for m in connected:
                given[m, fragment] = version
                hub.send(m, {"kind": GLOBAL, "fragment": fragment, "version": version}, tensors)
            timings.saw_sync(time.monotonic() - now)
            del deadline[fragment], round_started[fragment]
            if on_merge is not None:
                on_merge(fragment, version)
    return timings


# ---------------------------------------------------------------------------- a learner
class DecoupledLearner(torch.optim.Optimizer):
    """A Decoupled DiLoCo learner around any inner optimizer, talking to the synchronizer through
    ``link`` (a :class:`~lowcomm.comm.hub.HubLink`): after each inner step it counts the step and
    its tokens against every fragment, offers each fragment due at the step (``t % H == t_p``:
    its parameters and counters, queued, never waited for), then replaces every fragment whose
    newer global version has arrived by then and starts that fragment's counters again.

    ``wait``: after a fragment's offer at step t, wait at step ``t + overlap`` for its next
    version (under a quorum of every learner, a run whose every merge holds the same offers:
    Streaming DiLoCo's schedule with the synchronizer's merge); without it a learner never waits,
    and takes each version at the first step boundary after it arrived."""

    def __init__(self, fragments: Sequence[Sequence[torch.nn.Parameter]], inner: InnerOptimizer, link, *,
                 sync_every: int, overlap: int, tokens_per_step: int, wait: bool = False,
                 wait_timeout_s: float = 300.0):
        fragments = [list(fragment) for fragment in fragments]
        raise_argument_errors(fragment_errors(len(fragments), sync_every))
        if not 0 <= overlap < sync_every:
            raise ValueError(f"overlap must be in [0, sync_every), got {overlap}")
        params = [p for fragment in fragments for p in fragment]
        super().__init__(params, dict(sync_every=sync_every))
        self.inner = inner(params) if callable(inner) else inner
        self.param_groups = self.inner.param_groups
        self.fragments, self.link = fragments, link
        self.sync_every, self.overlap, self.tokens_per_step = sync_every, overlap, tokens_per_step
        self.wait, self.wait_timeout_s = wait, wait_timeout_s
        self.offsets = fragment_offsets(len(fragments), sync_every)
        self.local_step = 0
        self.versions = [0] * len(fragments)  # the global version each fragment last took
        self.steps_since = [0] * len(fragments)
        self.tokens_since = [0] * len(fragments)
        # fragment -> (the step its next version is waited for at, the version held at its offer)
        self._awaited: dict[int, tuple[int, int]] = {}
        self._step_started: float | None = None  # (the first step's time holds the start: not reported)
        self._waited_s = 0.0
        self._said_hello = False

    def step(self, closure: Callable[[], float] | None = None):
        if not self._said_hello:  # (after a restore: the versions it holds are its checkpoint's)
            self.link.push({"kind": HELLO, "versions": list(self.versions)})
            self._said_hello = True
        loss = self.inner.step(closure)
        self.local_step += 1
        now = time.perf_counter()
        # the step's own time, without the waits for merges (the synchronizer's, not the step's)
        step_s = 0.0 if self._step_started is None else now - self._step_started - self._waited_s
        self._step_started, self._waited_s = now, 0.0
        for fragment in range(len(self.fragments)):
            self.steps_since[fragment] += 1
            self.tokens_since[fragment] += self.tokens_per_step
        for fragment, offset in enumerate(self.offsets):
            if self.local_step % self.sync_every == offset % self.sync_every:
                self.link.push({"kind": OFFER, "fragment": fragment, "tokens": self.tokens_since[fragment],
                                "steps": self.steps_since[fragment], "step": self.local_step,
                                "step_s": seconds_field(step_s)},
                               [p.detach() for p in self.fragments[fragment]])
                if self.wait:
                    self._awaited[fragment] = (self.local_step + self.overlap, self.versions[fragment])
        # a version is taken as it arrives; one waited for, at the step it is waited for and not
        # before (it may arrive early: then when it arrived would decide what trains, and what
        # this step metered received): it stays with the link until then
        for message in self.link.take(lambda m: m.header.get("fragment") not in self._awaited):
            self._take(message)
        for fragment, (due, offered_at) in list(self._awaited.items()):
            if due > self.local_step:
                continue
            if self.versions[fragment] <= offered_at:
                waited = time.perf_counter()
                arrived = self.link.wait_for(
                    lambda m, f=fragment, v=offered_at: m.header.get("kind") == GLOBAL and m.header["fragment"] == f
                    and m.header["version"] > v, timeout_s=self.wait_timeout_s)
                self._waited_s += time.perf_counter() - waited
                self._take(arrived)
            del self._awaited[fragment]
        return loss

    @torch.no_grad()
    def _take(self, message) -> None:
        header = message.header
        if header.get("kind") != GLOBAL or header["version"] <= self.versions[header["fragment"]]:
            return
        fragment = header["fragment"]
        for param, value in zip(self.fragments[fragment], message.tensors, strict=True):
            param.copy_(value.to(param.dtype))
        self.versions[fragment] = header["version"]
        self.steps_since[fragment] = self.tokens_since[fragment] = 0

    def finish(self) -> None:
        """Leave the synchronizer (:meth:`~lowcomm.comm.hub.HubLink.leave`): the merges of its
        last offers still come to it, and are taken."""
        for message in self.link.leave(timeout_s=self.wait_timeout_s):
            self._take(message)

    def state_dict(self) -> dict:
        return {"inner": self.inner.state_dict(), "local_step": self.local_step, "versions": list(self.versions),
                "steps_since": list(self.steps_since), "tokens_since": list(self.tokens_since),
                "awaited": {str(f): list(due) for f, due in self._awaited.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state["inner"])
        self.param_groups = self.inner.param_groups  # (the inner's load replaced its list: the schedule's groups)
        self.local_step = int(state["local_step"])
        self.versions = list(state["versions"])
        self.steps_since, self.tokens_since = list(state["steps_since"]), list(state["tokens_since"])
        # the versions it waits for: one that arrives after the resume is taken at the step it was due at
        self._awaited = {int(f): (int(due), int(at)) for f, (due, at) in state.get("awaited", {}).items()}
