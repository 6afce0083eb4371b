"""--strategy fsdp2: torch's per-parameter sharding (`fully_shard`) through Lightning's ModelParallelStrategy.

FSDP2 shards every parameter on its first dimension as a DTensor instead of flattening each unit into one flat
tensor (FSDP1). Its state dicts are DTensors that torch.distributed.checkpoint reads and writes natively, so the
checkpoint formats, resume and conversion are the same code as for FSDP1 (app/checkpoint/state.py).

The units are each module of a wrap class, then lm_head and the input embeddings when they are as large as a layer
and no other module holds their weights (torchtitan's layout; Llama-3's 128K-token embeddings), then the root with
what is left. The modules transformers keeps in float32 (an MoE router, `kept_in_fp32_units`) are units of their own
too, whose mixed precision casts nothing. How the FSDP options map onto it:

| --sharding_strategy | device mesh | parameters re-sharded after forward |
| --- | --- | --- |
| FULL_SHARD | all ranks | yes, but for the last layer, lm_head and the root (ZeRO-3) |
| SHARD_GRAD_OP | all ranks | no (ZeRO-2) |
| HYBRID_SHARD | (nodes, devices per node): shard in a node, replicate across | as FULL_SHARD |
| NO_SHARD | (all ranks, 1): every rank holds everything (DDP through FSDP2) | no |

Mixed precision is FSDP2's `MixedPrecisionPolicy` (parameters gathered in the compute dtype, gradients reduced in
`app.distributed.precision.reduce_dtype`), not autocast; activation checkpointing is the model's own (transformers'
`activation_checkpointing_enable`, as for DDP), which keeps the parameter names unchanged. On CPU processes every
unit gathers and reduces point to point (app/distributed/cpu_collectives.py) rather than through gloo's temporaries.

A model built on the meta device is materialised one unit at a time just before that unit is sharded, by the same
`param_init_fn` and in the same order as FSDP1, whose auto-wrap policy (`UnitsWithEmbeddings`) makes the same units
(children before their parent in registration order, each unit's modules breadth-first),
so a run from a config starts from the same weights under either strategy and a rank never holds more than one
whole unit. Pretrained weights are then read file by file into the shards (`shard_like`).
"""

from __future__ import annotations

import warnings
from collections import Counter, deque
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn import Module

from app.distributed.cpu_collectives import use_point_to_point_collectives, uses_point_to_point
from app.distributed.precision import compute_dtype, kept_in_fp32_units, reduce_dtype

if TYPE_CHECKING:
    from arguments import Config

RESHARD_AFTER_FORWARD = {"FULL_SHARD": True, "SHARD_GRAD_OP": False, "HYBRID_SHARD": True, "NO_SHARD": False}


def mesh_shape(sharding_strategy: str, world_size: int, num_nodes: int) -> tuple[int, ...]:
    """FSDP2's mesh: 1-D shards over every rank; 2-D (replicate, shard) for HYBRID_SHARD and NO_SHARD."""
    if sharding_strategy == "HYBRID_SHARD":
        return num_nodes, world_size // num_nodes
    if sharding_strategy == "NO_SHARD":
        return world_size, 1
    return (world_size,)


def mixed_precision_policy(precision: str, requested_reduce_dtype: Optional[str]) -> MixedPrecisionPolicy:
    """Under *-mixed, fp32 weights are gathered in the compute dtype; under *-true and 32-true nothing is cast."""
    mixed = "mixed" in precision
    return MixedPrecisionPolicy(param_dtype=compute_dtype(precision) if mixed else None,
                                reduce_dtype=reduce_dtype(precision, requested_reduce_dtype))


def modules_to_materialize(unit: Module) -> list[Module]:
    """The unit and its submodules breadth-first, not entering units already sharded (FSDP1's order)."""
    found, queue = [], deque([unit])
    while queue:
        module = queue.popleft()
        found.append(module)
        queue.extend(child for child in module.children() if not isinstance(child, FSDPModule))
    return found


T5_VIEW_WARNING = r"FSDP2-wrapped module \(FSDP(M|UM)?T5Block\) returned a view tensor"
"""torch warns at every forward that a T5 block returns a view (of the relative-position bias it hands the next block),
since an in-place change of that view would skip fsdp2's gather before backward. T5 changes it only out of place,
and its losses step for step equal fsdp's (tests/test_seq2seq.py): the warning is left out for T5 blocks alone."""


def shard_model(model: Module, lightning_mesh: DeviceMesh, *, wrap_classes: set[type[Module]], sharding_strategy: str,
                num_nodes: int, mp_policy: MixedPrecisionPolicy, offload_policy: OffloadPolicy,
                param_init_fn: Optional[Callable[[Module], None]]) -> Module:
    """Lightning's `parallelize_fn`: `fully_shard` every wrap unit (children first), then the root."""
    warnings.filterwarnings("ignore", message=T5_VIEW_WARNING)
    world_size = lightning_mesh.size()
    shape = mesh_shape(sharding_strategy, world_size, num_nodes)
    mesh = (init_device_mesh(lightning_mesh.device_type, shape, mesh_dim_names=("replicate", "shard"))
            if len(shape) == 2 else lightning_mesh["data_parallel"])
    options: dict[str, Any] = dict(mesh=mesh, offload_policy=offload_policy)
    reshard = RESHARD_AFTER_FORWARD[sharding_strategy]
    point_to_point = uses_point_to_point(torch.device(mesh.device_type))
    in_float32 = {id(part) for unit in kept_in_fp32_units(model)[0] for part in unit.modules()}

    def shard(module: Module, reshard_after_forward: bool) -> None:
        if param_init_fn is not None:
            for part in modules_to_materialize(module):
                param_init_fn(part)
        policy = replace(mp_policy, param_dtype=None) if id(module) in in_float32 else mp_policy
        fully_shard(module, reshard_after_forward=reshard_after_forward, mp_policy=policy, **options)
        if point_to_point:
            use_point_to_point_collectives(module)

    layers = wrap_units(model, wrap_classes)
    output, _ = separate_embeddings(model, layers)
    *units, root = sharding_units(model, wrap_classes)
    for unit in units:
        # the last layer forward runs is the first one backward needs, and lm_head's gradient is reduced as soon as
        # backward has it: resharding either would only gather it again
        shard(unit, reshard and unit is not layers[-1] and unit is not output)
    shard(root, reshard_after_forward=False)  # the root's remaining parameters are used from first to last
    return model


def sharding_units(model: Module, wrap_classes: set[type[Module]]) -> list[Module]:
    """Every unit fsdp and fsdp2 shard, in the order they materialise and shard them: the layers, the embeddings
    `separate_embeddings` chooses and the modules kept in float32, children first, then the root."""
    return [*wrap_units(model, wrap_classes, also=units_beside_the_layers(model, wrap_classes)), model]


def units_beside_the_layers(model: Module, wrap_classes: set[type[Module]]) -> set[Module]:
    """The units that are no module of a wrap class: the embeddings `separate_embeddings` chooses and the modules
    transformers keeps in float32 (`kept_in_fp32_units`)."""
    embeddings = set(separate_embeddings(model, wrap_units(model, wrap_classes))) - {None}
    return embeddings | set(kept_in_fp32_units(model)[0])


def separate_embeddings(model: Module, layers: list[Module]) -> tuple[Optional[Module], Optional[Module]]:
    """The output and input embeddings that get units of their own (torchtitan's layout), under fsdp2 and fsdp
    alike. Left in the root, both stay gathered from the start of forward to the end of backward, and lm_head's
    whole gradient until the end of backward too: for Llama-3-8B (128K tokens), 1 GB each in bf16, more than two of
    its layers.

    Only an embedding at least as large as the largest of the `layers`: a smaller one held gathered
    costs less memory than a layer FSDP gathers anyway, and its own collectives would cost time at every step. And
    only one whose weight no other module holds: tied embeddings (one matrix at both ends, as T5's) and shared ones
    (an encoder's and a decoder's) stay in the root."""
    holders = Counter(id(parameter) for _, parameter in model.named_parameters(remove_duplicate=False))
    layer_size = max(map(parameter_count, layers), default=None)

    def alone_and_large(module: Optional[Module]) -> Optional[Module]:
        if module is None or layer_size is None or parameter_count(module) < layer_size:
            return None
        return module if all(holders[id(parameter)] == 1 for parameter in module.parameters()) else None

    return tuple(alone_and_large(getattr(model, name)() if hasattr(model, name) else None)
                 for name in ("get_output_embeddings", "get_input_embeddings"))


def parameter_count(module: Module) -> int:
    return sum(parameter.numel() for parameter in module.parameters())


def wrap_units(model: Module, wrap_classes: set[type[Module]], also: set[Module] = frozenset()) -> list[Module]:
    """The modules of the wrap classes (and those `also` named), children before their parent, in the order they were
    registered: the order forward runs them in (decoder layers; a T5 encoder's blocks, then its decoder's), and
    the order FSDP1's auto-wrapping materialises them in."""
    units = []
    for child in model.children():
        units += wrap_units(child, wrap_classes, also)
    if isinstance(model, tuple(wrap_classes)) or model in also:
        units.append(model)
    return units


class UnitsWithEmbeddings(ModuleWrapPolicy):
    """FSDP1's auto-wrap policy: a unit for each module of the wrap classes, and for the embeddings and modules kept
    in float32 that `units_beside_the_layers` chooses, as under fsdp2; the latter and what they hold (wrap units
    included) with a mixed precision that casts nothing."""

    def _run_policy(self, root_module: Module, ignored_modules: set[Module],
                    root_kwargs: dict[str, Any]) -> dict[Module, dict[str, Any]]:
        units = super()._run_policy(root_module, ignored_modules, root_kwargs)
        for unit in units_beside_the_layers(root_module, set(self._module_classes)):
            units[unit] = dict(root_kwargs)
        in_float32 = {part for unit in kept_in_fp32_units(root_module)[0] for part in unit.modules()}
        for unit, kwargs in units.items():
            if unit in in_float32 and kwargs.get("mixed_precision") is not None:
                kwargs["mixed_precision"] = replace(kwargs["mixed_precision"], param_dtype=None)
        return units


def parallelize_fn(cfg: Config, wrap_classes: set[type[Module]],
                   param_init_fn: Optional[Callable[[Module], None]]) -> Callable[[Module, DeviceMesh], Module]:
    offload = CPUOffloadPolicy() if cfg.cpu_offload else OffloadPolicy()
    return partial(shard_model, wrap_classes=wrap_classes, sharding_strategy=cfg.sharding_strategy,
                   num_nodes=cfg.num_nodes, mp_policy=mixed_precision_policy(cfg.precision, cfg.reduce_dtype),
                   offload_policy=offload, param_init_fn=param_init_fn)


def shard_like(full: torch.Tensor, target: Any) -> torch.Tensor:
    """A whole tensor read from a file, as the DTensor shard `target` holds (sliced locally, no communication)."""
    if not isinstance(target, DTensor):
        return full
    return distribute_tensor(full.to(target.device), target.device_mesh, target.placements, src_data_rank=None)
