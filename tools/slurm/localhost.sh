#!/usr/bin/env bash
# A real Slurm (Debian's slurm 22.05) on this one machine, for testing job scripts.
#
# Three slurmd "nodes" with fake GPUs of two types, all on 127.0.0.1:
#   partition a100    : a100-1, a100-2   (Gres gpu:a100:2 each)
#   partition rtx4090 : rtx4090-1        (Gres gpu:rtx4090:2)
#   partition all     : every node (default partition)
# Needs root (daemons run as root, slurmd runs in a private mount namespace whose /etc/hosts maps
# the node names to 127.0.0.1). Works without systemd and without cgroups. The machine's own
# /etc/hosts and /etc/slurm are never touched: every file lives under ROOT.
#
# Usage:
#   tools/slurm/localhost.sh start [ROOT]   install packages if missing, write config, start daemons,
#                                           wait until all nodes are idle (no-op if already running)
#   tools/slurm/localhost.sh stop [ROOT]    cancel all jobs, stop the daemons by their saved PIDs
#   tools/slurm/localhost.sh status [ROOT]  daemons and sinfo; exit 0 only if everything runs
#   tools/slurm/localhost.sh env [ROOT]     `export SLURM_CONF=...` lines: eval "$(... env)"
#   tools/slurm/localhost.sh info [ROOT]    path of ROOT/cluster.json (nodes, partitions, GPU types)
#
# ROOT: the argument, else $HEXI_SLURM_ROOT, else the ROOT recorded in the state file by the last
# `start`, else (start only) a new `mktemp -d` directory. The state file is
# $HEXI_SLURM_STATE_FILE, default ${TMPDIR:-/tmp}/hexi-slurm-localhost-$UID.state.
# Ports (unusual on purpose): slurmctld $HEXI_SLURM_CTLD_PORT (17817); slurmd nodes
# $HEXI_SLURM_NODE_PORT .. +2 (17001..17003).
#
# Layout of ROOT: etc/{slurm.conf,gres.conf,hosts,munge.key} run/ (sockets, pid files; pids/ holds
# the PIDs this script saved) log/ state/ spool/ dev/ (fake GPU device files), cluster.json.
set -euo pipefail
# the daemons and mungekey install to sbin, which a non-login shell's PATH (env -i, cron, some
# sudo setups) leaves out: without it the script reinstalls the packages and then cannot find them
PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"

CTLD_PORT="${HEXI_SLURM_CTLD_PORT:-17817}"
NODE_PORT="${HEXI_SLURM_NODE_PORT:-17001}"
STATE_FILE="${HEXI_SLURM_STATE_FILE:-${TMPDIR:-/tmp}/hexi-slurm-localhost-$(id -u).state}"
WAIT_S="${HEXI_SLURM_WAIT_S:-60}"
NODES=(a100-1 a100-2 rtx4090-1)
DAEMONS=(munged slurmctld "${NODES[@]/#/slurmd-}")

die() { echo "localhost.sh: error: $*" >&2; exit 1; }
say() { echo "localhost.sh: $*" >&2; }

# ---- ROOT resolution ------------------------------------------------------------------------
resolve_root() {  # $1: explicit ROOT or empty; prints ROOT or nothing
    local r="${1:-${HEXI_SLURM_ROOT:-}}"
    if [[ -z "$r" && -f "$STATE_FILE" ]]; then r="$(head -n1 "$STATE_FILE")"; fi
    [[ -n "$r" ]] && (cd "$r" 2>/dev/null && pwd -P) || true
}

need_root_dir() {  # $1: explicit ROOT or empty
    ROOT="$(resolve_root "${1:-}")"
    [[ -n "$ROOT" && -f "$ROOT/etc/slurm.conf" ]] \
        || die "no localhost Slurm found (give ROOT, set HEXI_SLURM_ROOT, or run start first)"
    export SLURM_CONF="$ROOT/etc/slurm.conf"
}

# ---- PIDs -----------------------------------------------------------------------------------
# A saved PID counts only if that process is still ours: its command line mentions ROOT.
pid_of() {  # $1: daemon name -> prints PID if alive and ours
    local f="$ROOT/run/pids/$1" pid
    [[ -f "$f" ]] || return 1
    pid="$(cat "$f")"
    [[ "$pid" =~ ^[0-9]+$ && -r "/proc/$pid/cmdline" ]] || return 1
    # zombies (<defunct>) have an empty cmdline and count as gone
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF -- "$ROOT" || return 1
    echo "$pid"
}

count_alive() {
    local n=0 d
    for d in "${DAEMONS[@]}"; do pid_of "$d" >/dev/null && n=$((n + 1)); done
    echo "$n"
}

# ---- install --------------------------------------------------------------------------------
ensure_packages() {
    local missing=0 b
    for b in slurmctld slurmd sbatch srun sinfo scontrol scancel munged mungekey; do
        command -v "$b" >/dev/null || missing=1
    done
    [[ $missing == 0 ]] && return 0
    [[ "$(id -u)" == 0 ]] || die "Slurm/munge are not installed and installing needs root"
    command -v apt-get >/dev/null || die "Slurm/munge are not installed and there is no apt-get"
    local pkgs=(slurmctld slurmd slurm-client munge)
    say "installing ${pkgs[*]}"
    export DEBIAN_FRONTEND=noninteractive
    if ! compgen -G "/var/lib/apt/lists/*_Packages*" >/dev/null \
        || ! apt-get install -y --no-install-recommends "${pkgs[@]}" >&2; then
        apt-get update >&2 || die "apt-get update failed"
        apt-get install -y --no-install-recommends "${pkgs[@]}" >&2 || die "apt-get install failed"
    fi
}

check_port_free() {  # $1: port
    if command -v ss >/dev/null; then
        ! ss -Hltn "sport = :$1" | grep -q . || die "TCP port $1 is in use (another Slurm? set HEXI_SLURM_CTLD_PORT / HEXI_SLURM_NODE_PORT)"
    elif (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then
        die "TCP port $1 is in use (set HEXI_SLURM_CTLD_PORT / HEXI_SLURM_NODE_PORT)"
    fi
}

# ---- config ---------------------------------------------------------------------------------
write_config() {
    mkdir -p "$ROOT"/{etc,run/pids,log,state,dev} "${NODES[@]/#/$ROOT/spool/}"
    chmod 0755 "$ROOT" "$ROOT/run"
    chmod 0700 "$ROOT/etc"
    local i
    for i in 0 1; do ln -sfn /dev/null "$ROOT/dev/nvidia$i"; done
    cat >"$ROOT/etc/slurm.conf" <<EOF
# generated by tools/slurm/localhost.sh
ClusterName=hexici
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$CTLD_PORT
SlurmdPort=$((CTLD_PORT + 1))
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$ROOT/run/munge.socket
StateSaveLocation=$ROOT/state
SlurmdSpoolDir=$ROOT/spool/%n
SlurmctldPidFile=$ROOT/run/slurmctld.pid
SlurmdPidFile=$ROOT/run/slurmd-%n.pid
SlurmctldLogFile=$ROOT/log/slurmctld.log
SlurmdLogFile=$ROOT/log/slurmd-%n.log
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
# heterogeneous jobs start only from backfill (default interval 30 s)
SchedulerParameters=bf_interval=1
# else sbatch --wait polls at 2, 8, 32 s
MinJobAge=4
# impossible requests fail at submission instead of pending forever
EnforcePartLimits=ALL
# lets a node claim more CPUs than the machine has
SlurmdParameters=config_overrides
ReturnToService=2
GresTypes=gpu
NodeName=a100-[1-2] NodeAddr=127.0.0.1 Port=$NODE_PORT-$((NODE_PORT + 1)) CPUs=4 RealMemory=8000 Gres=gpu:a100:2
NodeName=rtx4090-1  NodeAddr=127.0.0.1 Port=$((NODE_PORT + 2)) CPUs=4 RealMemory=8000 Gres=gpu:rtx4090:2
PartitionName=all     Nodes=ALL        Default=YES MaxTime=INFINITE State=UP
PartitionName=a100    Nodes=a100-[1-2] MaxTime=INFINITE State=UP
PartitionName=rtx4090 Nodes=rtx4090-1  MaxTime=INFINITE State=UP
EOF
    cat >"$ROOT/etc/gres.conf" <<EOF
# generated by tools/slurm/localhost.sh; fake GPUs: character devices (symlinks to /dev/null)
AutoDetect=off
NodeName=a100-[1-2] Name=gpu Type=a100    File=$ROOT/dev/nvidia[0-1]
NodeName=rtx4090-1  Name=gpu Type=rtx4090 File=$ROOT/dev/nvidia[0-1]
EOF
    # hosts file seen by slurmd and its jobs only (private mount namespace)
    { cat /etc/hosts; echo "# added by tools/slurm/localhost.sh"; echo "127.0.0.1 ${NODES[*]}"; } \
        >"$ROOT/etc/hosts"
    cat >"$ROOT/cluster.json" <<EOF
{
  "root": "$ROOT",
  "slurm_conf": "$ROOT/etc/slurm.conf",
  "default_partition": "all",
  "partitions": {
    "all": {"nodes": ["a100-1", "a100-2", "rtx4090-1"]},
    "a100": {"nodes": ["a100-1", "a100-2"], "gpu_type": "a100", "gpus_per_node": 2, "cpus_per_node": 4},
    "rtx4090": {"nodes": ["rtx4090-1"], "gpu_type": "rtx4090", "gpus_per_node": 2, "cpus_per_node": 4}
  },
  "nodes": {
    "a100-1": {"partition": "a100", "gpu_type": "a100", "gpus": 2, "cpus": 4},
    "a100-2": {"partition": "a100", "gpu_type": "a100", "gpus": 2, "cpus": 4},
    "rtx4090-1": {"partition": "rtx4090", "gpu_type": "rtx4090", "gpus": 2, "cpus": 4}
  }
}
EOF
}

# ---- start / stop ---------------------------------------------------------------------------
log_tail() {  # $1: log file
    [[ -f "$1" ]] && { echo "--- tail of $1:"; tail -n 20 "$1"; } >&2 || true
}

fail_start() {  # $*: message
    local f
    do_stop_daemons >/dev/null 2>&1 || true
    echo "localhost.sh: error: $*" >&2
    for f in "$ROOT"/log/*.out; do log_tail "$f"; done  # daemon stderr: log lines and crashes
    echo "localhost.sh: error: $* (logs above, under $ROOT/log)" >&2
    exit 1
}

launch() {  # $1: daemon name, rest: command; saves its PID (stdin/out/err detached)
    local name="$1"; shift
    "$@" </dev/null >>"$ROOT/log/$name.out" 2>&1 &
    echo $! >"$ROOT/run/pids/$name"
    # until the child has exec'd, its command line is this script's and pid_of would call it gone
    local i
    for ((i = 0; i < 100; i++)); do pid_of "$name" >/dev/null && return 0; sleep 0.05; done
    fail_start "$name exited at once"
}

cmd_start() {
    [[ "$(id -u)" == 0 ]] || die "start needs root (daemons run as root; slurmd needs a mount namespace)"
    local given="${1:-${HEXI_SLURM_ROOT:-}}"
    ROOT="$(resolve_root "$given")"
    if [[ -n "$ROOT" && -f "$ROOT/etc/slurm.conf" ]]; then
        local alive; alive="$(count_alive)"
        if [[ "$alive" == "${#DAEMONS[@]}" ]]; then
            say "already running at $ROOT (nothing to do)"
            echo "$ROOT" >"$STATE_FILE"
            return 0
        elif [[ "$alive" != 0 ]]; then
            say "partly running at $ROOT ($alive of ${#DAEMONS[@]} daemons); restarting"
            do_stop_daemons
        fi
    fi
    if [[ -z "$ROOT" ]]; then
        if [[ -n "$given" ]]; then mkdir -p "$given"; ROOT="$(cd "$given" && pwd -P)"
        else ROOT="$(mktemp -d "${TMPDIR:-/tmp}/hexi-slurm.XXXXXX")"; fi
    fi
    # start wipes ROOT's state/ spool/ run/: only in an empty dir or one this script set up
    if [[ -n "$(ls -A "$ROOT")" ]] && ! grep -qs '^# generated by tools/slurm/localhost.sh' "$ROOT/etc/slurm.conf"; then
        die "ROOT $ROOT is neither empty nor a localhost Slurm root; give an empty or new directory"
    fi
    # unix socket paths (munge, slurmd) must fit in 108 bytes
    (( ${#ROOT} <= 80 )) || die "ROOT path too long for unix sockets (${#ROOT} > 80 chars): $ROOT"
    ensure_packages
    local p
    for p in "$CTLD_PORT" "$((CTLD_PORT + 1))" "$NODE_PORT" "$((NODE_PORT + 1))" "$((NODE_PORT + 2))"; do
        check_port_free "$p"
    done
    local t0=$SECONDS
    # a fresh state dir each start: a node drained once stays drained through the state dir
    rm -rf "$ROOT/state" "$ROOT/spool" "$ROOT/run"
    [[ -d "$ROOT/log" ]] && { rm -rf "$ROOT/log.prev"; mv "$ROOT/log" "$ROOT/log.prev"; }
    write_config
    export SLURM_CONF="$ROOT/etc/slurm.conf"
    echo "$ROOT" >"$STATE_FILE"

    # munge, with its own key and socket
    [[ -f "$ROOT/etc/munge.key" ]] || mungekey -c -f -k "$ROOT/etc/munge.key" >&2
    chmod 0600 "$ROOT/etc/munge.key"
    # --force: munged refuses a socket whose parent dirs are not world-searchable (a pytest temp
    # dir is 0700); every client here is root, so that check does not matter
    launch munged munged -F --force --key-file="$ROOT/etc/munge.key" --socket="$ROOT/run/munge.socket" \
        --pid-file="$ROOT/run/munged.pid" --log-file="$ROOT/log/munged.log" \
        --seed-file="$ROOT/run/munge.seed"
    local i
    for ((i = 0; i < 50; i++)); do
        [[ -S "$ROOT/run/munge.socket" ]] && break
        pid_of munged >/dev/null || fail_start "munged exited"
        sleep 0.1
    done
    [[ -S "$ROOT/run/munge.socket" ]] || fail_start "munged did not create its socket"

    launch slurmctld slurmctld -D -f "$SLURM_CONF"
    for ((i = 0; i < WAIT_S * 5; i++)); do
        scontrol ping 2>/dev/null | grep -q 'is UP' && break
        pid_of slurmctld >/dev/null || fail_start "slurmctld exited"
        sleep 0.2
    done
    scontrol ping 2>/dev/null | grep -q 'is UP' || fail_start "slurmctld not UP after ${WAIT_S}s"

    local n
    for n in "${NODES[@]}"; do
        launch "slurmd-$n" unshare -m --propagation private sh -c \
            'mount --bind "$1/etc/hosts" /etc/hosts && exec slurmd -D -N "$2" -f "$1/etc/slurm.conf"' \
            sh "$ROOT" "$n"
    done
    local idle=0
    for ((i = 0; i < WAIT_S * 5; i++)); do
        idle="$(sinfo -h -N -p all -o '%N %t' 2>/dev/null | grep -c ' idle$' || true)"
        [[ "$idle" == "${#NODES[@]}" ]] && break
        for n in "${DAEMONS[@]}"; do pid_of "$n" >/dev/null || fail_start "$n exited"; done
        sleep 0.2
    done
    if [[ "$idle" != "${#NODES[@]}" ]]; then
        sinfo -N -p all >&2 || true
        fail_start "only $idle of ${#NODES[@]} nodes idle after ${WAIT_S}s"
    fi
    say "started at $ROOT in $((SECONDS - t0))s (SLURM_CONF=$SLURM_CONF)"
}

do_stop_daemons() {  # kill by saved PIDs, slurmd first, then slurmctld, then munged; wait
    local d pid pids=() i
    for d in "${NODES[@]/#/slurmd-}" slurmctld munged; do
        pid="$(pid_of "$d")" || continue
        kill -TERM "$pid" 2>/dev/null || true
        pids+=("$pid:$d")
        # slurmctld wants slurmd gone first; munged must outlive slurmctld's shutdown
        if [[ "$d" == slurmctld ]]; then
            for ((i = 0; i < 100; i++)); do pid_of slurmctld >/dev/null || break; sleep 0.1; done
        fi
    done
    for ((i = 0; i < 150; i++)); do
        local left=0
        for d in "${DAEMONS[@]}"; do pid_of "$d" >/dev/null && left=1; done
        [[ $left == 0 ]] && break
        sleep 0.1
    done
    for d in "${DAEMONS[@]}"; do
        if pid="$(pid_of "$d")"; then
            say "$d ($pid) did not stop on SIGTERM; sending SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
        fi
    done
    rm -f "$ROOT"/run/pids/*
}

cmd_stop() {
    ROOT="$(resolve_root "${1:-}")"
    if [[ -z "$ROOT" || ! -f "$ROOT/etc/slurm.conf" ]]; then say "nothing to stop"; return 0; fi
    export SLURM_CONF="$ROOT/etc/slurm.conf"
    if [[ "$(count_alive)" == 0 ]]; then say "not running at $ROOT"; return 0; fi
    if pid_of slurmctld >/dev/null; then
        local i
        # scancel of an empty queue is fine; the cancelled jobs' steps end before slurmd goes
        timeout 20 scancel --full --quiet --user="$(id -un)" 2>/dev/null || true
        for ((i = 0; i < 100; i++)); do
            [[ -z "$(squeue -h -t R,CG -o %i 2>/dev/null)" ]] && break
            sleep 0.1
        done
    fi
    do_stop_daemons
    say "stopped ($ROOT)"
}

cmd_status() {
    need_root_dir "${1:-}"
    local d pid ok=0
    echo "ROOT=$ROOT"
    for d in "${DAEMONS[@]}"; do
        if pid="$(pid_of "$d")"; then echo "$d: running (pid $pid)"; else echo "$d: not running"; ok=1; fi
    done
    if pid_of slurmctld >/dev/null; then sinfo -N || ok=1; fi
    return $ok
}

cmd_env() {
    need_root_dir "${1:-}"
    printf 'export SLURM_CONF=%q\n' "$ROOT/etc/slurm.conf"
    printf 'export HEXI_SLURM_ROOT=%q\n' "$ROOT"
}

cmd_info() {
    need_root_dir "${1:-}"
    echo "$ROOT/cluster.json"
}

sub="${1:-}"; shift || true
case "$sub" in
    start) cmd_start "$@" ;;
    stop) cmd_stop "$@" ;;
    status) cmd_status "$@" ;;
    env) cmd_env "$@" ;;
    info) cmd_info "$@" ;;
    *) echo "usage: $0 {start|stop|status|env|info} [ROOT]" >&2; exit 2 ;;
esac
