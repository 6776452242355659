"""``lowcomm-train``: compose the config from Hydra overrides, validate all of it, then launch.

Under torchrun (RANK/WORLD_SIZE set) it runs as one worker in-process.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import textwrap

from lowcomm.paths import config_dir, group_options

EXAMPLES = """\
examples:
  lowcomm-train                                          # tiny model, AdamW-DDP, synthetic data, 4 CPU workers
  lowcomm-train optimizer=demo optimizer.compression_topk=8 train.max_steps=50
  lowcomm-train experiment=quickstart optimizer=diloco optimizer.sync_every=20
  lowcomm-train model=olmo_300m optimizer=demo cluster=slurm_64gpu data=memmap 'data.paths=[/data/*.npy]'
  lowcomm-train optimizer=demo --cfg                     # print the composed config and stop

Every key is checked before a process starts or a job is submitted; a misspelt key or option
is named, with the valid ones. Runs go to <run_root>/<experiment_name>/<run_name>/ (run_name
derived from the config, so a rerun or a requeued job finds its own checkpoints).
"""


def describe_groups() -> str:
    """The config groups and their options, for --help."""
    try:
        groups = group_options()
    except FileNotFoundError as exc:
        return f"config groups: unavailable ({exc})"
    lines = ["config groups (choose one with group=option; see configs/<group>/<option>.yaml):"]
    for group, options in groups.items():
        lines += textwrap.wrap(", ".join(options), width=96, initial_indent=f"  {group:<12} ",
                               subsequent_indent=" " * 15)
    lines.append("  keys: train.*, data.*, model.*, optimizer.*, cluster.*, wandb.*, seed, run_root, label")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lowcomm-train",
        description="Train one run: an OLMo model with one optimizer (DeMo, AdamW-DDP, DiLoCo, ...) on local "
                    "workers or SLURM, every byte sent counted. The configuration is Hydra's tree in "
                    f"{_config_dir_text()}, changed by overrides.",
        epilog=describe_groups() + "\n\n" + EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="Hydra overrides: group=option (optimizer=demo) or key=value (train.max_steps=50)")
    parser.add_argument("--cfg", action="store_true", help="print the validated config as it would run, and exit")
    return parser


def _config_dir_text() -> str:
    try:
        return str(config_dir())
    except FileNotFoundError:
        return "configs/"


class RankEnded(Exception):
    """Under torchrun, this process (one rank) ended other than finished: its exit status
    (:func:`lowcomm.train.worker.run_rank`), its line already printed."""

    def __init__(self, exit_status: int):
        super().__init__(exit_status)
        self.exit_status = exit_status


def run_config(cfg):
    """Validate, then launch according to ``cluster.launcher``; return the run directory."""
    from lowcomm.config import validate
    from lowcomm.distenv import DistEnv

    run = validate(cfg)
    if DistEnv.present():
        from lowcomm.config import ConfigError
        from lowcomm.launch.local import prepare_run_dir
        from lowcomm.train.replicas import REPLICA_GROUP_ENV
        from lowcomm.train.stop import StopFlag
        from lowcomm.train.worker import run_rank

        env = DistEnv.from_environ()
        per_group = run.cluster.fault_tolerance == "torchft" and REPLICA_GROUP_ENV in os.environ
        if env.world_size != run.world_size and not per_group:  # (a replica group's torchrun: group_place)
            # the batch split and every strategy's layout were checked for the config's world
            raise ConfigError([f"this process group has {env.world_size} ranks (WORLD_SIZE) but the config's "
                               f"cluster gives {run.world_size}: set cluster.workers (or nodes x tasks_per_node) "
                               "to match the launcher"])
        # the same life as a worker's (lowcomm.train.worker.run_rank): a stop signal checkpoints
        # at the next boundary, rank 0 holds the run directory's lock while it prepares and trains
        stop = StopFlag.install(signal.SIGINT, signal.SIGTERM)
        code = run_rank(run, env, stop, before=lambda: prepare_run_dir(run))
        if code:
            raise RankEnded(code)
        return run.run_dir
    if run.cluster.launcher == "local":
        from lowcomm.launch.local import launch_local

        return launch_local(run)
    from lowcomm.launch.slurm import submit_run

    return submit_run(run)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    multirun = {"-m", "--multirun"} & set(argv)
    if multirun:  # Hydra's habit: answered with the sweep that does it, not "unrecognized arguments"
        from lowcomm.config.compose import sweep_hint, value_lists

        rest = [a for a in argv if a not in multirun]
        # with a list, name the flag too (alone, the hint's "there is no -m" does)
        named = f"{' / '.join(sorted(multirun, key=len))} (Hydra's multirun) is not lowcomm's: " if value_lists(rest)[0] else ""
        build_parser().exit(2, f"lowcomm-train: {named}{sweep_hint(rest)}\n")
    args = build_parser().parse_intermixed_args(argv)  # overrides before and after --cfg
    # Late imports: --help above answers without loading torch.
    from omegaconf import OmegaConf

    from lowcomm.config import ConfigError, validate
    from lowcomm.config.compose import compose
    from lowcomm.data.memmap import DataError
    from lowcomm.launch.local import Interrupted, WorkerFailure
    from lowcomm.launch.slurm import SlurmUnavailable
    from lowcomm.rundir import CheckpointError, MetricsError
    from lowcomm.runlock import RunDirLocked
    from lowcomm.train.loop import EXIT_DIVERGED, RunDiverged
    from lowcomm.train.peers import EXIT_PEERS_LOST, PeersLost
    from lowcomm.train.worker import describe_failure

    try:
        cfg = compose(args.overrides)
        if args.cfg:  # the config as it would run: validated, defaults resolved (warm-up steps)
            print(OmegaConf.to_yaml(OmegaConf.create(validate(cfg).raw)), end="")
            return 0
        run_dir = run_config(cfg)
    except ConfigError as exc:
        print(f"lowcomm-train: {exc}", file=sys.stderr)
        return 2
    except WorkerFailure as exc:
        if exc.reported:  # the worker printed where the run diverged, and what is kept
            return exc.exit_status
        if exc.detail:  # the first failing rank's traceback, for a cause lowcomm does not know
            print(exc.detail, file=sys.stderr, end="")
        print(f"lowcomm-train: {exc}", file=sys.stderr)
        return exc.exit_status
    except RankEnded as ended:  # under torchrun: a stop signal, a divergence or a lost peer, said
        return ended.exit_status
    except PeersLost as lost:  # under torchrun: this process is one rank
        if lost.reports:
            print(lost.line(), flush=True)
        lost.leave()
        return EXIT_PEERS_LOST
    except RunDiverged as exc:  # a rerun of a run that diverged
        print(exc, flush=True)
        return EXIT_DIVERGED
    except DataError as exc:  # data that does not fit the run: bad input, as a bad config is
        print(f"lowcomm-train: {exc}", file=sys.stderr)
        return 2
    except (SlurmUnavailable, RunDirLocked, MetricsError, CheckpointError) as exc:
        print(f"lowcomm-train: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # a file the run needs or writes: a read-only or full disk, a missing file
        print(f"lowcomm-train: {describe_failure(exc)[0]}", file=sys.stderr)
        return 1
    except Interrupted as exc:
        print(f"lowcomm-train: {exc}", file=sys.stderr)
        return exc.exit_status
    except KeyboardInterrupt:  # composing or validating: nothing was launched
        print("lowcomm-train: interrupted before the run was launched", file=sys.stderr)
        return 130
    from lowcomm.distenv import DistEnv

    if not DistEnv.present() or DistEnv.from_environ().rank == 0:  # under torchrun, once for the run
        print(f"[lowcomm] run directory: {run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
