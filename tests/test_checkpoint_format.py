"""Checkpoint formats in one process: pieces cut into blocks, written as a full file or a DCP folder, read back as any
other pieces, and the folder readable by torch.distributed.checkpoint's own loader.

The multi-process paths (FSDP's flat shards, FSDP2's rows, DDP's replicas, at any world size) are exercised by
tests/test_resume_anywhere.py, tests/test_reliability.py and tests/test_async_save.py; these tests pin the
arithmetic and the byte layouts.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import re
import shutil
import socket
import subprocess
import sys
from math import prod
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex

from app.checkpoint import read_tensors, stored_tensor_shapes
from app.checkpoint import direct_io
from app.checkpoint.dcp_blocks import framing, without_crc32, write_block
from app.checkpoint.direct_io import ALIGN
from app.checkpoint.sources import open_source
from app.checkpoint.state import LocalState, Part, Piece, blocks, flat_range
from app.checkpoint.tensor_file import read_header
from app.checkpoint.writers import Snapshot, StagingArea, lowest_holders
from conftest import ROOT, free_port, overwrite_in_place


def test_blocks_cover_a_range_in_order_and_each_is_one_range_again() -> None:
    generator = random.Random(0)
    for _ in range(3000):
        shape = tuple(generator.randint(1, 5) for _ in range(generator.randint(0, 4)))
        start = generator.randint(0, prod(shape))
        stop = generator.randint(start, prod(shape))
        found = blocks(shape, start, stop)
        position = start
        for offsets, sizes in found:
            assert all(0 <= o and o + s <= d for o, s, d in zip(offsets, sizes, shape))
            assert flat_range(shape, offsets, sizes) == (position, prod(sizes))
            position += prod(sizes)
        assert position == stop
        assert len(found) <= 2 * len(shape) + 1


def test_a_block_that_is_not_one_range_is_refused() -> None:
    with pytest.raises(ValueError, match="not one range"):
        flat_range((4, 6), (0, 2), (2, 3))  # two rows, three columns each: two ranges


def test_the_rank_that_writes_a_piece_is_the_lowest_holding_it_and_pieces_must_tile_each_tensor() -> None:
    shapes = {"a": (2, 4), "b": (10,), "c": (3,)}
    layouts = [{"a": [(0, 4)], "b": [(0, 10)], "c": []},
               {"a": [(4, 4)], "b": [(0, 10)], "c": [(0, 3)]}]
    assert lowest_holders(layouts, shapes) == {"a": [(0, 0, 4), (1, 4, 4)], "b": [(0, 0, 10)], "c": [(1, 0, 3)]}
    with pytest.raises(RuntimeError, match="pieces of a do not tile it: elements from 4 to 5"):
        lowest_holders([{"a": [(0, 4)], "b": [(0, 10)], "c": [(0, 3)]}, {"a": [(5, 3)]}], shapes)
    with pytest.raises(RuntimeError, match="pieces of c cover 2 of its 3 elements"):
        lowest_holders([{"a": [(0, 8)], "b": [(0, 10)], "c": [(0, 2)]}], shapes)


def uneven_pieces(tensors: dict[str, torch.Tensor], cuts: dict[str, list[int]]) -> LocalState:
    """One process holding every tensor as pieces cut at arbitrary elements, as FSDP's flat shards cut them."""
    parts = {}
    for name, tensor in tensors.items():
        bounds = [0, *cuts.get(name, []), tensor.numel()]
        parts[name] = Part(tuple(tensor.shape), tensor.dtype,
                           tuple(Piece(a, tensor.view(-1)[a:b]) for a, b in zip(bounds, bounds[1:]) if b > a))
    return LocalState(parts, [])


@pytest.fixture
def tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"model.embed.weight": torch.randn(7, 5, generator=generator),
            "model.experts": torch.randn(3, 4, 6, generator=generator).to(torch.bfloat16),
            "model.norm.weight": torch.randn(5, generator=generator),
            "optimizer.state.embed.step": torch.tensor(12.0)}


CUTS = {"model.embed.weight": [3, 4, 27], "model.experts": [5, 30, 31, 70], "model.norm.weight": [2]}


def updated_before_written(taken: Snapshot) -> Snapshot:
    """A background save whose next update came before its write: it writes every piece from copies."""
    area = StagingArea()
    background = taken.for_background(area)
    background.handover.freeze()
    return background.staged(area)


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("copied", [False, True])
def test_pieces_written_in_either_format_read_back_exactly_into_other_pieces(tensors, tmp_path, sharded,
                                                                             copied) -> None:
    path = tmp_path / ("step.ckpt" if not sharded else "folder")
    taken = Snapshot.take(uneven_pieces(tensors, CUTS), {"step": 12}, group=None, sharded=sharded)
    (updated_before_written(taken) if copied else taken).write(path)
    assert read_tensors(path).keys() == tensors.keys()
    for name, tensor in read_tensors(path).items():
        assert tensor.dtype == tensors[name].dtype and torch.equal(tensor, tensors[name])
    with open_source(path) as source:
        assert source.shapes() == {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}
        for name, tensor in tensors.items():
            start, stop = tensor.numel() // 3, tensor.numel() - 1
            target = torch.empty(stop - start, dtype=torch.float64)  # another dtype: read, then converted
            source.read_elements_into(name, start, target)
            assert torch.equal(target, tensor.reshape(-1)[start:stop].double())
    metadata = json.loads((path / "training.json").read_text() if sharded else read_header(path)[1]["training"])
    assert metadata == {"step": 12}


def test_copies_lie_in_memory_as_their_bytes_lie_in_a_full_file(tensors, tmp_path) -> None:
    """What lets a background save write its copies without copying again: each piece at the place within a page
    that its bytes have within a disk block of the file; the tensors begin on a block, whatever the metadata's
    length."""
    for metadata in ({"step": 12}, {"step": 12, "note": "x" * 1001}):
        taken = Snapshot.take(uneven_pieces(tensors, CUTS), metadata, group=None, sharded=False)
        area = StagingArea()
        background = taken.for_background(area)
        background.handover.freeze()
        background.staged(area).write(tmp_path / "step.ckpt")
        entries, _ = read_header(tmp_path / "step.ckpt")
        assert min(entry.begin for entry in entries.values()) % ALIGN == 0
        assert area.buffers.keys() == taken.pieces().keys()
        for (name, start), copy in area.buffers.items():
            assert copy.data_ptr() % ALIGN == (entries[name].begin + start * copy.element_size()) % ALIGN


def test_the_staging_area_is_one_arena_carved_into_the_pieces(tensors) -> None:
    """One allocation for every piece (pinned on a GPU machine, where torch rounds each pinned request up to a
    power of two: a buffer per piece pinned up to twice the state), each piece at its phase, reused by every save;
    a piece never seen makes one new arena for all."""
    taken = Snapshot.take(uneven_pieces(tensors, CUTS), {"step": 12}, group=None, sharded=True)
    pieces, phases = taken.pieces(), taken.block_phases()
    area = StagingArea()
    taken.reserve(area)
    arena = area.arena
    begin, end = arena.data_ptr(), arena.data_ptr() + arena.numel()
    state = sum(data.numel() * data.element_size() for data in pieces.values())
    assert state <= arena.numel() <= state + (len(pieces) + 1) * ALIGN
    spans = sorted((b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in area.buffers.values()
                   if b.numel())
    assert all(begin <= a and b <= end for a, b in spans) and all(b <= c for (_, b), (c, _) in zip(spans, spans[1:]))
    assert all(area.buffers[key].data_ptr() % ALIGN == phases[key] for key in pieces if pieces[key].numel())
    some = dict(list(pieces.items())[::2])
    copies = area.copy(some, phases)
    assert area.arena is arena and all(torch.equal(copies[key], data) for key, data in some.items())
    extra = {("another", 0): torch.arange(10.0)}
    area.copy(extra, {("another", 0): 100})
    assert area.arena is not arena and area.buffers.keys() == pieces.keys() | extra.keys()
    assert area.buffers[("another", 0)].data_ptr() % ALIGN == 100


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 5), (4, 0, 2), (70, 3, 9)])
def test_a_block_is_written_as_the_bytes_torch_save_writes(dtype, shape) -> None:
    """The checkpoint's sharded files are what DCP's own writer would make of the same blocks (with the CRC-32 off),
    so torch.distributed.checkpoint and torch.load read them; a new torch that changed torch.save fails here."""
    block = (torch.arange(torch.Size(shape).numel()) % 7).to(dtype).reshape(shape)
    ours, theirs = io.BytesIO(), io.BytesIO()
    write_block(ours, block)
    with without_crc32():
        torch.save(block, theirs)
    assert ours.getvalue() == theirs.getvalue()
    loaded = torch.load(io.BytesIO(ours.getvalue()), weights_only=True)
    assert loaded.dtype == dtype and torch.equal(loaded, block)


@pytest.mark.parametrize("source", ["training state", "background, before the update", "background, copied"])
def test_a_sharded_save_writes_every_large_block_from_where_it_lies(tmp_path, monkeypatch, source) -> None:
    """No large block of a sharded save is copied on its way to the disk: each lies in its file at the place within
    a disk block that it has in memory (the training state's, or a background save's copy), so its whole disk
    blocks go from there (direct_io.py)."""
    big = {"model.embed.weight": torch.randn(1000, 700), "optimizer.state.embed.exp_avg": torch.randn(1000, 700)}
    cuts = {name: [400 * 700 + 3] for name in big}  # blocks above IN_PLACE_BYTES, at any place within a page
    nbytes = 2 * 1000 * 700 * 4
    copied = []
    real_copy = direct_io.copy_into
    monkeypatch.setattr(direct_io, "copy_into",
                        lambda into, source: copied.append(len(source)) or real_copy(into, source))
    for save in range(2):
        copied.clear()
        taken = Snapshot.take(uneven_pieces(big, cuts), {}, group=None, sharded=True)
        if source != "training state":
            taken = taken.for_background(StagingArea())
        if source == "background, copied":
            taken.handover.freeze()
        taken.write(tmp_path / str(save))
        # only the parts of disk blocks that a large block shares with its neighbours go through a copy: their sum
        # varies with where the tensors lie within their pages (56 KB, 1% of these blocks, was once 57 KB)
        assert max(copied, default=0) < ALIGN and sum(copied) < nbytes / 20, (save, sorted(copied))
        assert all(torch.equal(read_tensors(tmp_path / str(save))[name], tensor) for name, tensor in big.items())
        storage = FileSystemReader(str(tmp_path / str(save))).read_metadata().storage_data
        written = (taken.handover.copies or taken.pieces()) if taken.handover else taken.pieces()
        for name, start, offsets, block in taken.sharded_blocks():
            if block.nbytes < direct_io.IN_PLACE_BYTES:  # small blocks are gathered into one buffer
                continue
            data_begin = storage[MetadataIndex(name, torch.Size(offsets))].offset + len(
                framing(block.dtype, tuple(block.shape))[0])
            assert written[(name, start)].data_ptr() % ALIGN == data_begin % ALIGN, (name, start)


def test_sharded_saves_of_one_layout_reuse_dcps_plan_and_of_another_layout_never_do(tensors, tmp_path,
                                                                                     monkeypatch) -> None:
    """The second save of a run skips DCP's global planning (its plan cache); a save of other dtypes in the same
    process, with the same names and shapes (which DCP's comparison of plans alone would take for the same), is
    planned afresh and reads back in its own dtypes."""
    planned = []
    real_plan = DefaultSavePlanner._create_global_plan
    monkeypatch.setattr(DefaultSavePlanner, "_create_global_plan",
                        lambda planner, plans: planned.append(1) or real_plan(planner, plans))
    tensors = {**tensors, f"model.{tmp_path.name}": torch.ones(3)}  # a layout no other save of this process had
    doubled = {name: (tensor * 2).to(torch.float64 if tensor.is_floating_point() else tensor.dtype)
               for name, tensor in tensors.items()}
    saves = [("first", tensors, 1), ("again", tensors, 0), ("other-dtypes", doubled, 1)]
    for folder, saved, planned_afresh in saves:
        planned.clear()
        Snapshot.take(uneven_pieces(saved, CUTS), {}, group=None, sharded=True).write(tmp_path / folder)
        assert len(planned) == planned_afresh, folder
        for name, tensor in read_tensors(tmp_path / folder).items():
            assert tensor.dtype == saved[name].dtype and torch.equal(tensor, saved[name]), (folder, name)


def test_a_sharded_folder_is_a_checkpoint_torch_distributed_checkpoint_itself_loads(tensors, tmp_path) -> None:
    Snapshot.take(uneven_pieces(tensors, CUTS), {}, group=None, sharded=True).write(tmp_path)
    chunks = FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata["model.experts"].chunks
    assert len(chunks) > len(CUTS["model.experts"]) + 1, "pieces are stored as the blocks they make up"
    loaded = {name: torch.zeros_like(tensor) for name, tensor in tensors.items()}
    dcp.load(loaded, storage_reader=FileSystemReader(str(tmp_path)), no_dist=True)
    assert all(torch.equal(loaded[name], tensors[name]) for name in tensors)


def test_a_folder_torch_distributed_checkpoint_wrote_reads_as_pieces(tensors, tmp_path) -> None:
    """Sharded checkpoints of earlier versions were written by DCP from torch's state dicts."""
    dcp.save(tensors, storage_writer=FileSystemWriter(str(tmp_path)), no_dist=True)
    assert all(torch.equal(tensor, tensors[name]) for name, tensor in read_tensors(tmp_path).items())


def test_a_checkpoint_pruned_while_a_resume_checks_it_is_passed_over(tmp_path, monkeypatch) -> None:
    """The same job submitted twice: the second's preflight read a checkpoint's metadata, the first run pruned it
    (--keep_last_n), and the completeness check's open ended in a FileNotFoundError traceback (seen in CI)."""
    from lightning_fabric import Fabric

    from app.checkpoint import CheckpointSaver, checkpoint_path
    from app.checkpoint import io as checkpoint_io
    from app.training.preflight.resume import newest_whole_checkpoint

    model = torch.nn.Linear(8, 4)
    state = {"model": model, "optimizer": torch.optim.AdamW(model.parameters()), "step": 0}
    saver = CheckpointSaver(Fabric(accelerator="cpu", devices=1), state, sharded=False, background=False)
    for step in (4, 8):
        state["step"] = step
        saver.save(checkpoint_path(tmp_path, step), state, lambda: None)
    checked = checkpoint_io.check_complete

    def pruned_meanwhile(path: Path) -> None:
        if path == checkpoint_path(tmp_path, 8):
            path.unlink()
        checked(path)

    monkeypatch.setattr(checkpoint_io, "check_complete", pruned_meanwhile)
    assert newest_whole_checkpoint(tmp_path) == (checkpoint_path(tmp_path, 4), [])


def test_a_rollback_compares_only_validation_losses_measured_on_the_same_rows(tmp_path) -> None:
    """A folder added to the mixture at a resume raised val_loss by its own rows (3.04 against 2.59 before the
    resume): the rollback passed over every checkpoint since the resume for the one before it, and set them aside."""
    from app.checkpoint import checkpoint_path
    from app.checkpoint.io import last_good_checkpoint

    def saved(step: int, val_loss: float, folders: str, **config: object) -> None:
        torch.save({"step": step, "val_loss": val_loss, "rng": [{}, {}], "model": {},
                    "config": {"train_data_dir": folders, "eval_iters": 10, "micro_batch_size": 4} | config},
                   checkpoint_path(tmp_path, step))

    checkpoint_path(tmp_path, 0).parent.mkdir(parents=True)
    saved(300, 2.59, "data:3,a2:1")
    saved(320, 3.04, "data:3,a2:0.5,prose:0.5")
    saved(340, 3.02, "data:3,a2:0.5,prose:0.5")
    assert last_good_checkpoint(tmp_path, 344) == checkpoint_path(tmp_path, 340)
    saved(360, 3.10, "data:3,a2:0.5,prose:0.5")  # the loss had begun to rise: passed over, as before
    assert last_good_checkpoint(tmp_path, 364) == checkpoint_path(tmp_path, 340)
    saved(380, 3.30, "data:3,a2:0.5,prose:0.5", eval_iters=20)  # other rows again: compared with no other
    assert last_good_checkpoint(tmp_path, 384) == checkpoint_path(tmp_path, 380)


def changed_copy(path: Path, copy: Path, change) -> Path:
    """A copy of the checkpoint at `path`, then `change(copy)`."""
    (shutil.copytree if path.is_dir() else shutil.copy)(path, copy)
    change(copy)
    return copy


def replace_bytes(file: Path, old: bytes, new: bytes) -> None:
    data = file.read_bytes()
    assert data.count(old) == 1 and len(old) == len(new)
    file.write_bytes(data.replace(old, new))


@pytest.mark.parametrize("sharded", [False, True])
def test_a_checkpoint_whose_metadata_or_checksums_changed_is_not_taken_for_whole(tmp_path, sharded) -> None:
    """The metadata had no checksum: a flipped digit of the position resumed a run on other rows without a word. A
    sharded folder that lost checksums.json was read unchecked, as one written before checksums; one that lost it in
    part, or lost DCP's .metadata, stopped `--resume true` (exit 2) instead of being passed over."""
    from lightning_fabric import Fabric

    from app.checkpoint import CheckpointSaver, broken_checkpoint, checkpoint_path, read_metadata
    from app.checkpoint.io import last_good_checkpoint
    from app.checkpoint.sources import CheckpointError

    model = torch.nn.Linear(8, 4)
    state = {"model": model, "optimizer": torch.optim.AdamW(model.parameters()), "step": 8, "position": 64}
    path = checkpoint_path(tmp_path / "run", 8)
    path.parent.mkdir(parents=True)
    CheckpointSaver(Fabric(accelerator="cpu", devices=1), state, sharded=sharded, background=False).save(
        path, state, lambda: None)
    assert broken_checkpoint(path) is None and read_metadata(path)["position"] == 64
    metadata = path / "training.json" if sharded else path
    quote = b'"' if sharded else b'\\"'
    moved = changed_copy(path, tmp_path / "moved.ckpt", lambda copy: replace_bytes(
        copy / "training.json" if sharded else copy, quote + b"position" + quote + b": 64",
        quote + b"position" + quote + b": 65"))
    assert broken_checkpoint(moved) == (f"{moved}: its metadata (step, position in the data, random states) are not "
                                        "what was saved (their checksum differs): the checkpoint is corrupt")
    with pytest.raises(CheckpointError):
        read_metadata(moved)
    shutil.move(moved, checkpoint_path(tmp_path / "run", 4))  # an earlier checkpoint: a rollback passes over it
    said: list[str] = []
    assert last_good_checkpoint(tmp_path / "run", 100, say=said.append) == path, "it raised CheckpointError"
    assert said == [f"not rolling back to {checkpoint_path(tmp_path / 'run', 4)}: its metadata (step, position in the "
                    "data, random states) are not what was saved (their checksum differs): the checkpoint is corrupt; "
                    "trying an earlier checkpoint"]
    if not sharded:
        return
    assert metadata.is_file()
    lost = changed_copy(path, tmp_path / "lost.ckpt", lambda copy: (copy / "checksums.json").unlink())
    assert broken_checkpoint(lost) == (f"{lost / 'checksums.json'}: the checksums of its pieces are missing: the "
                                       "checkpoint is incomplete")
    cut = changed_copy(path, tmp_path / "cut.ckpt", lambda copy: os.truncate(copy / "checksums.json", 50))
    assert broken_checkpoint(cut) == (f"{cut / 'checksums.json'}: the checksums of its pieces are not readable "
                                      "(JSONDecodeError): the checkpoint is incomplete")
    index = changed_copy(path, tmp_path / "index.ckpt", lambda copy: (copy / ".metadata").unlink())
    assert broken_checkpoint(index) == f"{index / '.metadata'} is missing: the checkpoint is incomplete"


@pytest.mark.parametrize("sharded", [False, True])
def test_a_rollback_passes_over_a_corrupt_checkpoint_for_the_one_before_it(tmp_path, sharded) -> None:
    """The spike guard's rollback met a checkpoint whose bytes changed in place with a traceback (on the ranks whose
    pieces were changed; the others waited for them)."""
    from lightning_fabric import Fabric

    from app.checkpoint import CheckpointSaver, checkpoint_path, load_last_good_checkpoint

    model = torch.nn.Linear(8, 4)
    state = {"model": model, "optimizer": torch.optim.AdamW(model.parameters()), "step": 0}
    saver = CheckpointSaver(Fabric(accelerator="cpu", devices=1), state, sharded=sharded, background=False)
    for step in (8, 16, 24):
        with torch.no_grad():
            model.weight.fill_(step)
        state["step"] = step
        saver.save(checkpoint_path(tmp_path, step), state, lambda: None)
    changed = overwrite_in_place(checkpoint_path(tmp_path, 16), "model.weight")
    said: list[str] = []
    path, saved = load_last_good_checkpoint(tmp_path, 20, model, state["optimizer"], said.append)
    assert (path, saved["step"]) == (checkpoint_path(tmp_path, 8), 8) and torch.all(model.weight == 8)
    assert len(said) == 1 and said[0].startswith(f"not rolling back to {changed}: elements 0 to ") and said[0].endswith(
        "of model.weight are not the bytes that were saved (their checksum differs): the checkpoint is corrupt; "
        "trying an earlier checkpoint"), said
    overwrite_in_place(checkpoint_path(tmp_path, 8), "model.weight")
    assert load_last_good_checkpoint(tmp_path, 20, model, state["optimizer"], said.append) is None

    # The run's line then says why no rollback is left: it once said there was no checkpoint before the incident.
    from app.training.loop import Loop

    printed: list[str] = []
    loop = SimpleNamespace(state=state, fabric=None, saver=saver, cfg=SimpleNamespace(out_dir=tmp_path),
                           resumed_from=None,
                           guard=SimpleNamespace(incident_began=lambda: 20), console=SimpleNamespace(
                               print=printed.append))
    assert Loop.roll_back(loop) is False
    assert printed[-1] == ("step 24: every checkpoint from before step 20 was passed over (see above); stopped without "
                           "saving. Resume from the last checkpoint with a lower --lr"), printed


@pytest.mark.parametrize("elsewhere", ["../secret", "/etc/hostname", "sub/__0_0.distcp", ".."])
def test_a_sharded_folder_whose_metadata_names_a_file_outside_it_is_refused(tensors, tmp_path, elsewhere) -> None:
    """DCP writes its rank files beside `.metadata`; a downloaded folder whose `.metadata` names another path would
    have its bytes read as the model's (and a conversion would push them)."""
    from app.checkpoint import CheckpointError, broken_checkpoint

    folder = tmp_path / "checkpoint"
    Snapshot.take(uneven_pieces(tensors, {}), {}, group=None, sharded=True).write(folder)
    (tmp_path / "secret").write_bytes(b"x" * 100_000)
    metadata = pickle.loads((folder / ".metadata").read_bytes())
    for stored in metadata.storage_data.values():
        stored.relative_path = elsewhere
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    refusal = f"names {elsewhere!r} for a tensor's bytes, outside the folder: not a checkpoint this program wrote"
    assert refusal in broken_checkpoint(folder)
    with pytest.raises(CheckpointError, match=re.escape(refusal)):
        read_tensors(folder)


def test_a_truncated_file_is_reported(tensors, tmp_path) -> None:
    path = tmp_path / "step.ckpt"
    Snapshot.take(uneven_pieces(tensors, {}), {}, group=None, sharded=False).write(path)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ValueError, match="truncated"):
        read_tensors(Path(path))


def test_a_sharded_folder_whose_metadata_would_run_code_is_refused_before_the_code_runs(tensors, tmp_path) -> None:
    """DCP's `.metadata` is a pickle: only the classes DCP stores there may be built from it."""
    Snapshot.take(uneven_pieces(tensors, {}), {}, group=None, sharded=True).write(tmp_path)
    marker = tmp_path / "code-ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(ValueError, match=r"\.metadata: .*system is not what a checkpoint's metadata holds"):
        stored_tensor_shapes(tmp_path)
    assert not marker.exists()


def write_pieces_on_two_ranks(folder: Path, *options: str) -> list[str]:
    """tests/helpers/write_pieces.py on ranks 0 and 1, each a fresh interpreter (see tests/forkserver.py's FORKED);
    what each printed."""
    for attempt in range(3):  # the free port can be taken before rank 0 listens on it (the other test worker)
        port = str(free_port())
        ranks = [subprocess.Popen([sys.executable, str(ROOT / "tests/helpers/write_pieces.py"), str(rank), port,
                                   str(folder), *options], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for rank in (0, 1)]
        outputs = [rank.communicate(timeout=120) for rank in ranks]
        if not any("EADDRINUSE" in error for _, error in outputs):
            break
    for rank, (_, error) in zip(ranks, outputs):
        assert rank.returncode == 0, error[-3000:]
    return [printed for printed, _ in outputs]


@pytest.mark.parametrize("machines", ["one machine", "two machines"])
def test_two_ranks_write_uneven_and_replicated_pieces_that_read_back_whole(tmp_path, machines) -> None:
    """On one machine both ranks write their pieces of a full file themselves; from another machine rank 1's pieces
    travel to rank 0. Replicated tensors are written once, by rank 0."""
    write_pieces_on_two_ranks(tmp_path, *(["machines"] if machines == "two machines" else []))


@pytest.mark.parametrize("machines, failing", [("two machines", 0), ("one machine", 1)])
def test_a_rank_whose_disk_is_full_fails_the_save_on_every_rank_alike(tmp_path, machines, failing) -> None:
    """The failing rank goes on through the save's exchanges (rank 0 still receives rank 1's pieces from another
    machine), then every rank raises the same error, for both formats; nothing hangs."""
    two_machines = machines == "two machines"
    printed = write_pieces_on_two_ranks(tmp_path, f"full-disk-on-rank-{failing}",
                                        *(["machines"] if two_machines else []))
    host = f"machine-{failing}" if two_machines else socket.gethostname()
    expected = "".join(f"{name}: rank {failing} on {host}: No space left on device (ENOSPC) writing "
                       f"{tmp_path / name}\n" for name in ("full.ckpt", "sharded"))
    assert printed == [expected, expected]


def test_keep_last_n_keeps_the_checkpoint_an_open_incident_would_roll_back_to_and_a_resumed_from_one_counts(
        tmp_path) -> None:
    """Spikes at 31 and 32, then the save at 32 under --keep_last_n 1 deleted step 24, the only checkpoint from
    before the incident: its third spike stopped the run with nothing to roll back to, as did every resume. A run
    resumed into a new --out_dir had nothing to roll back to until it saved: the checkpoint it resumed counts."""
    import time
    from types import SimpleNamespace

    from lightning_fabric import Fabric

    from app.checkpoint import CheckpointSaver, checkpoint_path, last_good_checkpoint, list_checkpoints
    from app.training.loop import Loop

    model = torch.nn.Linear(8, 4)
    state = {"model": model, "optimizer": torch.optim.AdamW(model.parameters()), "step": 0}
    saver = CheckpointSaver(Fabric(accelerator="cpu", devices=1), state, sharded=False, background=False)
    for step in (24, 32):
        state["step"] = step
        saver.save(checkpoint_path(tmp_path / "run", step), state, lambda: None)
    printed: list[str] = []
    loop = SimpleNamespace(cfg=SimpleNamespace(out_dir=tmp_path / "run", keep_last_n=1), resumed_from=None,
                           console=SimpleNamespace(print=printed.append))
    Loop.after_publishing(loop, checkpoint_path(tmp_path / "run", 32), 32, None, time.monotonic(), incident_began=31)
    assert sorted(list_checkpoints(tmp_path / "run")) == [24, 32], printed
    Loop.after_publishing(loop, checkpoint_path(tmp_path / "run", 32), 32, None, time.monotonic())
    assert sorted(list_checkpoints(tmp_path / "run")) == [32], "without an incident --keep_last_n applies"

    elsewhere = checkpoint_path(tmp_path / "run", 32)
    assert last_good_checkpoint(tmp_path / "new", 35) is None
    assert last_good_checkpoint(tmp_path / "new", 35, also=elsewhere) == elsewhere
    assert last_good_checkpoint(tmp_path / "new", 32, also=elsewhere) is None, "only from before the incident"
