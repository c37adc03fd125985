# The two commands of the README: `make demo` (install, fetch, run the main job on the embedded
# default data and models) and `make test` (install with test tools, fetch, run the tests).
VENV := .venv/bin
DEMO_OUT ?= runs/demo

.PHONY: setup setup-test assets demo test bench

setup:
	scripts/setup.sh

setup-test:
	scripts/setup.sh test

assets:
	$(VENV)/recspec assets fetch ml-100k smollm2

demo: setup assets
	$(VENV)/recspec data show ml-100k
	$(VENV)/recspec ids build --dataset ml-100k --out $(DEMO_OUT)/ml-100k-ids --overwrite

test: setup-test assets
	$(VENV)/python -m pytest -q

bench: setup assets
	$(VENV)/recspec bench ids
