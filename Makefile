# The two commands of the README: `make demo` (install, fetch, run the main job on the embedded
# default data and models) and `make test` (install with test tools, fetch, run the tests).
VENV := .venv/bin
DEMO_OUT ?= runs/demo
# Packed training (--pack 20: up to 20 consecutive examples of a user share one history) over every
# MovieLens training example, 2 epochs; 4 packs a step gives the small target enough optimizer steps
# to beat the most-popular baseline on all 943 test users within the demo's time.
DEMO_TRAIN := --dataset ml-100k --ids $(DEMO_OUT)/ml-100k-ids --split loo --pack 20 --batch-size 4 --epochs 2 \
	--valid-users 128
# transformers' constrained generate (hf) first: every speed-up is over it.
DEMO_DECODERS := --decoder hf --decoder beam --decoder tree-beam --decoder tree-beam+root --decoder spec-strict --decoder auto
DEMO_COMPARE := --target $(DEMO_OUT)/target --draft model:$(DEMO_OUT)/draft $(DEMO_DECODERS) --k 10 --users 100 --repeats 3 \
	--out $(DEMO_OUT)

.PHONY: setup setup-test assets demo test test-fast bench

setup:
	scripts/setup.sh

setup-test:
	scripts/setup.sh test

assets:
	$(VENV)/recspec assets fetch ml-100k smollm2
	$(VENV)/recspec assets kernel

# MovieLens-100K end to end: identifiers, a small target and its draft, then transformers' constrained
# generate (hf) and recspec's exact decoders side by side on the same 100 test users (users/s,
# speed-up over hf, identical items) with `auto`, and Recall/NDCG of `auto`'s recommendations for
# every test user against the most-popular baseline; last, what was shown and what to run next.
demo: setup assets
	$(VENV)/recspec data show ml-100k
	test -f $(DEMO_OUT)/ml-100k-ids/item_index.json || \
		$(VENV)/recspec ids build --dataset ml-100k --out $(DEMO_OUT)/ml-100k-ids
	$(VENV)/recspec train $(DEMO_TRAIN) --preset target-mini --out $(DEMO_OUT)/target
	$(VENV)/recspec train $(DEMO_TRAIN) --preset draft-tiny --out $(DEMO_OUT)/draft
	$(VENV)/recspec bench compare $(DEMO_COMPARE) --batch-size 1 --name decoders-batch1
	$(VENV)/recspec bench compare $(DEMO_COMPARE) --batch-size 16 --name decoders-batch16
	$(VENV)/recspec recommend --target $(DEMO_OUT)/target --draft model:$(DEMO_OUT)/draft --decoder auto --k 10 \
		--batch-size 16 --overwrite --out $(DEMO_OUT)/auto.jsonl
	$(VENV)/recspec eval --recs $(DEMO_OUT)/auto.jsonl --dataset ml-100k --split loo --k 5 --k 10 \
		> $(DEMO_OUT)/eval.txt && cat $(DEMO_OUT)/eval.txt
	@$(VENV)/python -m benchmarks.report_summary --demo $(DEMO_OUT)

# One worker per core, each test file on one worker (module fixtures such as trained models are made once),
# the files in the order tests/conftest.py gives (the longest first).
test: setup-test assets
	$(VENV)/python -m pytest -q -n auto --dist loadfile --no-loadscope-reorder --durations=25

# The tier to run often: every test that needs no fetched asset and no trained model, against an
# empty asset cache (so nothing it runs can lean on one).
test-fast: setup-test
	RECSPEC_CACHE=$$(mktemp -d) $(VENV)/python -m pytest -q -n auto -m "not slow"

bench: setup assets
	$(VENV)/python -m benchmarks.lab ids
