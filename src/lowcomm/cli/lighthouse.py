"""``lowcomm-lighthouse``: the torchft lighthouse of a run whose replica groups are started apart.

Under ``cluster.fault_tolerance=torchft`` the local launcher starts the lighthouse itself, and a
SLURM submission submits it as a job of its own (:class:`lowcomm.launch.slurm.LighthouseJob`). Under
torchrun each replica group is a torchrun of its own (``--standalone``, restarted by its own
``--max-restarts``), told which group it is by ``$LOWCOMM_REPLICA_GROUP``; the groups meet at
this lighthouse, started first on a host they all reach. It serves until stopped (Ctrl-C,
SIGTERM) and writes its address to ``RUN_DIR/torchft.json``, where the groups' workers find it
(``$LOWCOMM_TORCHFT_LIGHTHOUSE`` overrides the record).
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
from pathlib import Path

PROG = "lowcomm-lighthouse"
DESCRIPTION = (
    "The torchft lighthouse of a run whose replica groups are started apart "
    "(cluster.fault_tolerance=torchft under torchrun: each group a lowcomm-torchrun --standalone of its own, "
    "restarted by its own --max-restarts, told its group by $LOWCOMM_REPLICA_GROUP). Start it first, on a host "
    "every group reaches; it serves until Ctrl-C or SIGTERM and writes its address to RUN_DIR/torchft.json, "
    "where the groups' workers find it ($LOWCOMM_TORCHFT_LIGHTHOUSE overrides the record). The local launcher "
    "starts its own, and a SLURM submission a lighthouse job beside its groups' job array.")
STOPS = {signal.SIGINT, signal.SIGTERM}
EXAMPLE = """example, two nodes of 8 GPUs as two replica groups of the run in $RUN (cluster.workers=16
cluster.ranks_per_group=8 cluster.fault_tolerance=torchft run_name=..., its config.yaml prepared):
  login$ lowcomm-lighthouse --record $RUN --min-replicas 1 &
  node0$ LOWCOMM_REPLICA_GROUP=0 lowcomm-torchrun --standalone --nproc-per-node 8 --max-restarts 3 \\
             -m lowcomm.train.worker $RUN/config.yaml
  node1$ LOWCOMM_REPLICA_GROUP=1 lowcomm-torchrun ... (the same)
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION, epilog=EXAMPLE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record", type=Path, metavar="RUN_DIR",
                        help="the run directory: its torchft.json gets this lighthouse's address")
    parser.add_argument("--min-replicas", type=int, default=1,
                        help="the fewest replica groups an exchange commits with (cluster.min_replicas; default 1)")
    parser.add_argument("--join-timeout", type=float, default=10.0,
                        help="seconds a quorum waits for groups beyond the minimum (cluster.join_timeout_s; 10)")
    parser.add_argument("--heartbeat-timeout", type=float, default=5.0,
                        help="seconds a silent group stays a member (5)")
    parser.add_argument("--host", default=socket.gethostname(),
                        help="the name or address the groups reach this host by, in the record (default: hostname)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.min_replicas < 1:
        parser.error(f"--min-replicas must be >= 1, got {args.min_replicas}")
    for name in ("join_timeout", "heartbeat_timeout"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be a positive number of seconds")
    from lowcomm.comm.ft import lighthouse_url, record_lighthouse, start_lighthouse

    # Ctrl-C and SIGTERM wait for sigwait below, in every thread (the lighthouse's inherit the mask)
    signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)
    lighthouse = start_lighthouse(args.min_replicas, args.join_timeout, args.heartbeat_timeout)
    address = lighthouse_url(args.host, lighthouse.address())
    print(f"[lowcomm] lighthouse at {address}: replica groups commit with {args.min_replicas} or more",
          flush=True)
    if args.record is not None:
        path = record_lighthouse(args.record, address, min_replicas=args.min_replicas,
                                 join_timeout_s=args.join_timeout, heartbeat_timeout_s=args.heartbeat_timeout)
        print(f"[lowcomm] recorded in {path}", flush=True)
    stopped = signal.sigwait(STOPS)
    lighthouse.shutdown()
    print(f"[lowcomm] lighthouse stopped ({signal.Signals(stopped).name})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
