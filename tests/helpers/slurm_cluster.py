"""A one-node Slurm cluster on this machine, for tests that submit the project's own sbatch scripts.

slurmctld and slurmd run from a configuration written to a temporary folder (ports of their own, state and logs
there), authenticated by munge, and are stopped afterwards; nothing under /etc/slurm is read or written. What made
it work on Debian's slurm-wlm 22.05 without cgroups or GPUs is in shared/notes/slurm-on-one-machine.md:
proctrack/linuxproc and task/none, and a short credential lifetime (AuthInfo=cred_expire) so that a requeued job
starts again within about 25 s instead of 2 minutes.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from contextlib import closing, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import psutil

DAEMONS = ("munged", "slurmctld", "slurmd")
INSTALL_HINT = "Slurm is not installed: `apt-get install slurm-wlm munge` (as root) runs these tests"
KILL_WAIT_SEC = 30
"""Seconds between the SIGTERM of a preemption (or scancel) and its SIGKILL: the run's time to save."""


def missing_slurm() -> Optional[str]:
    """Why no cluster can start here, or None."""
    absent = [name for name in ("sbatch", *DAEMONS) if not shutil.which(name, path=os.environ.get("PATH", "") +
                                                                         ":/usr/sbin:/sbin")]
    if absent:
        return f"{INSTALL_HINT} (missing: {', '.join(absent)})"
    if os.geteuid() != 0:
        return "the Slurm tests start slurmd, which needs root"
    return None


def free_port() -> int:
    with closing(socket.socket()) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def daemon(name: str) -> str:
    return shutil.which(name, path="/usr/sbin:/sbin:" + os.environ.get("PATH", ""))


def munge_works() -> bool:
    encode = subprocess.run(["munge", "-n"], capture_output=True)
    return encode.returncode == 0 and subprocess.run(["unmunge"], input=encode.stdout,
                                                     capture_output=True).returncode == 0


def start_munge() -> Optional[psutil.Process]:
    """munged as the munge user, unless one already answers; returns the one started here."""
    if munge_works():
        return None
    key = Path("/etc/munge/munge.key")
    if not key.exists():  # the package makes one on the machines tried; a shared key is what munge needs
        key.write_bytes(os.urandom(1024))
        shutil.chown(key, "munge", "munge")
        key.chmod(0o400)
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    subprocess.run(["su", "-s", "/bin/sh", "munge", "-c", f"{daemon('munged')} --force"], check=True)
    deadline = time.monotonic() + 10
    while not munge_works():
        assert time.monotonic() < deadline, "munged did not answer within 10 s"
        time.sleep(0.1)
    return next((p for p in psutil.process_iter(["name"]) if p.info["name"] == "munged"), None)


def slurm_conf(folder: Path, host: str, cpus: int) -> str:
    return "\n".join([
        "ClusterName=tests",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={free_port()}",
        f"SlurmdPort={free_port()}",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        "AuthInfo=cred_expire=5",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "SchedulerType=sched/builtin",
        "SchedulerParameters=sched_interval=1",
        "MpiDefault=none",
        "SlurmUser=root",
        "SlurmdUser=root",
        "ReturnToService=2",
        "JobRequeue=1",
        "MinJobAge=3600",
        f"KillWait={KILL_WAIT_SEC}",
        "InactiveLimit=0",
        f"StateSaveLocation={folder / 'state'}",
        f"SlurmdSpoolDir={folder / 'spool'}",
        f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
        f"SlurmdPidFile={folder / 'slurmd.pid'}",
        f"SlurmctldLogFile={folder / 'slurmctld.log'}",
        f"SlurmdLogFile={folder / 'slurmd.log'}",
        f"NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN",
        f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP",
        "",
    ])


@dataclass
class SlurmCluster:
    """The running cluster: `env` is what a command needs to reach it (SLURM_CONF)."""

    folder: Path
    env: dict[str, str]
    munged: Optional[psutil.Process] = None
    started: float = field(default_factory=time.time)

    @classmethod
    def start(cls, folder: Path) -> "SlurmCluster":
        host = socket.gethostname()
        for sub in ("state", "spool"):
            (folder / sub).mkdir(parents=True)
        (folder / "slurm.conf").write_text(slurm_conf(folder, host, os.cpu_count() or 1))
        env = {**os.environ, "SLURM_CONF": str(folder / "slurm.conf")}
        cluster = cls(folder, env, start_munge())
        subprocess.run([daemon("slurmctld"), "-c"], env=env, check=True)
        subprocess.run([daemon("slurmd"), "-N", host], env=env, check=True)
        cluster.wait_until_idle(timeout=30)
        return cluster

    def command(self, *words: str, check: bool = True) -> str:
        result = subprocess.run(words, env=self.env, capture_output=True, text=True)
        if check and result.returncode:
            raise RuntimeError(f"{' '.join(words)}: exit {result.returncode}: {result.stderr.strip()}")
        return result.stdout

    def wait_until_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while "idle" not in self.command("sinfo", "--noheader", "--format=%T", check=False):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Slurm node is not idle after {timeout:.0f} s:\n{self.logs()}")
            time.sleep(0.2)

    def submit(self, *words: str, env: Optional[dict[str, str]] = None) -> str:
        """`sbatch --parsable WORDS` from the repository; returns the job id."""
        result = subprocess.run(["sbatch", "--parsable", *words], env={**self.env, **(env or {})},
                                capture_output=True, text=True)
        if result.returncode:
            raise RuntimeError(f"sbatch {' '.join(words)}: {result.stderr.strip()}")
        return result.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, Restarts, ...)."""
        text = self.command("scontrol", "show", "job", job_id, "--oneliner")
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait_for_state(self, job_id: str, states: tuple[str, ...], timeout: float) -> dict[str, str]:
        """Polls twice a second: each `scontrol show job` costs 13 ms of CPU (scontrol, munged and slurmctld)."""
        deadline = time.monotonic() + timeout
        while (job := self.job(job_id))["JobState"] not in states:
            if time.monotonic() > deadline:
                self.command("scancel", job_id, check=False)
                raise AssertionError(f"job {job_id} is {job['JobState']}, not {'/'.join(states)}, after "
                                     f"{timeout:.0f} s: {job}")
            time.sleep(0.5)
        return job

    def logs(self) -> str:
        return "\n".join(f"--- {name}\n" + (self.folder / name).read_text()[-3000:]
                         for name in ("slurmctld.log", "slurmd.log") if (self.folder / name).exists())

    def stop(self) -> None:
        """Stop everything this cluster started, jobs included: a test that failed mid-job leaves no process behind.
        The daemons and job steps are found by the configuration in their environment, the munged started here by
        its process."""
        self.command("scancel", "--user", "root", check=False)
        started = [process for process in psutil.process_iter(["name"])
                   if process.info["name"] in ("slurmd", "slurmctld", "slurmstepd") and self.configured(process)]
        every = started + [child for process in started for child in safe_children(process)]
        every += [self.munged] if self.munged is not None else []
        for process in every:
            with suppress(psutil.NoSuchProcess):
                process.terminate()
        _, alive = psutil.wait_procs(every, timeout=5)
        for process in alive:
            with suppress(psutil.NoSuchProcess):
                process.kill()

    def configured(self, process: psutil.Process) -> bool:
        """The daemons carry this cluster's SLURM_CONF; the job steps' slurmstepd clears its environment, so those
        started since this cluster did are taken as its own (the tests run one cluster at a time)."""
        try:
            if process.info["name"] == "slurmstepd":
                return process.create_time() >= self.started
            return process.environ().get("SLURM_CONF") == self.env["SLURM_CONF"]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return False


def safe_children(process: psutil.Process) -> list[psutil.Process]:
    try:
        return process.children(recursive=True)
    except psutil.NoSuchProcess:
        return []
