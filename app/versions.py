"""Which versions of the libraries made a prepared folder or a checkpoint: recorded in stats.json and in every
checkpoint (the converted model's card lists them, as the Hugging Face Trainer's cards do), and compared between the
nodes of a run, whose ranks must compute alike."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

TRAINING_LIBRARIES = ("torch", "transformers", "lightning-fabric", "datasets", "tokenizers")
"""What a run's numbers depend on besides the project's own code."""
PREPARING_LIBRARIES = ("transformers", "tokenizers", "datasets")
"""What prepare_data.py's tokens depend on."""


def library_versions(names: tuple[str, ...] = TRAINING_LIBRARIES) -> dict[str, str]:
    """{package: version} of those of `names` that are installed."""
    found = {}
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            continue
    return found
