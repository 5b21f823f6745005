"""Fixtures for the launch tests: a tiny dataset and model, and a real single-node Slurm.

`slurm_cluster` starts a private Slurm on this host for the session: its own munged (own key and
socket), slurmctld and slurmd, with every file under a temporary folder and ports picked free, so
that nothing of the host's configuration is read or changed. It needs root (slurmd runs jobs as
their users) and the Debian packages slurmctld, slurmd and munge, which .ci/run installs. Missing
packages fail the tests rather than skip them, so that a broken setup cannot pass as green.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, Optional

import pytest

from launching import free_port

REPO = Path(__file__).resolve().parents[2]
SLURM_PACKAGES = "slurmctld slurmd munge"
SBIN = ("/usr/sbin", "/sbin", "/usr/local/sbin")


@pytest.fixture(scope="session")
def tiny_data(train_data):
    """The training tests' data and tiny model, as launch/examples/tiny_cpu.sh takes them."""
    return SimpleNamespace(prefix=train_data.prefix, spm=train_data.spm, config=train_data.tiny)


def _which(name: str) -> Optional[str]:
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(SBIN))


def _tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError as e:
        return f"({path}: {e})"
    return "\n".join(text[-lines:])


@dataclass
class Job:
    """A job as `scontrol show job` sees it."""
    job_id: str
    state: str
    exit_code: str  # "status:signal", e.g. "0:0"
    fields: Dict[str, str] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.state not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING",
                                  "SUSPENDED", "REQUEUED", "RESIZING", "SIGNALING")


@dataclass
class SlurmCluster:
    """A running single-node Slurm; `env` points its commands (and jobs) at it via SLURM_CONF."""
    root: Path
    conf: Path
    node: str
    env: Dict[str, str]
    procs: Dict[str, subprocess.Popen] = field(default_factory=dict)

    def run(self, *cmd: str, timeout: float = 60, check: bool = True,
            env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
        """Run a command (sbatch, srun, squeue, scancel, ...) against this cluster."""
        proc = subprocess.run(list(cmd), env={**self.env, **(env or {})}, capture_output=True,
                              text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout}\n"
                                 f"{proc.stderr}\n{self.log_tails()}")
        return proc

    def sbatch(self, *args: str, env: Optional[Dict[str, str]] = None) -> str:
        """Submit; returns the job id."""
        out = self.run("sbatch", "--parsable", *args, env=env).stdout.strip()
        return out.split(";")[0]

    def job(self, job_id: str) -> Job:
        text = self.run("scontrol", "show", "job", "--oneliner", job_id).stdout
        fields = dict(re.findall(r"(\w+)=(\S*)", text))
        return Job(job_id, fields.get("JobState", "?"), fields.get("ExitCode", "?"), fields)

    def wait(self, job_id: str, timeout: float, describe=lambda: "") -> Job:
        """Poll until the job has ended; on timeout cancel it and fail with `describe()`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if job.finished:
                return job
            time.sleep(1)
        self.run("scancel", job_id, check=False)
        pytest.fail(f"job {job_id} still {self.job(job_id).state} after {timeout:.0f} s\n"
                    f"{describe()}\n{self.log_tails()}")

    def log_tails(self) -> str:
        return "\n".join(f"--- {name} (tail)\n{_tail(self.root / name)}"
                         for name in ("slurmctld.log", "slurmd.log"))

    def stop(self) -> None:
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self.run("scancel", "--user", str(os.getuid()), check=False, timeout=30)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and self.run(
                    "squeue", "--noheader", check=False, timeout=30).stdout.strip():
                time.sleep(0.5)
        for name in ("slurmd", "slurmctld", "munged"):
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(15)


def _require_slurm() -> Dict[str, str]:
    tools = {name: _which(name) for name in ("munged", "munge", "unmunge", "slurmctld",
                                             "slurmd", "sbatch", "srun", "scontrol", "sinfo",
                                             "squeue", "scancel")}
    missing = sorted(name for name, path in tools.items() if path is None)
    if missing:
        pytest.fail(f"Slurm is not installed (no {', '.join(missing)}): the launch tests start "
                    f"a real single-node Slurm; .ci/run installs the Debian packages "
                    f"({SLURM_PACKAGES}), or run: apt-get install -y {SLURM_PACKAGES}",
                    pytrace=False)
    if os.geteuid() != 0:
        pytest.fail("the Slurm launch tests must run as root: slurmd starts jobs as their user",
                    pytrace=False)
    return tools


def _start_munged(tools: Dict[str, str], root: Path) -> subprocess.Popen:
    """A private munged: its own key and socket, so the host's munge setup is not touched."""
    key = root / "munge.key"
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(os.urandom(1024))
    sock = root / "munge.socket"
    # --force: munged refuses to run as root otherwise; --foreground: we own the process.
    proc = subprocess.Popen(
        [tools["munged"], "--foreground", "--force", f"--socket={sock}", f"--key-file={key}",
         f"--pid-file={root / 'munged.pid'}", f"--log-file={root / 'munged.log'}",
         f"--seed-file={root / 'munged.seed'}", "--num-threads=2"],
        stdout=open(root / "munged.out", "w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        cred = subprocess.run([tools["munge"], f"--socket={sock}", "-n"], capture_output=True)
        if cred.returncode == 0 and subprocess.run(
                [tools["unmunge"], f"--socket={sock}"], input=cred.stdout,
                capture_output=True).returncode == 0:
            return proc
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"munged did not start:\n{_tail(root / 'munged.out')}\n"
                f"{_tail(root / 'munged.log')}", pytrace=False)


def _slurm_conf(root: Path, node: str, munge_socket: Path) -> str:
    cpus = len(os.sched_getaffinity(0))
    with open("/proc/meminfo") as f:
        mem_kib = int(re.search(r"MemTotal:\s+(\d+)", f.read()).group(1))
    real_memory_mib = int(mem_kib / 1024 * 0.9)  # below the total, or slurmd drains the node
    return f"""\
# Written by tests/launch/conftest.py: a private single-node cluster under {root}
ClusterName=t5launchtest
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups (containers often lack them): processes are tracked through /proc.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
SwitchType=switch/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
# Finished jobs stay visible to `scontrol show job` (there is no slurmdbd for sacct).
MinJobAge=3600
KillWait=30
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={real_memory_mib} State=UNKNOWN
PartitionName=debug Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A private single-node Slurm (partition `debug`, this host, all its CPUs), stopped at the
    end of the session. Yields a SlurmCluster whose `env` has SLURM_CONF set."""
    tools = _require_slurm()
    root = tmp_path_factory.mktemp("slurm")
    root.chmod(0o700)  # munged refuses a socket folder that others can write
    (root / "state").mkdir()
    (root / "spool").mkdir()
    node = socket.gethostname().split(".")[0]
    procs = {"munged": _start_munged(tools, root)}
    conf = root / "slurm.conf"
    conf.write_text(_slurm_conf(root, node, root / "munge.socket"))
    env = {**os.environ, "SLURM_CONF": str(conf), "PYTHON": sys.executable}
    for var in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))]:
        if var != "SLURM_CONF":  # the session may itself run inside a Slurm job
            del env[var]
    cluster = SlurmCluster(root, conf, node, env, procs)
    try:
        for daemon in ("slurmctld", "slurmd"):
            procs[daemon] = subprocess.Popen(
                [tools[daemon], "-D", "-f", str(conf)], env=env,
                stdout=open(root / f"{daemon}.out", "w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        state = ""
        while time.monotonic() < deadline:
            dead = [name for name, p in procs.items() if p.poll() is not None]
            if dead:
                break
            state = cluster.run("sinfo", "--noheader", "--format=%T", check=False).stdout.strip()
            if state == "idle":
                break
            time.sleep(0.5)
        if state != "idle":
            outs = "\n".join(f"--- {name}.out\n{_tail(root / f'{name}.out')}"
                             for name in ("slurmctld", "slurmd"))
            pytest.fail(f"the test Slurm did not come up (node state {state!r}, exited: "
                        f"{[n for n, p in procs.items() if p.poll() is not None]})\n"
                        f"{outs}\n{cluster.log_tails()}", pytrace=False)
        yield cluster
    finally:
        cluster.stop()


@dataclass
class TwoHosts:
    """Two network namespaces joined by a veth pair: host i is `names[i]`, reached at
    `addrs[i]` through its interface `ifnames[i]`. The file system is shared; only the network
    is separate, so the repository and the virtual environment have the same paths on both."""
    names: tuple
    ifnames: tuple
    addrs: tuple
    procs: list = field(default_factory=list)

    def run(self, host: int, cmd, env: Optional[Dict[str, str]] = None,
            **popen_kwargs) -> subprocess.Popen:
        """Start `cmd` inside host `host`'s namespace in a session of its own (`ip netns exec`
        execs the command, so the Popen's pid is the command's). gloo would take the interface
        of the hostname (127.0.0.1 here), which the other host cannot reach: name the veth."""
        env = {**os.environ, "GLOO_SOCKET_IFNAME": self.ifnames[host],
               "TP_SOCKET_IFNAME": self.ifnames[host], **(env or {})}
        popen_kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(["ip", "netns", "exec", self.names[host], *cmd], env=env,
                                **popen_kwargs)
        self.procs.append(proc)
        return proc

    def pids(self, host: int) -> list:
        """Every process in host `host`'s namespace (torchrun's workers included)."""
        out = subprocess.run(["ip", "netns", "pids", self.names[host]], capture_output=True,
                             text=True).stdout
        return [int(p) for p in out.split()]

    def kill_all(self) -> None:
        """SIGKILL everything in both namespaces and reap what we started."""
        deadline = time.monotonic() + 30
        for host in (0, 1):
            while (pids := self.pids(host)) and time.monotonic() < deadline:
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.1)
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            try:
                proc.communicate(timeout=10)
            except (subprocess.TimeoutExpired, ValueError):
                pass


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([_which("ip") or "ip", *args], capture_output=True, text=True)


@pytest.fixture
def two_hosts():
    """Two "hosts" on this machine: namespaces t5a-<pid> and t5b-<pid>, a veth pair with
    10.X.Y.1/24 and 10.X.Y.2/24 (X.Y from the pid), lo and the veths up. At the end every
    process in them is killed and they are deleted, whatever the test's outcome. Needs root
    (CAP_SYS_ADMIN, CAP_NET_ADMIN) and iproute2; without them the test fails, saying which."""
    if _which("ip") is None:
        pytest.fail("the two-host tests need `ip` (Debian package iproute2)", pytrace=False)
    pid = os.getpid()
    hosts = TwoHosts(names=(f"t5a-{pid}", f"t5b-{pid}"), ifnames=(f"t5va{pid}", f"t5vb{pid}"),
                     addrs=tuple(f"10.{(pid >> 8) % 256}.{pid % 256}.{i}" for i in (1, 2)))
    created = []
    try:
        steps = [("netns", "add", hosts.names[0]), ("netns", "add", hosts.names[1]),
                 ("link", "add", hosts.ifnames[0], "type", "veth", "peer", "name",
                  hosts.ifnames[1])]
        for i in (0, 1):
            steps += [("link", "set", hosts.ifnames[i], "netns", hosts.names[i]),
                      ("-n", hosts.names[i], "addr", "add", f"{hosts.addrs[i]}/24", "dev",
                       hosts.ifnames[i]),
                      ("-n", hosts.names[i], "link", "set", "lo", "up"),
                      ("-n", hosts.names[i], "link", "set", hosts.ifnames[i], "up")]
        for step in steps:
            proc = _ip(*step)
            if proc.returncode != 0:
                pytest.fail(f"could not set up the two network namespaces: `ip {' '.join(step)}`"
                            f" exited {proc.returncode}: {proc.stderr.strip()} (the two-host "
                            f"tests need root with CAP_SYS_ADMIN, CAP_NET_ADMIN and veth "
                            f"support)", pytrace=False)
            if step[:2] == ("netns", "add"):
                created.append(step[2])
        yield hosts
    finally:
        if created:
            hosts.kill_all()
        for name in created:  # deleting a namespace also deletes its end of the veth pair
            _ip("netns", "del", name)
        _ip("link", "del", hosts.ifnames[0])  # in case it never left the root namespace
