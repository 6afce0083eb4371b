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

test: $(VENV)/.installed
	$(PY) -m pytest -q tests

# The demo: prepare the Python standard library's source, train a small Llama from scratch with FSDP (2 CPU
# processes without a GPU, every GPU with one), convert the last checkpoint and print what the model writes.
# It replaces the demo/ folder of a previous demo.
DEMO_HARDWARE = $(shell $(PY) -c "import torch; n = torch.cuda.device_count(); \
	print(f'--accelerator gpu --devices {n} --precision bf16-mixed' if n else '--accelerator cpu --devices 2 --precision 32-true')")

.PHONY: demo
demo: $(VENV)/.installed
	rm -rf demo
	$(PY) prepare_data.py --input $$($(PY) -c "from app.prepare import stdlib_corpus_paths; print(*stdlib_corpus_paths())") \
		--vocab_size 2000 --block_size 128 --val_fraction 0.05 --output_dir demo/data
	$(PY) train.py --config configs/demo.yaml $(DEMO_HARDWARE)
	$(PY) convert_to_hf.py --checkpoint demo/run --output_dir demo/hf-model --dtype float32
	$(PY) -m app.generate demo/hf-model --prompt "def parse_header(" --max_new_tokens 60
