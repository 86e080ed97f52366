#!/bin/bash
# An emulated cluster on one Linux machine: N "nodes" that are network namespaces on a bridge,
# each with its own host name, an optional link rate limit, and (unless --no-slurm) a real
# SLURM: munge, slurmctld in the root namespace and one slurmd per node.  Needs root.
#
#   scripts/cluster.sh up     [--name P] [--nodes N] [--extra-nodes E] [--cpus C] [--rate RATE]
#                             [--subnet A.B.C]
#                             [--no-slurm] [--ctld-port PORT] [--slurmd-port PORT]
#                             [--cred-expire S] [--burst SIZE]
#   scripts/cluster.sh down   [--name P]          stop and delete exactly what `up` made
#   scripts/cluster.sh status [--name P]          exit 0 when up and every node is healthy
#   scripts/cluster.sh env    [--name P]          KEY=VALUE lines (shell-sourceable), see below
#   scripts/cluster.sh mpirun-args [--name P] [--ranks-per-node K]
#                             mpirun options that start K ranks on each node (one line:
#                             --host with K slots each and --map-by ppr:K:node, which wins
#                             over a mapping policy in the environment); with
#                             more ranks than the machine has cores, waiting ranks yield
#                             the core (--mca mpi_yield_when_idle 1)
#   scripts/cluster.sh install [--no-slurm]       install what `up` needs when it is missing
#                             (up does it too), one install at a time on this machine
#   scripts/cluster.sh exec   [--name P] NODE CMD...   run CMD inside a node (its network,
#                             host name and /etc/hosts), NODE a node name or address
#   scripts/cluster.sh agent  [--name P] [ssh options] HOST CMD...
#                             the launch agent mpirun uses in place of ssh (see mpirun-args)
#
# Options (defaults in brackets):
#   --name P        [lsgd] prefix of every name: namespaces and host names P-node0..P-node(N-1),
#                   bridge P-br, veths P-vI, state folder /run/lsgd-cluster/P.  Two clusters
#                   with different names (and subnets and --ctld-port) coexist.  1-10
#                   characters, lower-case letters and digits, starting with a letter.
#   --nodes N       [2] nodes;  --cpus C [16] CPUs each node declares to SLURM (may exceed the
#                   machine's cores: ranks share them)
#   --extra-nodes E [0] E more nodes (P-nodeN..): SLURM's default partition P holds the first N
#                   nodes, a second partition P-all every node, so jobs that do not name it
#                   land on the first N as before and a job that needs more asks for them
#                   (sbatch -p P-all --nodes 3: a job with a spare node)
#   --rate RATE     [none] tc tbf limit on what each node sends, e.g. 1gbit, 10gbit, 500mbit;
#                   --burst SIZE [max(256kb, 2 ms at RATE)] its bucket
#   --subnet A.B.C  [10.77.0] the bridge (and slurmctld) is A.B.C.1, node I is A.B.C.(10+I)
#   --no-slurm      namespaces, host names and rate limits only (for mpirun-only benchmarks)
#   --ctld-port     [first free from 6817] slurmctld's port in the root namespace
#   --slurmd-port   [6818] slurmd's port (inside each node's namespace)
#   --cred-expire S [15] munge credential lifetime; also how long a requeued job waits before
#                   it can start again (SLURM's default 120 s makes tests slow)
#
# `env` prints: CLUSTER_NAME, CLUSTER_STATE (the state folder), CLUSTER_NODES (names, blank
# separated), CLUSTER_ADDRS (addresses, same order), CLUSTER_SUBNET (A.B.C.0/24),
# CLUSTER_BRIDGE, CLUSTER_CPUS, CLUSTER_RATE, CLUSTER_SLURM (1 or 0), CLUSTER_AGENT (the launch
# agent's path), CLUSTER_VETHS (the nodes' veths on the bridge, root namespace) and, with SLURM,
# SLURM_CONF (export it, then sbatch/srun/salloc/squeue/scontrol talk to this cluster) and
# CLUSTER_JOBCOMP (one line per finished job: id, state, start and end time, exit code); and
# OMPI_MCA_coll='^han,xhc,acoll': Open MPI's node-aware collectives (han) hang or crawl across
# these nodes (all on one machine), so mpirun inside an allocation needs them off, as
# mpirun-args turns them off (srun --mpi=pmix jobs run either way).
#
# Use:
#   scripts/cluster.sh up --nodes 2 && eval "$(scripts/cluster.sh env | sed 's/^/export /')"
#   sbatch --nodes=2 --ntasks-per-node=2 --cpus-per-task=1 slurm/lsgd_cifar.sbatch --dataset digits
#   mpirun $(scripts/cluster.sh mpirun-args --ranks-per-node 2) -np 4 python -m lsgd_hpc.train
#   scripts/cluster.sh down
#
# Inside a node, a program sees the node's name as its host name, the node's address only,
# and /etc/hosts naming every node and the controller; files are shared with the machine.
# The packages (Debian/Ubuntu: slurm-wlm munge libpmix2 libpmix-dev) are installed with
# apt-get when missing, one install at a time on the machine: the check and the install hold
# the lock file /run/lsgd-cluster/install.lock (flock; $LSGD_CLUSTER_INSTALL_LOCK overrides
# it), and apt-get waits up to 300 s for dpkg's own lock.  `down` kills the daemons by the PIDs `up` recorded, then whatever
# still runs in the nodes' namespaces, and deletes the namespaces, veths and bridge; nothing
# else is touched.
# shellcheck disable=SC2016  # single-quoted programs get their arguments as $1, $2
set -euo pipefail

readonly STATE_ROOT=/run/lsgd-cluster
SCRIPT=$(readlink -f "${BASH_SOURCE[0]}")
readonly SCRIPT
readonly PACKAGES=(slurm-wlm munge libpmix2 libpmix-dev)

die() {
    echo "cluster.sh: error: $*" >&2
    exit 2
}
say() { echo "cluster.sh: $*" >&2; }

usage() {
    sed -n '2,/^set -euo/p' "$SCRIPT" | sed -e '$d' -e 's/^# \{0,1\}//'
    exit "${1:-0}"
}

# ---------------------------------------------------------------------------------- options
name=lsgd nodes=2 extra_nodes=0 cpus=16 rate="" burst="" subnet=10.77.0 slurm=1
ctld_port="" slurmd_port=6818 cred_expire=15 ranks_per_node=1

(($#)) || usage 2
cmd=$1
shift
case $cmd in -h|--help|help) usage 0 ;; esac

parse_common() {  # the options of every command; leaves the rest in ARGS
    ARGS=()
    while (($#)); do
        case $1 in
            --name) name=${2:?--name needs a value}; shift 2 ;;
            --name=*) name=${1#*=}; shift ;;
            --nodes) nodes=${2:?}; shift 2 ;;             --nodes=*) nodes=${1#*=}; shift ;;
            --extra-nodes) extra_nodes=${2:?}; shift 2 ;; --extra-nodes=*) extra_nodes=${1#*=}; shift ;;
            --cpus) cpus=${2:?}; shift 2 ;;               --cpus=*) cpus=${1#*=}; shift ;;
            --rate) rate=${2:?}; shift 2 ;;               --rate=*) rate=${1#*=}; shift ;;
            --burst) burst=${2:?}; shift 2 ;;             --burst=*) burst=${1#*=}; shift ;;
            --subnet) subnet=${2:?}; shift 2 ;;           --subnet=*) subnet=${1#*=}; shift ;;
            --ctld-port) ctld_port=${2:?}; shift 2 ;;     --ctld-port=*) ctld_port=${1#*=}; shift ;;
            --slurmd-port) slurmd_port=${2:?}; shift 2 ;; --slurmd-port=*) slurmd_port=${1#*=}; shift ;;
            --cred-expire) cred_expire=${2:?}; shift 2 ;; --cred-expire=*) cred_expire=${1#*=}; shift ;;
            --ranks-per-node) ranks_per_node=${2:?}; shift 2 ;;
            --ranks-per-node=*) ranks_per_node=${1#*=}; shift ;;
            --no-slurm) slurm=0; shift ;;
            -h|--help) usage 0 ;;
            --) shift; ARGS+=("$@"); break ;;
            *) ARGS+=("$1"); shift ;;
        esac
    done
    [[ $name =~ ^[a-z][a-z0-9]{0,9}$ ]] ||
        die "--name $name: 1-10 lower-case letters and digits, starting with a letter"
    STATE=$STATE_ROOT/$name
}

# The agent's options are ssh's, which must reach it untouched: only --name is ours.
if [[ $cmd == agent ]]; then
    if [[ ${1:-} == --name ]]; then name=$2; shift 2; fi
    if [[ ${1:-} == --name=* ]]; then name=${1#*=}; shift; fi
    parse_common
    ARGS=("$@")
else
    parse_common "$@"
fi

need_root() {
    ((EUID == 0)) || die "$cmd needs root (network namespaces, bridges and daemons); euid is $EUID"
}

# ------------------------------------------------------------------------------ state files
# $STATE/cluster.env   what `env` prints
# $STATE/made          one line per thing made, in order: "netns NAME", "link NAME",
#                      "pid PID COMM" (a process to stop); `down` undoes it bottom-up
# $STATE/nodes/NODE/   holder.pid, slurmd spool, tmp and log of that node

record() { echo "$*" >> "$STATE/made"; }

load_env() {
    [[ -f $STATE/cluster.env ]] || { echo "cluster.sh: no cluster named $name is up ($STATE/cluster.env missing)" >&2; exit 1; }
    # shellcheck disable=SC1091
    source "$STATE/cluster.env"
}

node_names() { local i; for ((i = 0; i < nodes; i++)); do printf '%s\n' "$name-node$i"; done; }

# ---------------------------------------------------------------------------------- helpers
pid_is() {  # PID COMM: the process PID is alive and is the program COMM (not a reused pid)
    [[ -r /proc/$1/comm ]] && [[ $(cat "/proc/$1/comm" 2> /dev/null) == "$2" ]]
}

stop_pid() {  # PID COMM: SIGTERM, up to 5 s, then SIGKILL
    local pid=$1 comm=$2 i
    pid_is "$pid" "$comm" || return 0
    kill -TERM "$pid" 2> /dev/null || true
    for ((i = 0; i < 50; i++)); do
        pid_is "$pid" "$comm" || return 0
        sleep 0.1
    done
    kill -KILL "$pid" 2> /dev/null || true
}

rate_bytes() {  # tc rate (e.g. 1gbit, 500mbit, 100kbit, 2gbps) -> bytes per second
    local r=${1,,} n unit
    [[ $r =~ ^([0-9]+)(bit|kbit|mbit|gbit|tbit|bps|kbps|mbps|gbps)$ ]] ||
        die "--rate $1: a number and a unit of tc (bit kbit mbit gbit, or bps kbps mbps gbps)"
    n=${BASH_REMATCH[1]} unit=${BASH_REMATCH[2]}
    case $unit in
        bit) echo $((n / 8)) ;; kbit) echo $((n * 125)) ;; mbit) echo $((n * 125000)) ;;
        gbit) echo $((n * 125000000)) ;; tbit) echo $((n * 125000000000)) ;;
        bps) echo "$n" ;; kbps) echo $((n * 1000)) ;; mbps) echo $((n * 1000000)) ;;
        gbps) echo $((n * 1000000000)) ;;
    esac
}

packages_present() {  # 0 when SLURM, munge and the unversioned libpmix.so are installed
    local b
    for b in slurmctld slurmd munged mungekey sinfo; do command -v "$b" > /dev/null || return 1; done
    # srun --mpi=pmix loads the unversioned libpmix.so, which only libpmix-dev provides.
    ldconfig -p 2> /dev/null | grep -q 'libpmix\.so '
}

# One install at a time on this machine: two `up`s started together (two pytest workers, two
# engineers) must not both run apt-get, since one of them would lose dpkg's lock and fail.
# The whole check-and-install holds $INSTALL_LOCK (flock); whoever waited checks again and
# finds the packages installed.  apt-get itself also waits up to 300 s for dpkg's own lock
# (DPkg::Lock::Timeout), which an apt run outside this script (unattended-upgrades) may hold.
readonly INSTALL_LOCK=${LSGD_CLUSTER_INSTALL_LOCK:-$STATE_ROOT/install.lock}
readonly INSTALL_WAIT_S=900
readonly APT_OPTS=(-o DPkg::Lock::Timeout=300 -y -q)

ensure_packages() {
    local missing=() b
    for b in ip tc nsenter unshare; do command -v "$b" > /dev/null || missing+=("$b"); done
    ((${#missing[@]} == 0)) || die "missing ${missing[*]} (Debian: apt-get install iproute2 util-linux)"
    ((slurm)) || return 0
    packages_present && return 0
    command -v apt-get > /dev/null ||
        die "SLURM, munge or libpmix missing and no apt-get: install ${PACKAGES[*]} (or your distribution's equivalents)"
    command -v flock > /dev/null || die "no flock (Debian: apt-get install util-linux)"
    local lock_dir log fd
    lock_dir=$(dirname "$INSTALL_LOCK")
    log=$lock_dir/apt-$name.log
    mkdir -p "$lock_dir"
    exec {fd}>> "$INSTALL_LOCK" || die "cannot open the install lock $INSTALL_LOCK"
    if ! flock -n "$fd"; then
        say "waiting for another install of ${PACKAGES[*]} ($INSTALL_LOCK)"
        flock -w "$INSTALL_WAIT_S" "$fd" ||
            die "another install of ${PACKAGES[*]} held $INSTALL_LOCK for over $INSTALL_WAIT_S s"
    fi
    if packages_present; then
        say "${PACKAGES[*]}: installed meanwhile by another cluster.sh"
        exec {fd}>&-
        return 0
    fi
    say "installing ${PACKAGES[*]} (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get "${APT_OPTS[@]}" install "${PACKAGES[@]}" > "$log" 2>&1; then
        apt-get -o DPkg::Lock::Timeout=300 -q update >> "$log" 2>&1 || true
        apt-get "${APT_OPTS[@]}" install "${PACKAGES[@]}" >> "$log" 2>&1 || {
            exec {fd}>&-
            die "apt-get install ${PACKAGES[*]} failed; see $log"
        }
    fi
    exec {fd}>&-
    packages_present || die "apt-get installed ${PACKAGES[*]}, but slurmctld, slurmd, munged, mungekey, sinfo or libpmix.so is still missing; see $log"
}

free_port() {  # the first TCP port from $1 nobody listens on in this namespace
    local p=$1
    while ss -Htln "sport = :$p" | grep -q .; do p=$((p + 1)); done
    echo "$p"
}

wait_for() {  # SECONDS CMD...: poll CMD every 0.2 s until it succeeds
    local limit=$1 t0=$SECONDS
    shift
    until "$@" > /dev/null 2>&1; do
        ((SECONDS - t0 < limit)) || return 1
        sleep 0.2
    done
}

# Enter a node: its network, UTS (host name) and mount (/etc/hosts) namespaces, which its
# holder process keeps alive; the working folder is kept when it exists inside.
node_enter() {  # NODE CMD...
    local node=$1 pid
    shift
    pid=$(cat "$STATE/nodes/$node/holder.pid" 2> /dev/null) || die "no node $node in cluster $name"
    pid_is "$pid" sleep || die "node $node of cluster $name is down (holder $pid gone)"
    exec nsenter -t "$pid" --net --uts --mount -- /bin/sh -c 'cd "$1" 2> /dev/null || cd /; shift; exec "$@"' \
        node "$PWD" "$@"
}

node_of() {  # a node name or address -> the node name
    local want=$1 i
    # shellcheck disable=SC2206
    local names=($CLUSTER_NODES) addrs=($CLUSTER_ADDRS)
    for i in "${!names[@]}"; do
        if [[ $want == "${names[i]}" || $want == "${addrs[i]}" ]]; then
            echo "${names[i]}"
            return 0
        fi
    done
    return 1
}

# ---------------------------------------------------------------------------------------- up
write_slurm_conf() {
    local ctl_host=$1 i
    : > "$STATE/plugstack.conf"
    {
        echo "# Written by scripts/cluster.sh for the emulated cluster $name."
        echo "ClusterName=$name"
        echo "SlurmctldHost=$ctl_host($subnet.1)"
        echo "SlurmctldPort=$ctld_port"
        echo "SlurmdPort=$slurmd_port"
        echo "SlurmUser=root"
        echo "SlurmdUser=root"
        echo "AuthType=auth/munge"
        echo "CredType=cred/munge"
        # cred_expire: also the pause before a requeued job may start again.
        echo "AuthInfo=socket=$STATE/munge/munge.socket,cred_expire=$cred_expire"
        echo "StateSaveLocation=$STATE/ctld"
        echo "SlurmctldPidFile=$STATE/ctld/slurmctld.pid"
        echo "SlurmctldLogFile=$STATE/slurmctld.log"
        echo "SlurmdSpoolDir=$STATE/nodes/%n/spool"
        echo "SlurmdPidFile=$STATE/nodes/%n/slurmd.pid"
        echo "SlurmdLogFile=$STATE/nodes/%n/slurmd.log"
        echo "TmpFS=$STATE/nodes/%n/tmp"
        echo "PlugStackConfig=$STATE/plugstack.conf"
        # No cgroups in the nodes: processes tracked by parentage, no task binding.
        echo "ProctrackType=proctrack/linuxproc"
        echo "TaskPlugin=task/none"
        echo "JobAcctGatherType=jobacct_gather/none"
        echo "AccountingStorageType=accounting_storage/none"
        echo "JobCompType=jobcomp/filetxt"
        echo "JobCompLoc=$STATE/jobcomp.log"
        echo "SelectType=select/cons_tres"
        echo "SelectTypeParameters=CR_Core"
        echo "SchedulerType=sched/backfill"
        # sched_interval=2: a requeued job may start cred_expire+1 s after its requeue, but
        # only the main scheduler's periodic pass starts it then (the backfill pass skips its
        # cycles while no job or node changes, and saw the job before it was eligible): with
        # the default 60 s it waited up to a minute more on free nodes.
        echo "SchedulerParameters=bf_interval=5,sched_interval=2"
        echo "JobRequeue=1"
        echo "ReturnToService=2"
        echo "MpiDefault=none"
        echo "KillWait=30"
        echo "MinJobAge=600"
        # The nodes declare more CPUs than the machine has.
        echo "SlurmdParameters=config_overrides"
        for ((i = 0; i < nodes; i++)); do
            echo "NodeName=$name-node$i NodeAddr=$subnet.$((10 + i)) NodeHostname=$name-node$i CPUs=$cpus State=UNKNOWN"
        done
        if ((partition_nodes < nodes)); then
            local first=()
            for ((i = 0; i < partition_nodes; i++)); do first+=("$name-node$i"); done
            echo "PartitionName=$name Nodes=$(IFS=,; echo "${first[*]}") Default=YES MaxTime=INFINITE State=UP"
            echo "PartitionName=$name-all Nodes=ALL MaxTime=INFINITE State=UP"
        else
            echo "PartitionName=$name Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
        fi
    } > "$STATE/slurm.conf"
}

start_munge() {
    local m=$STATE/munge pid
    mkdir -p "$m"
    mungekey --create --keyfile="$m/munge.key" > /dev/null
    chown -R munge:munge "$m"
    chmod 0755 "$m"
    chmod 0400 "$m/munge.key"
    # munged refuses to run as root; every folder above the socket is world-traversable.
    runuser -u munge -- munged --socket="$m/munge.socket" --key-file="$m/munge.key" \
        --pid-file="$m/munged.pid" --log-file="$m/munged.log" --seed-file="$m/munged.seed"
    wait_for 10 test -s "$m/munged.pid" || die "munged did not start; see $m/munged.log"
    pid=$(cat "$m/munged.pid")
    record "pid $pid munged"
    wait_for 10 test -S "$m/munge.socket" || die "munged made no socket; see $m/munged.log"
}

start_daemon() {  # LOG COMM CMD...: start CMD detached (own session), record its pid
    local log=$1 comm=$2
    shift 2
    setsid "$@" < /dev/null >> "$log" 2>&1 &
    record "pid $! $comm"
    disown
}

cmd_up() {
    need_root
    [[ $nodes =~ ^[1-9][0-9]?$ ]] || die "--nodes $nodes: 1-99"
    [[ $extra_nodes =~ ^[0-9]$ ]] || die "--extra-nodes $extra_nodes: 0-9"
    # from here on, nodes counts every node; the default partition holds the first ones
    partition_nodes=$nodes
    nodes=$((nodes + extra_nodes))
    [[ $cpus =~ ^[1-9][0-9]*$ ]] || die "--cpus $cpus: a positive integer"
    if ! [[ $cred_expire =~ ^[0-9]+$ ]] || ((cred_expire < 5)); then
        die "--cred-expire $cred_expire: at least 5 s"
    fi
    [[ $subnet =~ ^([0-9]{1,3})\.([0-9]{1,3})\.([0-9]{1,3})$ ]] || die "--subnet $subnet: three numbers, like 10.77.0"
    [[ $slurmd_port =~ ^[0-9]+$ ]] || die "--slurmd-port $slurmd_port: a port number"
    [[ -z $ctld_port || $ctld_port =~ ^[0-9]+$ ]] || die "--ctld-port $ctld_port: a port number"
    local bps="" i
    if [[ -n $rate ]]; then
        bps=$(rate_bytes "$rate")
        ((bps >= 1000)) || die "--rate $rate is too low"
        if [[ -z $burst ]]; then
            burst=$((bps / 500))                      # 2 ms of traffic, at least 256 kB
            ((burst >= 262144)) || burst=262144
        fi
    fi
    if [[ -e $STATE ]]; then
        echo "cluster.sh: a cluster named $name is already up ($STATE); scripts/cluster.sh down --name $name first" >&2
        exit 1
    fi
    if ip -4 -o addr | grep -qF " $subnet." || ip -4 route | grep -qF "$subnet."; then
        die "--subnet $subnet is in use on this machine (ip -4 addr / ip route); choose another"
    fi
    local bridge=$name-br
    ip link show "$bridge" > /dev/null 2>&1 && die "a link named $bridge exists already; choose another --name"
    for ((i = 0; i < nodes; i++)); do
        [[ -e /run/netns/$name-node$i ]] && die "network namespace $name-node$i exists already; choose another --name"
    done
    mkdir -p "$STATE_ROOT"
    ensure_packages
    if ((slurm)); then
        [[ -n $ctld_port ]] || ctld_port=$(free_port 6817)
        ss -Htln "sport = :$ctld_port" | grep -q . && die "--ctld-port $ctld_port is in use"
    fi

    mkdir -p "$STATE/nodes"
    chmod 0755 "$STATE_ROOT" "$STATE"
    : > "$STATE/made"
    # From here on, a failure (or an interrupt) undoes what was made.
    # shellcheck disable=SC2034  # read by the EXIT trap
    up_ok=0
    trap 'if ((!up_ok)); then say "up failed; undoing what was made"; cmd_down_quiet; fi' EXIT
    trap 'exit 130' INT TERM

    # Bridge in the root namespace; slurmctld (and mpirun, for mpirun-args) reach the nodes
    # through its address.
    ip link add "$bridge" type bridge
    record "link $bridge"
    ip addr add "$subnet.1/24" dev "$bridge"
    ip link set "$bridge" up

    local hosts=$STATE/hosts ctl_host
    ctl_host=$(hostname -s)
    {
        echo "127.0.0.1 localhost"
        echo "$subnet.1 $ctl_host"
        for ((i = 0; i < nodes; i++)); do echo "$subnet.$((10 + i)) $name-node$i"; done
    } > "$hosts"
    chmod 0644 "$hosts"

    local names=() addrs=() veths=()
    for ((i = 0; i < nodes; i++)); do
        local node=$name-node$i addr=$subnet.$((10 + i)) outer=$name-v$i peer=$name-p$i
        ip netns add "$node"
        record "netns $node"
        ip link add "$outer" type veth peer name "$peer"
        record "link $outer"
        ip link set "$peer" netns "$node"
        ip -n "$node" link set "$peer" name eth0
        ip link set "$outer" master "$bridge"
        ip link set "$outer" up
        ip -n "$node" link set lo up
        ip -n "$node" addr add "$addr/24" dev eth0
        ip -n "$node" link set eth0 up
        if [[ -n $rate ]]; then
            ip netns exec "$node" tc qdisc replace dev eth0 root tbf rate "$rate" burst "$burst" latency 50ms
        fi
        # The holder keeps the node's host name and /etc/hosts (UTS and mount namespaces).
        # Not `ip netns exec`: it remounts /sys, and slurmd then finds no cgroup filesystem.
        mkdir -p "$STATE/nodes/$node"
        setsid nsenter --net="/run/netns/$node" unshare --uts --mount --propagation slave \
            /bin/sh -c 'mount --bind "$1" /etc/hosts && hostname "$2" && exec sleep infinity' \
            holder "$hosts" "$node" < /dev/null > /dev/null 2>&1 &
        echo $! > "$STATE/nodes/$node/holder.pid"
        record "pid $! sleep"
        disown
        names+=("$node") addrs+=("$addr") veths+=("$outer")
    done
    for node in "${names[@]}"; do
        wait_for 10 bash -c '[[ $(nsenter -t "$1" --uts hostname) == "$2" ]]' \
            _ "$(cat "$STATE/nodes/$node/holder.pid")" "$node" || die "node $node did not come up"
    done

    # The agent mpirun runs in place of ssh: this script, with this cluster's name.
    printf '#!/bin/sh\nexec %q agent --name %q "$@"\n' "$SCRIPT" "$name" > "$STATE/agent"
    chmod 0755 "$STATE/agent"

    {
        echo "CLUSTER_NAME=$name"
        echo "CLUSTER_STATE=$STATE"
        echo "CLUSTER_NODES='${names[*]}'"
        echo "CLUSTER_ADDRS='${addrs[*]}'"
        echo "CLUSTER_VETHS='${veths[*]}'"
        echo "CLUSTER_SUBNET=$subnet.0/24"
        echo "CLUSTER_BRIDGE=$bridge"
        echo "CLUSTER_CPUS=$cpus"
        echo "CLUSTER_RATE=${rate:-none}"
        echo "CLUSTER_SLURM=$slurm"
        echo "CLUSTER_AGENT=$STATE/agent"
        echo "OMPI_MCA_coll='^han,xhc,acoll'"
        if ((slurm)); then
            echo "SLURM_CONF=$STATE/slurm.conf"
            echo "CLUSTER_JOBCOMP=$STATE/jobcomp.log"
        fi
    } > "$STATE/cluster.env"

    if ((slurm)); then
        mkdir -p "$STATE/ctld"
        for node in "${names[@]}"; do mkdir -p "$STATE/nodes/$node/spool" "$STATE/nodes/$node/tmp"; done
        write_slurm_conf "$ctl_host"
        start_munge
        start_daemon "$STATE/slurmctld.out" slurmctld slurmctld -D -f "$STATE/slurm.conf"
        for node in "${names[@]}"; do
            start_daemon "$STATE/nodes/$node/slurmd.out" slurmd \
                nsenter -t "$(cat "$STATE/nodes/$node/holder.pid")" --net --uts --mount -- \
                slurmd -D -f "$STATE/slurm.conf" -N "$node"
        done
        export SLURM_CONF=$STATE/slurm.conf
        if ! wait_for 60 all_idle; then
            sinfo -N >&2 || true
            die "the nodes did not become idle in 60 s; see $STATE/slurmctld.log and $STATE/nodes/*/slurmd.log"
        fi
    fi
    # shellcheck disable=SC2034
    up_ok=1
    trap - INT TERM
    say "up in ${SECONDS} s: ${names[*]} on $subnet.0/24${rate:+, $rate per node}$( ((slurm)) && echo ", SLURM_CONF=$STATE/slurm.conf")"
}

all_idle() {
    local states
    # one line per node and partition it is in: count the nodes, once each
    states=$(sinfo -h -N -o '%N %t' 2> /dev/null) || return 1
    [[ $(awk '$2 == "idle" {print $1}' <<< "$states" | sort -u | wc -l) -eq $nodes ]]
}

# -------------------------------------------------------------------------------------- down
cmd_down_quiet() {
    set +e
    [[ -f $STATE/made ]] || { rm -rf "$STATE"; return 0; }
    local lines=() kind a b
    mapfile -t lines < "$STATE/made"
    # Daemons first (slurmd, slurmctld, munged; holders last), then what runs in the nodes.
    for ((k = ${#lines[@]} - 1; k >= 0; k--)); do
        read -r kind a b <<< "${lines[k]}"
        if [[ $kind == pid && $b != sleep ]]; then stop_pid "$a" "$b"; fi
    done
    for ((k = ${#lines[@]} - 1; k >= 0; k--)); do
        read -r kind a b <<< "${lines[k]}"
        if [[ $kind == netns ]]; then
            local pids
            pids=$(ip netns pids "$a" 2> /dev/null)
            # shellcheck disable=SC2086
            [[ -z $pids ]] || kill -KILL $pids 2> /dev/null
        fi
    done
    for ((k = ${#lines[@]} - 1; k >= 0; k--)); do
        read -r kind a b <<< "${lines[k]}"
        case $kind in
            pid) stop_pid "$a" "$b" ;;
            netns) ip netns del "$a" 2> /dev/null ;;
            link) ip link show "$a" > /dev/null 2>&1 && ip link del "$a" 2> /dev/null ;;
        esac
    done
    rm -rf "$STATE"
    set -e
}

cmd_down() {
    need_root
    if [[ ! -d $STATE ]]; then
        say "no cluster named $name is up"
        return 0
    fi
    cmd_down_quiet
    say "down: $name"
}

# ------------------------------------------------------------------------------------ status
cmd_status() {
    load_env
    local ok=0 node pid kind a b
    echo "cluster $CLUSTER_NAME: nodes $CLUSTER_NODES on $CLUSTER_SUBNET (bridge $CLUSTER_BRIDGE), rate $CLUSTER_RATE, SLURM $( ((CLUSTER_SLURM)) && echo yes || echo no)"
    for node in $CLUSTER_NODES; do
        pid=$(cat "$STATE/nodes/$node/holder.pid" 2> /dev/null || echo 0)
        if pid_is "$pid" sleep; then echo "  $node: up"; else echo "  $node: DOWN"; ok=3; fi
    done
    while read -r kind a b; do
        if [[ $kind == pid && $b != sleep ]] && ! pid_is "$a" "$b"; then
            echo "  $b (pid $a): NOT RUNNING"
            ok=3
        fi
    done < "$STATE/made"
    if ((CLUSTER_SLURM)); then
        echo "  SLURM_CONF=$SLURM_CONF"
        SLURM_CONF=$SLURM_CONF sinfo -N -o '  %N %t %c' 2>&1 || ok=3
    fi
    return "$ok"
}

cmd_env() {
    load_env
    cat "$STATE/cluster.env"
}

cmd_mpirun_args() {
    load_env
    [[ $ranks_per_node =~ ^[1-9][0-9]*$ ]] || die "--ranks-per-node $ranks_per_node: a positive integer"
    local hosts="" a
    for a in $CLUSTER_ADDRS; do hosts+=${hosts:+,}$a:$ranks_per_node; done
    # TCP between nodes on the cluster's subnet only, shared memory within one; the
    # hierarchical collective components (han, xhc, acoll) hang across these nodes.
    local yield="" n_nodes
    n_nodes=$(wc -w <<<"$CLUSTER_ADDRS")
    # The nodes share this machine's cores. With more ranks than cores, ranks waiting in MPI
    # must yield the core (as Open MPI does by itself when it sees oversubscription, which
    # --host A:K,B:K hides): busy-polling ranks would take it from the ranks computing.
    if ((n_nodes * ranks_per_node > $(nproc))); then yield=" --mca mpi_yield_when_idle 1"; fi
    # The layout is pinned here, K ranks per node: a mapping policy from the environment
    # (PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe, say) would otherwise win over the
    # slots of --host and put every rank on the first node, silently.  More ranks than
    # nodes x K is then an error of mpirun's, not an oversubscribed node.
    echo "--host $hosts --map-by ppr:$ranks_per_node:node" \
         "--prtemca plm_ssh_agent $CLUSTER_AGENT --mca pml ob1" \
         "--mca btl self,sm,tcp --mca btl_tcp_if_include $CLUSTER_SUBNET" \
         "--mca oob_tcp_if_include $CLUSTER_SUBNET --mca coll ^han,xhc,acoll$yield"
}

cmd_exec() {
    need_root
    load_env
    ((${#ARGS[@]} >= 2)) || die "usage: cluster.sh exec [--name P] NODE CMD..."
    local node
    node=$(node_of "${ARGS[0]}") || die "no node ${ARGS[0]} in cluster $name (nodes: $CLUSTER_NODES)"
    node_enter "$node" "${ARGS[@]:1}"
}

cmd_agent() {
    load_env
    set -- "${ARGS[@]}"
    # Skip the ssh options PRRTE may put before the host.
    while (($#)); do
        case $1 in
            -x|-T|-t|-n|-q|-a|-A|-C|-N|-f|-4|-6) shift ;;
            -o|-p|-l|-i|-F) shift 2 ;;
            *) break ;;
        esac
    done
    (($# >= 2)) || die "agent: usage: agent HOST CMD..."
    local node
    node=$(node_of "$1") || die "agent: host $1 is not a node of cluster $name (nodes: $CLUSTER_NODES, $CLUSTER_ADDRS)"
    shift
    # ssh semantics: the remote side runs the words, joined by blanks, as one shell command.
    node_enter "$node" /bin/bash -c "$*"
}

case $cmd in
    up) cmd_up ;;
    down) cmd_down ;;
    status) cmd_status ;;
    env) cmd_env ;;
    mpirun-args) cmd_mpirun_args ;;
    install) ensure_packages ;;
    exec) cmd_exec ;;
    agent) cmd_agent ;;
    *) echo "cluster.sh: error: unknown command $cmd (up, down, status, env, mpirun-args, install, exec, agent)" >&2; exit 2 ;;
esac
