"""One training process: ``python -m lowcomm.train.worker <run_dir>/config.yaml`` with the
rank and world in its environment (the local launcher, torchrun or a SLURM task sets them)."""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
import warnings

from lowcomm.config import load_run_config, validate
from lowcomm.distenv import DistEnv
from lowcomm.train.loop import EXIT_DIVERGED, train
from lowcomm.train.peers import EXIT_PEERS_LOST, PeersLost
from lowcomm.train.stop import StopFlag

# Set by lowcomm's local launcher, which reports an interruption itself (once, not per rank).
LAUNCHED_LOCALLY = "LOWCOMM_LOCAL_LAUNCHER"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m lowcomm.train.worker RUN_DIR/config.yaml", file=sys.stderr)
        return 2
    env = DistEnv.from_environ()
    if env.rank != 0:
        warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.INFO if env.rank == 0 else logging.WARNING,
                        format="[lowcomm %(name)s] %(message)s")
    # Ctrl-C (SIGINT to the terminal's process group) or SIGTERM (kill, timeout, docker stop,
    # systemd, torchrun stopping its workers): checkpoint at the next step boundary.
    stop = StopFlag.install(signal.SIGINT, signal.SIGTERM)
    run = validate(load_run_config(argv[0]))
    try:
        result = train(run, env, should_stop=stop)
    except PeersLost as lost:
        # one line per node instead of a traceback per rank; a rerun resumes from the checkpoint
        if lost.reports:
            print(lost.line(), flush=True)
        lost.leave()
        return EXIT_PEERS_LOST
    if result.diverged is not None:  # rank 0 has printed the line
        return EXIT_DIVERGED
    if result.preempted:
        if env.rank == 0 and LAUNCHED_LOCALLY not in os.environ:
            print(f"[lowcomm] interrupted ({signal.Signals(stop.received).name}): stopped at step "
                  f"{result.final_step} with a checkpoint in {result.run_dir}; run the same command to resume",
                  flush=True)
        # not finished: the shell's status for the signal, on every rank (one that did not see
        # the signal itself stopped with the others at the same step)
        return 128 + (stop.received or signal.SIGINT)
    return 0


if __name__ == "__main__":
    # Leave with os._exit, skipping the interpreter's teardown: its destructor order (torch's
    # C++ threads against the GIL) can hang a finished worker, and a failed one must exit at
    # once so that the launcher sees it and stops the other ranks.
    try:
        code = main()
    except KeyboardInterrupt:  # Ctrl-C before the stop flag was installed: nothing to save yet
        code = 130
    except BaseException:  # noqa: BLE001 - report, then exit without teardown
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
