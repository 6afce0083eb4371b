"""Whether the run can start here: the accelerator, kernels and compilers it asks for, the precision the card supports,
and a launcher that starts as many processes as --devices x --num_nodes say."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch
from lightning_fabric.accelerators import XLAAccelerator
from lightning_fabric.plugins.environments import (LSFEnvironment, MPIEnvironment, SLURMEnvironment,
                                                   TorchElasticEnvironment)
from transformers import PretrainedConfig
from transformers.utils import is_flash_attn_2_available

from app.cli import first_line
from app.distributed.precision import bf16_moment_problem, bf16_support_problem, fp32_modules_problem
from app.distributed.strategy import resolve_accelerator, without_srun_hint
from app.model.build import meta_model

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
    if folder and folder.is_dir() and not any(any(folder.glob(pattern)) for pattern in ("*.safetensors", "*.bin")):
        problems.append(f"--model_name {folder}: the folder holds no weights (*.safetensors or *.bin); to train "
                        f"from its config.json alone, give it as --model_config {folder}")


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
        problem = fp32_modules_problem(cfg.precision, meta_model(model_config, cfg.trust_remote_code))
        if problem:
            problems.append(problem)
    moment = bf16_moment_problem(cfg.precision, cfg.beta2)
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
    started = launcher_processes()
    if started and started[1] != world_size(cfg):
        launcher, processes = started
        problems.append(f"--devices {cfg.devices} --num_nodes {cfg.num_nodes}: {world_size(cfg)} ranks, but {launcher} "
                        f"started {processes} processes; give --devices (processes per node) and --num_nodes whose "
                        f"product is {processes}")
    node_rank = os.environ.get("NODE_RANK", "0")
    if node_rank.isdigit() and int(node_rank) >= cfg.num_nodes:
        problems.append(f"NODE_RANK={node_rank} is set, but --num_nodes {cfg.num_nodes} has no node {node_rank}: "
                        "unset NODE_RANK, or give the run's --num_nodes")


def launched_on_every_node() -> bool:
    """True when something starts the ranks of every node: a launcher Lightning detects (Slurm's srun, torchrun,
    LSF's jsrun, MPI), or Lightning's manual multi-node variables (MASTER_ADDR and NODE_RANK set on each node)."""
    with without_srun_hint():
        detected = any(environment.detect() for environment in
                       (SLURMEnvironment, TorchElasticEnvironment, LSFEnvironment, MPIEnvironment))
    return detected or {"MASTER_ADDR", "NODE_RANK"} <= os.environ.keys()


def launcher_processes() -> Optional[tuple[str, int]]:
    """The launcher Lightning will take the ranks from (torchrun first: it may run inside a Slurm job) and how many
    processes it started; None without one."""
    with without_srun_hint():
        if TorchElasticEnvironment.detect():
            return "torchrun (WORLD_SIZE)", TorchElasticEnvironment().world_size()
        if SLURMEnvironment.detect():
            return "srun (SLURM_NTASKS)", SLURMEnvironment().world_size()
    return None
