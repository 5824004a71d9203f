"""The commands a user runs first: the tour (main job), the demo, and the benchmarks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_tour_writes_its_report_and_every_check_holds(tmp_path):
    from patchkit.tour import run_tour

    lines: list[str] = []
    result = run_tour(tmp_path / "tour", echo=lines.append)
    assert result.ok, result.checks
    assert len(result.checks) == 3
    page = (tmp_path / "tour" / "index.html").read_text()
    for fig in result.figures:
        assert fig.exists() and fig.stat().st_size > 1000
        assert fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f'src="{fig.name}"' in page
    assert "<table" in page
    assert any(line.startswith("[7/7]") for line in lines)  # progress was reported


def test_demo_prints_the_three_cases_and_every_check_holds():
    from patchkit.demo import run_demo

    lines: list[str] = []
    assert run_demo(echo=lines.append)
    text = "\n".join(lines)
    for heading in ("1. dense", "2. sparse", "3. repeated names"):
        assert heading in text
    assert "NO" not in text.split()


def test_python_dash_m_patchkit_lists_its_commands():
    out = subprocess.run(
        [sys.executable, "-m", "patchkit", "--help"], capture_output=True, text=True, cwd=ROOT
    )
    assert out.returncode == 0
    for command in ("tour", "demo", "inspect"):
        assert command in out.stdout


@pytest.mark.parametrize(
    ("script", "columns", "rows", "later"),
    [
        ("bench_loader.py",
         ["patchkit ms", "validate ms", "floor ms", "ratio", "peak extra MiB"], 16, []),
        ("bench_inspect.py",
         ["plain ms", "report ms", "ratio", "reuse ms", "torch-ops report ms", "written MiB",
          "changed MiB"],
         6,
         # the whole-model table: the floor of the report's mode next to the report
         ["model", "floor ms", "floor ratio", "report ms"]),
    ],
)
def test_benchmark_runs_in_quick_mode_and_prints_its_table(script, columns, rows, later):
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--quick"],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    header = next(line for line in out.stdout.splitlines() if line.startswith("| "))
    for col in columns:
        assert col in header
    body = [line for line in out.stdout.splitlines() if line.startswith("| ")]
    assert len(body) >= rows + 1  # the header and one row per case
    if later:
        table = next(line for line in body if all(col in line for col in later))
        row = body[body.index(table) + 1]
        assert len(row.split("|")) == len(table.split("|"))  # a row under that header


def test_the_report_benchmark_offers_a_row_of_real_model_shapes():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_inspect.py"), "--help"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--big" in out.stdout and "Llama-3-8B" in out.stdout
