"""Tokenize and pack text for training: see `python prepare_data.py --help` and the README."""

from app.cli import quiet_interrupts
from app.prepare.cli import main

if __name__ == "__main__":
    quiet_interrupts()
    main()
