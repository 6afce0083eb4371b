"""Download a model, its tokenizer and optionally a dataset into the Hugging Face cache for offline training."""

import sys

from app.huggingface.prefetch import main

if __name__ == "__main__":
    sys.exit(main())
