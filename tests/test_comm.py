"""The Communicator's collectives are correct and metered with the formulas of lowcomm.comm.meter."""

from __future__ import annotations

import pytest
import torch

from lowcomm.comm import CommMeter, Communicator
from lowcomm.comm.meter import (
    TRAFFIC,
    Traffic,
    chain_broadcast_traffic,
    pairwise_exchange_traffic,
    peer_exchange_traffic,
    ring_inter_node_share,
)
from lowcomm.comm.spawn import spawn_workers


def _exercise(rank: int, world_size: int):
    comm = Communicator()
    reduced = torch.full((10,), float(rank + 1))
    comm.all_reduce(reduced)
    averaged = torch.full((6,), float(rank))
    comm.all_reduce(averaged, op="avg")
    gathered = comm.all_gather(torch.tensor([rank, 10 * rank], dtype=torch.int64))
    scattered = torch.empty(2)
    comm.reduce_scatter(scattered, torch.arange(2.0 * world_size) + rank)
    broadcast = torch.full((5,), float(rank), dtype=torch.float64)
    comm.broadcast(broadcast, src=1)
    per_collective = comm.meter.breakdown(cumulative=False)
    step = comm.meter.end_step()
    return {
        "reduced": reduced, "averaged": averaged, "gathered": torch.stack(gathered), "scattered": scattered,
        "broadcast": broadcast, "per_collective": per_collective, "step": step,
    }


@pytest.mark.slow
def test_collectives_and_their_bytes_on_four_gloo_workers():
    world = 4
    results = spawn_workers(_exercise, world)
    for rank, out in enumerate(results):
        assert torch.equal(out["reduced"], torch.full((10,), 1.0 + 2 + 3 + 4))
        assert torch.allclose(out["averaged"], torch.full((6,), 1.5))
        assert out["gathered"].tolist() == [[r, 10 * r] for r in range(world)]
        expected_chunk = sum(torch.arange(2.0 * world) + r for r in range(world))[2 * rank : 2 * rank + 2]
        assert torch.equal(out["scattered"], expected_chunk)
        assert torch.equal(out["broadcast"], torch.full((5,), 1.0, dtype=torch.float64))

        by = out["per_collective"]
        # ring all-reduce: 2(W-1)/W x payload each way in 2(W-1) sends; two calls, 40 + 24 bytes
        assert by["data/world/all_reduce"] == {"calls": 2, "payload": 64, "tx": 96, "rx": 96, "messages": 12}
        # ring all-gather: every rank forwards all W-1 other messages: (W-1) x payload each way
        assert by["data/world/all_gather"] == {"calls": 1, "payload": 16, "tx": 48, "rx": 48, "messages": 3}
        # reduce-scatter of a 32-byte input on gloo: an all-reduce of it, 2(W-1)/W each way in 2(W-1)
        # sends (NCCL's ring would send (W-1)/W in W-1)
        assert by["data/world/reduce_scatter"] == {"calls": 1, "payload": 32, "tx": 48, "rx": 48, "messages": 6}
        # chain broadcast from rank 1: payload on the source only; all but the tail forward
        is_src, is_tail = rank == 1, rank == 0
        assert by["data/world/broadcast"] == {
            "calls": 1, "payload": 40 if is_src else 0, "tx": 0 if is_tail else 40, "rx": 0 if is_src else 40,
            "messages": 0 if is_tail else 1,
        }
        assert out["step"]["comm/payload_bytes"] == 64 + 16 + 32 + (40 if is_src else 0)
        assert out["step"]["comm/messages"] == 12 + 3 + 6 + (0 if is_tail else 1)
    # summed over the ranks, what is sent is received
    for kind in ("tx", "rx"):
        assert sum(out["step"][f"comm/{kind}_bytes"] for out in results) == sum(
            96 + 48 + 48 + (0 if rank == 0 else 40) for rank in range(world))


def test_single_process_communicator_is_an_identity_with_zero_wire_bytes():
    comm = Communicator()
    assert (comm.rank, comm.world_size) == (0, 1)
    tensor = torch.arange(4.0)
    comm.all_reduce(tensor, op="avg")
    assert torch.equal(tensor, torch.arange(4.0))
    assert torch.equal(comm.all_gather(tensor)[0], tensor)
    step = comm.meter.end_step()
    assert step["comm/payload_bytes"] == 32 and step["comm/tx_bytes"] == 0 and step["comm/rx_bytes"] == 0


def test_meter_cumulative_totals_survive_a_state_dict_round_trip():
    meter = CommMeter()
    meter.record("all_reduce", 100, 150, 150)
    meter.record("all_gather", 10, 10, 30, scope="inter")
    first = meter.end_step()
    assert first["comm/payload_bytes"] == 110 and first["comm/inter_payload_bytes"] == 10
    meter.record("all_reduce", 1, 1, 1, purpose="control")  # a checkpoint barrier: left out
    restored = CommMeter()
    restored.load_state_dict(meter.state_dict())
    assert restored.cumulative_bytes("payload") == 110
    restored.record("all_reduce", 100, 150, 150)
    assert restored.end_step()["comm/cum_payload_MB"] == 210 / 1e6


# ------------------------------------------------------------ the ring, step by step
def simulate(collective: str, payload: int, world: int, src: int = 0) -> list[Traffic]:
    """Per-rank traffic of a collective, from its algorithm written out message by message
    (an independent derivation of the meter's closed forms). Ring: rank r sends to r+1."""
    sent = [[0, 0] for _ in range(world)]  # bytes, messages
    got = [[0, 0] for _ in range(world)]

    def send(frm: int, to: int, size: int) -> None:
        sent[frm][0] += size
        sent[frm][1] += 1
        got[to][0] += size
        got[to][1] += 1

    chunks = [payload // world + (1 if i < payload % world else 0) for i in range(world)]
    if collective == "all_gather":  # step s: rank r forwards the message of rank r - s
        for _step in range(world - 1):
            for rank in range(world):
                send(rank, (rank + 1) % world, payload)
    elif collective in ("reduce_scatter", "all_reduce"):
        phases = 2 if collective == "all_reduce" else 1  # all-reduce = reduce-scatter + all-gather of chunks
        for _phase in range(phases):
            for step in range(world - 1):
                for rank in range(world):
                    send(rank, (rank + 1) % world, chunks[(rank - step) % world])
    elif collective == "broadcast":
        for hop in range(world - 1):
            send((src + hop) % world, (src + hop + 1) % world, payload)
    return [Traffic(sent[r][0], got[r][0], sent[r][1], got[r][1]) for r in range(world)]


def metered(collective: str, payload: int, world: int, src: int = 0) -> list[Traffic]:
    if collective == "broadcast":
        return [chain_broadcast_traffic(payload, world, rank, src) for rank in range(world)]
    return [TRAFFIC[collective](payload, world) for _ in range(world)]


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 7, 8, 64])
@pytest.mark.parametrize("payload", [0, 1, 12, 1000, 1_048_576, 999_983])
def test_summed_over_ranks_every_byte_and_message_sent_is_received(collective, world, payload):
    for src in range(min(world, 3)) if collective == "broadcast" else [0]:
        traffic = metered(collective, payload, world, src)
        assert sum(t.tx for t in traffic) == sum(t.rx for t in traffic)
        assert sum(t.messages for t in traffic) == sum(t.received for t in traffic)
        assert all(t.tx >= 0 and t.rx >= 0 for t in traffic)


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("world", [2, 3, 4, 8, 64])
def test_closed_forms_equal_the_ring_written_out(collective, world):
    # a payload the ring splits evenly: the closed forms are then exact per rank
    payload = 12 * world * 1009
    for src in range(world) if collective == "broadcast" else [0]:
        assert metered(collective, payload, world, src) == simulate(collective, payload, world, src)
    # uneven chunks: per rank the closed form is the mean, summed over ranks within W bytes
    uneven = payload + world // 2 + 1
    exact, formula = simulate(collective, uneven, world), metered(collective, uneven, world)
    assert abs(sum(t.tx for t in exact) - sum(t.tx for t in formula)) <= world
    assert [t.messages for t in exact] == [t.messages for t in formula]


def test_all_gather_sends_w_minus_1_times_the_payload_per_rank():
    # the figure: OLMo-300M, DeMo k=32 at W=64 -> 63 x 29.99 MB = about 1,890 MB per rank
    payload = 29_994_240
    assert TRAFFIC["all_gather"](payload, 64).tx == 63 * payload
    assert 1_889e6 < 63 * payload < 1_891e6


def test_inter_node_share_of_a_ring():
    assert ring_inter_node_share(8, 8) == 0.0  # one node: nothing crosses
    assert ring_inter_node_share(64, 8) == 8 / 64  # one hop out of each of the 8 nodes
    assert ring_inter_node_share(16, 1) == 1.0  # every rank its own node


def test_time_in_flight_counts_overlapping_intervals_once_and_never_a_wait():
    meter = CommMeter()
    meter.in_flight(0.0, 2.0, 2.5)  # in flight 0 -> 2, then blocked in its wait until 2.5
    meter.in_flight(1.0, 3.0, 3.0)  # issued with it: only 2.5 -> 3 is new
    meter.in_flight(0.5, 2.2, 2.2)  # inside what is counted: nothing new
    meter.in_flight(5.0, 6.0, 7.0)
    assert meter.take_in_flight_s() == pytest.approx(2.0 + 0.5 + 1.0)
    assert meter.take_in_flight_s() == 0.0


def _computes_while_in_flight(rank: int, world_size: int) -> tuple[float, float, list[float]]:
    import time

    comm = Communicator()
    out = torch.empty(world_size * 4)
    work = comm.all_gather_into_tensor(out, torch.full((4,), float(rank)), async_op=True)
    time.sleep(0.2)  # this rank's "compute" while its all-gather is in flight
    work.wait()
    in_flight = comm.meter.take_in_flight_s()
    comm.all_reduce(torch.ones(1))  # a blocking collective is never in flight
    return in_flight, comm.meter.take_in_flight_s(), out[::4].tolist()


@pytest.mark.slow
def test_an_async_collective_is_timed_from_its_start_to_its_wait():
    for in_flight, blocking, gathered in spawn_workers(_computes_while_in_flight, 2):
        assert 0.2 <= in_flight < 2.0
        assert blocking == 0.0
        assert gathered == [0.0, 1.0]


# (peers of each rank) at W = 3: a pair beside a rank that sits this round out, then a group of
# three in which every rank exchanges with both others (NoLoCo's odd W)
EXCHANGE_ROUNDS = ({0: [1], 1: [0], 2: []}, {0: [1, 2], 1: [2, 0], 2: [0, 1]})


def _exchange(rank: int, world_size: int) -> list[dict]:  # noqa: ARG001 - spawn_workers' signature
    comm = Communicator()
    rounds = []
    for peers in EXCHANGE_ROUNDS:
        sent = [torch.full((3,), float(rank)), torch.tensor([10 * rank, rank], dtype=torch.int64)]
        received, work = comm.exchange(sent, peers[rank], async_op=True)
        work.wait()
        rounds.append({"received": received, "per_collective": comm.meter.breakdown(cumulative=False),
                       "step": comm.meter.end_step()})
    return rounds


@pytest.mark.slow
def test_point_to_point_exchange_delivers_each_peers_tensors_and_meters_what_crosses():
    results = spawn_workers(_exchange, 3)
    for index, peers in enumerate(EXCHANGE_ROUNDS):
        for rank, out in enumerate(results):
            round_ = out[index]
            # peer k's tensors, in the order this rank named its peers
            assert [[t.tolist() for t in tensors] for tensors in round_["received"]] == [
                [[float(peer)] * 3, [10 * peer, peer]] for peer in peers[rank]]
            # 12 + 16 bytes to each peer, one message per tensor and peer, the same back
            count = len(peers[rank])
            expected = {"calls": 1, "payload": 28, "tx": 28 * count, "rx": 28 * count, "messages": 2 * count}
            assert round_["per_collective"]["data/world/exchange"] == expected
        # summed over ranks, every byte sent is received
        assert (sum(out[index]["step"]["comm/tx_bytes"] for out in results)
                == sum(out[index]["step"]["comm/rx_bytes"] for out in results)
                == 28 * sum(len(p) for p in peers.values()))


def test_an_exchange_names_other_ranks_only():
    comm = Communicator()
    with pytest.raises(ValueError, match="must be other ranks"):
        comm.exchange([torch.zeros(2)], [0])
    with pytest.raises(ValueError, match="outside the group"):
        comm.exchange([torch.zeros(2)], [1])
    assert comm.exchange([torch.zeros(2)], []) == []  # alone: nothing to send, nothing metered on the wire
    assert comm.meter.end_step()["comm/tx_bytes"] == 0


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 7, 64])
def test_pairwise_exchange_per_rank_does_not_grow_with_the_world(world):
    payload = 1000
    # ranks in pairs; an odd W has one group of three, each of whose members sends to two peers
    per_rank = [0] * world if world == 1 else [1] * (world - 3) + [2] * 3 if world % 2 else [1] * world
    sent = [peer_exchange_traffic(payload, peers) for peers in per_rank]
    assert sum(t.tx for t in sent) == sum(t.rx for t in sent)
    averaged = pairwise_exchange_traffic(payload, world)
    assert averaged.tx == sum(t.tx for t in sent) // world
    if world % 2 == 0:
        assert averaged == Traffic(payload, payload, 1, 1)  # one payload each way, whatever W
