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

# Three workers on two cores: a test's processes often wait (for the other rank's start-up, a signal, a timeout),
# and a third worker fills that time. Whole files per worker, so that a file's module fixtures (its shared runs) are
# made once, the longest files first (tests/conftest.py). The suite is CPU-bound (vmstat: 0% idle), and most of its
# CPU went to importing torch, Lightning Fabric (with torch._dynamo), transformers and datasets, ~6 CPU-s in each of
# its ~250 train.py processes: tests/forkserver.py now forks those processes from one that imported them already
# (test runs that measure a fresh process's peak RSS, or set variables read on import, still start from scratch).
# On 2026-11-28 in this clone, within the hour: 1,143 s before; 901 s with the fork server for single-node runs
# (and accelerate, which transformers imported in every process, moved to benchmarks/requirements.txt); 814 s with
# it for the multi-node, compiled and GPU-check runs too. New tests must come with an equal cut. On 2026-11-28, in a
# fresh clone, after the audit's fixes and their tests: 737 s (1,057 s in an earlier run the same morning: this
# machine's speed varies). On 2026-11-28, after a second audit's 24 new tests: 778 s (545 tests). Later that day, in
# fresh clones: 984 s and 1,005 s (609 tests), 929 s in place (612), 1,060 s (614) with `make demo`'s 300 steps
# taking 3m18s against 2m26s on the 737 s day: the same work, a slower machine. On 2026-11-28 (evening), fresh
# clones: 834 s; 759 s with one OpenMP thread per process (tests/conftest.py) and Slurm jobs of 30 steps. On
# 2026-11-29: 667 s in place (624 tests), 599 s in place and 737 s in a fresh clone (637 tests); after six audits'
# fixes and their tests: 668 s in place (664 tests) and 658 s in a fresh clone (671 tests). On 2026-11-29 (evening):
# 760 s in place (815 tests), 803 s in a fresh clone (816 tests). On 2026-11-30, fresh clones: 848 s and 788 s
# (831 tests); later that day 494 s (852 tests) on a quieter machine; in a later session 617 s in a fresh clone
# (958 tests), 774 s with an audit running beside it. On 2026-12-01, on a machine 1.5x slower (`make demo`: 3m23s
# against 2m17s): 1,096 s in place (1,167 tests); 915 s once the tests' helper ranks and the runs that take signals
# only through their launcher were forked too, and a forked program left without the interpreter's teardown of
# the server's imports (1.8 s a process). Measured with every process's CPU sampled: the suite is CPU-bound (28 s
# idle of 918), and a third of its CPU goes to train.py processes that must start from scratch (signals to a
# process group, Slurm jobs, peak RSS), 6 CPU-s of imports each. On 2026-12-02: 1,428 s in place (1,191 tests) with
# an audit's probes (one train.py or prepare_data.py preflight at a time) running beside it, where the Slurm and
# signal files alone took 620 and 690 s of one worker each; 907 s in a fresh clone with nothing beside it (1,196
# tests; `make demo` 2m54s, against 2m17s and 3m23s on the fast and slow days above). In a later session that day:
# 657 s in place (1,217 tests), then 801-817 s in three fresh clones (1,230 tests; `make demo` 2m47s-2m56s). In
# a later session: 787 s in place (1,248 tests), 808 s in a fresh clone (1,254 tests; `make demo` 3m06s).
# On 2026-12-03: 993 s in place (1,265 tests), CPU-bound (busy 1,864 CPU-s, idle 43, in a later run). Sampled
# with py-spy across every process: 45% of the suite's CPU went to imports in processes started from scratch.
# 952 s after the Slurm file's straight run was forked and one job took the frozen task's place, the job waits
# asked scontrol once a second (13 CPU-ms a query, 20 a second before), the --trust_remote_code run was forked
# (HF_MODULES_CACHE set for the whole suite) and three reliability runs too: 80 s less over the workers' files.
# In a later session that day: 907 s and 879 s in place (1,266 tests; busy 1,783 and 1,718 CPU-s), 903 s and then
# 962 s in fresh clones (1,268 tests; `make demo` 3m19s).
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
