"""Print what a Hugging Face model folder writes (a converted checkpoint): `python generate.py --help`."""

from app.cli import quiet_interrupts
from app.huggingface.generate_cli import main

if __name__ == "__main__":
    quiet_interrupts()
    main()
