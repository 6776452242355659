#!/usr/bin/env bash
# A real single-node SLURM cluster on this machine, for the launcher tests and for trying
# submission scripts without a cluster. Needs root (it runs the daemons as root and may apt-get
# install Debian's slurm-wlm and munge).
#
#   slurm/local_slurm.sh start  [STATE_DIR]   # prints `export SLURM_CONF=...` on stdout
#   slurm/local_slurm.sh status [STATE_DIR]   # exit 0 when running, 3 when not
#   slurm/local_slurm.sh stop   [STATE_DIR]   # cancels jobs, stops every daemon it started
#
#   eval "$(slurm/local_slurm.sh start)" && sinfo
#
# Everything lives in STATE_DIR (default $LOWCOMM_SLURM_DIR, else /tmp/lowcomm-slurm): slurm.conf,
# controller state, slurmd spool, logs, pid files and a private munged socket, so the system's
# own munge and SLURM (if any) are left alone. A fresh start begins with an empty job queue.
# `start` is idempotent: on a running cluster it only waits for the node and prints the export.
#
# Environment knobs: LOWCOMM_SLURM_DIR, LOWCOMM_SLURM_CTLD_PORT (6817), LOWCOMM_SLURM_SLURMD_PORT
# (6818), LOWCOMM_SLURM_START_TIMEOUT (seconds to wait for the node to be idle, 60),
# LOWCOMM_SLURM_FIRST_JOB_ID (the first job's id, 1). Clusters in different state directories can
# run side by side when given different ports and job ids far apart: submitit derives a job's
# rendezvous port (MASTER_PORT) from its id, so two clusters' job 3 would both listen on one port.
#
# Several nodes: LOWCOMM_SLURM_NODES="NAME=ADDRESS=NETNS ..." (the nodes of
# benchmarks/netns.py's node_network) and LOWCOMM_SLURM_CTLD_ADDR (this host's address on their
# network, node_network(login=True)). slurmctld then runs here, on that address, and one slurmd
# per node inside the node's network namespace under the node's hostname (a UTS namespace of its
# own: slurmd finds its NodeName by hostname), each with its own spool, pid and log file (%n).
# The nodes share this machine's CPUs and filesystem; only the network is theirs.
#
# Exit status: 0 success, 4 SLURM cannot be had here (not root, cannot install), 1 other failures.
#
# The node has all CPUs of the machine and no GPUs; the single partition is `debug` (the default),
# without a time limit. Accounting is off, so `sacct` fails (submitit falls back to `squeue`).
# Preemption-friendly: `--signal` is delivered on preemption, and `scontrol requeue` is allowed.
set -euo pipefail

readonly PACKAGES=(slurmctld slurmd slurm-client munge)
readonly MUNGE_KEY=/etc/munge/munge.key

command_name=${1:-}
STATE_DIR=${2:-${LOWCOMM_SLURM_DIR:-/tmp/lowcomm-slurm}}
CTLD_PORT=${LOWCOMM_SLURM_CTLD_PORT:-6817}
SLURMD_PORT=${LOWCOMM_SLURM_SLURMD_PORT:-6818}
START_TIMEOUT_S=${LOWCOMM_SLURM_START_TIMEOUT:-60}
FIRST_JOB_ID=${LOWCOMM_SLURM_FIRST_JOB_ID:-1}
# The lock that the project's package installs take turns on (tests/netns_helpers.py takes it too).
APT_LOCK=/var/lock/lowcomm-apt.lock

CONF="$STATE_DIR/slurm.conf"
MUNGE_DIR="$STATE_DIR/munge"
MUNGE_SOCKET="$MUNGE_DIR/munge.socket"
MUNGE_PID="$MUNGE_DIR/munged.pid"
CTLD_PID="$STATE_DIR/slurmctld.pid"
SLURMD_PID="$STATE_DIR/slurmd.pid"
# name=address=namespace per node; empty: one node, this host
read -r -a NODES <<<"${LOWCOMM_SLURM_NODES:-}"
CTLD_ADDR=${LOWCOMM_SLURM_CTLD_ADDR:-}
LOG_DIR="$STATE_DIR/log"

# stdout carries only the export line (so `eval "$(... start)"` works); everything else is stderr.
log() { echo "local_slurm: $*" >&2; }
die() { log "error: $*"; exit 1; }
# Exit status 4: SLURM cannot be had on this machine at all (callers such as tests skip on it).
unavailable() { log "unavailable: $*"; exit 4; }

# A daemon is ours and alive when its pid file names a live process with the expected command.
# Checking the command guards against a stale pid file whose number the kernel has reused.
alive() {
    local pid_file=$1 expected_comm=$2 pid
    [[ -s $pid_file ]] || return 1
    pid=$(<"$pid_file")
    [[ -r /proc/$pid/comm && $(</proc/"$pid"/comm) == "$expected_comm" ]]
}

pid_of() { cat "$1" 2>/dev/null || true; }

node_field() { local IFS='='; read -r -a parts <<<"$1"; echo "${parts[$2]}"; }  # entry, 0|1|2
node_names() { local entry; for entry in "${NODES[@]}"; do node_field "$entry" 0; done; }
# One slurmd pid file per node (slurm.conf's %n is the node's name), or the one node's.
slurmd_pid_files() {
    local name
    if ((${#NODES[@]} == 0)); then echo "$SLURMD_PID"; return; fi
    for name in $(node_names); do echo "$STATE_DIR/slurmd-$name.pid"; done
}
all_slurmd_alive() {
    local file
    for file in $(slurmd_pid_files); do alive "$file" slurmd || return 1; done
}

ensure_packages() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sinfo >/dev/null \
        && command -v munged >/dev/null; then
        return 0
    fi
    command -v apt-get >/dev/null || unavailable "slurm-wlm is not installed and there is no apt-get"
    log "installing ${PACKAGES[*]} (once)"
    # One apt at a time: apt-get fails at once on a dpkg lock that another holds, and clusters (the
    # suite's two pytest workers start one each) or tests installing iproute2 may start together.
    # Whoever waited finds the packages installed.
    exec {apt_lock}>"$APT_LOCK"
    flock -w 900 "$apt_lock" || unavailable "waited 900 s for $APT_LOCK (another apt-get)"
    if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
        local apt=(env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${PACKAGES[@]}")
        # Refresh the package lists only when installing from the current ones fails (e.g. none yet).
        if ! "${apt[@]}" >&2; then
            apt-get update -q >&2 || unavailable "apt-get update failed (no network?)"
            "${apt[@]}" >&2 || unavailable "apt-get install ${PACKAGES[*]} failed"
        fi
    fi
    exec {apt_lock}>&-
}

ensure_munge_key() {
    if [[ ! -s $MUNGE_KEY ]]; then
        log "creating $MUNGE_KEY"
        install -d -o munge -g munge -m 0700 "$(dirname "$MUNGE_KEY")"
        mungekey --create --keyfile="$MUNGE_KEY"
    fi
    # munged refuses a key that others can read or that it does not own.
    chown munge:munge "$MUNGE_KEY"
    chmod 0600 "$MUNGE_KEY"
}

start_munged() {
    alive "$MUNGE_PID" munged && return 0
    # munged checks that its socket directory belongs to it and is not writable by others.
    install -d -o munge -g munge -m 0755 "$MUNGE_DIR"
    runuser -u munge -- test -x "$MUNGE_DIR" \
        || die "the munge user cannot reach $MUNGE_DIR: choose a state directory whose parents are world-searchable"
    rm -f "$MUNGE_SOCKET" "$MUNGE_SOCKET.lock"
    runuser -u munge -- munged --socket="$MUNGE_SOCKET" --pid-file="$MUNGE_PID" \
        --log-file="$MUNGE_DIR/munged.log" --seed-file="$MUNGE_DIR/munged.seed" --key-file="$MUNGE_KEY"
    munge --socket="$MUNGE_SOCKET" --no-input | unmunge --socket="$MUNGE_SOCKET" >/dev/null \
        || die "munged does not answer on $MUNGE_SOCKET"
}

write_conf() {
    local host cpus real_memory_mb node_addr="" ctld_addr=""
    host=$(hostname -s)
    cpus=$(nproc)
    real_memory_mb=$(awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo)
    # SLURM talks to the node by name; fall back to loopback where the host name does not resolve.
    if ! getent hosts "$host" >/dev/null; then
        node_addr=" NodeAddr=127.0.0.1"
        ctld_addr="(127.0.0.1)"
    fi
    local slurmd_files=slurmd node_lines="" partition_nodes="" partition_options="" entry name address
    if ((${#NODES[@]} > 0)); then
        [[ -n $CTLD_ADDR ]] || die "LOWCOMM_SLURM_NODES needs LOWCOMM_SLURM_CTLD_ADDR (this host's address on their network)"
        ctld_addr="(${CTLD_ADDR})"
        slurmd_files=slurmd-%n
        for entry in "${NODES[@]}"; do
            name=$(node_field "$entry" 0)
            address=$(node_field "$entry" 1)
            node_lines+="NodeName=${name} NodeAddr=${address} CPUs=${cpus} RealMemory=${real_memory_mb} State=UNKNOWN"$'\n'
            partition_nodes+="${partition_nodes:+,}${name}"
            mkdir -p "$STATE_DIR/slurmd_spool/$name"
        done
        # Jobs of a node or less go to the least loaded node, as one-node jobs spread over a real
        # cluster's free nodes (the replica groups of a torchft run: a job per node), rather than
        # filling the first node's cores.
        partition_options=" LLN=YES"
    else
        node_lines="NodeName=${host}${node_addr} CPUs=${cpus} RealMemory=${real_memory_mb} State=UNKNOWN"$'\n'
        partition_nodes=$host
    fi
    mkdir -p "$STATE_DIR/ctld_state" "$STATE_DIR/slurmd_spool" "$LOG_DIR"
    cat >"$CONF" <<EOF
# Written by slurm/local_slurm.sh: a single-node development cluster. Regenerated on every start.
ClusterName=lowcomm-local
FirstJobId=${FIRST_JOB_ID}
SlurmctldHost=${host}${ctld_addr}
SlurmctldPort=${CTLD_PORT}
SlurmdPort=${SLURMD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also sets how long a requeued job waits before it may start again (default 120 s).
AuthInfo=socket=${MUNGE_SOCKET},cred_expire=10

StateSaveLocation=${STATE_DIR}/ctld_state
SlurmdSpoolDir=${STATE_DIR}/slurmd_spool${NODES:+/%n}
SlurmctldPidFile=${CTLD_PID}
SlurmdPidFile=${STATE_DIR}/${slurmd_files}.pid
SlurmctldLogFile=${LOG_DIR}/slurmctld.log
SlurmdLogFile=${LOG_DIR}/${slurmd_files}.log
SlurmctldDebug=info
SlurmdDebug=info

# No cgroups: track job processes through /proc and do not bind tasks (works in containers).
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# Look at pending jobs every 2 s (default 60): a requeued job becomes eligible by the clock, and
# only the periodic pass notices.
SchedulerParameters=sched_interval=2
# Trust the CPU count below even where slurmd detects another topology (SMT, cpusets).
SlurmdParameters=config_overrides
ReturnToService=2

AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none

# Preemption and requeue, as submitit uses them: deliver --signal when a job is preempted,
# allow scontrol requeue, and give tasks a few seconds between SIGTERM and SIGKILL.
SlurmctldParameters=preempt_send_user_signal
JobRequeue=1
KillWait=5
# Keep finished jobs visible to squeue for a while: without accounting that is where submitit
# reads a job's final state.
MinJobAge=300
InactiveLimit=0

${node_lines}PartitionName=debug Nodes=${partition_nodes} Default=YES MaxTime=INFINITE State=UP${partition_options}
EOF
}

show_logs() {
    local file
    for file in "$LOG_DIR/slurmctld.log" "$LOG_DIR"/slurmd*.log "$MUNGE_DIR/munged.log"; do
        [[ -f $file ]] || continue
        log "---- last lines of $file"
        tail -n 25 "$file" >&2
    done
}

# Every node's state on one line ("idle idle"); the least ready decides.
node_state() { SLURM_CONF="$CONF" sinfo --noheader --Node --format=%t 2>/dev/null | tr '\n' ' ' | sed 's/ $//'; }

wait_until_idle() {
    local deadline=$((SECONDS + START_TIMEOUT_S)) state=""
    while ((SECONDS < deadline)); do
        state=$(node_state)
        all_ready "$state" && return 0
        # A node registered but SLURM rejected it: waiting will not help.
        [[ $state =~ (inval|drain|drng) ]] && break
        sleep 0.2
    done
    log "the node did not become idle within ${START_TIMEOUT_S}s (state: '${state:-no answer}')"
    SLURM_CONF="$CONF" sinfo --list-reasons >&2 2>/dev/null || true
    show_logs
    return 1
}

# Every node of the cluster idle, mixed or allocated ("idle*": not responding, does not count).
all_ready() {
    local state ready=0
    for state in $1; do
        case $state in idle | mix | alloc) ready=$((ready + 1)) ;; esac
    done
    ((ready == $(expected_nodes)))
}

expected_nodes() { ((${#NODES[@]})) && echo "${#NODES[@]}" || echo 1; }

# slurmd on this host, or one per node in the node's network namespace under its hostname.
start_slurmds() {
    local entry name namespace
    if ((${#NODES[@]} == 0)); then
        SLURM_CONF="$CONF" slurmd -f "$CONF"
        return
    fi
    for entry in "${NODES[@]}"; do
        name=$(node_field "$entry" 0)
        namespace=$(node_field "$entry" 2)
        # Not `ip netns exec`: it mounts a sysfs of the namespace's own, without the cgroup
        # hierarchy slurmd needs to start. Enter the network namespace, and do the rest of what
        # `ip netns exec` does by hand: the node's /etc/hosts (/etc/netns/<namespace>/hosts, the
        # names of every node) in a mount namespace of its own, and its hostname in a UTS one.
        SLURM_CONF="$CONF" nsenter --net="/run/netns/$namespace" unshare --mount --uts sh -c \
            'mount --bind "/etc/netns/$3/hosts" /etc/hosts && hostname "$1" && exec slurmd -f "$2"' \
            sh "$name" "$CONF" "$namespace" || return 1
    done
}

do_start() {
    [[ $EUID -eq 0 ]] || unavailable "must run as root (it starts slurmctld, slurmd and munged)"
    ensure_packages
    if alive "$CTLD_PID" slurmctld && all_slurmd_alive; then
        log "already running in $STATE_DIR"
    else
        # A half-started cluster (one daemon died) is restarted from scratch.
        do_stop
        ensure_munge_key
        mkdir -p "$STATE_DIR"
        write_conf
        start_munged
        # -c: begin with an empty queue instead of recovering jobs from a previous run.
        SLURM_CONF="$CONF" slurmctld -c -f "$CONF" || { show_logs; do_stop; die "slurmctld did not start"; }
        start_slurmds || { show_logs; do_stop; die "slurmd did not start"; }
    fi
    if ! wait_until_idle; then
        do_stop
        die "cluster start failed"
    fi
    log "$( ((${#NODES[@]})) && echo "nodes $(node_names | paste -sd, -)" || echo "node $(hostname -s)") idle:" \
        "$(nproc) CPUs each, partition debug; state in $STATE_DIR"
    echo "export SLURM_CONF=$CONF"
}

# Wait for a pid to exit; SIGTERM, then SIGKILL, if it outlives the grace period.
reap() {
    local pid=$1 grace_s=$2 deadline
    [[ -n $pid ]] || return 0
    deadline=$((SECONDS + grace_s))
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.1; done
    kill -0 "$pid" 2>/dev/null || return 0
    kill -TERM "$pid" 2>/dev/null || true
    deadline=$((SECONDS + 5))
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.1; done
    kill -0 "$pid" 2>/dev/null || return 0
    log "killing pid $pid"
    kill -KILL "$pid" 2>/dev/null || true
}

unfinished_jobs() { SLURM_CONF="$CONF" squeue --noheader --format=%A 2>/dev/null || true; }

do_stop() {
    local ctld_pid="" slurmd_pids=() munged_pid="" deadline file pid
    alive "$CTLD_PID" slurmctld && ctld_pid=$(pid_of "$CTLD_PID")
    for file in $(slurmd_pid_files); do
        alive "$file" slurmd && slurmd_pids+=("$(pid_of "$file")")
    done
    alive "$MUNGE_PID" munged && munged_pid=$(pid_of "$MUNGE_PID")
    if [[ -n $ctld_pid ]]; then
        # Jobs outlive slurmd by design; cancel them first so no job step is left behind.
        # squeue lists only unfinished jobs (pending, running, completing) by default.
        if ((${#slurmd_pids[@]})) && [[ -n $(unfinished_jobs) ]]; then
            unfinished_jobs | xargs -r env SLURM_CONF="$CONF" scancel 2>/dev/null || true
            deadline=$((SECONDS + 20))
            while [[ -n $(unfinished_jobs) ]] && ((SECONDS < deadline)); do sleep 0.2; done
        fi
        # Shuts down slurmctld and every slurmd it knows of.
        SLURM_CONF="$CONF" scontrol shutdown 2>/dev/null || true
    fi
    reap "$ctld_pid" 10
    for pid in "${slurmd_pids[@]}"; do reap "$pid" 10; done
    if [[ -n $munged_pid ]]; then
        runuser -u munge -- munged --stop --socket="$MUNGE_SOCKET" >/dev/null 2>&1 || true
        reap "$munged_pid" 5
    fi
    rm -f "$CTLD_PID" "$MUNGE_PID" $(slurmd_pid_files)
}

do_status() {
    local name pid_file running=0
    local expected=2 pid_files
    for name in munged slurmctld slurmd; do
        case $name in
            munged) pid_files=$MUNGE_PID ;;
            slurmctld) pid_files=$CTLD_PID ;;
            slurmd) pid_files=$(slurmd_pid_files) && expected=$((expected + $(expected_nodes))) ;;
        esac
        for pid_file in $pid_files; do
            if alive "$pid_file" "$name"; then
                log "$name running (pid $(pid_of "$pid_file"))"
                running=$((running + 1))
            else
                log "$name not running ($pid_file)"
            fi
        done
    done
    if ((running == expected)); then
        SLURM_CONF="$CONF" sinfo >&2 || true
        echo "export SLURM_CONF=$CONF"
        return 0
    fi
    return 3
}

case $command_name in
    start) do_start ;;
    stop)
        [[ $EUID -eq 0 ]] || die "must run as root"
        do_stop
        log "stopped (logs kept in $LOG_DIR)"
        ;;
    status) do_status ;;
    *)
        echo "usage: $0 {start|stop|status} [STATE_DIR]" >&2
        exit 2
        ;;
esac
