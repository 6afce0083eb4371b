"""Draw train/validation loss, learning rate and throughput of train.py runs from their metrics.csv to a picture."""

import signal
import sys

if __name__ == "__main__":  # until it takes stop signals itself: Ctrl-C while the libraries import ends
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # it quietly (130), as train.py does (app/stopping.py)

from app.metrics.plot import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
