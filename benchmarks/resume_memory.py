"""How much host memory resuming costs: each rank's resident-memory rise while it loads a checkpoint.

    python benchmarks/resume_memory.py REPORT.json CHECKPOINT <train.py options, e.g. --devices 4 ...>

Every rank sets the model and optimizer up as train.py does, resets its high-water mark (`echo 5 >
/proc/self/clear_refs`), loads the checkpoint with the application's loader, and reads `VmHWM`. Rank 0 writes
the rises of every rank, their sum, and the checkpoint's size to REPORT.json. Linux only.
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from app.checkpoint import is_checkpoint, latest_checkpoint, load_checkpoint  # noqa: E402
from app.distributed.strategy import build_fabric  # noqa: E402
from app.exit_codes import EXIT_FINISHED  # noqa: E402
from app.model.build import deferred_init, setup_model  # noqa: E402
from app.optimization.optimizer import build_optimizer  # noqa: E402
from app.reliability.signals import run_and_exit  # noqa: E402
from app.training.preflight import preflight  # noqa: E402
from arguments import parse_config  # noqa: E402


def status_bytes(field: str) -> int:
    """A `kB` field of /proc/self/status (VmRSS, VmHWM) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def size_of(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def measure(fabric, cfg, inputs, deferred, checkpoint: Path, report: str) -> int:
    model, roles, _ = setup_model(fabric, cfg, inputs.model_config, deferred)
    optimizer = fabric.setup_optimizers(build_optimizer(model, cfg, roles))
    gc.collect()
    before = status_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    load_checkpoint(checkpoint, model, optimizer)
    rises = fabric.all_gather(torch.tensor(status_bytes("VmHWM") - before, dtype=torch.float64)).reshape(-1)
    if fabric.is_global_zero:
        size = size_of(checkpoint)
        Path(report).write_text(json.dumps({"rises_gb": [r / 1e9 for r in rises.tolist()],
                                            "sum_gb": rises.sum().item() / 1e9, "checkpoint_gb": size / 1e9,
                                            "ratio": rises.sum().item() / size}))
    return EXIT_FINISHED


def main() -> None:
    if len(sys.argv) < 3 or sys.argv[1] in ("-h", "--help"):
        sys.exit(__doc__)
    report, checkpoint, cfg = sys.argv[1], Path(sys.argv[2]), parse_config(sys.argv[3:])
    if checkpoint.is_dir() and not is_checkpoint(checkpoint):  # a run folder: its latest, as --resume takes it
        checkpoint = latest_checkpoint(checkpoint) or checkpoint
    if not is_checkpoint(checkpoint):
        sys.exit(f"resume_memory.py: error: CHECKPOINT {checkpoint}: no checkpoint there; give a checkpoint or a run "
                 "folder that holds one")
    inputs = preflight(cfg)
    deferred = deferred_init(cfg, inputs.model_config)
    fabric = build_fabric(cfg, inputs.plan.world_size, inputs.wrap_classes, [],
                          deferred.param_init_fn if deferred else None)
    fabric.launch(run_and_exit, measure, cfg, inputs, deferred, checkpoint, report)


if __name__ == "__main__":
    main()
