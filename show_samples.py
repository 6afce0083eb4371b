"""Print the generation samples of a run's latest evaluation next to their references: `python show_samples.py
--help`."""

from app.cli import quiet_interrupts
from app.evaluation.show import main

if __name__ == "__main__":
    quiet_interrupts()
    main()
