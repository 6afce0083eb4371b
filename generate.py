"""Print what a Hugging Face model folder writes (a converted checkpoint): `python generate.py --help`."""

import signal

if __name__ == "__main__":  # until it takes stop signals itself: Ctrl-C while the libraries import ends
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # it quietly (130), as train.py does (app/stopping.py)

from app.huggingface.generate_cli import main  # noqa: E402

if __name__ == "__main__":
    main()
