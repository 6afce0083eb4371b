"""The project's own sbatch scripts on a real one-node Slurm cluster (tests/helpers/slurm_cluster.py): submitted with
`sbatch`, changing only sbatch options (2 CPU tasks, no GPUs) and train.py arguments, preempted, warned, frozen and
crashed the ways Slurm and clusters do, each job followed to its end state.

Without Slurm these tests skip with one line saying how to install it; in CI (`CI` set) a missing Slurm fails them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import signal
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import psutil
import pytest

from app.checkpoint import list_checkpoints
from app.exit_codes import EXIT_BAD_INPUT, EXIT_PREEMPTED, EXIT_RENDEZVOUS_TIMEOUT, EXIT_STALLED
from conftest import ROOT, STEP_LINE, TinySetup, catches, read_checkpoint, run_train, train_args
from tests.helpers.slurm_cluster import SlurmCluster, missing_slurm
from test_reliability import logged_losses

CPU_TASKS = ["--nodes", "1", "--ntasks-per-node", "2", "--cpus-per-task", "1", "--gpus-per-node", "0"]
CPU_TORCHRUN = ["--nodes", "1", "--ntasks-per-node", "1", "--cpus-per-task", "2", "--gpus-per-node", "0",
                "--export", "ALL,PROCS_PER_NODE=2"]
MAX_STEP = 30
END_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")
JOB_SEC = 240
"""The longest a job may take here, requeues included (each requeue waits about 25 s for Slurm's credentials)."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    reason = missing_slurm()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the Slurm tests: {reason}", pytrace=False)
        pytest.skip(reason)
    with one_cluster_at_a_time():
        cluster = SlurmCluster.start(tmp_path_factory.mktemp("slurm"))
        yield cluster
        cluster.stop()


@contextmanager
def one_cluster_at_a_time() -> Iterator[None]:
    """Where pytest-xdist splits this file between workers (`-n N` without `--dist loadfile`), each worker's cluster
    waits for the previous one to stop: two on one machine would share the node's CPUs and stop each other's jobs."""
    with open(Path(tempfile.gettempdir()) / "fsdp-trainer-slurm-tests.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@dataclass
class Job:
    """A submitted job and its output file (--open-mode=append: every start of a requeued job writes to it)."""

    cluster: SlurmCluster
    id: str
    log: Path
    out_dir: Path

    def output(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def steps(self) -> list[int]:
        return [int(step) for step in STEP_LINE.findall(self.output())]

    def wait_for_step(self, step: int, timeout: float = 120) -> None:
        """Until the job's output shows a step >= `step`."""
        self.wait_until(lambda: any(s >= step for s in self.steps()), f"step {step}", timeout)

    def wait_for(self, pattern: str, timeout: float = 120) -> None:
        self.wait_until(lambda: re.search(pattern, self.output()) is not None, repr(pattern), timeout)

    def wait_until(self, condition: Callable[[], bool], what: str, timeout: float) -> None:
        """Polls `condition` every 50 ms and the job's state every second: each `scontrol show job` costs 13 ms of
        CPU (scontrol, munged and slurmctld), a quarter of a core at the condition's pace."""
        deadline = time.monotonic() + timeout
        state_checked = time.monotonic()
        while not condition():
            assert time.monotonic() < deadline, f"no {what} within {timeout} s: {self.describe()}"
            if time.monotonic() - state_checked >= 1:
                assert self.state() not in END_STATES, f"job ended before {what}: {self.describe()}"
                state_checked = time.monotonic()
            time.sleep(0.05)

    def state(self) -> str:
        return self.cluster.job(self.id)["JobState"]

    def end(self, timeout: float = JOB_SEC) -> dict[str, str]:
        """Wait for the job's end state; `scontrol show job` fields."""
        return self.cluster.wait_for_state(self.id, END_STATES, timeout)

    def task_process(self, rank: int) -> psutil.Process:
        """The train.py process of task `rank` (SLURM_PROCID)."""
        for process in psutil.process_iter(["cmdline"]):
            cmdline = process.info["cmdline"] or []
            if "train.py" in cmdline and str(self.out_dir) in cmdline and not cmdline[0].endswith("srun"):
                try:
                    if process.environ().get("SLURM_PROCID") == str(rank):
                        return process
                except psutil.NoSuchProcess:
                    continue
        raise AssertionError(f"no process of task {rank}: {self.describe()}")

    def describe(self) -> str:
        return f"job {self.id} {self.cluster.job(self.id)}\n--- output\n{self.output()[-5000:]}"


def submit(cluster: SlurmCluster, script: str, sbatch: list[str], tiny: TinySetup, out_dir: Path,
           **train: object) -> Job:
    """`sbatch <sbatch> slurm/<script> <train.py arguments>` from the repository, as a user submits it, with this
    virtual environment's python first on PATH."""
    log = out_dir.parent / f"{out_dir.name}.out"
    args = train_args(tiny, out_dir, devices=None, max_step=MAX_STEP, **train)
    env = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    job_id = cluster.submit(*sbatch, "--output", str(log), "--chdir", str(ROOT), f"slurm/{script}", *args, env=env)
    return Job(cluster, job_id, log, out_dir)


@pytest.fixture(scope="module")
def straight(tiny: TinySetup, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The out_dir of the uninterrupted run every preempted job is compared with: the same 2 ranks, started by
    Lightning's launcher outside Slurm (forked past the imports, tests/forkserver.py). Every job below that
    completes shows what a plain job does; a job of its own only for these losses cost 2 tasks started from
    scratch."""
    out_dir = tmp_path_factory.mktemp("straight") / "run"
    result = run_train(train_args(tiny, out_dir, max_step=MAX_STEP))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out_dir


def assert_completed(job: Job, restarts: int) -> None:
    fields = job.cluster.job(job.id)
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", str(restarts)), \
        job.describe()
    assert job.steps()[-1] == MAX_STEP and "Traceback" not in job.output(), job.describe()


def assert_same_losses(job: Job, straight: Path) -> None:
    expected, got = logged_losses(straight), logged_losses(job.out_dir)
    assert sorted(got) == list(range(1, MAX_STEP + 1))
    assert max(abs(got[s] - expected[s]) / abs(expected[s]) for s in expected) <= 1e-6


def stop_steps(job: Job) -> list[int]:
    return [int(step) for step in re.findall(r"step (\d+): stopped by a signal after saving", job.output())]


@pytest.mark.slow
def test_a_two_task_job_preempted_warned_and_frozen_requeues_each_time_and_ends_with_the_straight_losses(
        cluster: SlurmCluster, tiny: TinySetup, straight: Path, tmp_path: Path) -> None:
    """A two-task job of train.sbatch (Lightning's SLURMEnvironment takes both ranks from srun), one job for three
    interruptions, as each start costs two tasks started from scratch:
    1. Slurm's preemption with requeue (`scontrol requeue`: SIGTERM to every task, KillWait, requeue);
    2. the warning before a time limit (`scancel --signal=USR1`, as `--signal=USR1@120` sends it) with
       --requeue_on_signal true: the job requeues itself;
    3. task 1 stopped (SIGSTOP) mid-run: task 0's watchdog prints its stacks and exits 4, srun ends the frozen task
       (--kill-on-bad-exit; without it the job stayed RUNNING for as long as anyone waited), and the script
       requeues, with MAX_REQUEUES=1 after two restarts: a preemption or a warning is no stall (counting Slurm's
       restarts, the script gave up on it).
    Each start resumes at the step after its checkpoint."""
    job = submit(cluster, "train.sbatch", CPU_TASKS + ["--export", "ALL,MAX_REQUEUES=1"], tiny, tmp_path / "run",
                 requeue_on_signal=True, stall_timeout_min=0.1, save_step_interval=2)
    job.wait_for_step(1)
    assert "job " in job.output() and "1 nodes x 2 tasks" in job.output(), job.describe()
    assert "x 2 ranks)" in job.output(), "Lightning's SLURMEnvironment took both ranks from srun"
    assert job.output().count("--resume true: no checkpoint in") == 1, "the preflight's notes: one task per node"
    job.wait_for_step(3)
    cluster.command("scontrol", "requeue", job.id)
    job.wait_for(r"resumed from")
    first_stop = stop_steps(job)[0]
    job.wait_for_step(first_stop + 3)
    cluster.command("scancel", "--signal=USR1", job.id)
    job.wait_until(lambda: len(stop_steps(job)) == 2 and job.output().count("resumed from") == 2, "a second resume",
                   JOB_SEC)
    second_stop = stop_steps(job)[1]
    job.wait_for_step(second_stop + 2)
    job.task_process(1).suspend()
    frozen = time.monotonic()
    cluster.wait_for_state(job.id, ("PENDING", "REQUEUED"), timeout=60)
    seconds = time.monotonic() - frozen
    job.end()
    assert_completed(job, restarts=3)
    output = job.output()
    assert 3 <= first_stop < second_stop < MAX_STEP, job.describe()
    resumed = re.findall(r"resumed from \S+ at step (\d+)", output)
    assert len(resumed) == 3 and resumed[:2] == [str(first_stop), str(second_stop)], job.describe()
    assert int(resumed[2]) >= second_stop, job.describe()
    assert "requeueing the Slurm job" in output and "requeue failed" not in output, job.describe()
    assert "rank 0: stalled: no optimizer step, evaluation or save finished in 0.1 min" in output
    assert re.search(rf"srun: error: \S+: task 0: Exited with exit code {EXIT_STALLED}", output), job.describe()
    assert f"train.py exited with {EXIT_STALLED}: requeueing job {job.id} to resume from the latest checkpoint " \
        "(requeue 1 of 1 after a stall, a lost node or a corrupt checkpoint)" in output, job.describe()
    print(f"\nfrozen task: job requeued {seconds:.1f} s after SIGSTOP (--stall_timeout_min 0.1)")
    assert_same_losses(job, straight)
    assert len(read_checkpoint(job.out_dir / "checkpoints" / f"step-{MAX_STEP:08d}.ckpt")["rng"]) == 2
    losses = logged_losses(job.out_dir)
    assert losses[MAX_STEP] < losses[1] - 1.0


@pytest.mark.slow
def test_a_time_limit_warning_without_requeue_on_signal_ends_the_job_with_75_and_says_how_to_go_on(
        cluster: SlurmCluster, tiny: TinySetup, tmp_path: Path) -> None:
    job = submit(cluster, "train.sbatch", CPU_TASKS, tiny, tmp_path / "run")
    job.wait_for_step(3)
    cluster.command("scancel", "--signal=USR1", job.id)
    fields = job.end()
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("FAILED", f"{EXIT_PREEMPTED}:0", "0")
    assert "submit the same sbatch command again), or pass --requeue_on_signal true" in job.output(), job.describe()
    assert stop_steps(job)[0] in list_checkpoints(job.out_dir), job.describe()


@pytest.mark.slow
def test_an_interactive_jobs_time_limit_warning_to_its_batch_shell_saves_requeues_and_resumes(
        cluster: SlurmCluster, tiny: TinySetup, straight: Path, tmp_path: Path) -> None:
    """Two things users do. A job named `interactive` (salloc's name; `srun python train.py` in an allocation):
    Lightning stepped aside, each task started two ranks of its own, and one of the two runs was refused, the other
    ended by srun. A warning sent to the batch shell alone (`--signal=B:USR1@N`, `scancel --batch`): the shell died
    of it and the job FAILED without a checkpoint. The script picks its own free port and says it."""
    job = submit(cluster, "train.sbatch", CPU_TASKS + ["--job-name", "interactive"], tiny, tmp_path / "run",
                 requeue_on_signal=True)
    job.wait_for_step(3)
    cluster.command("scancel", "--batch", "--signal=USR1", job.id)
    job.end()
    assert_completed(job, restarts=1)
    [stop] = stop_steps(job)
    assert f"resumed from {job.out_dir / 'checkpoints' / f'step-{stop:08d}.ckpt'}" in job.output(), job.describe()
    assert "in use by another run" not in job.output() and re.search(r"tasks on \S+, port \d+", job.output())
    assert_same_losses(job, straight)


@pytest.mark.slow
def test_a_warning_before_training_that_reaches_another_task_first_still_requeues_the_job(
        cluster: SlurmCluster, tiny: TinySetup, tmp_path: Path) -> None:
    """SIGUSR1 before the first step, to task 1 before task 0 (task 0 held back here): task 1 quit with 75 at once,
    srun ended task 0 before it had said anything or requeued, and the job FAILED with 75, unsaid. Task 1 now waits
    for task 0 to say it and requeue, and for srun to end it."""
    job = submit(cluster, "train.sbatch", CPU_TASKS, tiny, tmp_path / "run", requeue_on_signal=True)
    deadline = time.monotonic() + 60
    while True:
        assert time.monotonic() < deadline, job.describe()
        with contextlib.suppress(AssertionError, psutil.NoSuchProcess, FileNotFoundError):
            first, second = job.task_process(0), job.task_process(1)
            if catches(first.pid, signal.SIGUSR1) and catches(second.pid, signal.SIGUSR1):
                break
        time.sleep(0.05)
    first.suspend()  # before the ranks meet: no step can be trained meanwhile
    second.send_signal(signal.SIGUSR1)
    time.sleep(1)
    first.resume()
    first.send_signal(signal.SIGUSR1)
    cluster.wait_for_state(job.id, ("PENDING", "REQUEUED"), timeout=60)
    cluster.command("scancel", job.id)
    assert "SIGUSR1 before training began: nothing new to save (exit 75)" in job.output(), job.describe()
    assert "step 1/" not in job.output(), job.describe()


@pytest.mark.slow
def test_the_torchrun_script_refuses_more_than_one_task_per_node(cluster: SlurmCluster, tiny: TinySetup,
                                                                 tmp_path: Path) -> None:
    """Two torchruns on one node formed a world each (or one with two processes on each GPU); the job FAILED with
    1 after training, or with torch's traceback."""
    job = submit(cluster, "train-torchrun.sbatch", CPU_TASKS, tiny, tmp_path / "run")
    fields = job.end(timeout=60)
    assert (fields["JobState"], fields["ExitCode"]) == ("FAILED", f"{EXIT_BAD_INPUT}:0"), job.describe()
    assert job.output() == ("slurm/train-torchrun.sbatch: it starts one torchrun per node, and this job has 2 tasks "
                            "and 1 node(s): submit it with --ntasks-per-node 1 (PROCS_PER_NODE sets the processes "
                            "each starts)\n")


@pytest.mark.slow
def test_a_killed_task_ends_the_whole_job_at_once_with_its_code_and_no_requeue(
        cluster: SlurmCluster, tiny: TinySetup, tmp_path: Path) -> None:
    """Task 1 killed (an out-of-memory kill, say): the job fails within a minute with 137 (128 + SIGKILL) and
    stays failed, as a requeued run would die the same way."""
    job = submit(cluster, "train.sbatch", CPU_TASKS, tiny, tmp_path / "run")
    job.wait_for_step(3)
    job.task_process(1).send_signal(signal.SIGKILL)
    killed = time.monotonic()
    fields = job.end(timeout=60)
    seconds = time.monotonic() - killed
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("FAILED", "137:0", "0"), job.describe()
    assert "requeueing" not in job.output()
    print(f"\nkilled task: job FAILED {seconds:.1f} s later")


@pytest.mark.slow
def test_the_torchrun_script_saves_on_preemption_and_resumes_with_the_straight_losses(
        cluster: SlurmCluster, tiny: TinySetup, straight: Path, tmp_path: Path) -> None:
    """slurm/train-torchrun.sbatch: one torchrun per node (here 2 CPU processes); `scontrol requeue` sends SIGTERM to
    torchrun, which hands it to its workers; they save, and the requeued job resumes."""
    job = submit(cluster, "train-torchrun.sbatch", CPU_TORCHRUN, tiny, tmp_path / "run")
    job.wait_for_step(3)
    cluster.command("scontrol", "requeue", job.id)
    job.end()
    assert_completed(job, restarts=1)
    assert "1 nodes x 2 processes" in job.output()
    assert "torchrun: SIGTERM handed to the workers, which stopped; exit 75" in job.output(), job.describe()
    [stop] = stop_steps(job)
    assert f"resumed from {job.out_dir / 'checkpoints' / f'step-{stop:08d}.ckpt'}" in job.output()
    assert_same_losses(job, straight)


@pytest.mark.slow
@pytest.mark.parametrize("script, sbatch", [("train.sbatch", CPU_TASKS), ("train-torchrun.sbatch", CPU_TORCHRUN)])
def test_a_refused_input_fails_the_job_with_2_and_one_line(cluster: SlurmCluster, tiny: TinySetup, tmp_path: Path,
                                                          script: str, sbatch: list[str]) -> None:
    """Every task (every torchrun worker) checks the same inputs: the log held the refusal once per task (with
    torchrun's 25-line failure report), and srun, which ends the other tasks when one fails and exits with the
    highest code, gave 143 in three of four jobs (the tasks it ended mid-check) instead of 2."""
    (tmp_path / "missing").mkdir()
    job = submit(cluster, script, sbatch, tiny, tmp_path / "run", train_data_dir=tmp_path / "missing" / "data")
    fields = job.end(timeout=120)
    output = job.output()
    assert (fields["JobState"], fields["ExitCode"]) == ("FAILED", f"{EXIT_BAD_INPUT}:0"), job.describe()
    assert output.count("error: --train_data_dir") == 1, job.describe()
    assert "Traceback" not in output and "Root Cause" not in output, job.describe()


@pytest.mark.slow
def test_a_task_that_never_joins_times_out_the_rendezvous_with_5_and_the_job_is_requeued(
        cluster: SlurmCluster, tiny: TinySetup, tmp_path: Path) -> None:
    """Task 1 frozen while it starts (a node that never joins): task 0 ends the rendezvous with 5, which the script
    requeues; srun ended task 1, whose 143 outranked the 5, and the job FAILED instead."""
    job = submit(cluster, "train.sbatch", CPU_TASKS, tiny, tmp_path / "run", rendezvous_timeout_min=0.2)
    deadline = time.monotonic() + 60
    while True:
        assert time.monotonic() < deadline, job.describe()
        with contextlib.suppress(AssertionError, psutil.NoSuchProcess, FileNotFoundError):
            task = job.task_process(1)
            if catches(task.pid, signal.SIGTERM):
                break
        time.sleep(0.05)
    task.suspend()
    cluster.wait_for_state(job.id, ("PENDING", "REQUEUED"), timeout=120)
    cluster.command("scancel", job.id)
    output = job.output()
    assert re.search(rf"srun: error: \S+: task 0: Exited with exit code {EXIT_RENDEZVOUS_TIMEOUT}", output), \
        job.describe()
    assert f"train.py exited with {EXIT_RENDEZVOUS_TIMEOUT}: requeueing job {job.id}" in output, job.describe()


@pytest.mark.slow
def test_a_job_submitted_outside_the_repository_ends_at_once_with_2_and_says_where_to_submit_from(
        cluster: SlurmCluster, tmp_path: Path) -> None:
    """The scripts run train.py from the job's folder: from elsewhere every task said "can't open file" instead."""
    log = tmp_path / "job.out"
    job_id = cluster.submit(*CPU_TASKS, "--output", str(log), "--chdir", str(tmp_path),
                            str(ROOT / "slurm" / "train.sbatch"), "--accelerator", "cpu")
    fields = cluster.wait_for_state(job_id, END_STATES, timeout=60)
    assert (fields["JobState"], fields["ExitCode"]) == ("FAILED", f"{EXIT_BAD_INPUT}:0"), log.read_text()
    assert log.read_text() == (f"slurm/train.sbatch: no train.py in {tmp_path}: submit from the repository's "
                               "folder, or give sbatch --chdir <repository>\n")


@pytest.mark.slow
def test_a_job_submitted_without_the_environment_ends_at_once_with_2_and_says_to_activate_it(
        cluster: SlurmCluster, tmp_path: Path) -> None:
    """Without the project's environment on PATH every task printed an ImportError traceback."""
    log = tmp_path / "job.out"
    job_id = cluster.submit(*CPU_TASKS, "--output", str(log), "--chdir", str(ROOT),
                            "slurm/train.sbatch", "--accelerator", "cpu", env={"PATH": "/usr/bin:/bin"})
    fields = cluster.wait_for_state(job_id, END_STATES, timeout=60)
    assert (fields["JobState"], fields["ExitCode"]) == ("FAILED", f"{EXIT_BAD_INPUT}:0"), log.read_text()
    assert log.read_text().endswith("the project's packages are not there: activate its environment "
                                    "(source .venv/bin/activate) before sbatch\n"), log.read_text()
