"""Print the generation samples of a run's latest evaluation next to their references: `python show_samples.py
--help`."""

import signal

if __name__ == "__main__":  # until it takes stop signals itself: Ctrl-C while the libraries import ends
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # it quietly (130), as train.py does (app/stopping.py)

from app.evaluation.show import main  # noqa: E402

if __name__ == "__main__":
    main()
