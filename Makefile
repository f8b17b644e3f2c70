# make demo / make test / make bench: each creates .venv and installs what it needs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast lint docs mutants bench bench-deploy bench-accuracy clean

$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/seg-train --config configs/demo.yaml --gpus 4

# The whole suite on two processes, one test file per process at a time (a file's module fixtures are built once).
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

# The edit loop: the in-process unit tests, without the ones marked slow (pyproject.toml; DEVELOPING.md says which).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not slow"

# The mutation check (scripts/mutants.yaml): every listed bug must make its targeted tests fail. Not part of
# `make test`; run it after changing the train step, BN, losses, inference, EMA, accumulation or clipping.
# First, in seconds: every entry still applies (find text once, tests present), else it stops there.
mutants: $(STAMP)
	$(BIN)/python scripts/mutants.py --check
	nice -n 10 $(BIN)/python scripts/mutants.py

lint: $(STAMP)
	$(BIN)/ruff check seg_train scripts benchmarks tests

# The drivers are in benchmarks/. CamVid (VOC layout) is read from CAMVID_ROOT, absolute or relative to the
# repository (default data/camvid, which `make clean` removes): e.g. `make bench-accuracy CAMVID_ROOT=DIR`.
CAMVID_ROOT ?= data/camvid
export CAMVID_ROOT

# docs/CONFIG.md, rendered from the config's dataclasses (tests/test_config_docs.py checks it is current).
docs: $(STAMP)
	$(BIN)/python -m seg_train.config.docs > docs/CONFIG.md.tmp && mv docs/CONFIG.md.tmp docs/CONFIG.md

# docs/PERFORMANCE.md, then docs/DEPLOY.md (CamVid recipes exported to TFLite and measured by seg-eval;
# trains each recipe (DeepLabV3+, LR-ASPP, SegFormer-B0) first unless runs/deploy holds its final checkpoint).
bench: $(STAMP)
	$(BIN)/python benchmarks/bench.py
	$(BIN)/python benchmarks/bench_deploy.py

bench-deploy: $(STAMP)
	$(BIN)/python benchmarks/bench_deploy.py

# CamVid accuracy at the recipe's step budget (2000 steps of batch 8), seg-train vs Keras model.fit.
bench-accuracy: $(STAMP)
	$(BIN)/python benchmarks/bench_accuracy.py

clean:
	rm -rf $(VENV) runs data build *.egg-info
