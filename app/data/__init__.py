"""Training data: the prepared folder's format (formats.py), weighted mixtures of folders (mixture.py), which rows
each rank reads (order.py), what identifies a folder for a resume wherever it lies (identity.py), and the steps and
evaluation batches read from it (loader.py)."""

from app.data.formats import IGNORE_INDEX, Batch, DataFormat
from app.data.loader import Step, TrainingData, load_data, train_steps

__all__ = ["IGNORE_INDEX", "Batch", "DataFormat", "Step", "TrainingData", "load_data", "train_steps"]
