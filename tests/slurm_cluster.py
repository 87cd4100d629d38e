"""A throw-away one-node Slurm cluster for the tests (a helper module, not a test file).

Everything lives in a fresh temporary folder: slurm.conf (daemons and commands find it through
SLURM_CONF, so /etc/slurm is neither read nor written), the controller's state, slurmd's spool,
the logs, and a private munged with its own key and socket (the machine's munge set-up is not
touched either). The daemons run as root, like on the Debian packages' defaults.

    cluster = SlurmCluster()       # SlurmCluster(cpus=8): CPUs the node claims (may exceed the cores)
    cluster.start()                # raises Unavailable(reason) where Slurm cannot run here
    job = cluster.sbatch("--wrap=hostname")
    cluster.wait(job)              # scontrol's fields of the finished job: {"JobState": "COMPLETED", ...}
    cluster.stop()                 # cancels the jobs, stops the daemons, kills what is left; idempotent

`cluster.env` is the environment for commands against it (SLURM_CONF set, the caller's own
SLURM_* variables removed). There is no accounting (no slurmdbd): job states come from
`scontrol show job`, which keeps finished jobs for MinJobAge (an hour).
Timings here (Slurm 22.05, 2 cores): start under 1 s; a job requeued from inside starts again
10-17 s later (KillWait=5, cred_expire=10; ~3 minutes with Slurm's defaults).
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
COMMANDS = ("sbatch", "scontrol", "squeue", "scancel", "sinfo", "srun")
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
            "DEADLINE", "PREEMPTED"}

# Settings that were seen to work on one machine without systemd, cgroups or a GPU, and keep the
# scheduler quick: linuxproc / task none (no cgroups), select by core with CPUs= allowed above the
# real core count, a 2 s scheduling pass, short credential lifetime and kill wait (fast requeues).
CONF = """\
ClusterName=laplace-test
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=10,socket={root}/munge/munge.socket
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MailProg=/bin/true
KillWait=5
SchedulerParameters=sched_interval=2
MinJobAge=3600
ReturnToService=2
JobRequeue=1
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc={root}/log/jobcomp.txt
PlugStackConfig={root}/plugstack.conf
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/run/slurmctld.pid
SlurmdPidFile={root}/run/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
NodeName={node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class Unavailable(RuntimeError):
    """Slurm cannot run on this machine; the message says why (tests skip with it)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    """Running (a zombie, which a daemon's exit leaves until init reaps it, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def parse_job(text: str) -> dict:
    """`scontrol show job -o` output -> {field: value} (values without spaces are all we read)."""
    return dict(re.findall(r"(\w+)=(\S*)", text))


class SlurmCluster:
    """One slurmctld + one slurmd (node `cpus` CPUs) + a private munged, all under a temp folder."""

    def __init__(self, cpus: int = 8):
        self.cpus = cpus
        self.node = socket.gethostname().split(".")[0]
        self.root: Path | None = None
        self.env: dict = {}
        self._pids: dict[str, int] = {}

    # ------------------------------------------------------------------ start / stop

    def start(self) -> "SlurmCluster":
        # The daemons live in /usr/sbin, which a non-root PATH may lack.
        path = f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin"
        self._bin = {c: shutil.which(c, path=path) for c in DAEMONS}
        missing = [c for c in DAEMONS + COMMANDS if (self._bin.get(c) or shutil.which(c)) is None]
        if missing:
            raise Unavailable(f"Slurm is not installed here (missing {', '.join(missing)}); CI installs "
                              "slurmctld slurmd slurm-client munge with apt-get")
        if os.geteuid() != 0:
            raise Unavailable("the test cluster's daemons run as root, and this is not root")
        self.root = Path(tempfile.mkdtemp(prefix="laplace-slurm-"))
        self.root.chmod(0o755)  # munged (user munge) must reach its own folder below
        for d in ("state", "spool", "run", "log"):
            (self.root / d).mkdir()
        (self.root / "plugstack.conf").write_text("")
        conf = self.root / "slurm.conf"
        conf.write_text(CONF.format(node=self.node, cpus=self.cpus, root=self.root,
                                    ctld_port=_free_port(), slurmd_port=_free_port()))
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
        self.env["SLURM_CONF"] = str(conf)
        try:
            self._start_munge()
            self._daemon("slurmctld", [self._bin["slurmctld"], "-i"])
            self._daemon("slurmd", [self._bin["slurmd"], "-N", self.node])
            self._wait_for_node()
        except Exception:
            self.stop()
            raise
        return self

    def _start_munge(self):
        d = self.root / "munge"
        d.mkdir()
        d.chmod(0o755)  # munged: its socket folder must be searchable by all
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        shutil.chown(d, "munge", "munge")
        shutil.chown(key, "munge", "munge")
        self._daemon("munged", [self._bin["munged"], f"--socket={d}/munge.socket", f"--key-file={key}",
                                f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log",
                                f"--seed-file={d}/munged.seed"], user="munge", pid_file=d / "munged.pid")

    def _daemon(self, name: str, cmd: list[str], user: str | None = None, pid_file: Path | None = None):
        """Start a daemon that forks into the background; remember its pid."""
        proc = subprocess.run(cmd, env=self.env, user=user, capture_output=True, text=True, timeout=30)
        pid_file = pid_file or self.root / "run" / f"{name}.pid"
        deadline = time.monotonic() + 10
        while proc.returncode == 0 and not (pid_file.exists() and pid_file.read_text().strip()):
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        if proc.returncode != 0 or not pid_file.exists():
            raise Unavailable(f"{name} did not start (exit {proc.returncode}): "
                              f"{(proc.stderr or proc.stdout).strip()[-500:]} {self._log_tail(name)}")
        self._pids[name] = int(pid_file.read_text().split()[0])

    def _wait_for_node(self, timeout: float = 30):
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.run("sinfo", "-h", "-N", "-o", "%T", check=False).stdout.strip()
            if state in ("idle", "mixed", "allocated"):
                return
            time.sleep(0.2)
        raise Unavailable(f"the node did not come up in {timeout:.0f} s (state {state!r}): "
                          f"{self._log_tail('slurmd')} {self._log_tail('slurmctld')}")

    def _log_tail(self, name: str) -> str:
        log = self.root / ("munge/munged.log" if name == "munged" else f"log/{name}.log")
        try:
            lines = [l for l in log.read_text().splitlines() if "error" in l.lower()]
        except OSError:
            return ""
        return f"[{log.name}: {' | '.join(lines[-3:])}]" if lines else ""

    def stop(self) -> list[str]:
        """Cancel every job, stop the daemons, then kill any process still running under this
        cluster (found by SLURM_CONF in its environment). Returns what had to be killed that way."""
        if self.root is None:
            return []
        if self._pids.get("slurmctld") and _alive(self._pids["slurmctld"]):
            jobs = self.run("squeue", "-h", "-o", "%A", check=False).stdout.split()
            if jobs:
                self.run("scancel", *jobs, check=False)
                self._until(lambda: not self.run("squeue", "-h", "-o", "%A", check=False).stdout.split(), 30)
            self.run("scontrol", "shutdown", check=False)
        for name in ("slurmd", "slurmctld", "munged"):
            pid = self._pids.pop(name, None)
            if pid is None:
                continue
            # scontrol shutdown ends slurmctld and slurmd; munged (and a daemon that hangs) gets TERM, then KILL.
            for sig, wait in ((None, 0 if name == "munged" else 15), (signal.SIGTERM, 10), (signal.SIGKILL, 5)):
                if sig is not None and _alive(pid):
                    os.kill(pid, sig)
                if self._until(lambda: not _alive(pid), wait):
                    break
        leftovers = self._kill_leftovers()
        if os.environ.get("LAPLACE_KEEP_SLURM") != "1":
            shutil.rmtree(self.root, ignore_errors=True)
        self.root = None
        return leftovers

    def _kill_leftovers(self) -> list[str]:
        mark = f"SLURM_CONF={self.env['SLURM_CONF']}".encode()
        killed = []
        for d in os.listdir("/proc"):
            if not d.isdigit() or int(d) == os.getpid():
                continue
            try:
                with open(f"/proc/{d}/environ", "rb") as f:
                    if mark not in f.read().split(b"\0"):
                        continue
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                if _alive(int(d)):
                    os.kill(int(d), signal.SIGKILL)
                    killed.append(f"{d} {cmd}")
            except OSError:  # gone meanwhile
                continue
        return killed

    @staticmethod
    def _until(cond, timeout: float, every: float = 0.2) -> bool:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                return False
            time.sleep(every)
        return True

    def __enter__(self) -> "SlurmCluster":
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # ------------------------------------------------------------------ jobs

    def run(self, *cmd: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
        """A command against this cluster (its SLURM_CONF)."""
        proc = subprocess.run(cmd, env=kw.pop("env", self.env), capture_output=True, text=True, timeout=60, **kw)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def sbatch(self, *args: str, **kw) -> str:
        """Submit; returns the job id."""
        return self.run("sbatch", "--parsable", *args, **kw).stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict:
        """scontrol's fields of one job (JobState, Restarts, ExitCode, StartTime, EndTime, ...)."""
        return parse_job(self.run("scontrol", "show", "job", "-o", str(job_id)).stdout)

    def wait(self, *job_ids: str, timeout: float = 120, every: float = 0.3) -> dict | list[dict]:
        """Poll until every job has finished (requeues pass through PENDING and do not count);
        returns each job's fields. A job still running after `timeout` s raises TimeoutError."""
        deadline = time.monotonic() + timeout
        pending = list(job_ids)
        while True:
            jobs = {j: self.job(j) for j in pending}
            if all(info.get("JobState") in FINISHED for info in jobs.values()):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"jobs still running after {timeout:.0f} s: "
                                   + ", ".join(f"{j} {i.get('JobState')}" for j, i in jobs.items()))
            time.sleep(every)
        out = [jobs[j] for j in job_ids]
        return out[0] if len(out) == 1 else out
