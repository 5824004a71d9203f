# Every target sets up .venv first (scripts/bootstrap), so on a fresh machine one
# command does all the set-up: `make tour` runs the main job, `make test` the tests.
PY := .venv/bin/python
STAMP := .venv/.bootstrapped

.PHONY: tour demo test lint bench notebooks lab readme-figures

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
	$(PY) benchmarks/bench_build.py
	$(PY) benchmarks/bench_scaling.py

# Re-execute the tutorial notebooks in place (when a change to their story is intended).
notebooks: $(STAMP)
	$(PY) scripts/execute-notebooks

# JupyterLab on the notebooks. Not part of the set-up (`make test` runs the notebooks
# without it): installed into .venv on first use. More options for it in LAB_ARGS, e.g.
# `make lab LAB_ARGS="--no-browser --port 8890"`.
LAB_SPEC := jupyterlab>=4
LAB_ARGS ?=
lab: $(STAMP)
	$(PY) -c "import jupyterlab" 2>/dev/null || $(PY) -m pip install --quiet "$(LAB_SPEC)"
	$(PY) -m jupyterlab --ServerApp.root_dir=notebooks $(LAB_ARGS)

# The main job: a report of dense, sparse and repeated-name loads in patchkit-tour/.
tour: $(STAMP)
	$(PY) -m patchkit tour

# The two figures the README shows, from the tour.
readme-figures: $(STAMP)
	$(PY) -m patchkit tour --out build/tour
	mkdir -p docs/figures
	cp build/tour/dense_placement_rank0.png docs/figures/placement.png
	cp build/tour/sparse_delta_qkv_rank0.png docs/figures/delta.png
