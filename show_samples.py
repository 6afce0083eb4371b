"""Print the generation samples of a run's latest evaluation next to their references: `python show_samples.py
--help`."""

from app.evaluation.show import main

if __name__ == "__main__":
    main()
