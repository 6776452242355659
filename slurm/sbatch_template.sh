#!/bin/bash
# Raw sbatch template: one lowcomm training run on 8 nodes x 8 GPUs, for clusters (or users) that
# do not go through submitit (`lowcomm-train cluster=slurm_64gpu` submits by itself).
#
#   sbatch slurm/sbatch_template.sh optimizer=demo model=olmo_1b
#   sbatch --partition=gpu --account=myproj --nodes=2 slurm/sbatch_template.sh optimizer=adamw_ddp
#
# Every argument after the script name is a Hydra override, passed unchanged to
# `python -m lowcomm.cli.train`. Unless one of them chooses the cluster group, `cluster=slurm_64gpu`
# is added, so the config's world size matches the allocation. Partition, account and QoS: give
# them on the sbatch command line or as SBATCH_PARTITION / SBATCH_ACCOUNT / SBATCH_QOS (both win
# over the #SBATCH lines below). Resizing: --nodes on the command line; GPUs per node follow the
# allocation ($SLURM_GPUS_ON_NODE), or $LOWCOMM_PROCS_PER_NODE when set.
#
# Layout: srun starts one torchrun per node; each torchrun starts one worker per GPU, and all of
# them meet at a c10d rendezvous on the first node of the allocation. Under torchrun the CLI
# trains in-process as that worker. lowcomm-torchrun is torchrun ending as lowcomm's launcher
# does: 143 with the workers' checkpoint on SIGTERM, a failed worker's own status (75: peers
# lost, 65: diverged) rather than 1 and a traceback.
#
# Preemption and time limit: SLURM sends USR2 to this script 180 s before the kill; the trap
# below requeues the job (same job id, up to LOWCOMM_MAX_REQUEUES times, default 3). The requeued
# job starts from scratch and the training loop resumes from the run's latest checkpoint, so work
# since that checkpoint is lost: keep train.checkpoint_every short enough.
#
# The job runs in the submission directory with the virtual environment $LOWCOMM_VENV
# (default: .venv there). The log goes to lowcomm-<job id>.out in that directory (appended to
# across requeues).

#SBATCH --job-name=lowcomm
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --mem=0
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR2@180
#SBATCH --output=%x-%j.out
#SBATCH --open-mode=append

set -euo pipefail

cd "${SLURM_SUBMIT_DIR:?run this script with sbatch}"
# shellcheck disable=SC1091
source "${LOWCOMM_VENV:-$SLURM_SUBMIT_DIR/.venv}/bin/activate"

overrides=("$@")
if [[ " ${overrides[*]} " != *" cluster="* ]]; then
    overrides=("cluster=slurm_64gpu" "${overrides[@]}")
fi

procs_per_node=${LOWCOMM_PROCS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
rendezvous_host=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# Derived from the job id so that two jobs sharing a first node do not collide.
rendezvous_port=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
max_requeues=${LOWCOMM_MAX_REQUEUES:-3}

requeue() {
    if ((${SLURM_RESTART_COUNT:-0} < max_requeues)); then
        echo "lowcomm: job $SLURM_JOB_ID is about to be stopped; requeueing it" >&2
        scontrol requeue "$SLURM_JOB_ID"
    else
        echo "lowcomm: job $SLURM_JOB_ID is about to be stopped; already requeued $max_requeues times" >&2
    fi
}
trap requeue USR2

echo "lowcomm: ${SLURM_NNODES} nodes x ${procs_per_node} workers, rendezvous ${rendezvous_host}:${rendezvous_port}," \
    "restart ${SLURM_RESTART_COUNT:-0}, overrides: ${overrides[*]}" >&2

# srun runs in the background because bash only runs a trap between foreground commands.
srun --ntasks-per-node=1 --kill-on-bad-exit=1 \
    lowcomm-torchrun \
    --nnodes="$SLURM_NNODES" \
    --nproc-per-node="$procs_per_node" \
    --rdzv-id="$SLURM_JOB_ID" \
    --rdzv-backend=c10d \
    --rdzv-endpoint="${rendezvous_host}:${rendezvous_port}" \
    --max-restarts=0 \
    -m lowcomm.cli.train "${overrides[@]}" &
srun_pid=$!

# `wait` also returns when the trap has run; keep waiting until srun itself has ended.
status=0
wait "$srun_pid" || status=$?
while kill -0 "$srun_pid" 2>/dev/null; do
    wait "$srun_pid" || status=$?
done
exit "$status"
