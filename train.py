"""Train a Hugging Face causal LM with Lightning Fabric and FSDP: `python train.py --help`."""

from arguments import parse_config

if __name__ == "__main__":
    config = parse_config()
    from app.run import run

    run(config)
