"""The deployment files users copy-paste: the Docker image, its run script and the Slurm batch scripts.

No Docker engine runs here, so these tests check what can be checked without one: hadolint on the Dockerfile, the
build context, the command lines the scripts produce, that Lightning's own cluster environment code accepts the
environment srun creates for the batch script's 2-node layout, and what the scripts do with each exit code. The
Slurm scripts also run on a real one-node Slurm cluster: tests/test_slurm.py.
"""

import fnmatch
import json
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import free_port

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "docker" / "Dockerfile"
RUN_SCRIPT = ROOT / "docker" / "run.sh"
SBATCH = ROOT / "slurm" / "train.sbatch"
SBATCH_TORCHRUN = ROOT / "slurm" / "train-torchrun.sbatch"
SECRET_NAMES = re.compile(r"TOKEN|API_KEY|SECRET|PASSWORD", re.IGNORECASE)


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs with line continuations joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", path.read_text())
    instructions = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, arguments = line.partition(" ")
            instructions.append((keyword.upper(), arguments.strip()))
    return instructions


def dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def is_ignored(relative_path: str, patterns: list[str]) -> bool:
    """Docker's rule: a pattern excludes the paths it matches and everything below a matched folder."""
    parts = relative_path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        bare = pattern.removeprefix("**/")
        if any(fnmatch.fnmatch(prefix, pattern) for prefix in prefixes):
            return True
        if pattern.startswith("**/") and any(fnmatch.fnmatch(part, bare) for part in parts):
            return True
    return False


def sbatch_options(path: Path) -> dict[str, str]:
    options = {}
    for match in re.finditer(r"^#SBATCH\s+--([\w-]+)(?:=(\S+))?", path.read_text(), re.MULTILINE):
        options[match.group(1)] = match.group(2) or ""
    return options


def launch_command(path: Path, program: str) -> list[str]:
    """The words of the (continued) command line that starts with `program`, without a trailing `|| ...` or `&`."""
    joined = re.sub(r"\\\n", " ", path.read_text())
    line = next(line for line in joined.splitlines() if line.strip().startswith(program + " "))
    words = shlex.split(line, posix=True)
    words = words[:words.index("||")] if "||" in words else words
    return words[:-1] if words[-1] == "&" else words


def flag_value(words: list[str], flag: str) -> str:
    return words[words.index(flag) + 1]


def shell_variable(path: Path, name: str, env: dict[str, str]) -> str:
    """`name` as the script sets it under `env`: the script run (with `set -euo pipefail`) up to its last assignment
    of `name`, the way bash runs it in the job."""
    lines = path.read_text().splitlines()
    last = max(i for i, line in enumerate(lines) if line.startswith(f"{name}="))
    prefix = "\n".join(lines[:last + 1])
    result = subprocess.run(["bash", "-c", f'{prefix}\nprintf %s "${name}"'], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout


def hadolint() -> str:
    beside_python = shutil.which("hadolint", path=str(Path(sys.executable).parent))
    found = beside_python or shutil.which("hadolint")
    assert found, "hadolint is missing: pip install -r requirements-dev.txt"
    return found


def test_dockerfile_passes_hadolint_at_every_level_without_ignore_pragmas():
    result = subprocess.run(
        [hadolint(), "--failure-threshold", "info", "--disable-ignore-pragma", "--no-color", str(DOCKERFILE)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_base_image_torch_matches_the_requirements_pin():
    torch_pin = re.search(r"^torch==(\S+)$", (ROOT / "requirements.txt").read_text(), re.MULTILINE).group(1)
    base_arg = next(args for kw, args in dockerfile_instructions(DOCKERFILE) if kw == "ARG" and "BASE_IMAGE=" in args)
    image = base_arg.split("=", 1)[1]
    assert image.startswith(f"pytorch/pytorch:{torch_pin}-cuda") and image.endswith("-runtime"), image


def test_requirements_are_installed_in_a_layer_before_the_code_is_copied():
    instructions = dockerfile_instructions(DOCKERFILE)
    copy_requirements = instructions.index(("COPY", "requirements.txt ./"))
    install = next(i for i, (kw, args) in enumerate(instructions) if kw == "RUN" and "-r requirements.txt" in args)
    copy_code = next(i for i, (kw, args) in enumerate(instructions) if kw == "COPY" and args.endswith(". ."))
    assert copy_requirements < install < copy_code


def test_every_copied_file_exists_and_is_in_the_build_context():
    patterns = dockerignore_patterns()
    for keyword, arguments in dockerfile_instructions(DOCKERFILE):
        if keyword != "COPY":
            continue
        sources = [word for word in shlex.split(arguments) if not word.startswith("--")][:-1]
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: missing from the repository"
            if source != ".":
                assert not is_ignored(source, patterns), f"COPY {source}: excluded by .dockerignore"


def test_build_context_keeps_the_code_and_drops_secrets_data_and_results():
    patterns = dockerignore_patterns()
    needed = ["requirements.txt", "prefetch.py", "app/huggingface/prefetch.py", "slurm/train.sbatch", "docker/run.sh"]
    needed += [name for name in ("train.py", "prepare_data.py", "convert_to_hf.py") if (ROOT / name).exists()]
    assert [path for path in needed if is_ignored(path, patterns)] == []
    unwanted = [".venv/bin/python", ".git/HEAD", "wandb/run-1/x", "runs/a/checkpoints/step-00000004.ckpt",
                "outputs/model.safetensors", "app/__pycache__/x.pyc", ".cache/huggingface/token", "checkpoints/x",
                ".gpu-image/bin/python", ".whl/datasets-5.2.0-py3-none-any.whl", "gpu-check.json",
                ".gpu-check-site/jsonargparse/__init__.py"]  # make gpu-*
    assert [path for path in unwanted if not is_ignored(path, patterns)] == []


def test_no_credential_is_baked_into_the_image():
    for keyword, arguments in dockerfile_instructions(DOCKERFILE):
        if keyword in ("ENV", "ARG"):
            names = re.findall(r"(\w+)=", arguments) or [arguments.split()[0]]
            assert not [name for name in names if SECRET_NAMES.search(name)], f"{keyword} {arguments}"
            assert not re.search(r"\bhf_[A-Za-z0-9]{20,}", arguments)
        if keyword == "RUN":
            assert "login" not in arguments, f"RUN {arguments}"


def test_image_runs_as_a_non_root_user():
    users = [args for kw, args in dockerfile_instructions(DOCKERFILE) if kw == "USER"]
    assert users, "no USER instruction: the container would run as root"
    assert users[-1].split(":")[0] not in ("root", "0")
    uid_default = next(args for kw, args in dockerfile_instructions(DOCKERFILE) if kw == "ARG" and args.startswith("UID="))
    assert users[-1] == "${UID}" and uid_default != "UID=0"


def test_hf_home_is_a_volume():
    instructions = dockerfile_instructions(DOCKERFILE)
    env = " ".join(args for kw, args in instructions if kw == "ENV")
    hf_home = re.search(r"HF_HOME=(\S+)", env).group(1)
    volumes = json.loads(next(args for kw, args in instructions if kw == "VOLUME"))
    assert hf_home in volumes


@pytest.fixture
def fake_docker(tmp_path):
    """A `docker` executable that records its arguments: the real client needs an engine this machine lacks."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "docker-args.json"
    script = bin_dir / "docker"
    script.write_text(
        f"#!{sys.executable}\nimport json, sys\njson.dump(sys.argv[1:], open({str(record)!r}, 'w'))\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return bin_dir, record


def test_run_script_gives_gpus_shared_memory_volumes_and_tokens_by_name_only(tmp_path, fake_docker):
    bin_dir, record = fake_docker
    (tmp_path / "data").mkdir()
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "DATA_DIR": str(tmp_path / "data"),
        "OUT_DIR": str(tmp_path / "outputs"),
        "HF_TOKEN": "hf_secretvalue0123456789abcdef",
        "WANDB_API_KEY": "wandb-secret-value",
    }
    command = ["python", "train.py", "--devices", "4"]
    subprocess.run([str(RUN_SCRIPT), *command], env=env, check=True, cwd=tmp_path)
    args = json.loads(record.read_text())
    joined = " ".join(args)

    assert args[0] == "run" and args[-len(command) :] == command
    assert flag_value(args, "--gpus") == "all"
    assert "--ipc=host" in args
    assert flag_value(args, "--stop-timeout") == "300", "docker stop's 10 s would kill the checkpoint a SIGTERM saves"
    volumes = [args[i + 1] for i, word in enumerate(args) if word == "--volume"]
    assert f"{tmp_path / 'data'}:/data:ro" in volumes
    assert f"{tmp_path / 'outputs'}:/outputs" in volumes
    assert "hf-cache:/cache/huggingface" in volumes
    passed = [args[i + 1] for i, word in enumerate(args) if word == "--env"]
    assert {"HF_TOKEN", "WANDB_API_KEY", "WANDB_MODE", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_NAME"} <= set(passed)
    assert env["HF_TOKEN"] not in joined and env["WANDB_API_KEY"] not in joined
    assert (tmp_path / "outputs").is_dir()


def test_run_script_refuses_a_missing_data_folder_in_one_line(tmp_path, fake_docker):
    bin_dir, record = fake_docker
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "DATA_DIR": str(tmp_path / "nope")}
    result = subprocess.run([str(RUN_SCRIPT)], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "DATA_DIR" in result.stderr
    assert not record.exists()


@pytest.mark.parametrize("script", [RUN_SCRIPT, SBATCH, SBATCH_TORCHRUN], ids=lambda p: p.name)
def test_scripts_are_valid_bash(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_sbatch_script_asks_for_one_task_per_gpu_and_a_preemption_signal():
    options = sbatch_options(SBATCH)
    assert options["ntasks-per-node"] == options["gpus-per-node"]
    assert re.fullmatch(r"USR1@\d+", options["signal"])
    assert "requeue" in options
    srun = launch_command(SBATCH, "srun")
    assert flag_value(srun, "--resume") == "true", "a requeued job must continue from its latest checkpoint"
    assert srun[1:4] == ["--kill-on-bad-exit=1", "python", "train.py"] and srun[-1] == "$@"
    assert flag_value(srun, "--num_nodes") == "$SLURM_NNODES"
    assert flag_value(srun, "--devices") == "$TASKS_PER_NODE"
    assert "--strategy" not in srun, "flags win over --config: the script passes only what the job decides"


def test_devices_are_the_tasks_per_node_and_torchruns_processes_the_gpu_count_even_with_a_gpu_type():
    job = {"SLURM_CPUS_PER_TASK": "8"}
    assert shell_variable(SBATCH, "TASKS_PER_NODE", job | {"SLURM_NTASKS_PER_NODE": "8"}) == "8"
    assert shell_variable(SBATCH, "TASKS_PER_NODE", job | {"SLURM_TASKS_PER_NODE": "8(x2)"}) == "8"  # --ntasks alone
    for reported in ("8", "a100:8", "gpu:h100:8"):
        assert shell_variable(SBATCH_TORCHRUN, "PROCS_PER_NODE", job | {"SLURM_GPUS_PER_NODE": reported}) == "8"
    assert shell_variable(SBATCH_TORCHRUN, "PROCS_PER_NODE", job) == "1"  # a node without GPUs, no set -u failure
    assert shell_variable(SBATCH_TORCHRUN, "PROCS_PER_NODE", job | {"PROCS_PER_NODE": "2"}) == "2"


def test_torchrun_sbatch_starts_one_launcher_per_node_with_one_worker_per_gpu():
    options = sbatch_options(SBATCH_TORCHRUN)
    assert options["ntasks-per-node"] == "1"
    words = launch_command(SBATCH_TORCHRUN, "srun")
    # torchrun passing on the failed worker's exit code
    assert words[1:5] == ["--kill-on-bad-exit=1", "python", "-m", "app.reliability.torchrun"]
    assert flag_value(words, "--nproc_per_node") == flag_value(words, "--devices") == "$PROCS_PER_NODE"
    assert flag_value(words, "--nnodes") == flag_value(words, "--num_nodes") == "$SLURM_NNODES"
    assert "SIGUSR1" in flag_value(words, "--signals_to_handle").split(",")


LIGHTNING_PROBE = textwrap.dedent(
    """
    import json, os, sys
    from lightning_fabric import Fabric
    from lightning_fabric.plugins.environments import SLURMEnvironment

    tasks, devices, num_nodes = json.loads(sys.argv[1])
    seen = []
    for task_env in tasks:
        os.environ.update(task_env)
        assert SLURMEnvironment.detect()
        fabric = Fabric(accelerator="cpu", strategy="ddp", devices=devices, num_nodes=num_nodes)
        fabric.strategy.launcher.launch(lambda: None)  # the checks fabric.launch() runs before any process group
        environment = fabric._connector.cluster_environment
        seen.append([type(environment).__name__, fabric.world_size, fabric.global_rank, fabric.local_rank,
                     fabric.node_rank, environment.main_address])
    try:
        fabric = Fabric(accelerator="cpu", strategy="ddp", devices=devices // 2, num_nodes=num_nodes)
        fabric.strategy.launcher.launch(lambda: None)
        seen.append("mismatch accepted")
    except ValueError as error:
        seen.append(str(error))
    print(json.dumps(seen))
    """
)


def srun_task_environments(options: dict[str, str], gpus_per_node: str) -> list[dict[str, str]]:
    """The SLURM_* variables srun sets in each task of a job with this #SBATCH layout (names from Slurm's srun docs)."""
    nodes, per_node = int(options["nodes"]), int(options["ntasks-per-node"])
    common = {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": options["job-name"],
        "SLURM_NNODES": str(nodes),
        "SLURM_NTASKS": str(nodes * per_node),
        "SLURM_NTASKS_PER_NODE": str(per_node),
        "SLURM_GPUS_PER_NODE": gpus_per_node,
        "SLURM_CPUS_PER_TASK": options["cpus-per-task"],
        "SLURM_NODELIST": f"gpu-node[{1:02d}-{nodes:02d}]",
    }
    return [
        {**common, "SLURM_PROCID": str(node * per_node + local), "SLURM_LOCALID": str(local), "SLURM_NODEID": str(node)}
        for node in range(nodes)
        for local in range(per_node)
    ]


def test_lightning_detects_slurm_and_derives_every_rank_from_the_sbatch_layout():
    options = sbatch_options(SBATCH)
    tasks = srun_task_environments(options, options["gpus-per-node"])
    nodes, per_node = int(options["nodes"]), int(options["ntasks-per-node"])
    devices = int(shell_variable(SBATCH, "TASKS_PER_NODE", tasks[0]))
    num_nodes = int(tasks[0]["SLURM_NNODES"])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "TORCHELASTIC_"))}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK"):
        env.pop(name, None)

    result = subprocess.run(
        [sys.executable, "-c", LIGHTNING_PROBE, json.dumps([tasks, devices, num_nodes])],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    *ranks, mismatch = json.loads(result.stdout.strip().splitlines()[-1])

    expected = [
        ["SLURMEnvironment", nodes * per_node, node * per_node + local, local, node, "gpu-node01"]
        for node in range(nodes)
        for local in range(per_node)
    ]
    assert ranks == expected
    assert f"--ntasks-per-node={per_node}" in mismatch


@pytest.fixture
def fake_slurm(tmp_path):
    """`srun` exiting with $FAKE_STATUS (what train.py returned), `squeue` printing the job's comment $FAKE_COMMENT
    (or failing where it is "squeue fails"), and `scontrol` recording what it was asked to do (an update failing where
    $FAKE_UPDATE_FAILS is set); a `python` that has the project's packages, and a train.py where the job runs (the
    scripts check both first)."""
    bin_dir = tmp_path / "slurm-bin"
    bin_dir.mkdir()
    record = tmp_path / "scontrol.log"
    (tmp_path / "train.py").write_text("")
    (bin_dir / "python").write_text("#!/bin/bash\nexit 0\n")
    (bin_dir / "srun").write_text('#!/bin/bash\nexit "$FAKE_STATUS"\n')
    (bin_dir / "squeue").write_text(
        '#!/bin/bash\nif [ "$FAKE_COMMENT" = "squeue fails" ]; then exit 1; fi\necho "$FAKE_COMMENT"\n'
    )
    (bin_dir / "scontrol").write_text(
        '#!/bin/bash\nif [ "$1" = show ]; then echo gpu-node01; exit; fi\n'
        'if [ "$1" = update ] && [ -n "$FAKE_UPDATE_FAILS" ]; then exit 1; fi\n'
        'if [ "$1" = requeue ] && [ -n "$FAKE_REQUEUE_FAILS" ]; then exit 1; fi\n'
        f'echo "$@" >> {record}\n'
    )
    for program in bin_dir.iterdir():
        program.chmod(program.stat().st_mode | stat.S_IEXEC)
    return bin_dir, record


@pytest.mark.parametrize("script", [SBATCH, SBATCH_TORCHRUN], ids=lambda p: p.name)
@pytest.mark.parametrize("status, restarts, comment, requeued_as", [
    (4, 0, "(null)", "stall-requeues=1"),      # stalled: requeue and resume
    (5, 2, "stall-requeues=2", "stall-requeues=3"),  # rendezvous timeout: requeue (a node may have failed)
    (4, 5, "mine", "mine stall-requeues=1"),   # five preemptions before are no stalls; the user's comment stays
    (8, 1, "stall-requeues=1", "stall-requeues=2"),  # a corrupt checkpoint moved aside: resume from the one before
    (4, 3, "stall-requeues=3", None),          # after MAX_REQUEUES (3) requeues, a run that keeps stalling
    (75, 0, "(null)", None),                   # preempted: Slurm's own --requeue
    (130, 0, "(null)", None),                  # Ctrl-C: the user stopped it
    (2, 0, "(null)", None),                    # bad input
    (0, 0, "(null)", None),
])
def test_batch_scripts_requeue_a_stalled_run_a_bounded_number_of_times(script, status, restarts, comment, requeued_as,
                                                                        fake_slurm, tmp_path):
    """Counted in the job's comment: SLURM_RESTART_COUNT also counts preemptions, and with it a job preempted three
    times was not requeued after its first stall."""
    bin_dir, record = fake_slurm
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242", "SLURM_NNODES": "2",
           "SLURM_GPUS_PER_NODE": "8", "SLURM_NTASKS_PER_NODE": "8", "SLURM_CPUS_PER_TASK": "8",
           "SLURM_JOB_NODELIST": "gpu-node[01-02]", "SLURM_RESTART_COUNT": str(restarts),
           "FAKE_STATUS": str(status), "FAKE_COMMENT": comment}
    result = subprocess.run(["bash", str(script), "--out_dir", "/outputs/run"], env=env, capture_output=True,
                            text=True, cwd=tmp_path)
    assert result.returncode == status, result.stderr
    asked = record.read_text().splitlines() if record.exists() else []
    assert asked == ([f"update JobId=4242 Comment={requeued_as}", "requeue 4242"] if requeued_as else []), asked


@pytest.mark.parametrize("script", [SBATCH, SBATCH_TORCHRUN], ids=lambda p: p.name)
@pytest.mark.parametrize("restarts, comment, update_fails, requeued", [
    (1, "squeue fails", False, True),       # the count unknown: the restarts stand in for it
    (3, "squeue fails", False, False),      # ... and bound it, rather than reading 0 requeues every time
    (0, "(null)", True, True),              # the count could not be written: the restarts decide
    (3, "stall-requeues=1", True, False),   # ... so that a count never written cannot requeue for ever
])
def test_batch_scripts_bound_the_requeues_when_slurm_cannot_keep_the_count(script, restarts, comment, update_fails,
                                                                           requeued, fake_slurm, tmp_path):
    bin_dir, record = fake_slurm
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242", "SLURM_NNODES": "1",
           "SLURM_GPUS_PER_NODE": "8", "SLURM_NTASKS_PER_NODE": "8", "SLURM_CPUS_PER_TASK": "8",
           "SLURM_JOB_NODELIST": "gpu-node01", "SLURM_RESTART_COUNT": str(restarts), "FAKE_STATUS": "4",
           "FAKE_COMMENT": comment, "FAKE_UPDATE_FAILS": "1" if update_fails else ""}
    result = subprocess.run(["bash", str(script), "--out_dir", "/outputs/run"], env=env, capture_output=True,
                            text=True, cwd=tmp_path)
    assert result.returncode == 4, result.stderr
    assert f"counting the job's {restarts} restarts" in result.stdout or f"counting its {restarts} restarts" \
        in result.stdout, result.stdout
    asked = record.read_text().splitlines() if record.exists() else []
    assert asked == (["requeue 4242"] if requeued else []), asked
    if not requeued:  # the last line names what it counted
        assert f"after {restarts} restarts (MAX_REQUEUES=3)" in result.stdout, result.stdout


@pytest.mark.parametrize("script", [SBATCH, SBATCH_TORCHRUN], ids=lambda p: p.name)
def test_a_stall_the_job_cannot_be_requeued_after_keeps_its_exit_code(script, fake_slurm, tmp_path):
    """Submitted with --no-requeue (the header's opt-out), `scontrol requeue` fails, and `set -e` ended the script
    there: the job ended FAILED with 1 (an exception, in the docs' table) instead of the stall's 4."""
    bin_dir, _ = fake_slurm
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242", "SLURM_NNODES": "1",
           "SLURM_GPUS_PER_NODE": "8", "SLURM_NTASKS_PER_NODE": "8", "SLURM_CPUS_PER_TASK": "8",
           "SLURM_JOB_NODELIST": "gpu-node01", "SLURM_RESTART_COUNT": "0", "FAKE_STATUS": "4",
           "FAKE_COMMENT": "(null)", "FAKE_REQUEUE_FAILS": "1"}
    result = subprocess.run(["bash", str(script), "--out_dir", "/outputs/run"], env=env, capture_output=True,
                            text=True, cwd=tmp_path)
    assert result.returncode == 4, result.stdout + result.stderr
    assert "scontrol could not requeue job 4242: resubmit it with the same arguments" in result.stdout


@pytest.mark.slow
def test_torchrun_wrapper_exits_with_the_failed_workers_own_code(tmp_path):
    """torchrun itself exits 1 for any failed worker; the Slurm script needs the stall's 4 to requeue."""
    worker = tmp_path / "stalls.py"
    worker.write_text("import os\nos._exit(4)\n")
    result = subprocess.run([sys.executable, "-m", "app.reliability.torchrun", "--standalone", "--nproc_per_node", "1",
                             str(worker)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 4, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == ("torchrun: the worker of rank 0 exited with 4 (its output above "
                                                      "says why): exit 4"), result.stderr[-2000:]
    assert "Root Cause" not in result.stderr, "torchrun's 25-line report said nothing more"
    worker.write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")  # as the OOM killer does
    result = subprocess.run([sys.executable, "-m", "app.reliability.torchrun", "--standalone", "--nproc_per_node", "1",
                             str(worker)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.stderr.strip().splitlines()[-1] == (  # it said "its output above says why" of a silent worker
        "torchrun: the worker of rank 0 was killed by SIGKILL (out of memory? the kernel's out-of-memory killer sends "
        "SIGKILL, and the killed worker says nothing: see `dmesg`, or sacct's MaxRSS): exit 137"), result.stderr[-2000:]


def test_torchrun_wrapper_ends_a_rendezvous_that_a_node_never_joins_with_5_in_one_line(tmp_path):
    """Under c10d the workers start once every node has joined, so --rendezvous_timeout_min never applied: torchrun's
    RendezvousTimeoutError, a 30-line traceback and exit 1, which the script does not requeue."""
    from app.exit_codes import EXIT_RENDEZVOUS_TIMEOUT

    worker = tmp_path / "never.py"
    worker.write_text("raise SystemExit('a worker started')\n")
    result = subprocess.run([sys.executable, "-m", "app.reliability.torchrun", "--nnodes", "2", "--nproc_per_node",
                             "1", "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{free_port()}",
                             "--rdzv_id", "job", "--rdzv_conf", "join_timeout=3", str(worker)],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == EXIT_RENDEZVOUS_TIMEOUT, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "a worker started" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith(
        "torchrun: the nodes did not all join the rendezvous within its join_timeout of 3 s (--rdzv_conf "
        "join_timeout; RDZV_JOIN_TIMEOUT_SEC in slurm/train-torchrun.sbatch)")


def test_torchrun_sbatch_meets_at_a_port_of_its_own_job_and_bounds_the_wait_for_the_nodes(tmp_path):
    """A port free on the first node, from a start the job id moves (app/distributed/ports.py): a formula of the id
    alone (29500 + the id modulo 3000) was another job's too, which the second job's torchrun then joined."""
    (tmp_path / "scontrol").write_text("#!/bin/sh\necho node1\n")  # `scontrol show hostnames`, without a cluster
    (tmp_path / "scontrol").chmod(0o755)
    job = {"SLURM_CPUS_PER_TASK": "8", "SLURM_JOB_NODELIST": "node1", "SLURM_JOB_ID": "123457", "SLURM_NNODES": "1",
           "PATH": f"{tmp_path}:{Path(sys.executable).parent}:/usr/bin:/bin"}
    ports = {int(shell_variable(SBATCH_TORCHRUN, "RDZV_PORT", job | {"SLURM_JOB_ID": job_id})) for job_id in "78"}
    assert len(ports) == 2 and all(20000 <= port < 32768 for port in ports), ports  # not ephemeral
    with socket.socket() as other_job:
        other_job.bind(("", min(ports)))
        other_job.listen()
        assert int(shell_variable(SBATCH_TORCHRUN, "RDZV_PORT", job | {"SLURM_JOB_ID": "7"})) != min(ports)
    words = launch_command(SBATCH_TORCHRUN, "srun")
    assert flag_value(words, "--rdzv_conf") == "join_timeout=$RDZV_JOIN_TIMEOUT_SEC"
    assert shell_variable(SBATCH_TORCHRUN, "RDZV_JOIN_TIMEOUT_SEC", job) == "600"


def test_torchrun_wrapper_reads_the_reporting_workers_code_past_the_others_zeros() -> None:
    """train.py's ranks that do not report exit 0 (app/reliability/signals.py exit_run): a preempted run's 75 is
    rank 0's, with 0 from the others; taken for a failure, it ended a real Slurm job with 0."""
    from app.reliability.torchrun import exit_after_signal

    assert exit_after_signal(signal.SIGTERM, [75, 0])[0] == 75
    assert exit_after_signal(signal.SIGINT, [130, 0])[0] == 130
    assert exit_after_signal(signal.SIGTERM, [0, 0])[0] == 0, "finished before the signal took effect"
    assert exit_after_signal(signal.SIGTERM, [75, 137]) == (
        137, "SIGTERM handed to the workers; one exited with 137, not 75: exit 137")
    assert exit_after_signal(signal.SIGTERM, None)[0] == 75


@pytest.mark.slow
@pytest.mark.parametrize("on_sigterm, code, line", [
    ("sys.exit(75)", 75, "SIGTERM handed to the workers, which stopped; exit 75"),  # saved, as train.py does
    (None, 143, "SIGTERM handed to the workers; one exited with 143, not 75: exit 143"),  # killed before it could
])
def test_torchrun_wrapper_after_a_signal_exits_with_the_workers_code(on_sigterm, code, line, tmp_path):
    """It exited 75 ("stopped after saving a checkpoint") from the signal alone, also when the workers were killed
    while they started and saved nothing."""
    ready = tmp_path / "ready"
    worker = tmp_path / "worker.py"
    worker.write_text("import signal, sys, time\n"
                      + (f"signal.signal(signal.SIGTERM, lambda *_: {on_sigterm})\n" if on_sigterm else "")
                      + f"open({str(ready)!r}, 'w').close()\ntime.sleep(120)\n")
    with subprocess.Popen([sys.executable, "-m", "app.reliability.torchrun", "--standalone", "--nproc_per_node", "1",
                           str(worker)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as wrapper:
        deadline = time.monotonic() + 60
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        wrapper.send_signal(signal.SIGTERM)
        _, stderr = wrapper.communicate(timeout=60)
    assert wrapper.returncode == code, stderr[-2000:]
    assert f"torchrun: {line}" in stderr


@pytest.mark.parametrize("script", [SBATCH, SBATCH_TORCHRUN])
def test_a_warning_to_the_batch_script_is_handed_on_and_the_steps_exit_code_kept(tmp_path, script):
    """`--signal=B:USR1@N` (or `scancel --batch --signal=USR1`) reaches the batch shell alone, which died of it
    (138); the script hands it to the job's steps, and keeps srun's exit code also when scancel fails (under set -e a
    failing command in the trap ended the script with 1)."""
    fakes = {"srun": "#!/bin/sh\ntouch \"$0.started\"\nsleep 1.5\nexit 3\n",
             "scancel": "#!/bin/sh\necho \"$@\" > \"$0.args\"\nexit 1\n",
             "scontrol": "#!/bin/sh\necho node1\n"}
    for name, body in fakes.items():
        (tmp_path / name).write_text(body)
        (tmp_path / name).chmod(0o755)
    job = {"SLURM_JOB_ID": "5", "SLURM_NNODES": "1", "SLURM_NTASKS": "1", "SLURM_CPUS_PER_TASK": "1",
           "SLURM_NTASKS_PER_NODE": "1", "SLURM_JOB_NODELIST": "node1",
           "PATH": f"{tmp_path}:{Path(sys.executable).parent}:/usr/bin:/bin"}
    with subprocess.Popen(["bash", str(script)], cwd=ROOT, env=job, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as batch:
        deadline = time.monotonic() + 20
        while not (tmp_path / "srun.started").exists():  # past the checks, srun started and waited for
            assert time.monotonic() < deadline and batch.poll() is None, batch.communicate()
            time.sleep(0.02)
        time.sleep(0.2)
        batch.send_signal(signal.SIGUSR1)
        output, errors = batch.communicate(timeout=30)
    assert batch.returncode == 3, output + errors
    assert (tmp_path / "scancel.args").read_text().split() == ["--signal=USR1", "5"]
    assert "scancel could not hand USR1 on to the tasks" in errors
