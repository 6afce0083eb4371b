"""Two ranks over gloo write one checkpoint from uneven pieces (as FSDP's flat shards cut them) and replicated
tensors (as DDP holds them), in both formats; rank 0 reads both back and compares them with the whole tensors.

    python tests/helpers/write_pieces.py RANK PORT FOLDER [machines] [full-disk-on-rank-N]

With `machines`, each rank reports a machine of its own, so that rank 1's pieces of a full file travel to rank 0
instead of being written by rank 1 itself (what ranks on other nodes do). With `full-disk-on-rank-N`, rank N's disk
writes fail (ENOSPC): every rank prints the SaveFailed it raised, for each format, instead of reading back.
"""

from __future__ import annotations

import errno
import socket
import sys
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from app.checkpoint import SaveFailed, read_metadata, read_tensors  # noqa: E402
from app.checkpoint.direct_io import DirectFile  # noqa: E402
from app.checkpoint.state import LocalState, Part, Piece  # noqa: E402
from app.checkpoint.writers import Snapshot, StagingArea  # noqa: E402

CUT = {"model.embed.weight": 13, "model.norm.weight": 1, "optimizer.state.embed.exp_avg": 30}


def whole_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"model.embed.weight": torch.randn(7, 5, generator=generator),
            "model.norm.weight": torch.randn(5, generator=generator),
            "optimizer.state.embed.exp_avg": torch.randn(7, 5, generator=generator).to(torch.bfloat16),
            "optimizer.state.embed.step": torch.tensor(3.0)}


def this_ranks_part(rank: int, tensors: dict[str, torch.Tensor]) -> LocalState:
    """Split tensors cut at CUT (rank 0 below, rank 1 above); the others replicated on both ranks."""
    parts = {}
    for name, tensor in tensors.items():
        flat = tensor.view(-1)
        if name in CUT:
            start, stop = (0, CUT[name]) if rank == 0 else (CUT[name], flat.numel())
            pieces = (Piece(start, flat[start:stop]),)
        else:
            pieces = (Piece(0, flat),)
        parts[name] = Part(tuple(tensor.shape), tensor.dtype, pieces)
    return LocalState(parts, [])


def full_disk(*args: object) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def main() -> None:
    rank, port, folder, options = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), sys.argv[4:]
    if "machines" in options:
        socket.gethostname = lambda: f"machine-{rank}"
    if f"full-disk-on-rank-{rank}" in options:
        DirectFile.write_at = DirectFile.write_blocks = full_disk  # type: ignore[method-assign]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    tensors = whole_tensors()
    for sharded, background in ((False, False), (True, True)):
        path = folder / ("sharded" if sharded else "full.ckpt")
        taken = Snapshot.take(this_ranks_part(rank, tensors), {"step": 3}, group=None, sharded=sharded)
        if background:  # a background save whose next update came first: written from copies
            taken = taken.for_background(StagingArea())
            taken.handover.freeze()
        try:
            taken.write(path)
        except SaveFailed as error:
            print(f"{path.name}: {error}", flush=True)
            continue
        dist.barrier()
        if rank == 0:
            assert read_metadata(path) == {"step": 3}
            read = read_tensors(path)
            assert read.keys() == tensors.keys(), sorted(read)
            for name, tensor in tensors.items():
                assert read[name].dtype == tensor.dtype and torch.equal(read[name], tensor), name
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
