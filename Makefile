# Everything on a fresh machine: `make demo` (set up, run the main job), `make test` (set up, test).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
OUT ?= lensdiv-out/demo
# Test processes (pytest-xdist; each test file runs whole in one of them, one torch thread each).
TEST_WORKERS ?= 2

# The test files that exercise transformers' and TransformerLens' internals (models, caches,
# hooks, GGUF): what `make test-latest` runs against their newest releases (TESTS= for all).
LATEST_TESTS ?= tests/test_architectures.py tests/test_patchscope.py tests/test_sinks.py \
	tests/test_gguf.py tests/test_device_map.py tests/test_purelayers.py
LATEST := .venv-latest

.PHONY: setup demo test test-latest check bench bench-gpu bench-gpu-smoke findings findings-real lint clean ship-toy toy-reproduce

setup: $(VENV)/.installed

# torch is installed first, from the pinned constraint, so nothing pulls a CUDA build behind our back.
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt torch
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	touch $@

demo: setup
	$(BIN)/lensdiv analyze toy --plugins lens,contrib --out $(OUT)

test: setup check
	HF_HUB_OFFLINE=1 MPLBACKEND=Agg $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile \
		--durations=25

# The same tests against the newest transformers and TransformerLens on the index (everything else
# pinned, torch first): a change upstream is caught the day it ships. CI runs it after `make test`.
test-latest: $(LATEST)/.installed
	@$(LATEST)/bin/python -c "import transformers, transformer_lens, importlib.metadata as m; \
		print('newest releases: transformers', transformers.__version__, \
		'transformer-lens', m.version('transformer-lens'))"
	HF_HUB_OFFLINE=1 MPLBACKEND=Agg $(LATEST)/bin/python -m pytest -q -n $(TEST_WORKERS) \
		--dist loadfile $(if $(TESTS),$(TESTS),$(LATEST_TESTS))

$(LATEST)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install -q --upgrade pip
	grep -v -E '^(transformers|transformer-lens|tokenizers|huggingface_hub|safetensors)==' \
		constraints.txt > $(LATEST)/constraints.txt
	$(LATEST)/bin/python -m pip install -q -c $(LATEST)/constraints.txt torch
	$(LATEST)/bin/python -m pip install -q -c $(LATEST)/constraints.txt -e '.[dev]'
	$(LATEST)/bin/python -m pip install -q -c $(LATEST)/constraints.txt --upgrade \
		transformers transformer-lens
	touch $@

# The checks `make test` (so CI) runs first: the linter, the architecture (ARCHITECTURE.md:
# layers import one way) and the types (strict on lensdiv.core).
check: setup lint
	$(BIN)/lint-imports
	$(BIN)/mypy

# Every figure a GPU changes (bench/*_gpu.json); on a machine without one: a "no GPU here" line.
bench-gpu: setup
	PYTHON=$(BIN)/python bash bench/gpu.sh

# every script of bench-gpu at tiny sizes on the CPU, into a temporary folder (minutes)
bench-gpu-smoke: setup
	PYTHON=$(BIN)/python bash bench/gpu.sh --smoke

bench: setup
	$(BIN)/python bench/bench_fused.py --json bench/fused_cpu.json
	$(BIN)/python bench/bench_skip.py --json bench/skip_cpu.json
	$(BIN)/python bench/bench_linmap.py --json bench/linmap_cpu.json
	$(BIN)/python bench/bench_bias.py --json bench/bias_cpu.json
	$(BIN)/python bench/bench_dynamics.py --json bench/dynamics_cpu.json
	$(BIN)/python bench/bench_distributed.py --tokens 8192 --json bench/distributed_cpu.json
	$(BIN)/python bench/bench_floor.py --tokens 384 --threads 1 --json bench/floor_cpu.json
	$(BIN)/python bench/bench_lens_floor.py --json bench/lens_floor_cpu.json
	$(BIN)/python bench/bench_memory.py --json bench/memory_cpu.json
	$(BIN)/python bench/bench_study.py --json bench/study_cpu.json
	$(BIN)/python bench/bench_lenses.py --json bench/lenses_cpu.json
	$(BIN)/python bench/bench_data.py --overlap-tokens 32768 --json bench/data_cpu.json
	$(BIN)/python bench/bench_fixed.py --json bench/fixed_cpu.json
	$(BIN)/python bench/bench_explore.py --json bench/explore_cpu.json

# docs/findings.md and its figures, measured from scratch (trains the toy models it needs that are not
# cached and runs every analysis; the teacher-student row reads the cpu preset's run recorded in
# bench/teacher_student_cpu.json, `python docs/findings.py --rerun-teacher-student` trains it again).
findings: setup
	HF_HUB_OFFLINE=1 MPLBACKEND=Agg $(BIN)/python docs/findings.py

# docs/findings_real.md: the same findings on the real models smollm2-135m and gemma3-270m (4-bit
# GGUF, dequantized) and on SmolLM2 re-quantized to Q4_0 (bench/requantize_gguf.py); about 25
# minutes on 2 shared cores (budgets of 128-256 tokens). `--only RUN --reuse` measures one run again.
findings-real: setup
	MPLBACKEND=Agg $(BIN)/python docs/findings_real.py

# The default toy ships trained (lensdiv/models/shipped/): retrain it with its recipe and ship the
# result (says whether the weights are those it replaces); after a change to its recipe, corpus
# or TOY_VERSION (a new key), or to refresh it.
ship-toy: setup
	env -u LENSDIV_TOY_STEPS $(BIN)/python -m lensdiv.models.ship

# The whole default recipe against the shipped toy (held-out loss within 1 %, bit for bit on the
# platform its prefix.json names): minutes, so not in `make test`, which checks its first steps.
toy-reproduce: setup
	LENSDIV_REPRODUCE_TOY=1 HF_HUB_OFFLINE=1 MPLBACKEND=Agg $(BIN)/python -m pytest -q -n 0 \
		tests/test_toy.py -k "reproduces"

lint: setup
	$(BIN)/ruff check lensdiv tests bench plugins docs
	$(BIN)/ruff format --check lensdiv

clean:
	rm -rf $(VENV) $(LATEST) lensdiv-out .pytest_cache
