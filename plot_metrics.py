"""Draw train/validation loss, learning rate and throughput of train.py runs from their metrics.csv to a picture."""

import sys

from app.cli import quiet_interrupts
from app.metrics.plot import main

if __name__ == "__main__":
    quiet_interrupts()
    sys.exit(main())
