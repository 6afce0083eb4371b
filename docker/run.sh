#!/usr/bin/env bash
# Run a command in the training image with every GPU, shared memory for the data loaders and NCCL, and the
# data, outputs and Hugging Face cache on volumes.
#
#   docker/run.sh python train.py --devices 4 --train_data_dir /data/tokenized --out_dir /outputs/run1 ...
#
# Environment (all optional):
#   IMAGE      image to run                          (default: fsdp-trainer:latest)
#   DATA_DIR   host folder mounted read-only at /data (default: ./data)
#   OUT_DIR    host folder mounted at /outputs        (default: ./outputs)
#   HF_CACHE   host folder or volume name for /cache/huggingface (default: the named volume hf-cache)
#   STOP_TIMEOUT seconds `docker stop` waits after its SIGTERM before a SIGKILL (default: 300)
#   HF_TOKEN, WANDB_API_KEY, HF_HUB_OFFLINE, WANDB_MODE, WANDB_PROJECT, WANDB_ENTITY, WANDB_NAME and WANDB_RUN_ID
#   are passed through by name: their values never appear on the command line, in the image or in `docker inspect`
#   of the image (train.py reads the W&B ones where no flag is given).
set -euo pipefail

IMAGE="${IMAGE:-fsdp-trainer:latest}"
DATA_DIR="$(realpath -m "${DATA_DIR:-./data}")"
OUT_DIR="$(realpath -m "${OUT_DIR:-./outputs}")"
HF_CACHE="${HF_CACHE:-hf-cache}"
STOP_TIMEOUT="${STOP_TIMEOUT:-300}"

if [[ ! -d "$DATA_DIR" ]]; then
    echo "docker/run.sh: DATA_DIR $DATA_DIR does not exist; set DATA_DIR to the folder holding your datasets" >&2
    exit 2
fi
mkdir -p "$OUT_DIR"

if [[ $# -eq 0 ]]; then
    set -- python train.py --help
fi

# --ipc=host: PyTorch data loader workers and NCCL exchange tensors through shared memory, and Docker's default
#             64 MB /dev/shm makes them crash with "bus error".
# --network host: multi-node NCCL/Gloo and the torchrun rendezvous need the host's interfaces and ports.
# --ulimit memlock/stack: what NVIDIA recommends for NCCL and InfiniBand inside containers.
# --stop-timeout: on `docker stop`'s SIGTERM the run finishes its step and saves a checkpoint, minutes for a large
#             model on a network disk; Docker's default 10 s would kill the save and lose the steps since the last one.
exec docker run --rm --init \
    --stop-timeout "$STOP_TIMEOUT" \
    --gpus all \
    --ipc=host \
    --network host \
    --ulimit memlock=-1 \
    --ulimit stack=67108864 \
    --volume "$DATA_DIR:/data:ro" \
    --volume "$OUT_DIR:/outputs" \
    --volume "$HF_CACHE:/cache/huggingface" \
    --env HF_TOKEN \
    --env WANDB_API_KEY \
    --env HF_HUB_OFFLINE \
    --env WANDB_MODE \
    --env WANDB_PROJECT \
    --env WANDB_ENTITY \
    --env WANDB_NAME \
    --env WANDB_RUN_ID \
    "$IMAGE" "$@"
