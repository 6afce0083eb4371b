"""What the nodes of a run must share, checked once their ranks have met and before anything is read or written.

Each node's launching process parses its own command line, reads its own data folder and imports its own copy of
the code: nodes started differently trained one model together without a word (node 1 applying --lr 0.3 while node 0
logged 3e-3, a data folder of 400 rows on one node and 647 on the other, a checkout whose default weight decay
differs), until a collective of another shape ended them in a gloo error after a mixed checkpoint was saved.
"""

from __future__ import annotations

import hashlib
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch.distributed as dist
from lightning_fabric import Fabric

from app.checkpoint import read_metadata
from app.checkpoint.io import identity
from app.checkpoint.files import holder_line, sees_lock
from app.data.mixture import parse_sources
from app.versions import library_versions

if TYPE_CHECKING:
    from app.training.preflight import RunInputs
    from arguments import Config

NODE_OWN_OPTIONS = frozenset({"train_data_dir", "model_name", "model_config", "init_from", "tokenizer", "out_dir",
                              "checkpoint", "num_workers", "wandb_mode", "project", "entity", "run_name"})
"""Options a node may give its own way: paths (a node's copy of the data or the model lies where it lies; what they
hold is compared instead, and out_dir and the checkpoint are checked apart), the data workers of its CPUs, and the
W&B run's settings, which each node's WANDB_* variables fill in and only rank 0 uses."""
SAMPLES, SAMPLE_BYTES = 16, 1 << 16
"""A weight file's identity reads its size and this many pieces of this size spread over it: another revision or a
fine-tune of the same model differs in every tensor, and hashing 16 GB whole on every node would take minutes."""
CODE = ("app", "train.py", "arguments.py")
"""The code every node must run alike, from the project's root."""
ROOT = Path(__file__).resolve().parents[2]


def code_version() -> str:
    """A hash of the project's Python code as this node imports it."""
    digest = hashlib.sha256()
    for path in sorted(file for name in CODE for file in ([ROOT / name] if name.endswith(".py")
                                                          else (ROOT / name).rglob("*.py"))):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def weights_identity(model_name: Optional[str], init_from: Optional[str] = None) -> Optional[list]:
    """The pretrained weights this node reads (a local folder, or the Hub's snapshot in this node's cache): each
    safetensors file's name, size and a hash of pieces spread over it; for --init_from, its checkpoint's identity
    (which holds the checksums of its tensors). None when unknown, which compares with anything: no pretrained
    weights, none in this node's cache yet (each rank fetches the same revision), a file that cannot be read (its
    own rank says so when it loads)."""
    if init_from:
        return [identity(read_metadata(Path(init_from)))]
    if not model_name:
        return None
    folder = Path(model_name)
    try:
        if not folder.is_dir():
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(model_name, local_files_only=True))
        found = [[path.name, path.stat().st_size, sampled_hash(path)] for path in sorted(folder.glob("*.safetensors"))]
    except Exception:  # not in this node's cache, or not readable here
        return None
    return found or None


def sampled_hash(path: Path) -> str:
    digest, size = hashlib.sha256(), path.stat().st_size
    with open(path, "rb") as file:
        for index in range(SAMPLES):
            file.seek(size * index // SAMPLES)
            digest.update(file.read(SAMPLE_BYTES))
    return digest.hexdigest()


def node_fingerprint(cfg: Config, inputs: RunInputs) -> dict[str, Any]:
    """What this node was started with, as it must be on every node. A single data folder's name is its folder's
    (a node's copy may be named otherwise); a mixture's names and weights decide what each step draws."""
    model = inputs.model_config.to_dict() if inputs.model_config is not None else {}
    folders = inputs.data_folders
    own = {"path"} if len(folders) > 1 else {"path", "name"}
    return {"options": {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name not in NODE_OWN_OPTIONS},
            "data": [{key: value for key, value in folder.items() if key not in own} for folder in folders],
            "mixture": [[source.name, str(source.weight)] for source in parse_sources(cfg.train_data_dir)]
            if len(folders) > 1 else [],
            "model": {key: value for key, value in model.items()
                      if key not in ("_name_or_path", "transformers_version")},
            # a resume reads no pretrained weights
            "weights": None if inputs.resume_from else weights_identity(cfg.model_name, cfg.init_from),
            "code": code_version(), "libraries": library_versions()}


PARTS = (("data", "the data folders' contents (stats.json or row counts)"),
         ("mixture", "the mixture's folder names or weights"), ("model", "the model's config"),
         ("weights", "the pretrained weights"), ("code", "the code (app/, train.py, arguments.py)"))
"""The parts of a fingerprint besides the options, and how a difference in each is named."""


def nodes_disagreement(fingerprints: dict[int, dict[str, Any]]) -> Optional[str]:
    """A line naming what the nodes' fingerprints (by node rank) differ in from node 0's; None when they agree."""
    first, differences = fingerprints[0], []
    for node, other in sorted(fingerprints.items()):
        found = [f"--{name} {first['options'][name]} / {other['options'].get(name)}" for name in first["options"]
                 if first["options"][name] != other["options"].get(name)]
        found += [what for part, what in PARTS if first[part] != other[part]
                  and not (part == "weights" and None in (first[part], other[part]))]
        libraries = other.get("libraries", {})  # none: a node of earlier code, which the code's hash names
        found += [f"{name} {version} / {libraries.get(name)}" for name, version in first["libraries"].items()
                  if libraries and libraries.get(name) != version]
        if found:
            differences.append(f"node 0 / node {node}: {', '.join(found)}")
    if not differences:
        return None
    return (f"the nodes were not started alike: {'; '.join(differences)}; give every node the same command line, "
            "data, code and libraries")


def nodes_disagree(fabric: Fabric, cfg: Config, inputs: RunInputs) -> Optional[str]:
    """nodes_disagreement of every node's fingerprint, the same line on every rank. Collective."""
    gathered: list = [None] * fabric.world_size
    mine = node_fingerprint(cfg, inputs) if fabric.local_rank == 0 else None
    dist.all_gather_object(gathered, (fabric.node_rank, mine))
    return nodes_disagreement({node: fingerprint for node, fingerprint in gathered if fingerprint is not None})


def unshared_out_dir(fabric: Fabric, out_dir: Path) -> Optional[str]:
    """Every rank writes its part of each checkpoint into out_dir and every node reads them back to resume: a node
    whose --out_dir is another folder, or a disk of its own, split each checkpoint across folders that no node reads
    whole (the two-node test ended in a traceback from a collective). Each node's first rank looks for the lock rank
    0 holds (`sees_lock`)."""
    holder = [holder_line() if fabric.is_global_zero else None]
    dist.broadcast_object_list(holder, src=0)
    seen: list = [None] * fabric.world_size
    sees = fabric.local_rank != 0 or sees_lock(out_dir, holder[0])
    dist.all_gather_object(seen, (fabric.node_rank, sees, str(out_dir)))
    blind = {node: folder for node, saw, folder in seen if not saw}
    if not blind:
        return None
    return (f"--out_dir: the lock node 0 holds in {seen[0][2]} is not seen by every node ("
            + "; ".join(f"node {node} looked in {folder}" for node, folder in sorted(blind.items()))
            + "); every node must write and read the same --out_dir, on a filesystem they share (each rank writes "
            "its part of every checkpoint, and each node reads them back to resume)")


def resume_disagreement(chosen: list[tuple[int, Optional[int], str, str]]) -> Optional[str]:
    """Each node's launching process chose the checkpoint to resume from on its own, in its preflight: nodes given
    another --out_dir or --checkpoint, or whose view of a shared folder lags (an NFS client's cached listing misses
    the newest checkpoint), would resume at different steps and train one model from shards of different steps.
    Checkpoints of one step from other runs (a node's stale local copy) were taken: each replica of HYBRID_SHARD
    trained on from other weights, and the next save kept node 0's. `chosen` holds every rank's (node, step,
    checkpoint, identity); a line naming each node's choice when they differ."""
    if len({(step, identity) for _, step, _, identity in chosen}) == 1:
        return None
    one_step = len({step for _, step, _, _ in chosen}) == 1
    by_node = {node: (f"from {path} (step {step}{f', checkpoint {identity}' if one_step else ''})"
                      if step is not None else "at step 0, without a checkpoint")
               for node, step, path, identity in chosen}
    return ("--resume: the nodes would not continue from the same checkpoint: " + "; ".join(
        f"node {node} {choice}" for node, choice in sorted(by_node.items())) + "; give every node the same --out_dir "
        "and --resume, or the same --checkpoint (a lagging view of a shared folder misses the newest one; a copy "
        "of a checkpoint on a node's own disk must be that checkpoint)")
