"""A real Slurm cluster on this one host, for the tests and benchmarks: munge, one slurmctld and two slurmd
"nodes" (node1, node2: Debian's build runs several slurmd per host, each on its own port).

    python tests/slurm_cluster.py start     prints `export SLURM_CONF=…` for a shell that uses it
    python tests/slurm_cluster.py stop

Idempotent: `start` on a running cluster only waits for it; `stop` stops only the daemons this script
started (their PIDs are kept in the state folder). Needs root and Debian's `slurm-wlm` and `munge`
(.ci/run installs them). No systemd: the daemons are started directly. shared/NOTES.md has what was
measured here, and the traps this configuration avoids.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

STATE = Path(os.environ.get("DDPDASH_TEST_SLURM_DIR", "/tmp/ddpdash-slurm"))
CONF = STATE / "slurm.conf"
NODES = ("node1", "node2")
CTLD_PORT = 16817
NODE_PORTS = {"node1": 17001, "node2": 17002}
PARTITION = "debug"
MUNGE_SOCKET_DIR = Path("/run/munge")


def available() -> str | None:
    """Why no cluster can start here, or None."""
    missing = [tool for tool in ("slurmctld", "slurmd", "munged", "sbatch") if not shutil.which(tool)
               and not Path("/usr/sbin", tool).exists()]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing: apt-get install slurm-wlm munge)"
    if os.geteuid() != 0:
        return "starting slurmd needs root"
    return None


def env() -> dict[str, str]:
    """What a client (sbatch, squeue, ddpdash) needs to reach this cluster."""
    return {"SLURM_CONF": str(CONF)}


def _node_line(name: str) -> str:
    cpus = os.cpu_count() or 1
    memory = max(1024, int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20) - 512)
    return (f"NodeName={name} NodeHostname={socket.gethostname()} NodeAddr=127.0.0.1 Port={NODE_PORTS[name]} "
            f"CPUs={cpus} Boards=1 SocketsPerBoard=1 CoresPerSocket={cpus} ThreadsPerCore=1 RealMemory={memory} "
            "State=UNKNOWN")


def write_config() -> None:
    STATE.mkdir(parents=True, exist_ok=True)
    (STATE / "spool").mkdir(exist_ok=True)
    lines = [
        "ClusterName=ddpdash-test",
        f"SlurmctldHost={socket.gethostname()}(127.0.0.1)",
        f"SlurmctldPort={CTLD_PORT}",
        "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge",
        "ProctrackType=proctrack/cgroup",  # the only one that catches torchrun's workers (own sessions)
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
        "SchedulerParameters=batch_sched_delay=0",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/filetxt", f"JobCompLoc={STATE / 'jobcomp.txt'}",
        "ReturnToService=2", "MinJobAge=300", "KillWait=5", "MailProg=/bin/true",
        f"StateSaveLocation={STATE / 'ctld'}",
        f"SlurmdSpoolDir={STATE / 'spool' / '%n'}",
        f"SlurmctldPidFile={STATE / 'slurmctld.pid'}",
        f"SlurmdPidFile={STATE / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={STATE / 'slurmctld.log'}",
        f"SlurmdLogFile={STATE / 'slurmd-%n.log'}",
        *(_node_line(n) for n in NODES),
        f"PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
    ]
    CONF.write_text("\n".join(lines) + "\n")
    # cgroup v2 fails here ("Hybrid mode is not supported"); v1 with nothing constrained kills in 0.01 s.
    (STATE / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nConstrainCores=no\nConstrainRAMSpace=no\n"
                                       "ConstrainDevices=no\nConstrainSwapSpace=no\n")


def _alive(pid_file: Path) -> int | None:
    """The PID in `pid_file` when that process runs (a stopped daemon lingers here as a zombie: read its state)."""
    try:
        pid = int(pid_file.read_text().split()[0])
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, ValueError, IndexError):
        return None
    return None if state in ("Z", "X") else pid


def _munge_works() -> bool:
    try:
        token = subprocess.run(["munge", "-n"], capture_output=True, timeout=5)
        check = subprocess.run(["unmunge"], input=token.stdout, capture_output=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return token.returncode == 0 and check.returncode == 0


def _start_munge() -> None:
    if _munge_works():
        return
    MUNGE_SOCKET_DIR.mkdir(parents=True, exist_ok=True)
    shutil.chown(MUNGE_SOCKET_DIR, "munge", "munge")
    subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged"], check=True)
    (STATE / "started-munge").write_text("1")
    _wait(_munge_works, 10, "munged")


def _wait(ready: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready():  # type: ignore[operator]
            return
        time.sleep(0.2)
    raise RuntimeError(f"{what} did not become ready in {timeout_s:g} s; see {STATE}")


def _idle() -> bool:
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True,
                         env={**os.environ, **env()})
    states = dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)
    return out.returncode == 0 and all(states.get(n, "").rstrip("*") in ("idle", "mix", "alloc") for n in NODES)


def running() -> bool:
    """Whether this script's cluster runs (its controller and both nodes' daemons)."""
    return all(_alive(STATE / name) for name in ("slurmctld.pid", *(f"slurmd-{n}.pid" for n in NODES)))


def start() -> dict[str, str]:
    """Start what is not running; return the clients' environment once every node is idle."""
    why = available()
    if why:
        raise RuntimeError(why)
    write_config()
    _start_munge()
    daemon_env = {**os.environ, **env()}
    if not _alive(STATE / "slurmctld.pid"):
        subprocess.run(["slurmctld", "-f", str(CONF)], check=True, env=daemon_env)
    for node in NODES:
        if not _alive(STATE / f"slurmd-{node}.pid"):
            (STATE / "spool" / node).mkdir(parents=True, exist_ok=True)
            subprocess.run(["slurmd", "-f", str(CONF), "-N", node], check=True, env=daemon_env)
    _wait(_idle, 30, "the Slurm nodes")
    return env()


def stop() -> None:
    """Stop the daemons this script started, and what runs in their jobs."""
    daemon_env = {**os.environ, **env()}
    if CONF.exists() and _alive(STATE / "slurmctld.pid"):
        subprocess.run(["scancel", "--full", "--user", "root"], env=daemon_env, capture_output=True, timeout=10)
    pid_files = [*(STATE / f"slurmd-{n}.pid" for n in NODES), STATE / "slurmctld.pid"]
    for pid_file in pid_files:
        pid = _alive(pid_file)
        if pid:
            os.kill(pid, signal.SIGTERM)
    _wait(lambda: not any(_alive(p) for p in pid_files), 15, "the Slurm daemons' exit")  # a restart may follow
    if (STATE / "started-munge").exists():
        pid = _alive(Path("/run/munge/munged.pid"))
        if pid:
            os.kill(pid, signal.SIGTERM)
        (STATE / "started-munge").unlink()


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command == "start":
        for key, value in start().items():
            print(f"export {key}={value}")
    elif command == "stop":
        stop()
    else:
        raise SystemExit("usage: python tests/slurm_cluster.py start|stop")
