"""``lowcomm-synchronizer``: the synchronizer of a run whose workers are learners
(``optimizer=decoupled_diloco`` or ``async_diloco``), started apart from them.

The local launcher starts it itself. Under torchrun (or any launcher of your own) start it first,
on a host every learner reaches; it serves until every learner has said it is done and writes its
address to ``RUN_DIR/synchronizer.json``, where the learners find it.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

PROG = "lowcomm-synchronizer"
DESCRIPTION = (
    "The synchronizer of a run of learners (optimizer=decoupled_diloco or async_diloco) started apart from its "
    "learners: it holds the global parameters and the outer optimizer, serves until every learner is done, writes "
    "its address to RUN_DIR/synchronizer.json (where the learners find it; $LOWCOMM_SYNCHRONIZER overrides the "
    "record) and its state as of each checkpoint step to RUN_DIR/synchronizer/. The local launcher starts its own.")
EXAMPLE = """example, 8 learners under torchrun (the run's config.yaml prepared in $RUN):
  login$ lowcomm-synchronizer $RUN/config.yaml --host login &
  node0$ lowcomm-torchrun --standalone --nproc-per-node 8 -m lowcomm.train.worker $RUN/config.yaml
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=DESCRIPTION, epilog=EXAMPLE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="the run's RUN_DIR/config.yaml")
    parser.add_argument("--host", default=socket.gethostname(),
                        help="the name or address the learners reach this host by, in the record (default: hostname)")
    args = parser.parse_args(argv)
    from lowcomm.train.synchronizer import SYNCHRONIZER_HOST_ENV
    from lowcomm.train.synchronizer import main as serve

    os.environ[SYNCHRONIZER_HOST_ENV] = args.host

    return serve([args.config])


if __name__ == "__main__":
    sys.exit(main())
