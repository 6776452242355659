#!/usr/bin/env bash
# Every GPU row of lowcomm's speed targets, in one prepared run on one GPU, within 8 minutes
# (the four limits below sum to 470 s).
#
#   bash benchmarks/gpu_targets.sh OUT            # on a machine with one GPU; writes OUT/*.log
#   bash benchmarks/gpu_targets.sh OUT --smoke    # the same commands on this machine's CPU, tiny shapes
#
# In order, each under its own time limit (a command that reaches it ends its log with rc=124;
# every row is printed as soon as it is measured, so a cut-short log still holds what it got):
#   1. senders_300m.log (80 s), senders_1b.log (50 s): benchmarks/senders.py, every method's
#      receiving side at W = 1, 8 and 64 on OLMo-300M's shapes, then DeMo's on OLMo-1B's at
#      W = 1 and 64;
#   2. targets.log (250 s): benchmarks/targets.py, the optimizer row, the senders row and the
#      300M and 1B training rows (AdamW-DDP and DeMo compiled, bf16 weights; each model's peak
#      memory, the 1B checkpoint's write time);
#   3. others.log (90 s): every other method's 300M training step against AdamW-DDP's (eager,
#      bf16 weights, all in one worker process).
# environment.txt records the device, driver and versions. The pages of results/gpu/ are
# written from these logs.
set -u
out=${1:?usage: bash benchmarks/gpu_targets.sh OUT [--smoke]}
smoke=${2:-}
here=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python}
[ -x "$here/.venv/bin/python" ] && python=${PYTHON:-$here/.venv/bin/python}
mkdir -p "$out" && out=$(cd "$out" && pwd)  # absolute: the commands run from the checkout
cd "$here" || exit 1

if [ "$smoke" = "--smoke" ]; then
    senders_300m=(--device cpu --model tiny --workers 1 4 --steps 1)
    senders_1b=(--device cpu --model tiny --methods demo --workers 1 4 --steps 1)
    targets=(--device cpu --smoke --steps 1 --repeats 1)
elif [ -n "$smoke" ]; then
    echo "gpu_targets.sh: the second argument is --smoke or nothing, got $smoke" >&2
    exit 2
else
    senders_300m=(--device cuda --model olmo_300m --workers 1 8 64 --steps 5)
    senders_1b=(--device cuda --model olmo_1b --methods demo --workers 1 64 --steps 3)
    targets=(--device cuda --threads 8 --repeats 1 --steps 3)
fi

run() {  # name, seconds, command...: its output to OUT/name.log, the log's tail here
    local name=$1 limit=$2
    shift 2
    echo "=== $name: $* (limit ${limit} s)"
    echo "=== $name: $* (limit ${limit} s)" > "$out/$name.log"
    local began=$SECONDS
    timeout -k 15 "$limit" "$@" >> "$out/$name.log" 2>&1  # (SIGKILL 15 s after, if SIGTERM is not enough)
    local rc=$?
    echo "=== rc=$rc after $((SECONDS - began)) s" >> "$out/$name.log"
    tail -n +2 "$out/$name.log" | tail -n 30  # (its first line, the command, is printed above)
}

{
    date -u +"%Y-%m-%d %H:%M:%S UTC"
    git log -1 --format="lowcomm %h %s" 2>/dev/null
    command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    "$python" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'device',
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none')"
    nproc
} > "$out/environment.txt" 2>&1

run senders_300m 80 "$python" benchmarks/senders.py "${senders_300m[@]}"
run senders_1b 50 "$python" benchmarks/senders.py "${senders_1b[@]}"
run targets 250 "$python" benchmarks/targets.py "${targets[@]}" train.param_dtype=bf16 \
    --rows optimizer senders training_300m training_1b
run others 90 "$python" benchmarks/targets.py "${targets[@]}" train.param_dtype=bf16 --rows others
echo "gpu_targets.sh: the logs are in $out"
