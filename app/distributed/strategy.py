"""Lightning Fabric for the chosen strategy, and the one place where FSDP on CPU differs from FSDP on GPU.

FSDP on CPU processes (gloo) is the same torch FSDP users run on GPUs; Lightning 2.6 needs one adjustment for it,
measured in shared/notes/fsdp-on-cpu.md: it refuses `FSDPStrategy` on CPU by exact type check, and passes
`device_id=None` (the CPU device has no index), which torch FSDP rejects. `CPUFSDPStrategy` passes `device_id=cpu`
(and builds HYBRID_SHARD's device mesh on the CPU). Everything else (wrapping, sharding, activation checkpointing)
is Lightning's own code, so a GPU run takes exactly the path the CPU tests take; checkpoints are the application's
own (app/checkpoint/). FSDP2 (`--strategy fsdp2`) runs through Lightning's ModelParallelStrategy unchanged on CPU
(app/distributed/fsdp2.py). Tied to lightning-fabric==2.6.6 (pinned in requirements.txt).
"""

from __future__ import annotations

import inspect
import logging
import warnings
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch
from lightning_fabric import Fabric
from lightning_fabric.plugins.environments import SLURMEnvironment
from lightning_fabric.strategies import (DDPStrategy, FSDPStrategy, ModelParallelStrategy, SingleDeviceStrategy,
                                         XLAFSDPStrategy)
from lightning_fabric.strategies import fsdp as lightning_fsdp
from torch.distributed import distributed_c10d
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import BackwardPrefetch
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import CustomPolicy
from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel

from app.distributed.fsdp2 import UnitsWithEmbeddings, parallelize_fn
from app.distributed.precision import fsdp_mixed_precision, precision_plugin
from app.tasks import srun_in_interactive_job

if TYPE_CHECKING:
    from arguments import Config


class CPUFSDPStrategy(FSDPStrategy):
    """Lightning's FSDPStrategy for CPU processes over gloo; see the module docstring for the differences."""

    def setup_environment(self) -> None:
        shape = self._fsdp_kwargs.pop("device_mesh", None)
        super().setup_environment()
        if shape is not None:
            self._fsdp_kwargs["device_mesh"] = init_device_mesh("cpu", shape)

    def setup_module(self, module: Module) -> Module:
        module = FSDP(
            module=module,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=torch.device("cpu"),
            **self._fsdp_kwargs,
        )
        lightning_fsdp._setup_activation_checkpointing(module, self._activation_checkpointing_kwargs)
        return module


class EveryNthLayer(CustomPolicy):
    """FSDP1's activation checkpointing of one module of the wrap classes in every `every`, from the first, in the
    model's order (--gradient_checkpointing_every): the layers transformers' own `every_n_layers` chooses under the
    other strategies (app/model/build.py). Which modules depends on all of them, so the policy lists them from the
    root (`_run_policy`, which torch's apply_activation_checkpointing calls for a policy object that is not callable,
    as ModuleWrapPolicy is) rather than judging one module at a time."""

    def __init__(self, classes: set[type[Module]], every: int) -> None:
        super().__init__(lambda module: False)  # not asked: _run_policy chooses
        self.classes, self.every = tuple(classes), every

    def _run_policy(self, root_module: Module, ignored_modules: set[Module],
                    root_kwargs: dict[str, Any]) -> dict[Module, dict[str, Any]]:
        layers = [module for module in root_module.modules()
                  if isinstance(module, self.classes) and module not in ignored_modules]
        return {layer: dict(root_kwargs) for layer in layers[::self.every]}


def checkpointed_layers(cfg: Config, wrap_classes: set[type[Module]]) -> Optional[set[type[Module]] | EveryNthLayer]:
    """The activation checkpointing policy of Lightning's FSDP1 strategies: None without --gradient_checkpointing."""
    if not cfg.gradient_checkpointing:
        return None
    return wrap_classes if cfg.gradient_checkpointing_every == 1 else EveryNthLayer(wrap_classes,
                                                                                  cfg.gradient_checkpointing_every)


def resolve_accelerator(cfg: Config) -> str:
    if cfg.tpu:
        return "tpu"
    if cfg.accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if cfg.accelerator == "gpu" else cfg.accelerator


DDP_PARAMETERS = inspect.signature(DistributedDataParallel).parameters
SYNC_BUFFERS = "forward_sync_buffers" if "forward_sync_buffers" in DDP_PARAMETERS else "broadcast_buffers"
"""torch 2.13's name (its old one warned on every rank of every run); the GPU image's torch 2.11 has the old one
alone. Buffers are still synced once at the start under the new name: every rank's are equal then."""
DDP_OPTIONS = {SYNC_BUFFERS: False, "gradient_as_bucket_view": True}
"""Causal LMs' buffers (rotary frequencies) never change, so re-broadcasting them before every forward is a wasted
collective; gradients as views of DDP's communication buckets save a copy of every gradient per step (and its memory)."""


def build_strategy(cfg: Config, world_size: int, wrap_classes: set[type[Module]],
                   param_init_fn: Optional[Callable] = None) -> Any:
    """The Lightning strategy object for --strategy and the FSDP flags; param_init_fn materialises meta modules."""
    accelerator = resolve_accelerator(cfg)
    if accelerator == "tpu":  # its own checkpoint wrapper, as FSDP1's below: transformers' is not asked (build.py)
        return XLAFSDPStrategy(auto_wrap_policy=wrap_classes, state_dict_type=cfg.state_dict_type,
                               activation_checkpointing_policy=checkpointed_layers(cfg, wrap_classes))
    if cfg.strategy == "single_device":
        return SingleDeviceStrategy(device=torch.device("cuda", 0) if accelerator == "cuda" else torch.device(accelerator))
    timeout = timedelta(minutes=cfg.process_group_timeout_min)
    every_group_times_out_after(timeout)
    if cfg.strategy == "ddp":
        return DDPStrategy(timeout=timeout, **DDP_OPTIONS)
    if cfg.strategy == "fsdp2":
        return ModelParallelStrategy(parallelize_fn(cfg, wrap_classes, param_init_fn), data_parallel_size=world_size,
                                     tensor_parallel_size=1, timeout=timeout)
    fsdp_class = CPUFSDPStrategy if accelerator == "cpu" else FSDPStrategy
    return fsdp_class(
        auto_wrap_policy=UnitsWithEmbeddings(wrap_classes),
        activation_checkpointing_policy=checkpointed_layers(cfg, wrap_classes),
        sharding_strategy=fsdp1_sharding(cfg, world_size),
        state_dict_type=cfg.state_dict_type,
        limit_all_gathers=cfg.limit_all_gathers,
        cpu_offload=cfg.cpu_offload,
        backward_prefetch=None if cfg.backward_prefetch == "none" else BackwardPrefetch[cfg.backward_prefetch],
        forward_prefetch=cfg.forward_prefetch,
        mixed_precision=fsdp_mixed_precision(cfg.precision, cfg.reduce_dtype),
        device_mesh=mesh_shape(cfg, world_size),
        timeout=timeout,
        **({"param_init_fn": param_init_fn} if param_init_fn else {}),
    )


def every_group_times_out_after(timeout: timedelta) -> None:
    """Make `timeout` the default of every process group this process creates, not only of the default group that
    Lightning's strategies are given it for. torch gives a group created without an explicit timeout its backend's
    default (NCCL 10 min, gloo 30 min), and the device meshes of HYBRID_SHARD and fsdp2 (`init_device_mesh`, in
    Lightning's strategies and in app/distributed/fsdp2.py) and the checkpoint writer's gloo group pass none: a slow
    node would then abort the run from NCCL's watchdog, without the stall watchdog's stacks and exit code. torch reads
    these two module attributes whenever it creates a group without a timeout (`_get_default_timeout`)."""
    distributed_c10d.default_pg_timeout = timeout
    distributed_c10d.default_pg_nccl_timeout = timeout


def fsdp1_sharding(cfg: Config, world_size: int) -> str:
    """The sharding strategy FSDP1 is given: NO_SHARD where there is nothing to shard. One process: FSDP would switch
    to NO_SHARD itself, with a warning at every start. HYBRID_SHARD with one device per node (shard groups of one):
    FSDP switches to NO_SHARD over the shard group alone and never all-reduces across nodes, so each node trained its
    own replica on its own rows (grad_norm 0.52 for 1.12 on 2 nodes); NO_SHARD over every rank is what it means."""
    if world_size == 1 or cfg.sharding_strategy == "HYBRID_SHARD" and world_size == cfg.num_nodes:
        return "NO_SHARD"
    return cfg.sharding_strategy


def mesh_shape(cfg: Config, world_size: int) -> tuple[int, ...]:
    """FSDP's device mesh: one dimension of all ranks, or (nodes, devices per node) to shard within a node and
    replicate across nodes (HYBRID_SHARD). With a mesh, FSDP's sharded state dicts are DTensors."""
    if fsdp1_sharding(cfg, world_size) == "HYBRID_SHARD":
        return cfg.num_nodes, world_size // cfg.num_nodes
    return (world_size,)


def gradient_replicas(cfg: Config, world_size: int) -> int:
    """How many ranks hold the same gradient values once they are synchronised: the sum of the ranks' squared
    gradient norms divided by this is the squared norm of the whole gradient."""
    if cfg.strategy == "single_device":
        return 1
    if cfg.strategy == "ddp" or cfg.sharding_strategy == "NO_SHARD":
        return world_size
    if cfg.sharding_strategy == "HYBRID_SHARD":
        return cfg.num_nodes
    return 1


@contextmanager
def without_srun_hint() -> Iterator[None]:
    """Without Lightning's warning on machines where Slurm is installed, for a run started without srun: the
    preflight refuses the case it guards against (several nodes and nothing starting them), and one node needs no
    srun."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The `srun` command is available on your system but is not used")
        yield


def build_fabric(cfg: Config, world_size: int, wrap_classes: set[type[Module]], loggers: list[Any],
                 param_init_fn: Optional[Callable] = None) -> Fabric:
    accelerator = resolve_accelerator(cfg)
    slurm = [SLURMEnvironment()] if srun_in_interactive_job() else []  # Lightning detects the others itself
    precision = ({"precision": cfg.precision, "plugins": slurm} if accelerator == "tpu" else
                 {"plugins": [precision_plugin(cfg.precision, cfg.strategy, device_type=accelerator), *slurm]})
    quiet_lightning_start()
    if cfg.strategy == "fsdp" and cfg.sharding_strategy == "NO_SHARD":  # the preflight's note says it once
        warnings.filterwarnings("ignore", message="The `NO_SHARD` sharding strategy is deprecated")
    with without_srun_hint():
        return Fabric(
            accelerator=accelerator,
            devices=cfg.devices,
            num_nodes=cfg.num_nodes,
            strategy=build_strategy(cfg, world_size, wrap_classes, param_init_fn),
            loggers=loggers,
            **precision,
        )


def quiet_lightning_start() -> None:
    """Lightning's start-up lines ("Initializing distributed: GLOBAL_RANK ...", a banner naming the backend) tell a
    user nothing to act on; its warnings still show."""
    for name in ("lightning_fabric.utilities.distributed", "lightning_fabric.utilities.rank_zero"):
        logging.getLogger(name).setLevel(logging.WARNING)
