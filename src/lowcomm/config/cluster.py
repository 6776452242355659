"""SLURM profiles: the checks of a cluster profile's SLURM fields (:func:`cluster_errors`), and
:func:`slurm_profile`, the checked profile of a cluster section.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
from collections.abc import Mapping, Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lowcomm.config.schema import ClusterSpec, ConfigError
from lowcomm.units import parse_bandwidth

# submitit handles SIGTERM and SIGCONT itself (it ignores the TERM that precedes a preemption
# kill); KILL and STOP cannot be caught at all.
_UNUSABLE_SIGNALS = {"TERM", "CONT", "KILL", "STOP"}


def _int_error(key: str, value: Any, minimum: int) -> list[str]:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        return [f"cluster.{key} must be an integer >= {minimum}, got {value!r}"]
    return []


def collective_timeout_errors(cluster: ClusterSpec) -> list[str]:
    """The collective timeout's check, for every launcher (a local run's collectives wait too)."""
    value = cluster.collective_timeout_s
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        return [f"cluster.collective_timeout_s must be a whole number of seconds >= 1 (how long a collective "
                f"waits for its peers before the run stops), got {value!r}"]
    return []


def slowdown_errors(cluster: ClusterSpec) -> list[str]:
    """``cluster.slow_ranks`` and ``cluster.slowdown``: ranks of this run, and a finite factor >= 1,
    on the CPU (where lowcomm stretches a rank's compute for real: :mod:`lowcomm.train.slowdown`)."""
    ranks, factor, world = cluster.slow_ranks, cluster.slowdown, cluster.world_size
    errors = []
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not math.isfinite(factor) or factor < 1:
        errors.append(f"cluster.slowdown must be a factor >= 1 (how many times slower cluster.slow_ranks compute), "
                      f"got {factor!r}")
    if not isinstance(ranks, Sequence) or isinstance(ranks, str):
        return errors + [f"cluster.slow_ranks must be a list of ranks, got {ranks!r}"]
    for rank in ranks:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
            errors.append(f"cluster.slow_ranks: {rank!r} is not a rank of this run (0 ... {world - 1})")
    if len(set(ranks)) != len(ranks):
        errors.append(f"cluster.slow_ranks names a rank twice: {list(ranks)}")
    if not errors and factor != 1 and not ranks:
        errors.append(f"cluster.slowdown is {factor:g} but cluster.slow_ranks names no rank to slow down "
                      "(cluster.slow_ranks=[3])")
    if ranks and factor != 1 and cluster.device == "cuda":
        errors.append("cluster.slowdown is realised on the CPU (a rank's compute measured in CPU time and "
                      "stretched); set cluster.device=cpu, or leave cluster.slow_ranks empty on GPUs")
    return errors


# Set by the program that shaped the nodes' links (benchmarks/wan.py's Nodes: tc on each node's veth),
# or by a person whose links are what the config says: without it a run asking for shaped links is
# refused, since lowcomm's launchers shape none.
LINKS_SHAPED_ENV = "LOWCOMM_LINKS_SHAPED_BY"


def link_errors(cluster: ClusterSpec) -> list[str]:
    """``cluster.link_rate``, ``cluster.slow_link_nodes`` and ``cluster.slow_link_rate``: rates
    that parse, node indices, a slow rate exactly where slow nodes are named, and someone who
    made the links so (``$LOWCOMM_LINKS_SHAPED_BY``). Which nodes exist is known where the links
    are made (:func:`node_link_rates`)."""
    errors = []
    if shaped_links(cluster) and not os.environ.get(LINKS_SHAPED_ENV):
        errors.append("cluster.link_rate / cluster.slow_link_nodes are realised on network-namespace nodes, each "
                      "node's veth shaped with tc as root (benchmarks/stragglers.py and benchmarks/wan.py, whose "
                      f"wan.Nodes sets ${LINKS_SHAPED_ENV}); lowcomm-train's launchers shape no link: leave them "
                      f"unset, or set ${LINKS_SHAPED_ENV} where the links already are what they say")
    for key in ("link_rate", "slow_link_rate"):
        value = getattr(cluster, key)
        if value is not None:
            try:
                parse_bandwidth(value)
            except ValueError as exc:
                errors.append(f"cluster.{key}: {exc}")
    nodes = cluster.slow_link_nodes
    if not isinstance(nodes, Sequence) or isinstance(nodes, str):
        return errors + [f"cluster.slow_link_nodes must be a list of node indices, got {nodes!r}"]
    for node in nodes:
        if isinstance(node, bool) or not isinstance(node, int) or node < 0:
            errors.append(f"cluster.slow_link_nodes: {node!r} is not a node index (0, 1, ...)")
    if len(set(nodes)) != len(nodes):
        errors.append(f"cluster.slow_link_nodes names a node twice: {list(nodes)}")
    if not errors and cluster.launcher == "slurm" and isinstance(cluster.nodes, int):
        errors += _nodes_beyond(nodes, cluster.nodes)
    if bool(nodes) != (cluster.slow_link_rate is not None):
        errors.append("cluster.slow_link_nodes and cluster.slow_link_rate go together: the nodes whose link is "
                      "thinner, and its rate (cluster.slow_link_nodes=[3] cluster.slow_link_rate=10M)")
    return errors


def shaped_links(cluster: ClusterSpec) -> bool:
    """Does the run ask for shaped inter-node links?"""
    return cluster.link_rate is not None or bool(cluster.slow_link_nodes)


def _nodes_beyond(slow: Sequence[int], nodes: int) -> list[str]:
    """The error naming the slow link nodes a run of ``nodes`` nodes does not have, if any."""
    missing = [node for node in slow if node >= nodes]
    return [f"cluster.slow_link_nodes: {missing} not among the run's {nodes} nodes (0 ... {nodes - 1})"] \
        if missing else []


def node_link_rates(cluster: ClusterSpec, nodes: int) -> list[float | None]:
    """Each of ``nodes`` nodes' link rate in bits/s (None: unshaped), as the config asks for it;
    a ConfigError names a slow node the run does not have."""
    if beyond := _nodes_beyond(cluster.slow_link_nodes, nodes):
        raise ConfigError(beyond)
    base = parse_bandwidth(cluster.link_rate) if cluster.link_rate is not None else None
    slow = parse_bandwidth(cluster.slow_link_rate) if cluster.slow_link_rate is not None else None
    return [slow if node in cluster.slow_link_nodes else base for node in range(nodes)]


def fault_tolerance_errors(cluster: ClusterSpec) -> list[str]:
    """``cluster.fault_tolerance`` and its settings (lowcomm.comm.ft): torchft runs each local
    worker as a replica group; the quorum's minimum is a number of those groups."""
    mode = cluster.fault_tolerance
    if mode not in ("none", "torchft"):
        return [f"cluster.fault_tolerance must be one of: none, torchft; got {mode!r}"]
    errors = (_int_error("min_replicas", cluster.min_replicas, minimum=1)
              + _int_error("max_rejoins", cluster.max_rejoins, minimum=0)
              + _int_error("ranks_per_group", cluster.ranks_per_group, minimum=1))
    wait = cluster.join_timeout_s
    if isinstance(wait, bool) or not isinstance(wait, int | float) or not math.isfinite(wait) or wait <= 0:
        errors.append(f"cluster.join_timeout_s must be a positive number of seconds, got {wait!r}")
    if mode == "none" and not errors and cluster.ranks_per_group != 1:
        errors.append(f"cluster.ranks_per_group={cluster.ranks_per_group} groups ranks into replica groups, which "
                      "only cluster.fault_tolerance=torchft has")
    if mode == "none" or errors:
        return errors
    if cluster.launcher == "slurm" and any(_int_error(key, getattr(cluster, key), minimum=1)
                                           for key in ("nodes", "tasks_per_node")):
        return errors  # the SLURM profile's own checks name them
    if cluster.device == "cuda":
        errors.append("cluster.fault_tolerance=torchft exchanges between replica groups over gloo on the CPU: set "
                      "cluster.device=cpu")
    elif cluster.launcher == "slurm" and cluster.ranks_per_group != cluster.tasks_per_node:
        errors.append(f"under SLURM a replica group is a node, a job of its own: set cluster.ranks_per_group="
                      f"{cluster.tasks_per_node} (cluster.tasks_per_node), got {cluster.ranks_per_group}")
    elif cluster.world_size % cluster.ranks_per_group:
        errors.append(f"cluster.workers ({cluster.workers}) must be a multiple of cluster.ranks_per_group "
                      f"({cluster.ranks_per_group}): every replica group has as many ranks")
    elif cluster.min_replicas > cluster.replica_groups:
        errors.append(f"cluster.min_replicas ({cluster.min_replicas}) is more than the run's replica groups "
                      f"({cluster.replica_groups}: {cluster.describe_replica_groups()}): no exchange could ever commit")
    return errors


def every_launcher_errors(cluster: ClusterSpec) -> list[str]:
    """The checks of the fields every launcher reads: the collective timeout, unequal workers and
    links, fault tolerance."""
    return (collective_timeout_errors(cluster) + slowdown_errors(cluster) + link_errors(cluster)
            + fault_tolerance_errors(cluster))


def cluster_errors(cluster: ClusterSpec) -> list[str]:
    """Every problem of a SLURM profile's fields, each naming its key."""
    errors: list[str] = every_launcher_errors(cluster)
    for key in ("nodes", "tasks_per_node", "cpus_per_task", "timeout_min"):
        errors += _int_error(key, getattr(cluster, key), minimum=1)
    for key in ("gpus_per_node", "signal_delay_s", "max_requeues"):
        errors += _int_error(key, getattr(cluster, key), minimum=0)
    if errors:
        return errors  # the checks below compare these numbers
    mem_gb = cluster.mem_gb
    rate = cluster.rank_write_MBps
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not rate > 0:
        errors.append(f"cluster.rank_write_MBps must be a positive number (MB/s one rank writes its checkpoint "
                      f"files at), got {rate!r}")
    if mem_gb is not None and (isinstance(mem_gb, bool) or not isinstance(mem_gb, int | float) or mem_gb < 0):
        errors.append(f"cluster.mem_gb must be a number >= 0 or null, got {mem_gb!r}")
    for key in ("partition", "account", "qos"):
        value = getattr(cluster, key)
        if value is not None and (not isinstance(value, str) or not value):
            errors.append(f"cluster.{key} must be a non-empty string or null, got {value!r}")
    if cluster.gpus_per_node and cluster.tasks_per_node != cluster.gpus_per_node:
        # every rank gets exactly one GPU (lowcomm.distenv.setup_distributed_from_slurm)
        errors.append(
            f"cluster.tasks_per_node ({cluster.tasks_per_node}) must equal cluster.gpus_per_node "
            f"({cluster.gpus_per_node}): lowcomm runs one rank per GPU"
        )
    if cluster.signal_delay_s >= cluster.timeout_min * 60:
        errors.append(
            f"cluster.signal_delay_s ({cluster.signal_delay_s}) must be shorter than the time limit "
            f"(cluster.timeout_min = {cluster.timeout_min} min)"
        )
    signal_name = cluster.signal.removeprefix("SIG") if isinstance(cluster.signal, str) else ""
    if not hasattr(signal, f"SIG{signal_name}") or signal_name in _UNUSABLE_SIGNALS:
        errors.append(f"cluster.signal must name a catchable signal such as USR2, got {cluster.signal!r}")
    setup = cluster.setup
    if not isinstance(setup, Sequence) or isinstance(setup, str) or not all(isinstance(x, str) for x in setup):
        errors.append(f"cluster.setup must be a list of shell lines, got {setup!r}")
    if not isinstance(cluster.additional_parameters, Mapping):
        errors.append(
            f"cluster.additional_parameters must map sbatch options to values, got {cluster.additional_parameters!r}"
        )
    elif "signal" in cluster.additional_parameters:
        errors.append("set cluster.signal and cluster.signal_delay_s, not additional_parameters.signal")
    return errors


def normalised(cluster: ClusterSpec) -> ClusterSpec:
    """A checked profile in canonical form: signal without ``SIG``, plain containers."""
    return dataclasses.replace(
        cluster, signal=cluster.signal.removeprefix("SIG"), setup=tuple(cluster.setup),
        additional_parameters=dict(cluster.additional_parameters),
    )


def slurm_profile(cluster: ClusterSpec | Mapping[str, Any] | Any) -> ClusterSpec:
    """The checked SLURM profile (a :class:`ClusterSpec` with ``launcher="slurm"``) of a cluster
    section: a ClusterSpec, a mapping (dict, Hydra DictConfig) or an object with its attributes.
    Missing fields take their defaults; raises :class:`ConfigError` naming every bad key."""
    names = [f.name for f in dataclasses.fields(ClusterSpec)]
    if isinstance(cluster, DictConfig):
        cluster = OmegaConf.to_container(cluster, resolve=True)
    if isinstance(cluster, Mapping):
        unknown = sorted(set(cluster) - set(names))
        if unknown:
            raise ConfigError([f"cluster.{key} is not a cluster setting; allowed keys: {', '.join(names)}"
                               for key in unknown])
        values = dict(cluster)
    else:
        values = {name: getattr(cluster, name) for name in names if hasattr(cluster, name)}
    values["launcher"] = "slurm"
    spec = ClusterSpec(**values)
    errors = cluster_errors(spec)
    if errors:
        raise ConfigError(errors)
    return normalised(spec)
