"""The packaging promises: one set of dependencies, a light import, a true README."""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the dev extra's tomli (the same module)
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]

# conda and PyPI spell a few packages differently.
CONDA_NAME = {"torch": "pytorch"}


def _split(req: str) -> tuple[str, str]:
    """``(name, version spec)`` of a requirement, without its environment marker (conda's
    file lists a package pip installs only on some Pythons unconditionally)."""
    m = re.match(r"^\s*([A-Za-z0-9_.\-]+)\s*([^;#]*)", req)
    assert m, req
    return m.group(1).lower(), m.group(2).replace(" ", "")


def test_environment_yml_installs_the_same_set_as_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [project["dependencies"]]
    wanted += [project["optional-dependencies"][k] for k in ("notebooks", "dev")]
    pip_side = {}
    for reqs in wanted:
        for r in reqs:
            name, spec = _split(r)
            pip_side[CONDA_NAME.get(name, name)] = spec
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda_side = {}
    for dep in env["dependencies"]:
        if isinstance(dep, str):
            name, spec = _split(dep)
            if name not in ("python", "pip"):
                conda_side[name] = spec
    assert conda_side == pip_side


def _fresh_python(code: str) -> str:
    """What ``code`` prints (stripped), run by this interpreter in a new process."""
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout.strip()


def test_import_patchkit_loads_torch_only():
    code = (
        "import sys, patchkit\n"
        "heavy = {'matplotlib', 'pandas', 'ipywidgets', 'IPython', 'safetensors'}\n"
        "print(sorted(heavy & {m.split('.')[0] for m in sys.modules}))\n"
    )
    out = _fresh_python(code)
    assert out == "[]"


def test_heavy_submodules_are_attributes_of_the_package_once_read():
    code = (
        "import sys, patchkit\n"
        "assert 'patchkit.plot' not in sys.modules and 'plot' in dir(patchkit)\n"
        "print(patchkit.plot.plot_chunks.__name__, patchkit.widgets.chunk_planner.__name__,\n"
        "      patchkit.toymodels.TinyLlamaRuntime.__name__,\n"
        "      patchkit.inspect.LoadReport.__name__,\n"
        "      'matplotlib' in sys.modules)\n"
    )
    out = _fresh_python(code)
    assert out == "plot_chunks chunk_planner TinyLlamaRuntime LoadReport True"


def test_a_lazy_submodule_whose_extra_is_missing_is_no_attribute():
    code = (
        "import sys, inspect\n"
        "sys.modules['ipywidgets'] = None  # the notebooks extra not installed\n"
        "import patchkit\n"
        "try:\n"
        "    patchkit.widgets\n"
        "except AttributeError as e:\n"
        "    print('ipywidgets' in str(e), isinstance(e.__cause__, ImportError))\n"
        "print(hasattr(patchkit, 'widgets'), len(inspect.getmembers(patchkit)) > 40)\n"
    )
    assert _fresh_python(code).split() == ["True", "True", "False", "True"]


def test_a_report_without_matplotlib_loads_and_its_figures_name_the_extra():
    code = (
        "import sys, torch\n"
        "sys.modules['matplotlib'] = None  # the notebooks extra not installed\n"
        "import patchkit\n"
        "from patchkit.toymodels import PlainModel\n"
        "p = patchkit.CheckpointWeightPatch('w', (2,), torch.float32, torch.ones(2))\n"
        "r = patchkit.inspect_load(PlainModel({'w': (2,)}), [p])\n"
        "print(int(r.deltas.loc['w', 'changed']))\n"
        "try:\n"
        "    r.plot_placement()\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    assert _fresh_python(code).splitlines() == [
        "2", "patchkit.plot (the figures: plot_*, report.plot_*) needs matplotlib: "
             "pip install 'patchkit[notebooks]'"]


def test_every_module_a_plain_install_imports_is_a_dependency():
    # (a plain ``pip install`` could not save a patch file or make a report: numpy and
    # pandas were only in the notebooks extra)
    import ast

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {_split(r)[0] for r in project["dependencies"]}
    extras = {"plot.py": {"matplotlib"}, "widgets.py": {"matplotlib", "ipywidgets"},
              "progress.py": {"ipywidgets", "IPython"}}  # (progress: only in a kernel)

    def imported(node) -> set[str]:  # (what runs: not the ``if TYPE_CHECKING:`` blocks)
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            return imported_in(node.orelse)
        if isinstance(node, ast.Import):
            return {a.name.split(".")[0] for a in node.names}
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            return {node.module.split(".")[0]}
        return imported_in(ast.iter_child_nodes(node))

    def imported_in(nodes) -> set[str]:
        return set().union(*(imported(n) for n in nodes))

    for f in sorted((ROOT / "patchkit").glob("*.py")):
        found = imported(ast.parse(f.read_text()))
        third = {m for m in found if m not in sys.stdlib_module_names and m != "patchkit"}
        third -= extras.get(f.name, set())
        assert {m.lower() for m in third} <= core, (f.name, third - core)
    # safetensors writes through numpy: a file written with only the core installed
    assert {"numpy", "pandas", "safetensors"} <= core


def test_public_names_are_exported_and_documented():
    import patchkit

    for name in patchkit.__all__:
        obj = getattr(patchkit, name)
        if callable(obj) or isinstance(obj, type):
            assert obj.__doc__ and obj.__doc__.strip(), f"{name} has no docstring"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in readme
    assert re.search(r"^make test$", ci, re.M)


def test_docs_contract_is_the_shared_spec():
    shared = ROOT.parent / "shared" / "CONTRACT.md"
    if not shared.exists():
        import pytest

        pytest.skip("no ../shared beside this checkout (only the project's machines have it)")
    assert (ROOT / "docs" / "CONTRACT.md").read_text() == shared.read_text()


def test_readme_example_runs_and_prints_what_the_readme_says(capsys):
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## A first load", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    shown = section.split("```text\n", 1)[1].split("```", 1)[0]
    exec(compile(code, "README.md", "exec"), {})
    got = capsys.readouterr().out
    assert [line.rstrip() for line in got.strip().splitlines()] == [
        line.rstrip() for line in shown.strip().splitlines()
    ]


def test_readme_layout_lists_every_file_of_the_package_and_nothing_gone():
    # a row names files as `patchkit/a.py`, `b.py` (the later ones in the same folder)
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    listed = set()
    for row in table.splitlines():
        cells = row.split(" | ")
        first = re.findall(r"`([^`]+)`", cells[0]) if row.startswith("| `patchkit/") else []
        listed |= {name.removeprefix("patchkit/") for name in first}
    files = {f.name for f in (ROOT / "patchkit").iterdir()
             if f.is_file() and not f.name.endswith((".pyc", ".so"))}
    assert listed == files, (sorted(files - listed), sorted(listed - files))


def test_readme_errors_section_names_every_exception_class():
    import patchkit.errors

    readme = (ROOT / "README.md").read_text()
    section = " ".join(readme.split("## Errors", 1)[1].split("\n## ", 1)[0].split())
    for name in patchkit.errors.__all__:
        assert f"`patchkit.{name}`" in section, name


def test_readme_figures_exist():
    readme = (ROOT / "README.md").read_text()
    for path in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", readme):
        assert (ROOT / path).exists(), path


def _heading_anchors(markdown: str) -> set[str]:
    # GitHub's anchors: the heading's text lower-cased, punctuation but hyphens dropped,
    # spaces made hyphens
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", markdown, re.M)}


def test_the_links_of_the_readme_and_docs_lead_somewhere():
    # (the README's long sections moved to docs/: a link or a contents line that names a
    # file or a heading that is not there is a dead end for a reader)
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    checked = 0
    for page in pages:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            assert dest.exists(), f"{page.name}: {target}"
            if anchor:
                assert anchor in _heading_anchors(dest.read_text()), f"{page.name}: {target}"
            checked += 1
    assert checked >= 8, checked  # the README's links, the figures and docs' contents lines


def test_the_wheel_carries_the_c_file_that_patchkit_native_compiles(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path), str(ROOT)],
        check=True, capture_output=True, text=True,
    )
    (wheel,) = tmp_path.glob("patchkit-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    assert "patchkit/_native.c" in names
    assert "patchkit/py.typed" in names  # (a user's type checker reads the annotations)
    assert any(n.endswith("licenses/LICENSE") for n in names), names


def _execute_notebooks_script():
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.SourceFileLoader(
        "execute_notebooks", str(ROOT / "scripts" / "execute-notebooks"))
    spec = importlib.util.spec_from_loader("execute_notebooks", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_stored_notebooks_carry_stable_widget_ids():
    # scripts/execute-notebooks renumbers the widget ids a kernel draws at random, so that
    # re-executing an unchanged notebook leaves its file as it was
    script = _execute_notebooks_script()
    with_widgets = 0
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        text = path.read_text(encoding="utf-8")
        with_widgets += '"application/vnd.jupyter.widget-state+json"' in text
        assert script.stable_widget_ids(text) == text, f"{path.name}: ids not renumbered"
    assert with_widgets >= 2  # 02 and 04 display widgets


def test_widget_ids_are_numbered_without_regard_to_their_random_values():
    import json
    import uuid

    import nbformat

    script = _execute_notebooks_script()

    def notebook(a, b, c):
        # a shown widget a whose state names its layout b; c shown in a later cell
        nb = nbformat.v4.new_notebook()
        view = "application/vnd.jupyter.widget-view+json"
        nb.cells = [nbformat.v4.new_code_cell(outputs=[nbformat.v4.new_output(
            "display_data", data={view: {"model_id": m, "version_major": 2,
                                         "version_minor": 0}})], id=f"cell{k}")
                    for k, m in enumerate((a, c))]
        nb.metadata["widgets"] = {script.WIDGET_STATE: {"state": {
            a: {"model_name": "HTMLModel", "state": {"layout": f"IPY_MODEL_{b}"}},
            b: {"model_name": "LayoutModel", "state": {}},
            c: {"model_name": "IntSliderModel", "state": {}},
        }, "version_major": 2, "version_minor": 0}}
        return nbformat.writes(nb)

    draws = [[uuid.uuid4().hex for _ in range(3)] for _ in range(4)]
    outs = {script.stable_widget_ids(notebook(*ids)) for ids in draws}
    assert len(outs) == 1
    state = json.loads(outs.pop())["metadata"]["widgets"][script.WIDGET_STATE]["state"]
    assert {k: v["model_name"] for k, v in state.items()} == {
        f"{1:032x}": "HTMLModel", f"{2:032x}": "IntSliderModel", f"{3:032x}": "LayoutModel"}
    assert state[f"{1:032x}"]["state"]["layout"] == f"IPY_MODEL_{3:032x}"


def test_widgets_no_cell_shows_are_numbered_by_what_they_refer_to_as_well():
    import uuid

    import nbformat

    script = _execute_notebooks_script()
    view = "application/vnd.jupyter.widget-view+json"

    def notebook(a, c1, c2, l1, l2):
        # two buttons no cell shows, alike but for the layouts they refer to
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_code_cell(outputs=[nbformat.v4.new_output(
            "display_data", data={view: {"model_id": a, "version_major": 2,
                                         "version_minor": 0}})], id="c0")]
        nb.metadata["widgets"] = {script.WIDGET_STATE: {"state": {
            a: {"model_name": "HTMLModel", "state": {}},
            c1: {"model_name": "ButtonModel", "state": {"layout": f"IPY_MODEL_{l1}"}},
            c2: {"model_name": "ButtonModel", "state": {"layout": f"IPY_MODEL_{l2}"}},
            l1: {"model_name": "LayoutModel", "state": {"width": "10px"}},
            l2: {"model_name": "LayoutModel", "state": {"width": "20px"}},
        }, "version_major": 2, "version_minor": 0}}
        return nbformat.writes(nb)

    outs = {script.stable_widget_ids(notebook(*[uuid.uuid4().hex for _ in range(5)]))
            for _ in range(12)}
    assert len(outs) == 1


def test_make_lab_installs_jupyterlab_on_first_use_and_make_test_does_not():
    import shutil

    import pytest

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    installed = [*extras["dependencies"], *extras["optional-dependencies"]["notebooks"],
                 *extras["optional-dependencies"]["dev"]]
    assert not [r for r in installed if _split(r)[0] in ("jupyterlab", "notebook")]
    assert "jupyterlab" not in (ROOT / "scripts" / "bootstrap").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "make lab" in readme and "jupyterlab notebooks/" in " ".join(readme.split())
    if shutil.which("make") is None:
        pytest.skip("no make")

    def dry_run(target: str) -> str:  # (make -n prints the commands, runs none)
        return subprocess.run(["make", "-n", target], capture_output=True, text=True,
                              cwd=ROOT, check=True).stdout

    lab = dry_run("lab")
    assert 'python -c "import jupyterlab" 2>/dev/null || ' in lab  # installed once
    assert 'pip install --quiet "jupyterlab>=4"' in lab
    assert "python -m jupyterlab --ServerApp.root_dir=notebooks" in lab
    assert "jupyterlab" not in dry_run("test")


def test_plot_density_quotes_the_benchmark_numbers_the_readme_quotes():
    from patchkit.plot import plot_density

    readme = " ".join((ROOT / "README.md").read_text().split())
    doc = " ".join(plot_density.__doc__.split())
    measured = re.search(r"measured on the 2-core machine `density_map` at (\S+ s) .*?"
                         r"`plot_density` at (\S+ s)", readme)
    assert measured, "README: the figures' timings"
    dmap, pdens = measured.groups()
    assert f"measured {dmap} for ``density_map`` and {pdens} for ``plot_density``" in doc
    assert "2-core machine" in doc


def test_readme_says_how_to_draw_its_placement_figure_after_the_example(capsys):
    # the README's placement figure is the tour's; the README names the call that draws it
    # after the example: that call runs there and draws the same figure
    from PIL import Image

    from patchkit.tour import figure_words

    readme = (ROOT / "README.md").read_text()
    section = readme.split("## A first load", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    call = re.search(r"after the example, `([^`]+\.plot_placement\(\))` draws it",
                     " ".join(section.split()))
    assert call, "README: the call that draws the placement figure"
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    capsys.readouterr()
    fig = eval(call.group(1), scope)
    kept = Image.open(ROOT / "docs" / "figures" / "placement.png").text.get("Description")
    assert figure_words(fig) == kept


def test_the_readme_counts_the_contract_suite_as_it_is():
    # (a test added to tests/contract left the README's count behind: 147, not 148)
    readme = " ".join((ROOT / "README.md").read_text().split())
    found = re.search(r"(\d+) tests pass and (\d+) fail \((\d+) are patchkit-only", readme)
    assert found, "README: the contract suite's counts"
    passed, failed, only = map(int, found.groups())

    def collected(*marks: str) -> int:
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q",
             *marks, "tests/contract"],
            cwd=ROOT, capture_output=True, text=True, check=True,
        ).stdout.strip().splitlines()[-1]
        return int(re.match(r"(\d+)", out).group(1))

    assert collected("-m", "patchkit_only") == only
    assert collected("-m", "not patchkit_only") == passed + failed


def test_bootstrap_refuses_a_system_torch_older_than_the_bound_before_making_anything(
        tmp_path):
    # (a python whose torch is older than pyproject's bound got a venv over it, into which
    # pip then fetched the newest torch, a CUDA build of several GB)
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (bound,) = [r for r in deps if r.startswith("torch")]
    script = (ROOT / "scripts" / "bootstrap").read_text()
    assert f"TORCH_MIN={bound.removeprefix('torch>=')}\n" in script  # (the same bound)

    fake = tmp_path / "site" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('__version__ = "2.3.1+cu121"\n')
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={tmp_path / "site"} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    venv = tmp_path / "venv"
    out = subprocess.run(["bash", str(ROOT / "scripts" / "bootstrap")], capture_output=True,
                         text=True, env={"PATH": "/usr/bin:/bin", "PYTHON": str(python),
                                         "VENV": str(venv)}, cwd=tmp_path)
    assert out.returncode == 1, out
    assert "has torch 2.3.1+cu121, and patchkit needs 2.4 or newer" in out.stderr
    assert not venv.exists()
