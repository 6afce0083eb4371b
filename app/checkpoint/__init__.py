"""Checkpoints: where they live and which are kept (files.py), what they hold in which format (io.py, state.py,
tensor_file.py, reader.py), writing now or in the background (saver.py), random states (rng.py), and the formats of earlier versions (legacy.py)."""

from app.checkpoint.files import (checkpoint_dir, checkpoint_path, latest_checkpoint, list_checkpoints, mark_if_best,
                                  prune_checkpoints, read_best)
from app.checkpoint.io import (CheckpointError, load_checkpoint, read_metadata, read_model_weights, save_checkpoint,
                               stored_tensor_shapes)
from app.checkpoint.rng import resume_rng, rng_of_every_rank
from app.checkpoint.saver import CheckpointSaver

__all__ = ["CheckpointError", "CheckpointSaver", "checkpoint_dir", "checkpoint_path", "latest_checkpoint", "list_checkpoints",
           "load_checkpoint", "mark_if_best", "prune_checkpoints", "read_best", "read_metadata", "read_model_weights",
           "resume_rng", "rng_of_every_rank", "save_checkpoint", "stored_tensor_shapes"]
