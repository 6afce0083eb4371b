"""--tensorboard: what it needs, checked before any worker starts."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from arguments import Config

TENSORBOARDX = "tensorboardX==2.6.5"
"""requirements.txt's pin (tests/test_preflight.py checks that they agree)."""


def check_tensorboard(cfg: Config, problems: list[str]) -> None:
    """A writer for Fabric's TensorBoardLogger: tensorboardX, or torch's own, which needs the tensorboard package.
    Without either, every rank raised Fabric's ModuleNotFoundError as it made the loggers (on every node)."""
    if cfg.tensorboard and not any(importlib.util.find_spec(name) for name in ("tensorboardX", "tensorboard")):
        problems.append(f"--tensorboard true needs the tensorboardX package: pip install {TENSORBOARDX} (or pip "
                        "install -r requirements.txt), or drop --tensorboard")
