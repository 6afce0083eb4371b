"""Checkpoints: where they live and which are kept (files.py); what they hold and each rank's part of it (state.py,
state_dicts.py, fsdp_shards.py); saving and loading (io.py) through writers (writers.py, tensor_file.py,
dcp_blocks.py, direct_io.py) and readers (sources.py), each piece's checksum recorded and checked (checksums.py);
writing now or in the background (saver.py; handover.py writes pieces from where they lie until the next update),
a save the storage refuses failing on every rank alike (failures.py);
random states (rng.py); earlier versions (legacy.py)."""

from app.checkpoint.failures import SaveFailed
from app.checkpoint.files import (checkpoint_dir, checkpoint_path, latest_checkpoint, list_checkpoints, mark_if_best,
                                  prune_checkpoints, read_best, run_folder_of, run_tokenizer_dir, set_aside_newer)
from app.checkpoint.io import (CheckpointError, broken_checkpoint, is_checkpoint, last_good_checkpoint, load_checkpoint,
                               load_last_good_checkpoint, load_on_every_rank, read_metadata, read_model_weights,
                               read_tensors, stored_tensor_shapes)
from app.checkpoint.rng import resume_rng, rng_of_every_rank
from app.checkpoint.saver import CheckpointSaver

__all__ = ["CheckpointError", "CheckpointSaver", "SaveFailed", "broken_checkpoint", "checkpoint_dir", "checkpoint_path",
           "is_checkpoint", "last_good_checkpoint", "latest_checkpoint", "list_checkpoints", "load_checkpoint",
           "load_last_good_checkpoint", "load_on_every_rank",
           "mark_if_best", "prune_checkpoints", "read_best", "read_metadata", "read_model_weights", "read_tensors",
           "resume_rng", "rng_of_every_rank", "run_folder_of", "run_tokenizer_dir", "set_aside_newer",
           "stored_tensor_shapes"]
