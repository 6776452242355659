"""The hub (lowcomm.comm.hub): learners in processes of their own push to one synchronizer and
take what it sends back, each on its own clock; every byte is in a meter, and summed over the
learners and the hub tx equals rx, frame for frame (each frame's size worked out by hand)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from lowcomm.comm.hub import BYE, CONTROL, SYNC, Hub, HubClosed, HubLink, frame, frame_size, read_message
from lowcomm.comm.meter import CommMeter
from lowcomm.comm.spawn import spawn_workers


def _sizes(meter: CommMeter) -> dict[str, int]:
    """Every byte: the tensors' frames (the method's data) and the frames without tensors (the
    hellos, the protocol's own: control)."""
    return {kind: sum(meter.cumulative_bytes(kind, purpose=purpose) for purpose in (SYNC, CONTROL))
            for kind in ("payload", "tx", "rx")}


def test_a_frame_is_its_header_and_tensors_and_reads_back():
    import socket

    tensors = [torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.tensor([1, 2], dtype=torch.int64),
               torch.ones(3, dtype=torch.bfloat16), torch.empty(0)]
    parts = frame({"fragment": 2, "tokens": 4096}, tensors)
    head = json.dumps({"header": {"fragment": 2, "tokens": 4096},
                       "tensors": [["torch.float32", [2, 3]], ["torch.int64", [2]], ["torch.bfloat16", [3]],
                                   ["torch.float32", [0]]]}, separators=(",", ":")).encode()
    # 4 + 8 bytes of lengths, the header, then 24 + 16 + 6 + 0 tensor bytes
    assert frame_size(parts) == 12 + len(head) + 46
    left, right = socket.socketpair()
    with left, right:
        for part in parts:
            left.sendall(part)
        message = read_message(right)
    assert message.header == {"fragment": 2, "tokens": 4096} and message.nbytes == frame_size(parts)
    assert message.payload == 46
    for ours, theirs in zip(message.tensors, tensors, strict=True):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)


def _learner(rank: int, world: int, address: str, rounds: int) -> dict:  # noqa: ARG001 - spawn_workers' signature
    """Push ``rounds`` tensors (rank + round), and wait for each one's answer (twice it)."""
    meter = CommMeter()
    link = HubLink(address, learner=rank, meter=meter)
    answers = []
    for round_ in range(rounds):
        link.push({"round": round_}, [torch.full((1000,), float(rank + round_))])
        reply = link.wait_for(lambda m, r=round_: m.header.get("round") == r, timeout_s=60)
        answers.append(reply.tensors[0][0].item())
    link.flush()
    link.close()
    return {"answers": answers, **_sizes(meter)}


def test_learners_push_and_pull_and_the_bytes_balance():
    hub = Hub("127.0.0.1")
    rounds, learners = 3, 2
    try:
        import threading

        seen: list[tuple[int, dict]] = []

        def serve() -> None:
            answered = 0
            while answered < rounds * learners:
                learner, message = hub.next(timeout=120)
                if message is None or "joined" in message.header:
                    continue
                seen.append((learner, message.header["round"]))
                assert hub.send(learner, message.header, [2 * message.tensors[0]])
                answered += 1

        errors: list[BaseException] = []

        def serving() -> None:
            try:
                serve()
            except BaseException as error:  # noqa: BLE001 - the test's thread reports to the test
                errors.append(error)

        server = threading.Thread(target=serving)
        server.start()
        results = spawn_workers(_learner, learners, f"127.0.0.1:{hub.port}", rounds, backend=None)
        server.join(timeout=60)
        assert not server.is_alive() and errors == []
    finally:
        hub.close()
    for rank, result in enumerate(results):
        assert result["answers"] == [2.0 * (rank + r) for r in range(rounds)]
    assert sorted(seen) == [(m, r) for m in range(learners) for r in range(rounds)]
    for m in range(learners):  # each learner's messages in the order it sent them
        assert [r for learner, r in seen if learner == m] == list(range(rounds))
    hub_sizes = _sizes(hub.meter)
    # conservation: what the learners sent the hub received, and the other way
    assert sum(r["tx"] for r in results) == hub_sizes["rx"]
    assert sum(r["rx"] for r in results) == hub_sizes["tx"]
    # by hand: each push and each answer carries 1,000 float32 (4,000 B) and a header
    head = len(json.dumps({"header": {"round": 0}, "tensors": [["torch.float32", [1000]]]},
                          separators=(",", ":")).encode())
    hello = 12 + len(json.dumps({"header": {"learner": 0}, "tensors": []}, separators=(",", ":")).encode())
    for result in results:
        assert result["payload"] == rounds * 4000
        assert result["tx"] == hello + rounds * (12 + head + 4000)
        assert result["rx"] == rounds * (12 + head + 4000)
    assert hub_sizes["payload"] == learners * rounds * 4000 * 2  # pushes received and answers sent
    # the tensors' frames are the method's data; a hello, the protocol's control
    assert hub.meter.cumulative_bytes("tx", purpose=SYNC) == hub.meter.cumulative_bytes("rx", purpose=SYNC)
    assert hub.meter.cumulative_bytes("rx", purpose=CONTROL) == learners * hello


def test_a_learner_that_goes_is_seen_by_the_hub_alone_and_the_link_says_when_the_hub_goes():
    hub = Hub("127.0.0.1")
    meter = CommMeter()
    first = HubLink(f"127.0.0.1:{hub.port}", learner=0, meter=meter)
    second = HubLink(f"127.0.0.1:{hub.port}", learner=1, meter=CommMeter())
    joined = {hub.next(timeout=10)[0] for _ in range(2)}
    assert joined == {0, 1} and hub.learners() == [0, 1]
    first.close()
    assert hub.next(timeout=10) == (0, None)  # learner 0 gone; 1 still there
    assert hub.learners() == [1] and not hub.send(0, {"x": 1})
    second.push({"still": "here"})
    learner, message = hub.next(timeout=10)
    assert learner == 1 and message.header == {"still": "here"}
    # a learner that starts again connects again under its number
    again = HubLink(f"127.0.0.1:{hub.port}", learner=0, meter=CommMeter())
    assert hub.next(timeout=10)[1].header == {"joined": 0} and hub.learners() == [0, 1]
    hub.close()
    with pytest.raises(HubClosed, match="synchronizer is gone"):
        second.wait_for(lambda _message: True, timeout_s=10)
    again.close()
    # learner 0's first link: its hello, and nothing else
    hello = 12 + len(json.dumps({"header": {"learner": 0}, "tensors": []}, separators=(",", ":")).encode())
    assert meter.cumulative_bytes("tx", purpose=CONTROL) == hello and meter.cumulative_bytes("tx", purpose=SYNC) == 0
    assert _sizes(meter)["rx"] == 0


def test_what_came_before_the_synchronizer_closed_is_still_handed_out():
    # The synchronizer answers a learner's DONE with BYE and may close at once: the learner reads
    # both ends of the stream together, and its leave must see the BYE, not only the close (a
    # fresh-clone CI run of 9039caa failed two resume tests on exactly that).
    hub = Hub("127.0.0.1")
    link = HubLink(f"127.0.0.1:{hub.port}", learner=0, meter=CommMeter())
    assert hub.next(timeout=10)[1].header == {"joined": 0}
    hub.send(0, {"kind": "global", "version": 3}, [torch.ones(4)])
    hub.send(0, {"kind": BYE})
    hub.close()
    while link._connection.closed is False:  # the close has reached the learner's reader
        time.sleep(0.01)
    bye = link.wait_for(lambda m: m.header.get("kind") == BYE, timeout_s=10)
    assert bye.header == {"kind": BYE}
    assert [m.header for m in link.take()] == [{"kind": "global", "version": 3}]
    # once everything is handed out, the end is said
    with pytest.raises(HubClosed, match="synchronizer is gone"):
        link.take()
    with pytest.raises(HubClosed, match="synchronizer is gone"):
        link.wait_for(lambda _m: True, timeout_s=10)
    link.close()
