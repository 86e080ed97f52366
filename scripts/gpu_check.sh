#!/bin/bash
# One GPU machine, one prepared check: every method on 2 and 4 ranks sharing the GPU, per
# backend, bf16, the collective benchmark on GPU tensors and a ResNet-20 step time per method,
# a worker killed and the survivor going on through torchft's NCCL process groups; ONE JSON
# report. Uses only the working tree and its .venv (no network).
#
#   scripts/gpu_check.sh [--out FILE] [--steps N] [--timeout S] [--budget S] [--dry-run]
#
#   --out FILE    the report [$OUT/gpu_check.json when $OUT is set, else gpu_check.json]
#   --steps N     [200] training steps per run (digits, digits_cnn)
#   --timeout S   [60] seconds each sub-run may take (timeout kills it; recorded)
#   --budget S    [450] seconds for all sub-runs; those that would start later are recorded
#                 as "skipped: budget"
#   --dry-run     check the arguments, list the commands, write the report with every
#                 status "dry-run"; runs nothing
#
# Every sub-run is recorded, failed or not: name, command, status (ok, failed, timeout,
# not available, skipped: ..., dry-run), exit code, seconds, step time and final test
# accuracy (from the run's HDF5 files) and its last log lines. --backend torch, bf16
# (--precision bf16) and diloco/slowmo run only when `python -m lsgd_hpc.train --help` lists
# them ("not available" otherwise); the torchft-* runs (benchmarks/torch_ft_kill_check.py: 2
# workers, one SIGKILLed, kill and shrink only, at most 90 s each, run first) only when torchft
# is installed. The MPI backend is run whether or not the MPI is CUDA-aware (ompi_info and
# mpi4py's MPIX_Query_cuda_support are recorded): without it the failure is what the report
# shows. Exit status: 0 report written, 2 bad arguments.
set -uo pipefail

die() { echo "gpu_check.sh: error: $*" >&2; exit 2; }

ROOT=$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/.." && pwd)
out="" steps=200 timeout_s=60 budget=450 dry=0
while (($#)); do
    case $1 in
        --out) [[ $# -ge 2 && -n $2 ]] || die "--out needs a file"; out=$2; shift 2 ;;
        --out=*) out=${1#*=}; [[ -n $out ]] || die "--out needs a file"; shift ;;
        --steps) [[ $# -ge 2 ]] || die "--steps needs a number"; steps=$2; shift 2 ;;
        --timeout) [[ $# -ge 2 ]] || die "--timeout needs seconds"; timeout_s=$2; shift 2 ;;
        --budget) [[ $# -ge 2 ]] || die "--budget needs seconds"; budget=$2; shift 2 ;;
        --dry-run) dry=1; shift ;;
        -h|--help) sed -n '2,/^set -uo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument $1 (see --help)" ;;
    esac
done
[[ $steps =~ ^[1-9][0-9]*$ ]] || die "--steps $steps: a positive integer"
[[ $timeout_s =~ ^[1-9][0-9]*$ ]] || die "--timeout $timeout_s: a positive integer (seconds)"
[[ $budget =~ ^[1-9][0-9]*$ ]] || die "--budget $budget: a positive integer (seconds)"
if [[ -z $out ]]; then
    if [[ -n ${OUT:-} ]]; then out=$OUT/gpu_check.json; else out=gpu_check.json; fi
fi
out_dir=$(dirname "$out")
[[ -d $out_dir ]] || die "--out $out: folder $out_dir does not exist"

PY=${LSGD_PYTHON:-$ROOT/.venv/bin/python}
[[ -x $PY ]] || PY=$(command -v python3) || die "no python (LSGD_PYTHON, .venv/bin/python)"
MPIRUN=$(dirname "$PY")/mpirun
[[ -x $MPIRUN ]] || MPIRUN=$(command -v mpirun || echo mpirun)
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 HDF5_USE_FILE_LOCKING=FALSE
export PYTHONUNBUFFERED=1 MASTER_ADDR=127.0.0.1
HELPER=$ROOT/scripts/gpu_check_report.py

work=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
records=$work/records.jsonl
: > "$records"
trap 'rm -rf "$work"' EXIT

# What the trainer offers: --algorithm, --backend and --precision choices.
help=$("$PY" -m lsgd_hpc.train --help 2>&1 | tr -s ' \n' ' ')
choices() { sed -n "s/.*$1 {\([^}]*\)}.*/\1/p" <<< "$help" | head -n 1 | tr ',' ' '; }
algos=$(choices --algorithm)
backends=$(choices --backend)
precisions=$(choices --precision)
methods=""
for m in lsgd lsgd-async allreduce easgd local-sgd gossip diloco slowmo; do
    if [[ " $algos " == *" $m "* ]]; then methods+=" $m"; fi
done
t_start=$SECONDS
port=29600

# record NAME STATUS EXIT SECONDS RUN_DIR LOG CMD...
record() {
    local name=$1 status=$2 code=$3 secs=$4 run_dir=$5 log=$6
    shift 6
    "$PY" "$HELPER" record --name "$name" --status "$status" --exit "$code" --seconds "$secs" \
        --run-dir "$run_dir" --log "$log" -- "$@" >> "$records" 2> /dev/null ||
        printf '{"name": "%s", "status": "%s", "error": "helper failed"}\n' "$name" "$status" >> "$records"
}

# run NAME CMD...: under timeout, recorded whatever happens
run() {
    local name=$1
    shift
    local dir=$work/$name log=$work/$name.log
    if ((dry)); then record "$name" dry-run "" 0 "" "" "$@"; echo "[dry-run] $name: $*"; return; fi
    if ((SECONDS - t_start + timeout_s > budget)); then
        record "$name" "skipped: budget" "" 0 "" "" "$@"; return
    fi
    local t0=$SECONDS code status
    timeout -k 10 "$timeout_s" "$@" > "$log" 2>&1
    code=$?
    case $code in 0) status=ok ;; 124|137) status=timeout ;; *) status=failed ;; esac
    record "$name" "$status" "$code" $((SECONDS - t0)) "$dir" "$log" "$@"
    echo "$name: $status ($((SECONDS - t0)) s)" >&2
}

unavailable() { record "$1" "not available" "" 0 "" "" "${@:3}"; echo "$1: not available ($2)" >&2; }

train() {  # NAME NP BACKEND [trainer options...]
    local name=$1 np=$2 backend=$3
    shift 3
    port=$((port + 1))
    run "$name" "$MPIRUN" --oversubscribe --bind-to none -np "$np" -x PYTHONPATH \
        -x OMP_NUM_THREADS -x MASTER_ADDR -x "MASTER_PORT=$port" -x HDF5_USE_FILE_LOCKING \
        "$PY" -m lsgd_hpc.train --device cuda --backend "$backend" --run-dir "$work/$name" \
        --consensus-every 0 "$@"
}

# ---- facts: the GPU, torch, the MPI and whether it is CUDA-aware
run facts "$PY" "$HELPER" facts
run ompi_cuda_support sh -c "ompi_info --parsable --all 2>&1 | grep mpi_built_with_cuda_support:value || echo 'no ompi_info or no such line'"

# ---- torchft's process groups over NCCL (the engine of --backend torch --on-failure shrink):
# a lighthouse, 2 replica groups of torchft's own DDP on the GPU(s) (one GPU: each its own
# NCCL_HOSTID), the second SIGKILLed from outside at step 100, the survivor finishing its 300
# steps in a quorum of 1; through ProcessGroupBabyNCCL and ProcessGroupNCCL. Then the same kill
# with lsgd_hpc's trainer on the GPU (--backend torch --on-failure heal, allreduce): the killed
# worker started again at once (as torchrun --max-restarts) joins, and both end at the last
# step. At most 3 x 90 s.
# (The check's own --timeout ends its workers, whose sessions are their own, before timeout
# ends the check.)
ft_timeout=90
ft_check=$ROOT/benchmarks/torch_ft_kill_check.py
ft_runs="torchft-baby-nccl-kill torchft-nccl-kill torchft-trainer-heal"
if "$PY" -c "import torchft.manager" > /dev/null 2>&1; then
    for pg in baby-nccl nccl; do
        timeout_s=$ft_timeout run "torchft-$pg-kill" "$PY" "$ft_check" --device cuda --pg "$pg" \
            --workers 2 --steps 300 --kill-at 100 --failure-timeout 5 \
            --timeout $((ft_timeout - 25))
    done
    timeout_s=$ft_timeout run torchft-trainer-heal "$PY" "$ft_check" --device cuda \
        --trainer allreduce --heal --straggler-s 0.02 --workers 2 --steps 1500 --kill-at 100 \
        --failure-timeout 5 --timeout $((ft_timeout - 25))
else
    for name in $ft_runs; do unavailable "$name" "torchft is not installed in $PY"; done
fi

# ---- every method x ranks x backend, digits
for backend in torch mpi; do
    for np in 2 4; do
        for m in $methods; do
            name=train-$m-np$np-$backend
            if [[ " $backends " != *" $backend "* ]]; then
                unavailable "$name" "--backend $backend not in lsgd_hpc.train --help"
                continue
            fi
            train "$name" "$np" "$backend" --algorithm "$m" --dataset digits --max-steps "$steps" \
                --eval-every "$steps"
        done
    done
done
gpu_backend=mpi
if [[ " $backends " == *" torch "* ]]; then gpu_backend=torch; fi

# ---- bf16, 2 ranks
for m in $methods; do
    name=bf16-$m-np2-$gpu_backend
    if [[ " $precisions " != *" bf16 "* ]]; then
        unavailable "$name" "--precision bf16 not in lsgd_hpc.train --help"
        continue
    fi
    train "$name" 2 "$gpu_backend" --algorithm "$m" --dataset digits --max-steps "$steps" \
        --eval-every "$steps" --precision bf16
done

# ---- collectives on GPU tensors (lsgd_hpc vs raw mpi4py), 2 and 4 ranks
for np in 2 4; do
    run "collectives-np$np-cuda" "$MPIRUN" --oversubscribe --bind-to none -np "$np" -x PYTHONPATH \
        -x OMP_NUM_THREADS "$PY" "$ROOT/benchmarks/collectives.py" --device cuda --quick \
        --out "$work/collectives-np$np-cuda.json"
done

# ---- ResNet-20 on CIFAR-shaped synthetic data: step time per method, 4 ranks
for m in $methods; do
    train "resnet20-$m-np4-$gpu_backend" 4 "$gpu_backend" --algorithm "$m" --dataset synthetic \
        --model resnet20 --max-steps 60 --eval-every 60
done

# ---- the report
"$PY" "$HELPER" report --records "$records" --out "$out" --dry-run "$dry" \
    --methods "$methods" --backends "$backends" --precisions "$precisions" \
    --steps "$steps" --timeout "$timeout_s" --budget "$budget" --seconds $((SECONDS - t_start)) ||
    die "could not write the report $out"
echo "gpu_check.sh: report in $out" >&2
exit 0
