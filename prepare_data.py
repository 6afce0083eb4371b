"""Tokenize raw text, prompt/response pairs, chats or source/target pairs into a dataset folder for training (packed
or padded): see `python prepare_data.py --help` and the README."""

import signal

if __name__ == "__main__":  # until it takes stop signals itself: Ctrl-C while the libraries import ends
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # it quietly (130), as train.py does (app/stopping.py)

from app.prepare.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
