#!/bin/bash
# Count the run lines of a sweep file and print the sbatch command that runs them all.
#
#   slurm/submit_sweep.sh FILE [options for every run]
#   MAX_PARALLEL=4 slurm/submit_sweep.sh FILE        (at most 4 array tasks at a time)
#
# Prints e.g. "sbatch --array=0-14 slurm/sweep.sbatch FILE" (the run count on stderr); run
# that from this folder, or in one go: eval "$(slurm/submit_sweep.sh FILE)".
# Exit 2 if FILE is missing or has no run lines.
set -euo pipefail

if (($# < 1)) || [[ $1 == -h || $1 == --help ]]; then
    echo "usage: $0 SWEEP_FILE [trainer options for every run]" >&2
    exit 2
fi
file=$1
shift
if [[ ! -f $file || ! -r $file ]]; then
    echo "submit_sweep.sh: error: no readable sweep file $file" >&2
    exit 2
fi
# The same filter as slurm/sweep.sbatch: blank lines and "#" lines are not runs.
n=$(sed -e 's/\r$//' -e 's/^[[:space:]]*//' -e 's/[[:space:]]*$//' "$file" |
    grep -c -v -e '^#' -e '^$' || true)
if ((n == 0)); then
    echo "submit_sweep.sh: error: $file has no run lines" >&2
    exit 2
fi
array="0-$((n - 1))${MAX_PARALLEL:+%$MAX_PARALLEL}"

# The template's path as the user would type it: relative when it is under this folder.
template=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/sweep.sbatch
case $template in
    "$PWD"/*) template=${template#"$PWD"/} ;;
esac
echo "# $n runs in $file" >&2
printf 'sbatch --array=%s' "$array"
printf ' %q' "$template" "$file" "$@"
printf '\n'
