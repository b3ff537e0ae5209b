#!/usr/bin/env bash
# A real Slurm cluster on this machine for the system tests: munge, MariaDB + slurmdbd (accounting:
# `sacct`, which NeMo-Run reads job states with), slurmctld and two slurmd nodes (n1, n2) on localhost,
# from Debian's packages (Slurm 22.05 on bookworm). Every daemon runs in the foreground of a background
# shell, its PID in <dir>/pids/, and `down` stops exactly those PIDs. Each daemon also carries
# NRC_SLURM_CLUSTER=<dir> in its environment (slurmd passes it on to its slurmstepd processes): `down` finds
# them by it in /proc when the PID files are gone (e.g. pytest removed its temporary directory), and stops
# only this cluster's daemons, never another cluster's or a system slurmd.
#
#   bash ci/slurm_cluster.sh up   [DIR]   # installs the packages if missing (root), starts, waits for idle nodes
#   bash ci/slurm_cluster.sh down [DIR]   # stops what `up` started (by PID) and keeps DIR's logs
#   bash ci/slurm_cluster.sh env  [DIR]   # prints `export SLURM_CONF=...` for clients (sbatch, squeue, sacct)
#
# DIR defaults to $NRC_SLURM_DIR or /tmp/nrc-slurm. Ports: slurmctld NRC_SLURM_PORT (default 16817),
# slurmdbd +2, the nodes +100 and +101 (n1, n2), MariaDB +3 (bound to 127.0.0.1). Each node gets
# NRC_SLURM_CPUS CPUs (default 2) and 4000 MB. Needs root (SlurmUser=root, munged --force).
# Settings that this machine class needs (docs/deployment.md, "Testing the container and Slurm"):
# proctrack/linuxproc and task/none (no cgroup setup), jobacct_gather/none.
set -euo pipefail

cmd="${1:-}"
dir="${2:-${NRC_SLURM_DIR:-/tmp/nrc-slurm}}"
port="${NRC_SLURM_PORT:-16817}"
cpus="${NRC_SLURM_CPUS:-2}"
dbd_port=$((port + 2))
db_port=$((port + 3))
pids="${dir}/pids"

usage() { echo "usage: ci/slurm_cluster.sh <up|down|env> [DIR]" >&2; exit 2; }

# Start "$@" in the background with its output in <dir>/log/<name>.log and its PID in <dir>/pids/<name>.pid.
start() {
  local name="$1"; shift
  NRC_SLURM_CLUSTER="${dir}" "$@" >"${dir}/log/${name}.log" 2>&1 &
  echo $! > "${pids}/${name}.pid"
}

# PIDs of the processes whose environment holds NRC_SLURM_CLUSTER=<dir> (this cluster's daemons and the
# slurmstepd processes of its jobs) and whose command is one of "$@" (/proc/<pid>/comm), one a line.
cluster_pids() {
  local p comm
  for p in /proc/[0-9]*; do
    comm="$(cat "${p}/comm" 2>/dev/null)" || continue
    [[ " $* " == *" ${comm} "* ]] || continue
    if tr '\0' '\n' < "${p}/environ" 2>/dev/null | grep -qxF "NRC_SLURM_CLUSTER=${dir}"; then
      echo "${p#/proc/}"
    fi
  done
}

# Stop the PIDs "$@" (TERM, then KILL after 10 s).
stop_pids() {
  local pid i
  (( $# )) || return 0
  kill -TERM "$@" 2>/dev/null || true
  for ((i = 0; i < 100; i++)); do
    for pid in "$@"; do kill -0 "${pid}" 2>/dev/null && break; pid=""; done
    [[ -z "${pid}" ]] && return 0
    sleep 0.1
  done
  for pid in "$@"; do
    if kill -0 "${pid}" 2>/dev/null; then
      echo "slurm_cluster: ${pid} ($(cat "/proc/${pid}/comm" 2>/dev/null)) did not stop in 10 s; sending KILL" >&2
      kill -KILL "${pid}" 2>/dev/null || true
    fi
  done
}

# Wait until "$@" succeeds (at most $1 seconds); on timeout print the daemon's log and fail.
wait_for() {
  local secs="$1" log="$2"; shift 2
  local i
  for ((i = 0; i < secs * 5; i++)); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.2
  done
  echo "slurm_cluster: timed out after ${secs} s waiting for: $*" >&2
  tail -n 30 "${dir}/log/${log}.log" >&2 || true
  return 1
}

write_configs() {
  mkdir -p "${dir}"/{log,pids,state,spool/n1,spool/n2,mysql,munge}
  chmod 700 "${dir}/munge"
  if [[ ! -f "${dir}/munge/munge.key" ]]; then
    dd if=/dev/urandom of="${dir}/munge/munge.key" bs=1024 count=1 status=none
    chmod 600 "${dir}/munge/munge.key"
  fi
  cat > "${dir}/slurm.conf" <<EOF
# Written by ci/slurm_cluster.sh: two nodes on localhost for the system tests.
ClusterName=nrc
SlurmctldHost=localhost
SlurmctldPort=${port}
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=${dir}/state
SlurmdSpoolDir=${dir}/spool/%n
SlurmctldPidFile=${dir}/slurmctld.pid
SlurmdPidFile=${dir}/slurmd-%n.pid
SlurmctldLogFile=${dir}/log/slurmctld.daemon.log
SlurmdLogFile=${dir}/log/slurmd-%n.daemon.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
MinJobAge=600
KillWait=10
JobRequeue=1
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=${dbd_port}
JobCompType=jobcomp/none
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((port + 100)) CPUs=${cpus} RealMemory=4000 State=UNKNOWN
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((port + 101)) CPUs=${cpus} RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP
EOF
  # slurmdbd reads slurmdbd.conf next to slurm.conf (SLURM_CONF's directory); it must be mode 600.
  cat > "${dir}/slurmdbd.conf" <<EOF
AuthType=auth/munge
DbdHost=localhost
DbdPort=${dbd_port}
SlurmUser=root
PidFile=${dir}/slurmdbd.pid
LogFile=${dir}/log/slurmdbd.daemon.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=${db_port}
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
  chmod 600 "${dir}/slurmdbd.conf"
}

up() {
  if [[ "$(id -u)" -ne 0 ]]; then
    echo "slurm_cluster: run as root (SlurmUser=root, munged --force)" >&2
    exit 1
  fi
  if compgen -G "${pids}/*.pid" >/dev/null \
      || [[ -n "$(cluster_pids munged mariadbd slurmdbd slurmctld slurmd slurmstepd)" ]]; then
    echo "slurm_cluster: ${dir} has running daemons (PID files or processes marked with it); run 'down' first" >&2
    exit 1
  fi
  local t0=$SECONDS
  if ! command -v slurmctld >/dev/null || ! command -v slurmdbd >/dev/null || ! command -v mariadbd >/dev/null \
      || ! command -v munged >/dev/null; then
    echo "== slurm_cluster: apt-get install slurm-wlm slurmdbd munge mariadb-server =="
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm slurmdbd munge mariadb-server >/dev/null
    echo "== slurm_cluster: packages took $((SECONDS - t0)) s =="
  fi
  local t1=$SECONDS
  write_configs
  export SLURM_CONF="${dir}/slurm.conf"

  # munge keeps its default socket (/run/munge/munge.socket.2): slurmdbd's client ignores AuthInfo=socket=.
  mkdir -p /run/munge
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    echo "slurm_cluster: a munged already answers on munge's socket (another cluster?); stop it first" >&2
    exit 1
  fi
  start munged munged -F --force --key-file="${dir}/munge/munge.key" --pid-file="${dir}/munge/munged.pid" \
    --seed-file="${dir}/munge/munge.seed" --log-file="${dir}/log/munged.daemon.log"
  wait_for 20 munged bash -c 'munge -n | unmunge'

  if [[ ! -d "${dir}/mysql/mysql" ]]; then
    mariadb-install-db --no-defaults --user=root --datadir="${dir}/mysql" --auth-root-authentication-method=socket \
      >"${dir}/log/mariadb-install.log" 2>&1 || { tail -20 "${dir}/log/mariadb-install.log" >&2; exit 1; }
  fi
  start mariadbd mariadbd --no-defaults --user=root --datadir="${dir}/mysql" --socket="${dir}/mysql.sock" \
    --port="${db_port}" --bind-address=127.0.0.1 --pid-file="${dir}/mariadbd.pid" --skip-log-error
  wait_for 60 mariadbd mariadb --no-defaults -S "${dir}/mysql.sock" -u root -e "SELECT 1"
  mariadb --no-defaults -S "${dir}/mysql.sock" -u root -e "
    CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'slurm';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';"

  start slurmdbd slurmdbd -D
  wait_for 60 slurmdbd sacctmgr -i show cluster
  start slurmctld slurmctld -D -i
  wait_for 60 slurmctld scontrol ping
  start slurmd-n1 slurmd -D -N n1
  start slurmd-n2 slurmd -D -N n2
  # Both nodes idle (sinfo prints one state per node).
  # shellcheck disable=SC2016
  wait_for 60 slurmd-n2 bash -c '[ "$(sinfo -h -N -o %t | grep -c "^idle")" -eq 2 ]'
  # shellcheck disable=SC2016
  # The cluster is registered in the accounting database once slurmctld talked to slurmdbd.
  wait_for 60 slurmctld bash -c 'sacctmgr -n -P show cluster format=cluster | grep -qx nrc'
  sinfo -N
  echo "== slurm_cluster: up in $((SECONDS - t1)) s (export SLURM_CONF=${dir}/slurm.conf) =="
}

down() {
  local f name i
  local -a found
  # Jobs first: their slurmstepd processes are not children of the slurmd PIDs stopped below.
  if [[ -f "${dir}/slurm.conf" ]] && SLURM_CONF="${dir}/slurm.conf" timeout 20 scontrol ping >/dev/null 2>&1; then
    export SLURM_CONF="${dir}/slurm.conf"
    squeue -h -o %i | xargs -r scancel --full >/dev/null 2>&1 || true
    for ((i = 0; i < 150; i++)); do [[ -z "$(squeue -h -o %i 2>/dev/null)" ]] && break; sleep 0.2; done
  fi
  # Reverse order of start: the nodes (and any step left), the controller, accounting, the database, munge. A
  # daemon is found by its PID file and by this cluster's mark in its environment (the PID files may be gone).
  for name in slurmd-n1 slurmd-n2 slurmstepd slurmctld slurmdbd mariadbd munged; do
    found=()
    f="${pids}/${name}.pid"
    if [[ -f "${f}" ]] && kill -0 "$(cat "${f}")" 2>/dev/null; then found=("$(cat "${f}")"); fi
    rm -f "${f}"
    mapfile -t -O "${#found[@]}" found < <(cluster_pids "${name%%-*}")
    stop_pids "${found[@]}"
  done
  echo "== slurm_cluster: down (logs in ${dir}/log) =="
}

case "${cmd}" in
  up) up ;;
  down) down ;;
  env) echo "export SLURM_CONF=${dir}/slurm.conf" ;;
  *) usage ;;
esac
