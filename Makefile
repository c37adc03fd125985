# The two commands of the README: `make demo` (install, fetch, run the main job on the embedded
# default data and models) and `make test` (install with test tools, fetch, run the tests).
VENV := .venv/bin
DEMO_OUT ?= runs/demo
DEMO_TRAIN := --dataset ml-100k --ids $(DEMO_OUT)/ml-100k-ids --split loo --epochs 1 --max-train-examples 6000 \
	--valid-users 128

.PHONY: setup setup-test assets demo test bench

setup:
	scripts/setup.sh

setup-test:
	scripts/setup.sh test

assets:
	$(VENV)/recspec assets fetch ml-100k smollm2

# MovieLens-100K end to end: identifiers, a small target and its draft (a few minutes each),
# exact beam search and speculative beam search on the same users, Recall/NDCG of both.
demo: setup assets
	$(VENV)/recspec data show ml-100k
	test -f $(DEMO_OUT)/ml-100k-ids/item_index.json || \
		$(VENV)/recspec ids build --dataset ml-100k --out $(DEMO_OUT)/ml-100k-ids
	$(VENV)/recspec train $(DEMO_TRAIN) --preset target-small --out $(DEMO_OUT)/target
	$(VENV)/recspec train $(DEMO_TRAIN) --preset draft-tiny --out $(DEMO_OUT)/draft
	$(VENV)/recspec recommend --target $(DEMO_OUT)/target --decoder beam --k 10 --users 200 --batch-size 1 --overwrite \
		--out $(DEMO_OUT)/beam.jsonl
	$(VENV)/recspec recommend --target $(DEMO_OUT)/target --draft $(DEMO_OUT)/draft --decoder spec-strict \
		--draft-beams 20 --k 10 --users 200 --batch-size 1 --overwrite --out $(DEMO_OUT)/spec.jsonl
	$(VENV)/python -c "import json; read = lambda p: [json.loads(l)['items'] for l in open(p)]; \
		same = read('$(DEMO_OUT)/beam.jsonl') == read('$(DEMO_OUT)/spec.jsonl'); \
		print('spec-strict returned ' + ('the same items as beam search' if same else 'OTHER ITEMS than beam search'))"
	$(VENV)/recspec eval --recs $(DEMO_OUT)/spec.jsonl --dataset ml-100k --split loo --k 5 --k 10

# One worker per core, each test file on one worker (module fixtures such as trained models are made once).
test: setup-test assets
	$(VENV)/python -m pytest -q -n auto --dist loadfile --durations=25

bench: setup assets
	$(VENV)/recspec bench ids
