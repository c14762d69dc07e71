#!/bin/bash
# A two-node Slurm cluster on this one machine, for the heterogeneous-job test:
#   tests/slurm/cluster.sh start DIR   # munge + slurmctld + two slurmd (n1, n2) on 127.0.0.1
#   tests/slurm/cluster.sh stop DIR    # stops every daemon it started, by the PID it recorded
# Needs root and Debian's slurm-wlm and munge packages (tests/slurm/run.sh installs them).
set -euo pipefail
cmd=${1:?start|stop}
D=$(realpath -m "${2:?state directory}")

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

stop() {
    # slurmd and slurmctld first (they use munge), each by its recorded PID.
    for f in "$D"/slurmd.n1.pid "$D"/slurmd.n2.pid "$D"/slurmctld.pid "$D"/munged.pid; do
        [ -f "$f" ] || continue
        pid=$(cat "$f")
        if kill -0 "$pid" 2>/dev/null; then
            kill -TERM "$pid" 2>/dev/null || true
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            kill -KILL "$pid" 2>/dev/null || true
        fi
        rm -f "$f"
    done
}

if [ "$cmd" = stop ]; then stop; exit 0; fi
[ "$cmd" = start ] || { echo "usage: $0 start|stop DIR" >&2; exit 2; }

mkdir -p "$D"/munge "$D"/state "$D"/spool/n1 "$D"/spool/n2
chmod 700 "$D"/munge
dd if=/dev/urandom of="$D"/munge/munge.key bs=1024 count=1 status=none
chmod 400 "$D"/munge/munge.key
munged --force --socket="$D"/munge/munge.socket.2 --key-file="$D"/munge/munge.key \
    --pid-file="$D"/munged.pid --log-file="$D"/munged.log --seed-file="$D"/munge/munged.seed
CPUS=$(nproc)
cat > "$D"/slurm.conf <<CONF
ClusterName=aligner
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$(free_port)
AuthType=auth/munge
AuthInfo=socket=$D/munge/munge.socket.2
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool/%n
SlurmctldPidFile=$D/slurmctld.pid
SlurmdPidFile=$D/slurmd.%n.pid
SlurmctldLogFile=$D/slurmctld.log
SlurmdLogFile=$D/slurmd.%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
KillWait=30
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$(free_port) CPUs=$CPUS RealMemory=4000 State=UNKNOWN
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$(free_port) CPUs=$CPUS RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
CONF
export SLURM_CONF="$D"/slurm.conf
slurmctld -f "$SLURM_CONF" -i
for n in n1 n2; do slurmd -f "$SLURM_CONF" -N "$n"; done
for _ in $(seq 100); do
    idle=$(sinfo -h -N -o "%N %t" 2>/dev/null | grep -c -E "idle|mix" || true)
    [ "$idle" = 2 ] && break
    sleep 0.3
done
sinfo -N
[ "$idle" = 2 ] || { echo "the two slurmd did not register; see $D/*.log" >&2; stop; exit 1; }
echo "export SLURM_CONF=$SLURM_CONF"
