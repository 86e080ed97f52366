#!/bin/bash
# The SLURM templates' completion check: a job ends COMPLETED only when its run recorded that
# it completed (RUN_DIR/complete.json, written by the trainer's rank 0 at the end of the run).
#
#   check_complete.sh clear PROG RUN_DIR [TRAINER OPTIONS...]          before the launcher
#   check_complete.sh check PROG STATUS RUN_DIR [TRAINER OPTIONS...]   after it; exits with
#                                                                      the job's status
#
# Why: mpirun --with-ft ulfm (LSGD_ON_FAILURE=shrink) exits 0 whatever became of the ranks,
# even when every one of them was SIGKILLed, so its exit status cannot tell a finished run
# from a dead one (docs/cluster.md, "Did the run complete?").
#
# PROG names the template in its lines. RUN_DIR is the template's run directory; a
# --run-dir among the trainer options (the last one) wins over it, as it does in the trainer.
#   clear  removes a record left by an earlier attempt (a requeued job runs again in the same
#          folder), so that the record checked afterwards is this attempt's.
#   check  STATUS is the launcher's exit status. Not 0: exit with it (the trainer's own
#          failure, or a stop on purpose: 143). 0: python -m lsgd_hpc.summary RUN_DIR --check
#          prints the run's summary and whether it completed; complete: exit 0. A run that
#          stopped on purpose (preempted or warned of the time limit: a checkpoint, then exit)
#          exits with the status the trainer meant (0 when it requeued the job, else 143). No
#          record: one line saying so, exit 1, and SLURM marks the job FAILED.
# Environment: LSGD_PYTHON (default python3), which must import lsgd_hpc (PYTHONPATH).

set -euo pipefail

usage() {
    echo "check_complete.sh: usage: check_complete.sh clear PROG RUN_DIR [OPTIONS...]" \
         "| check PROG STATUS RUN_DIR [OPTIONS...]" >&2
    exit 2
}

(($# >= 3)) || usage
mode=$1
prog=$2
shift 2
status=0
if [[ $mode == check ]]; then
    (($# >= 2)) || usage
    status=$1
    shift
    [[ $status =~ ^[0-9]+$ ]] || usage
elif [[ $mode != clear ]]; then
    usage
fi
run_dir=$1
shift

# The run directory the trainer used: the last --run-dir among its options, else RUN_DIR.
help=0
while (($#)); do
    case $1 in
        --run-dir)
            if (($# >= 2)); then
                run_dir=$2
                shift
            fi ;;
        --run-dir=*) run_dir=${1#--run-dir=} ;;
        -h | --help) help=1 ;;
    esac
    shift
done
record=$run_dir/complete.json

if [[ $mode == clear ]]; then
    rm -f -- "$record"
    exit 0
fi

if ((status != 0)); then
    echo "$prog: the launcher exited with status $status" >&2
    exit "$status"
fi
if ((help)); then
    exit 0          # --help: the trainer printed its options, no run
fi
py=${LSGD_PYTHON:-python3}
echo "==== $prog: did the run complete? (python -m lsgd_hpc.summary $run_dir --check)"
if "$py" -m lsgd_hpc.summary "$run_dir" --check; then
    exit 0
fi
# Stopped on purpose: the record's exit status (0: the job requeued itself).
stopped=$("$py" -c 'import sys
from lsgd_hpc.runtime.completion import read_completion
r = read_completion(sys.argv[1]) or {}
if r.get("status") == "stopped":
    print(int(r.get("exit_status", 143)))' "$run_dir" 2> /dev/null || true)
if [[ $stopped =~ ^[0-9]+$ ]]; then
    echo "$prog: the run stopped on purpose ($record); exiting $stopped" >&2
    exit "$stopped"
fi
echo "$prog: error: the run did not record its completion ($record): ranks crashed or" \
     "were killed; exiting 1 so that SLURM marks the job FAILED" >&2
exit 1
