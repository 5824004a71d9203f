# Every target sets up .venv first (scripts/bootstrap), so on a fresh machine one
# command does all the set-up: `make demo` runs the main job, `make test` the tests.
PY := .venv/bin/python
STAMP := .venv/.bootstrapped

.PHONY: demo test lint bench notebooks

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

# Re-execute the tutorial notebooks in place (when a change to their story is intended).
notebooks: $(STAMP)
	$(PY) scripts/execute-notebooks
