#!/bin/bash
# Launch agent for Open MPI / PRRTE, used in place of ssh (--prtemca plm_ssh_agent):
#   agent.sh [ssh-style options] HOST CMD...
# Runs CMD (the PRRTE daemon command line) inside the network namespace that serves HOST,
# in a fresh UTS namespace whose host name is that node's name, so every rank the daemon
# starts sees its own node's socket.gethostname().
#
# The map comes from the environment (inherited from mpirun):
#   LSGD_NETNS_HOSTS="ADDR=NAMESPACE:HOSTNAME,ADDR=NAMESPACE:HOSTNAME,..."
# PATH is inherited as well (ip netns exec keeps the environment), so prted is found in the venv.
set -u
# LSGD_NETNS_TRACE=FILE: append the arguments PRRTE passed (debugging the launch).
if [ -n "${LSGD_NETNS_TRACE:-}" ]; then
    printf 'agent argv:%s\n' "$(printf ' [%s]' "$@")" >> "$LSGD_NETNS_TRACE"
fi
# Skip ssh-style options PRRTE may put before the host name.
while [ $# -gt 0 ]; do
    case "$1" in
        -x|-T|-t|-n|-q) shift ;;
        -o|-p|-l|-i) shift 2 ;;
        *) break ;;
    esac
done
if [ $# -lt 2 ]; then
    echo "agent.sh: usage: agent.sh HOST CMD..." >&2
    exit 2
fi
host=$1; shift
entry=""
IFS=',' read -ra pairs <<< "${LSGD_NETNS_HOSTS:-}"
for p in "${pairs[@]}"; do
    if [ "${p%%=*}" = "$host" ]; then entry=${p#*=}; fi
done
if [ -z "$entry" ]; then
    echo "agent.sh: host $host not in LSGD_NETNS_HOSTS=${LSGD_NETNS_HOSTS:-}" >&2
    exit 2
fi
ns=${entry%%:*}
name=${entry#*:}
# "$*": ssh semantics, the remote side runs the words joined by spaces as one shell command.
exec ip netns exec "$ns" unshare --uts /bin/bash -c 'hostname "$1" && eval "$2"' agent "$name" "$*"
