"""Convert a train.py checkpoint into a verified Hugging Face model folder: `python convert_to_hf.py --help`."""

import signal

if __name__ == "__main__":  # until it takes stop signals itself: Ctrl-C while the libraries import ends
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # it quietly (130), as train.py does (app/stopping.py)

from app.huggingface.convert_cli import main  # noqa: E402

if __name__ == "__main__":
    main()
