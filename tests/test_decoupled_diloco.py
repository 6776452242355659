"""Decoupled DiLoCo's synchronizer (lowcomm.optim.decoupled_diloco): its merges against values
worked by hand, and its serving loop over a real hub with learners in processes of their own: a
quorum of all waits for everyone, a quorum of one merges without the slow learner and takes its
fragment at the next merge."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import pytest
import torch

from lowcomm.comm.hub import SYNC, Hub, HubLink
from lowcomm.comm.meter import CommMeter
from lowcomm.comm.spawn import spawn_workers
from lowcomm.optim.decoupled_diloco import GLOBAL, HELLO, OFFER, FragmentSynchronizer, serve

LR, MU = 0.5, 0.9


def _synchronizer(quorum: int = 0) -> FragmentSynchronizer:
    # two tensors, one fragment each: tensor 0 a weight (radial-directional), tensor 1 the embedding
    return FragmentSynchronizer([torch.zeros(2), torch.zeros(2)], [[0], [1]], outer_lr=LR, outer_momentum=MU,
                                quorum=quorum, embeddings=[1])


def test_a_merge_is_the_token_weighted_radial_directional_average_then_outer_nesterov():
    sync = _synchronizer()
    # learner 0: 100 tokens in 1 step (w = 10,000); learner 1: 100 tokens in 4 steps (w = 2,500)
    sync.offer(0, 0, [torch.tensor([-2.0, 0.0])], tokens=100, steps=1)
    sync.offer(1, 0, [torch.tensor([0.0, -2.0])], tokens=100, steps=4)
    version, (theta,) = sync.merge(0)
    # v = (2, 0) and (0, 2), weights 4/5 and 1/5: norm 2 along (4/5, 1/5) / |(4/5, 1/5)|;
    # Nesterov from zero momentum: b = Delta, step lr (Delta + mu b) = lr (1 + mu) Delta
    delta = torch.tensor([0.8, 0.2]) / math.sqrt(0.8**2 + 0.2**2) * 2
    torch.testing.assert_close(theta, -LR * (1 + MU) * delta)
    assert version == 1 and sync.versions == [1, 0] and sync.offers[0] == {}
    # the embedding's fragment: the plain weighted mean, (4/5 * 2, 1/5 * 2)
    sync.offer(0, 1, [torch.tensor([-2.0, 0.0])], tokens=100, steps=1)
    sync.offer(1, 1, [torch.tensor([0.0, -2.0])], tokens=100, steps=4)
    _, (embedding,) = sync.merge(1)
    torch.testing.assert_close(embedding, -LR * (1 + MU) * torch.tensor([1.6, 0.4]))
    assert sync.contributors == [[0, 0, 1], [1, 0, 1]]
    # a second merge of fragment 0 with learner 0 alone: its outer gradient from the new global
    # value, the momentum carried (b = mu b + Delta)
    before = theta.clone()
    sync.offer(0, 0, [before - torch.tensor([1.0, 0.0])], tokens=50, steps=1)
    _, (after,) = sync.merge(0)
    momentum = MU * delta + torch.tensor([1.0, 0.0])
    torch.testing.assert_close(after, before - LR * (torch.tensor([1.0, 0.0]) + MU * momentum))
    with pytest.raises(ValueError, match="shapes"):
        sync.offer(0, 0, [torch.zeros(3)], tokens=1, steps=1)


def test_the_quorum_counts_offers_of_learners_that_took_a_step():
    sync = _synchronizer(quorum=2)
    assert sync.needed(3) == 2 and sync.needed(1) == 1 and _synchronizer(quorum=0).needed(3) == 3
    sync.offer(0, 0, [torch.ones(2)], tokens=10, steps=1)
    sync.offer(1, 0, [torch.ones(2)], tokens=0, steps=0)  # nothing trained since its last receipt
    assert not sync.quorum_met(0, training=3)
    sync.offer(2, 0, [torch.ones(2)], tokens=10, steps=1)
    assert sync.quorum_met(0, training=3) and not sync.everyone_offered(0, [0, 1, 2, 3])
    sync.merge(0)
    assert sync.contributors[-1] == [0, 0, 2]  # learner 1's empty offer left out
    # the state after a merge (momentum, version, global values) resumes: the next merge alike
    state = sync.state_dict()
    again = _synchronizer(quorum=2)
    again.load_state_dict(state)
    for each in (sync, again):
        each.offer(0, 0, [torch.tensor([0.5, -1.0])], tokens=10, steps=1)
        each.offer(2, 0, [torch.tensor([2.0, 1.0])], tokens=30, steps=2)
    ours, theirs = sync.merge(0), again.merge(0)
    assert ours[0] == theirs[0] == 2 and torch.equal(ours[1][0], theirs[1][0])
    assert again.contributors == sync.contributors


def _learner(rank: int, world: int, address: str, late: bool) -> list[tuple[int, list[float]]]:  # noqa: ARG001
    """Offer fragment 0 (rank 0: (-2, 0) after one step; rank 1: (0, -2) after four; where
    ``late``, rank 1 only once the first merge has reached it), then take the global fragments
    the synchronizer sends until the one after its own offer; leave."""
    link = HubLink(address, learner=rank, meter=CommMeter())
    link.push({"kind": HELLO, "versions": [0]})  # what a DecoupledLearner says first: it holds version 0
    received = []

    def next_global():
        message = link.wait_for(lambda m: m.header.get("kind") == GLOBAL, timeout_s=60)
        received.append((message.header["version"], message.tensors[0].tolist()))
        return message.header["version"]

    if late and rank == 1:
        next_global()  # version 1: broadcast to it, or sent to it in answer to its hello
    mine = torch.tensor([-2.0, 0.0]) if rank == 0 else torch.tensor([0.0, -2.0])
    link.push({"kind": OFFER, "fragment": 0, "tokens": 100, "steps": 1 if rank == 0 else 4, "step_s": 0.01}, [mine])
    next_global()
    link.leave(timeout_s=60)
    return received


def _serve_in_thread(sync: FragmentSynchronizer, learners: int):
    hub = Hub("127.0.0.1")
    server = threading.Thread(target=serve, args=(hub, sync),
                              kwargs=dict(learners=learners, overlap_steps=2, gamma=0.0, idle_timeout_s=60))
    server.start()
    return hub, server


def test_a_quorum_of_all_waits_for_every_learner_and_sends_every_one_the_merge():
    sync = FragmentSynchronizer([torch.zeros(2)], [[0]], outer_lr=LR, outer_momentum=MU, quorum=0)
    hub, server = _serve_in_thread(sync, 2)
    try:
        received = spawn_workers(_learner, 2, f"127.0.0.1:{hub.port}", False, backend=None)
        server.join(timeout=60)
    finally:
        hub.close()
    expected = (-LR * (1 + MU) * torch.tensor([0.8, 0.2]) / math.sqrt(0.68) * 2).tolist()
    for got in received:
        assert got[0][0] == 1 and got[0][1] == pytest.approx(expected)
    assert sync.contributors == [[0, 0, 1]]


def test_a_quorum_of_one_merges_without_the_late_learner_and_takes_it_at_the_next_merge():
    sync = FragmentSynchronizer([torch.zeros(2)], [[0]], outer_lr=LR, outer_momentum=MU, quorum=1)
    hub, server = _serve_in_thread(sync, 2)
    try:
        received = spawn_workers(_learner, 2, f"127.0.0.1:{hub.port}", True, backend=None)
        server.join(timeout=60)
    finally:
        hub.close()
    assert sync.contributors == [[0, 0], [0, 1]]  # learner 0 alone, then learner 1 alone
    # merge 1: learner 0's (2, 0) alone: theta = -lr (1 + mu) (2, 0) = (-1.9, 0)
    first = [-1.9, 0.0]
    # merge 2: learner 1's fragment (0, -2) against the global (-1.9, 0): v = (-1.9, 2);
    # b = mu (2, 0) + v; theta -= lr (v + mu b)
    v = torch.tensor([-1.9, 2.0])
    second = (torch.tensor(first) - LR * (v + MU * (MU * torch.tensor([2.0, 0.0]) + v))).tolist()
    assert received[0] == [(1, pytest.approx(first))]
    assert received[1] == [(1, pytest.approx(first)), (2, pytest.approx(second))]


# ------------------------------------------------------------------ learners training a model
STEPS, H, P, OVERLAP = 12, 4, 2, 1


def _tiny_model():
    from lowcomm.config import validate
    from lowcomm.config.compose import compose
    from lowcomm.models import build_model

    return build_model(validate(compose(["experiment=quickstart"])).model, "cpu", seed=0)


def _fragments(model) -> tuple[list[list[int]], list[int]]:
    from lowcomm.optim.synchronizer import balanced_fragments

    named = list(model.named_parameters())
    fragments = balanced_fragments([p.numel() for _, p in named], P)
    return fragments, [i for i, (name, _) in enumerate(named) if "wte" in name]


def _process(rank: int, world: int, rendezvous: str) -> dict:
    """Rank 0 is the synchronizer; ranks 1 ... are learners, each training the tiny OLMo on
    tokens of its own for STEPS inner steps under a quorum of every learner (and so waiting for
    each merge ``OVERLAP`` steps after its offer)."""
    import torch.nn.functional as F

    from lowcomm.optim.decoupled_diloco import DecoupledLearner

    torch.manual_seed(0)
    model = _tiny_model()
    fragments, embeddings = _fragments(model)
    params = list(model.parameters())
    if rank == 0:
        hub = Hub("127.0.0.1")  # a port of the kernel's choosing, told the learners by a file
        (Path(rendezvous) / "port.tmp").write_text(str(hub.port))
        (Path(rendezvous) / "port.tmp").rename(Path(rendezvous) / "port")
        sync = FragmentSynchronizer(params, fragments, outer_lr=0.7, outer_momentum=0.9, quorum=0,
                                    embeddings=embeddings)
        serve(hub, sync, learners=world - 1, overlap_steps=OVERLAP, gamma=0.0, idle_timeout_s=120)
        hub.close()
        return {"contributors": sync.contributors, "versions": sync.versions,
                "global": [p.clone() for p in sync.parameters], "breakdown": hub.meter.breakdown(),
                **{kind: hub.meter.cumulative_bytes(kind, purpose=SYNC) for kind in ("payload", "tx", "rx")}}
    meter = CommMeter()
    while not (Path(rendezvous) / "port").is_file():
        time.sleep(0.01)
    link = HubLink(f"127.0.0.1:{(Path(rendezvous) / 'port').read_text()}", learner=rank - 1, meter=meter)
    batch, length = 4, 32
    learner = DecoupledLearner([[params[i] for i in f] for f in fragments],
                               lambda ps: torch.optim.AdamW(ps, lr=3e-3), link, sync_every=H, overlap=OVERLAP,
                               tokens_per_step=batch * length, wait=True)
    generator = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(STEPS):
        tokens = torch.randint(0, 64, (batch, length + 1), generator=generator)  # a small vocabulary: learnable
        logits = model(tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
        loss.backward()
        learner.step()
        learner.zero_grad()
        losses.append(loss.item())
    learner.finish()
    return {"losses": losses, "versions": learner.versions, "params": [p.detach().clone() for p in params],
            **{kind: meter.cumulative_bytes(kind, purpose=SYNC) for kind in ("payload", "tx", "rx")}}


def test_two_learner_processes_train_against_a_synchronizer_process_and_the_bytes_balance(tmp_path):
    (tmp_path / "first").mkdir()
    synchronizer, *learners = spawn_workers(_process, 3, str(tmp_path / "first"), backend=None)
    # every offer merged with both learners (a quorum of all): 3 per fragment in 12 steps of H = 4
    # (fragment 1 offered at steps 2, 6, 10; fragment 0 at 4, 8, 12), a learner that finished
    # counted until its last offer is merged
    assert sorted(synchronizer["contributors"]) == sorted([[f, 0, 1] for f in range(P)] * (STEPS // H))
    assert synchronizer["versions"] == [STEPS // H] * P
    for learner in learners:
        # each took every version: fragment 0's third (offered at step 12, merged after the run's
        # last step) as it left
        assert learner["versions"] == [STEPS // H] * P
        assert learner["losses"][-1] < learner["losses"][0]
    # the bytes: what the learners sent the synchronizer received, and the other way
    assert sum(lr["tx"] for lr in learners) == synchronizer["rx"]
    assert sum(lr["rx"] for lr in learners) == synchronizer["tx"]
    # by hand: each learner offers each fragment 3 times (its fp32 parameters), and the
    # synchronizer sends each merged fragment to both learners
    model = _tiny_model()
    fragments, _ = _fragments(model)
    sizes = [sum(list(model.parameters())[i].numel() * 4 for i in fragment) for fragment in fragments]
    offered = (STEPS // H) * sum(sizes)
    assert all(lr["payload"] == offered for lr in learners)
    received, sent = (synchronizer["breakdown"][f"{SYNC}/world/{kind}"] for kind in ("push", "pull"))
    assert received["payload"] == 2 * offered
    assert sent["payload"] == 2 * offered  # every merge to both learners, the last ones as they left
    # fragment 0's last merge came as the learners left (they hold it); fragment 1's (taken at
    # step 11) was followed by an inner step
    for learner in learners:
        for index in fragments[0]:
            assert torch.equal(learner["params"][index], synchronizer["global"][index])
        for index in fragments[1]:
            assert not torch.equal(learner["params"][index], synchronizer["global"][index])
    # the run is determined by its offers (a quorum of all, each merge waited for): again, the same
    (tmp_path / "again").mkdir()
    synchronizer_again, *learners_again = spawn_workers(_process, 3, str(tmp_path / "again"), backend=None)
    for ours, theirs in zip(learners, learners_again, strict=True):
        assert ours["losses"] == theirs["losses"]
    for ours, theirs in zip(synchronizer["global"], synchronizer_again["global"], strict=True):
        assert torch.equal(ours, theirs)


def _learner_in_the_window(rank: int, world: int, address: str, go: str) -> list[tuple[int, list[float]]]:  # noqa: ARG001
    """Connect; once told to go, rank 0 offers at once and rank 1 0.3 s later, both reporting
    3 s steps; take the merge; leave."""
    link = HubLink(address, learner=rank, meter=CommMeter())
    while not Path(go).exists():
        time.sleep(0.01)
    time.sleep(0.3 * rank)
    mine = torch.tensor([-2.0, 0.0]) if rank == 0 else torch.tensor([0.0, -2.0])
    link.push({"kind": OFFER, "fragment": 0, "tokens": 100, "steps": 1 if rank == 0 else 4, "step_s": 3.0}, [mine])
    message = link.wait_for(lambda m: m.header.get("kind") == GLOBAL, timeout_s=60)
    link.leave(timeout_s=60)
    return [(message.header["version"], message.tensors[0].tolist())]


def test_a_quorum_of_one_waits_the_grace_window_for_a_learner_a_little_late(tmp_path):
    """The grace window after the quorum: gamma x (tau x step - quorum wait - sync), here
    0.5 x (2 x 3 s - ~0) = ~3 s, takes learner 1's offer 0.3 s after learner 0's into the same
    merge (with gamma 0 it would be the next one: the test above)."""
    sync = FragmentSynchronizer([torch.zeros(2)], [[0]], outer_lr=LR, outer_momentum=MU, quorum=1)
    hub = Hub("127.0.0.1")
    server = threading.Thread(target=serve, args=(hub, sync),
                              kwargs=dict(learners=2, overlap_steps=2, gamma=0.5, idle_timeout_s=60))
    server.start()
    go = tmp_path / "go"
    try:
        def release() -> None:  # once both are connected: their offers' order is then the test's
            while hub.learners() != [0, 1]:
                time.sleep(0.01)
            go.touch()

        releaser = threading.Thread(target=release)
        releaser.start()
        received = spawn_workers(_learner_in_the_window, 2, f"127.0.0.1:{hub.port}", str(go), backend=None)
        server.join(timeout=60)
        releaser.join(timeout=5)
    finally:
        hub.close()
    assert sync.contributors == [[0, 0, 1]]  # one merge, both learners in it
    expected = (-LR * (1 + MU) * torch.tensor([0.8, 0.2]) / math.sqrt(0.68) * 2).tolist()
    assert received == [[(1, pytest.approx(expected))]] * 2
