# Developer shortcuts. `make test` is what CI runs (through .ci/run).
PYTHON ?= python
RECIPE ?= recipes/demo/tiny_sft_cpu.yaml

.PHONY: test test-fast lint format docs demo bench clean

test:            ## the whole suite (CPU; GPU tests skip themselves)
	$(PYTHON) -m pytest

test-fast:       ## the fast tier: unit tests and in-process runs, no subprocess (docs/CONTRIBUTING.md)
	$(PYTHON) -m pytest -m "not slow"

lint:            ## ruff lint + format check
	ruff check .
	ruff format --check .

format:          ## apply ruff fixes and formatting
	ruff check --fix .
	ruff format .

docs:            ## regenerate docs/reference.md from the recipe schema (tests/unit/test_docs.py checks it)
	$(PYTHON) -m finetune.recipe.reference docs/reference.md

demo:            ## LoRA on a tiny random-init Llama, CPU, offline
	finetune train $(RECIPE)

bench:           ## benchmarks (figures go to benchmarks/RESULTS.md)
	$(PYTHON) benchmarks/bench_prepare.py
	$(PYTHON) benchmarks/bench_prepare_cli.py
	$(PYTHON) benchmarks/bench_loop.py
	$(PYTHON) benchmarks/bench_diffusion.py
	$(PYTHON) benchmarks/bench_preference_packing.py --threads 1
	$(PYTHON) benchmarks/bench_chunked_ce.py
	$(PYTHON) benchmarks/bench_dpo.py
	$(PYTHON) benchmarks/plan_table.py
	$(PYTHON) benchmarks/plan_table.py --vs-deepspeed

clean:
	rm -rf outputs prepared .pytest_cache .ruff_cache
