"""Download a model, its tokenizer and optionally a dataset into the Hugging Face cache for offline training."""

import sys

from app.cli import quiet_interrupts
from app.huggingface.prefetch import main

if __name__ == "__main__":
    quiet_interrupts()
    sys.exit(main())
