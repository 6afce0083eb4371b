"""Download a model, its tokenizer and optionally a dataset into the Hugging Face cache for offline training."""

import signal
import sys

if __name__ == "__main__":  # until it takes stop signals itself: Ctrl-C while the libraries import ends
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # it quietly (130), as train.py does (app/stopping.py)

from app.huggingface.prefetch import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
