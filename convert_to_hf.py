"""Convert a train.py checkpoint into a verified Hugging Face model folder: `python convert_to_hf.py --help`."""

from app.cli import quiet_interrupts
from app.huggingface.convert_cli import main

if __name__ == "__main__":
    quiet_interrupts()
    main()
