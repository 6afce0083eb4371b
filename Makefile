# The README's two commands: `make demo` and `make test`. Both build .venv from the pinned requirements first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: test

$(VENV)/.installed: requirements.txt requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt -r requirements-dev.txt
	touch $@

# Three workers on two cores, whole files each, the longest files first (tests/conftest.py), and a fork server for
# the suite's train.py processes (tests/forkserver.py): why, and the suite's times, in docs/testing.md. It has to fit
# in 15 minutes on CI's 2 cores: new tests come with an equal cut.
test: $(VENV)/.installed
	$(PY) -m pytest -q -n 3 --dist loadfile --no-loadscope-reorder tests

# The demo: prepare the Python standard library's source, train a small Llama from scratch with FSDP (2 CPU
# processes without a GPU, every GPU with one), convert the last checkpoint and print what the model writes.
# It replaces the demo/ folder of a previous demo.
DEMO_HARDWARE = $(shell $(PY) -c "import torch; n = torch.cuda.device_count(); \
	print(f'--accelerator gpu --devices {n} --precision bf16-mixed' if n else '--accelerator cpu --devices 2 --precision 32-true')")

# The GPU check (benchmarks/gpu_check.py, docs/performance.md#gpu-check), on a GPU machine whose own python3 holds
# torch (2.11 or newer) and transformers (5.17 or newer): `make gpu-wheels` here downloads the pure-Python packages
# such an image lacks into .whl/, which gpu-check installs beside that Python before it runs.
# The fused loss kernels: Liger Kernel for bench_loss.py's comparison only, Cut Cross-Entropy also for training's
# --loss_kernel cut_cross_entropy (gpu_check.py's row).
GPU_WHEELS := jsonargparse==4.53.0 docstring-parser==0.18.0 typeshed-client==2.15.0 datasets==5.2.0 dill==0.4.1 \
	multiprocess==0.70.19 lightning-fabric==2.6.6 liger-kernel==0.8.5 cut-cross-entropy==25.1.1
GPU_PYTHON ?= python3
GPU_CHECK_ARGS ?= --out gpu-check.json
.PHONY: gpu-wheels gpu-check gpu-rehearsal
gpu-wheels:  # afresh: wheels of an earlier pin beside the new ones make gpu-check's install refuse both
	rm -rf .whl
	python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)
# The wheels go into .gpu-check-site/ of this checkout, made afresh: a fixed folder in /tmp could be made first by
# another user of the machine, with a sitecustomize.py that PYTHONPATH would run.
gpu-check:
	rm -rf .gpu-check-site
	if [ -d .whl ]; then $(GPU_PYTHON) -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
		--upgrade --target .gpu-check-site .whl/*.whl; fi
	PYTHONPATH=$(CURDIR)/.gpu-check-site PYTHONUNBUFFERED=1 $(GPU_PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

# The GPU check rehearsed here, on CPU, against the GPU machine's image before a lent GPU's minutes are spent on it:
# .gpu-image/ holds the versions that image holds (Python 3.12, torch 2.11's CUDA wheel, transformers 5.17, which
# requires huggingface_hub 1.x; the device tool's package list of 2026-11) and not this project's pure-Python
# packages, which come from .whl/ as on the GPU machine; then `gpu_check.py --tiny`. The first build downloads
# about 4 GB (torch and CUDA's libraries, which import without a GPU).
GPU_IMAGE_PYTHON ?= python3.12
GPU_IMAGE_PACKAGES := torch==2.11.0 transformers==5.17.0 huggingface_hub==1.33.0 tokenizers==0.23.2 \
	safetensors==0.8.0 numpy==2.5.2 sentencepiece==0.2.2 tiktoken==0.14.0 accelerate==1.15.0 \
	pytorch-lightning==2.6.6 lightning==2.6.6 protobuf psutil tqdm matplotlib pyarrow pandas xxhash fsspec pyyaml
gpu-rehearsal:
	test -f .gpu-image/.installed || (rm -rf .gpu-image && $(GPU_IMAGE_PYTHON) -m venv .gpu-image && \
		.gpu-image/bin/pip install --quiet $(GPU_IMAGE_PACKAGES) && touch .gpu-image/.installed)
	$(MAKE) gpu-wheels
	$(MAKE) gpu-check GPU_PYTHON=.gpu-image/bin/python GPU_CHECK_ARGS="--tiny --out gpu-rehearsal.json"

.PHONY: demo
demo: $(VENV)/.installed
	rm -rf demo
	$(PY) prepare_data.py --input $$($(PY) -c "from app.prepare import stdlib_corpus_paths; print(*stdlib_corpus_paths())") \
		--vocab_size 2000 --block_size 128 --val_fraction 0.05 --output_dir demo/data
	$(PY) train.py --config configs/demo.yaml $(DEMO_HARDWARE)
	$(PY) convert_to_hf.py --checkpoint demo/run --output_dir demo/hf-model --dtype float32
	$(PY) generate.py demo/hf-model --prompt "def parse_header(" --max_new_tokens 60

# Supervised fine-tuning: the demo model learns to say what a function does (the first sentence of its docstring)
# from the standard library's code -> summary pairs, packed with the default chat template; then it is converted
# and its answers to validation prompts are printed next to the references. Builds on `make demo`.
.PHONY: sft-demo
sft-demo: $(VENV)/.installed
	test -d demo/hf-model || $(MAKE) demo
	rm -rf demo/sft
	$(PY) -m app.prepare.stdlib_tasks --output demo/sft/pairs.jsonl
	$(PY) prepare_data.py --input demo/sft/pairs.jsonl --prompt_field code --response_field summary \
		--tokenizer demo/hf-model --block_size 512 --val_fraction 0.1 --output_dir demo/sft/data
	$(PY) train.py --config configs/sft-demo.yaml $(DEMO_HARDWARE)
	$(PY) convert_to_hf.py --checkpoint demo/sft/run --output_dir demo/sft/hf-model --dtype float32
	$(PY) show_samples.py demo/sft/run 4

# Summarization with an encoder-decoder (seed 002's system, small): a T5 trained from scratch with FSDP to turn a
# standard-library function into the first sentence of its docstring, converted, and its summaries printed next to
# the references (ROUGE at every evaluation in demo/summarize/run/metrics.csv).
.PHONY: summarize-demo
summarize-demo: $(VENV)/.installed
	rm -rf demo/summarize
	$(PY) -m app.prepare.stdlib_tasks --output demo/summarize/pairs.jsonl
	$(PY) prepare_data.py --input demo/summarize/pairs.jsonl --source_field code --target_field summary \
		--vocab_size 2000 --max_source_length 256 --max_target_length 48 --val_fraction 0.1 \
		--output_dir demo/summarize/data
	$(PY) train.py --config configs/summarize-demo.yaml $(DEMO_HARDWARE)
	$(PY) convert_to_hf.py --checkpoint demo/summarize/run --output_dir demo/summarize/hf-model --dtype float32
	$(PY) show_samples.py demo/summarize/run 4
