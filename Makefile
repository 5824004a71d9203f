# Every target sets up .venv first (scripts/bootstrap), so on a fresh machine one
# command does all the set-up: `make tour` runs the main job, `make test` the tests.
PY := .venv/bin/python
STAMP := .venv/.bootstrapped

.PHONY: tour demo test lint bench notebooks readme-figures

$(STAMP): pyproject.toml scripts/bootstrap
	scripts/bootstrap

demo: $(STAMP)
	$(PY) -m patchkit demo

test: $(STAMP)
	$(PY) -m pytest

lint: $(STAMP)
	.venv/bin/ruff check .

bench: $(STAMP)
	$(PY) benchmarks/bench_loader.py
	$(PY) benchmarks/bench_inspect.py

# Re-execute the tutorial notebooks in place (when a change to their story is intended).
notebooks: $(STAMP)
	$(PY) scripts/execute-notebooks

# The main job: a report of dense, sparse and repeated-name loads in patchkit-tour/.
tour: $(STAMP)
	$(PY) -m patchkit tour

# The two figures the README shows, from the tour.
readme-figures: $(STAMP)
	$(PY) -m patchkit tour --out build/tour
	mkdir -p docs/figures
	cp build/tour/dense_placement_rank0.png docs/figures/placement.png
	cp build/tour/sparse_delta_qkv_rank0.png docs/figures/delta.png
