"""Whether the run can start here: the accelerator, kernels and compilers it asks for, the precision the card supports,
and a launcher that starts as many processes as --devices x --num_nodes say."""

from __future__ import annotations

import importlib.util
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch
from lightning_fabric.accelerators import XLAAccelerator
from lightning_fabric.plugins.environments import (LSFEnvironment, MPIEnvironment, SLURMEnvironment,
                                                   TorchElasticEnvironment)
from transformers import PretrainedConfig
from transformers.utils import is_flash_attn_2_available

from app.checkpoint import is_checkpoint
from app.cli import first_line
from app.distributed.precision import bf16_moment_problem, bf16_support_problem, fp32_modules_problem
from app.distributed.strategy import resolve_accelerator, without_srun_hint
from app.model.build import meta_model
from app.tasks import LAUNCHER_PID, srun_in_interactive_job

if TYPE_CHECKING:
    from arguments import Config


def world_size(cfg: Config) -> int:
    """The run's ranks: --devices x --num_nodes; `auto` counts the visible GPUs, or the TPU cores under --tpu as
    Lightning's XLA launcher does (one process for single_device, whose plan once counted every GPU of the node and
    trained a 1/N share of each step)."""
    if cfg.strategy == "single_device":
        return 1
    if cfg.devices != "auto":
        return cfg.devices * cfg.num_nodes
    if cfg.tpu:
        local = XLAAccelerator.auto_device_count()
    else:
        local = torch.cuda.device_count() if cfg.accelerator in ("auto", "gpu", "cuda") else 0
    return max(local, 1) * cfg.num_nodes


def check_runs_here(cfg: Config, problems: list[str]) -> None:
    """What the ranks would otherwise find only after the launch, each with a traceback: no GPU for --accelerator
    gpu, no FlashAttention for --attn_implementation flash_attention_2, no C++ compiler for --compile on CPU, a
    --model_name folder without weights.
    Planning (--estimate_memory) needs none of them, so a GPU run can be planned on a laptop."""
    if cfg.estimate_memory:
        return
    if resolve_accelerator(cfg) == "cuda" and not torch.cuda.is_available():
        problems.append(f"--accelerator {cfg.accelerator}: no CUDA GPU is visible here (torch.cuda.is_available() is "
                        "False); run on a machine with GPUs, or use --accelerator cpu")
    if cfg.attn_implementation == "flash_attention_2" and not is_flash_attn_2_available():
        problems.append("--attn_implementation flash_attention_2 needs the flash-attn package and a CUDA GPU, and "
                        "transformers finds them not both here; install flash-attn on a GPU machine, or use "
                        "--attn_implementation sdpa (FlashAttention kernels on GPUs as well)")
    if cfg.compile and resolve_accelerator(cfg) == "cpu":
        missing = missing_cpp_compiler()
        if missing:
            problems.append(f"--compile true on CPU builds its kernels with a C++ compiler, and torch finds none here "
                            f"({missing}); install g++ (or set CXX to a compiler), or use --compile false")
    if cfg.compile and resolve_accelerator(cfg) == "cuda" and not triton_c_compiler():
        problems.append("--compile true on GPUs builds Triton's kernel launchers with a C compiler, and there is "
                        "none here ($CC, gcc or clang; PyTorch's CUDA runtime Docker images long had none); install "
                        "gcc, or use --compile false")
    folder = Path(cfg.model_name) if cfg.model_name else None
    weights = folder and any(any(folder.glob(pattern)) for pattern in ("*.safetensors", "*.bin"))
    if folder and folder.is_dir() and not output_of_train_py(folder) and not weights:  # (that: check_model's line)
        problems.append(f"--model_name {folder}: the folder holds no weights (*.safetensors or *.bin); to train "
                        f"from its config.json alone, give it as --model_config {folder}")


def output_of_train_py(path: Path) -> Optional[str]:
    """`a run folder` or `a checkpoint` where a model option names what train.py writes rather than a model."""
    if not path.exists() or (path / "config.json").exists():
        return None
    if (path / "checkpoints").is_dir():
        return "a run folder"
    return "a checkpoint" if path.suffix == ".ckpt" or path.is_dir() and is_checkpoint(path) else None


def missing_cpp_compiler() -> Optional[str]:
    """Why torch.compile's CPU kernels could not be built here, by inductor's own search ($CXX, else g++), or None:
    without a compiler every rank ended in a 100-line InductorError traceback at its first forward. Imported only
    for --compile (2 s)."""
    from torch._inductor.cpp_builder import get_cpp_compiler
    from torch._inductor.exc import InvalidCxxCompiler

    try:
        get_cpp_compiler()
    except InvalidCxxCompiler as error:
        return first_line(error)
    return None


def triton_c_compiler() -> Optional[str]:
    """The C compiler Triton builds each kernel's launcher with, found as triton/runtime/build.py finds it ($CC, else
    gcc, else clang): without one every rank ended in "Failed to find C compiler" at its first compiled forward."""
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang")


def check_precision(cfg: Config, model_config: Optional[PretrainedConfig], problems: list[str]) -> None:
    """On a GPU without bf16 (V100, T4) a bf16 run would emulate it slowly or fail inside a worker, and a model
    that needs float32 modules overflows in fp16: refuse both here."""
    if model_config is not None:
        problem = fp32_modules_problem(cfg.precision, meta_model(model_config, cfg.trust_remote_code), cfg.strategy)
        if problem:
            problems.append(problem)
    moment = bf16_moment_problem(cfg.precision, cfg.beta2, cfg.stochastic_rounding)
    if moment:
        problems.append(moment)
    if resolve_accelerator(cfg) == "cuda" and torch.cuda.is_available():
        problem = bf16_support_problem(cfg.precision, torch.cuda.get_device_name(0),
                                       torch.cuda.get_device_capability(0))
        if problem:
            problems.append(problem)


def check_devices(cfg: Config, problems: list[str]) -> None:
    """CPU offloading moves shards from an accelerator to the host; on CPU processes there is nowhere to offload
    from, and torch failed inside every rank (FSDP1 pinning memory, FSDP2's policy) after the run had written its
    files. TPUs need torch_xla, which Lightning asks for only inside every rank."""
    if cfg.cpu_offload and resolve_accelerator(cfg) == "cpu":
        problems.append(f"--cpu_offload true with --strategy {cfg.strategy} needs GPUs: on CPU processes the shards "
                        "already live in host memory; drop --cpu_offload")
    if cfg.tpu and importlib.util.find_spec("torch_xla") is None:
        problems.append(f"--accelerator tpu needs torch_xla, which this Python lacks: install the torch_xla release "
                        f"of torch {torch.__version__.split('+')[0]}")


def check_launcher(cfg: Config, problems: list[str]) -> None:
    """Without a launcher for the other nodes, a multi-node run would wait for them until the rendezvous timeout. A
    launcher that started another number of processes than --devices x --num_nodes ended every rank in a traceback
    (an IndexError, Lightning's ValueError) or left one waiting for the others; a NODE_RANK beyond --num_nodes left
    every rank waiting until --rendezvous_timeout_min."""
    if cfg.num_nodes > 1 and not launched_on_every_node():
        problems.append(f"--num_nodes {cfg.num_nodes}: nothing starts the other nodes here; run train.py on every "
                        "node with srun (slurm/train.sbatch), torchrun --nnodes (slurm/train-torchrun.sbatch), or "
                        "by hand with MASTER_ADDR, MASTER_PORT and each node's NODE_RANK set; or use --num_nodes 1")
    layout = launcher_layout()
    split = layout_problems(cfg, layout) if layout else []
    problems += split
    if layout is None and world_size(cfg) > 1 and stale_local_rank():
        others = world_size(cfg) - 1
        problems.append(f"LOCAL_RANK={os.environ['LOCAL_RANK']} is set here, and Lightning then starts none of the "
                        f"run's other {others} process{'es' if others > 1 else ''} itself (it takes them as started "
                        "by hand): unset LOCAL_RANK (left in this shell by another launcher)")
    if layout and not split and layout.processes != world_size(cfg):
        problems.append(f"--devices {cfg.devices} --num_nodes {cfg.num_nodes}: {world_size(cfg)} ranks, but "
                        f"{layout.launcher} ({layout.processes_variable}) started {layout.processes} processes; give "
                        f"--devices (processes per node) and --num_nodes whose product is {layout.processes}")
    node_rank = os.environ.get("NODE_RANK", "0")
    if node_rank.isdigit() and int(node_rank) >= cfg.num_nodes:
        problems.append(f"NODE_RANK={node_rank} is set, but --num_nodes {cfg.num_nodes} has no node {node_rank}: "
                        "unset NODE_RANK, or give the run's --num_nodes")


def stale_local_rank() -> bool:
    """LOCAL_RANK set where no launcher started this process (a shell that kept torchrun's, an `export` in a job
    script): Lightning takes every rank as started by hand and waits for them until the rendezvous timeout, then
    blames nodes that never started. Not where Lightning's launcher started this rank (LAUNCHER_PID), where
    WORLD_SIZE says that each rank is started by hand, nor under MPI or LSF, whose ranks Lightning takes from their
    own variables."""
    if "LOCAL_RANK" not in os.environ or LAUNCHER_PID in os.environ or "WORLD_SIZE" in os.environ:
        return False
    with without_srun_hint():
        return not (MPIEnvironment.detect() or LSFEnvironment.detect())


def launched_on_every_node() -> bool:
    """True when something starts the ranks of every node: a launcher Lightning detects (Slurm's srun, torchrun,
    LSF's jsrun, MPI), or Lightning's manual multi-node variables (MASTER_ADDR and NODE_RANK set on each node)."""
    with without_srun_hint():
        detected = any(environment.detect() for environment in
                       (SLURMEnvironment, TorchElasticEnvironment, LSFEnvironment, MPIEnvironment))
    return detected or srun_in_interactive_job() or {"MASTER_ADDR", "NODE_RANK"} <= os.environ.keys()


@dataclass(frozen=True)
class LauncherLayout:
    """How the launcher Lightning takes the ranks from spread them, where it says so."""

    launcher: str
    processes: int
    processes_variable: str
    per_node: Optional[str]
    """Processes on each node ("4"), or, when nodes differ, the launcher's own spelling ("4(x2),3")."""
    per_node_variable: str
    nodes: Optional[int]
    nodes_variable: str


def launcher_layout() -> Optional[LauncherLayout]:
    """The launcher Lightning will take the ranks from (torchrun first: it may run inside a Slurm job), how many
    processes it started, and how many on each of how many nodes; None without one."""
    with without_srun_hint():
        if TorchElasticEnvironment.detect():
            return LauncherLayout("torchrun", TorchElasticEnvironment().world_size(), "WORLD_SIZE",
                                  os.environ.get("LOCAL_WORLD_SIZE"), "LOCAL_WORLD_SIZE",
                                  int_or_none(os.environ.get("GROUP_WORLD_SIZE")), "GROUP_WORLD_SIZE")
        if SLURMEnvironment.detect() or srun_in_interactive_job():  # build_fabric takes Slurm's ranks then too
            per_node = first_set("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")
            nodes = first_set("SLURM_STEP_NUM_NODES", "SLURM_NNODES")
            return LauncherLayout("srun", int(os.environ["SLURM_NTASKS"]), "SLURM_NTASKS",
                                  tasks_on_each_node(per_node[1]), per_node[0], int_or_none(nodes[1]), nodes[0])
    return None


def first_set(*names: str) -> tuple[str, Optional[str]]:
    """The first of the variables `names` that is set, and its value (the last name and None when none is)."""
    name = next((name for name in names if os.environ.get(name)), names[-1])
    return name, os.environ.get(name) or None


def tasks_on_each_node(spelled: Optional[str]) -> Optional[str]:
    """Slurm's tasks per node, "4(x2)" or "4,4": "4" when every node has as many; as spelled when they differ."""
    if not spelled:
        return None
    counts = {part.split("(")[0] for part in spelled.split(",")}
    return counts.pop() if len(counts) == 1 else spelled


def int_or_none(value: Optional[str]) -> Optional[int]:
    return int(value) if value and value.isdigit() else None


def layout_problems(cfg: Config, layout: LauncherLayout) -> list[str]:
    """The product of --devices and --num_nodes may match the launcher's processes and their split not: with
    --num_nodes 1 on two nodes, HYBRID_SHARD's "within a node" spanned both, and the check that every node sees
    --out_dir was skipped (the first save on a node-local disk ended in a traceback); with --devices below the
    processes per node, every rank ended in an IndexError."""
    if layout.launcher == "srun" and "SLURM_STEP_ID" not in os.environ and (layout.processes > 1
                                                                             or world_size(cfg) > 1):
        return ["train.py runs in the job's allocation (its batch script, or an salloc shell), not under srun, and no "
                "other process of the run is started: run it as `srun python train.py ...` (slurm/train.sbatch), in "
                "a job submitted with --nodes and --ntasks-per-node (one task per device)"]
    if layout.launcher == "torchrun" and layout.nodes and layout.per_node and layout.per_node.isdigit() \
            and layout.processes != layout.nodes * int(layout.per_node):
        return [f"torchrun started {layout.processes} processes on {layout.nodes} nodes, {layout.per_node} on this "
                "one: the nodes' torchrun were given different --nproc_per_node; give every node the same"]
    if layout.launcher == "srun" and layout.processes > 1 and "SLURM_NTASKS_PER_NODE" not in os.environ:
        return [f"srun started {layout.processes} tasks of a job sized without --ntasks-per-node, and Lightning "
                "(SLURMEnvironment) refuses such a job on every rank; submit it with --nodes and --ntasks-per-node "
                "(one task per device)"]
    found = []
    if layout.nodes is not None and layout.nodes != cfg.num_nodes:
        found.append(f"--num_nodes {cfg.num_nodes}: {layout.launcher} started the run on {layout.nodes} nodes "
                     f"({layout.nodes_variable}); give --num_nodes {layout.nodes}")
    per_node = layout.per_node
    if per_node is not None and not per_node.isdigit():
        found.append(f"{layout.launcher} started different numbers of processes on the nodes "
                     f"({layout.per_node_variable}={per_node}): every node needs as many ranks; ask for them per "
                     "node (--ntasks-per-node)")
    elif per_node is not None and cfg.devices != "auto" and cfg.strategy != "single_device" \
            and int(per_node) != cfg.devices:
        found.append(f"--devices {cfg.devices}: {layout.launcher} started {per_node} processes on each node "
                     f"({layout.per_node_variable}); give --devices {per_node}")
    return found
