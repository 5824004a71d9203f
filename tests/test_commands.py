"""The commands a user runs first: the tour (main job), the demo, and the benchmarks."""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_tour_writes_its_report_and_every_check_holds(tmp_path):
    from patchkit.tour import OUTPUTS, run_tour

    # (into a folder that exists: it says so, replaces its own files and leaves others)
    (tmp_path / "tour").mkdir()
    (tmp_path / "tour" / "mine.txt").write_text("mine")
    (tmp_path / "tour" / "index.html").write_text("an earlier tour's")
    lines: list[str] = []
    result = run_tour(tmp_path / "tour", echo=lines.append)
    assert result.ok, result.checks
    assert len(result.checks) == 3
    assert "writing into the existing folder" in lines[0] and "replaced" in lines[0]
    assert sorted(os.listdir(tmp_path / "tour")) == sorted([*OUTPUTS, "mine.txt"])
    assert [f.name for f in result.figures] == list(OUTPUTS[:-1])
    assert (tmp_path / "tour" / "mine.txt").read_text() == "mine"
    page = (tmp_path / "tour" / "index.html").read_text()
    for fig in result.figures:
        assert fig.exists() and fig.stat().st_size > 1000
        assert fig.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f'src="{fig.name}"' in page
    assert "<table" in page
    assert any(line.startswith("[7/7]") for line in lines)  # progress was reported
    for check in result.checks:  # (each verdict, printed and on the page)
        assert f"    {check}: yes" in lines
        assert f"<li>{html.escape(check)}: <b>yes</b></li>" in page
    assert lines[-1] == f"wrote {tmp_path / 'tour' / 'index.html'} and 6 figures"
    # the dense case's calls: the plan at the tour's budget (not the default one), per rank
    import torch

    from patchkit import dense_patches, plan_chunks
    from patchkit.toymodels import TinyLlamaConfig, tiny_llama_checkpoint

    dense = dense_patches(tiny_llama_checkpoint(TinyLlamaConfig(), seed=0,
                                                dtype=torch.bfloat16))
    calls = len(plan_chunks(dense, 64 << 10))
    assert calls > 1
    assert (f"    {len(dense)} patches, {calls} load_weights calls per rank at "
            "max_chunk_bytes=64 KiB") in lines
    assert f", on {'cuda' if torch.cuda.is_available() else 'cpu'}; " in lines[0]
    # the sparse case, 2 % of each of layer 0's 7 projections: each changed checkpoint
    # element is one changed runtime element (two ranks, two kv heads: nothing is
    # replicated), counted over both ranks
    sparse = re.findall(r"^    (\d+) sparse patches, (\d+) changed checkpoint elements, "
                        r"(\d+) runtime elements changed over both ranks$",
                        "\n".join(lines), re.M)
    assert len(sparse) == 1
    patches, changed, runtime = map(int, sparse[0])
    assert patches == 7 and changed > 0 and runtime == changed
    _the_readme_figures_say_what_the_tour_draws_now(tmp_path / "tour")


def _the_readme_figures_say_what_the_tour_draws_now(tour: Path) -> None:
    """The README's figures are copies of tour figures (``make readme-figures``): each
    must still show the words the tour's figure shows now (its titles and labels, kept in
    the PNG; pixels differ between machines' fonts). A change to a figure's numbers or
    wording that was not followed by ``make readme-figures`` fails here."""
    from PIL import Image

    copies = re.findall(r"cp build/tour/(\S+\.png) (docs/figures/\S+\.png)",
                        (ROOT / "Makefile").read_text())
    readme = (ROOT / "README.md").read_text()
    assert copies and all(dst in readme for _, dst in copies)
    for src, dst in copies:
        drawn = Image.open(tour / src).text.get("Description")
        kept = Image.open(ROOT / dst).text.get("Description")
        assert drawn, src
        assert kept == drawn, f"{dst} is out of date: run `make readme-figures`"


def test_demo_prints_the_three_cases_and_every_check_holds():
    from patchkit.demo import run_demo

    lines: list[str] = []
    assert run_demo(echo=lines.append)
    text = "\n".join(lines)
    for heading in ("1. dense", "2. sparse", "3. repeated names"):
        assert heading in text
    assert "NO" not in text.split()
    assert lines[-1] == "all checks held"
    assert [line.rsplit(": ", 1)[1] for line in lines if "bit for bit" in line or
            "later patch wins" in line] == ["yes", "yes", "yes"]
    # (each sparse patch's line: its changed elements of all of its checkpoint tensor's)
    from patchkit.toymodels import TinyLlamaConfig, tiny_llama_checkpoint

    ckpt = tiny_llama_checkpoint(TinyLlamaConfig(), seed=0)
    counts = re.findall(r"^   (\S+): (\d+) of (\d+) elements change$", text, re.M)
    assert {name for name, _, _ in counts} == {"model.layers.0.self_attn.k_proj.weight",
                                               "model.norm.weight"}
    for name, changed, of in counts:
        assert int(of) == ckpt[name].numel() and 0 < int(changed) < int(of)
    # (the device it ran on, then the dense case: each rank's calls are the plan at the
    # demo's budget, and every checkpoint tensor is written once on each rank)
    import torch

    from patchkit import dense_patches, plan_chunks

    assert lines[0].endswith(", on " + ("cuda" if torch.cuda.is_available() else "cpu"))
    dense = dense_patches(tiny_llama_checkpoint(TinyLlamaConfig(), seed=0,
                                                dtype=torch.bfloat16))
    calls = len(plan_chunks(dense, 64 << 10))
    assert calls > 1 and "max_chunk_bytes=64 KiB" in text
    ranks = re.findall(r"^   rank (\d): (\d+) load_weights calls \(closed by .*\), \d+ names "
                       r"loaded, (\d+) runtime writes$", text, re.M)
    assert ranks == [("0", str(calls), str(len(dense))), ("1", str(calls), str(len(dense)))]
    # (the repeated name: two calls, the first closed by the repeated name)
    assert re.findall(r"^   plan: .*$", text, re.M) == [
        "   plan: call 0 carries patch [0], closed by repeated name",
        "   plan: call 1 carries patch [1], closed by end"]


@pytest.mark.parametrize("broken", ["dense", "sparse", "repeated", "repeated, earlier dropped"])
def test_demo_says_so_and_returns_false_when_a_check_fails(broken, monkeypatch):
    # (each check of the demo can fail: a load that went wrong in one case shows as that
    # case's "NO", "SOME CHECKS FAILED" last, and False, which the command exits 1 on; a
    # loader that dropped the earlier of two patches of one name fails the repeated check
    # too: position 0, which only the earlier one writes, is compared as well)
    import patchkit.demo
    import patchkit.inspect
    from patchkit.demo import run_demo

    real_same, real_load = patchkit.demo.same_state, patchkit.inspect.inspect_load
    compared: list[int] = []

    def same_state(a, b):  # (the dense comparison is the first, the sparse the second)
        compared.append(1)
        fails = len(compared) == {"dense": 1, "sparse": 2}.get(broken)
        return real_same(a, b) and not fails

    def inspect_load(model, patches, **kwargs):  # (repeated: the earlier patch applied last)
        repeated = len(patches) == 2 and patches[0].name == patches[1].name
        if repeated and broken != "dense" and broken != "sparse":
            patches = patches[::-1] if broken == "repeated" else patches[1:]
        return real_load(model, patches, **kwargs)

    monkeypatch.setattr(patchkit.demo, "same_state", same_state)
    monkeypatch.setattr(patchkit.inspect, "inspect_load", inspect_load)
    lines: list[str] = []
    assert run_demo(device="cpu", echo=lines.append) is False
    verdicts = [line.rsplit(": ", 1)[1] for line in lines
                if "bit for bit" in line or "later patch wins" in line]
    assert verdicts == [("NO" if broken.startswith(case) else "yes")
                        for case in ("dense", "sparse", "repeated")]
    assert lines[-1] == "SOME CHECKS FAILED"


def test_run_demo_refuses_an_empty_device_rather_than_choosing_one():
    from patchkit.demo import run_demo
    from patchkit.errors import PatchValueError

    lines: list[str] = []
    with pytest.raises(PatchValueError, match="device '' is not a torch device"):
        run_demo(device="", echo=lines.append)
    assert lines == []  # refused before anything ran


def test_python_dash_m_patchkit_lists_its_commands():
    out = subprocess.run(
        [sys.executable, "-m", "patchkit", "--help"], capture_output=True, text=True, cwd=ROOT
    )
    assert out.returncode == 0
    for command in ("tour", "demo", "inspect"):
        assert command in out.stdout
    assert out.stdout.startswith("usage: python -m patchkit ")
    assert "``" not in out.stdout and "'python -m patchkit {tour,demo,inspect} ...'" in out.stdout
    # (no reStructuredText role either: ":func:`~patchkit.load_patches`" was shown as such)
    assert "`" not in out.stdout and "patchkit.load_patches() would refuse" in out.stdout


def test_the_console_script_names_itself_and_has_a_version(monkeypatch, capsys):
    import patchkit
    from patchkit.__main__ import main

    monkeypatch.setattr(sys, "argv", ["/some/venv/bin/patchkit", "--help"])
    with pytest.raises(SystemExit) as info:
        main()
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: patchkit ") and "``" not in out and "--version" in out
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"patchkit {patchkit.__version__}\n"
    with pytest.raises(SystemExit):
        main(["inspect", "--help"])
    assert "a patch file written by patchkit.save_patches" in capsys.readouterr().out


@pytest.mark.parametrize("held", [True, False])
def test_demo_command_exit_status_follows_its_checks(monkeypatch, held):
    import patchkit.demo
    from patchkit.__main__ import main

    seen = []

    def fake_run_demo(device=None, echo=print):
        seen.append(device)
        return held

    monkeypatch.setattr(patchkit.demo, "run_demo", fake_run_demo)
    assert main(["demo", "--device", "cpu"]) == (0 if held else 1)
    assert [str(d) for d in seen] == ["cpu"]


@pytest.mark.parametrize("cuda", [True, False])
def test_tour_and_demo_default_to_patchkit_tour_and_to_cuda_where_available(
        cuda, tmp_path, monkeypatch):
    # (the README: "writes patchkit-tour/index.html"; --help: "default: cuda if available")
    import torch

    import patchkit.demo
    import patchkit.io
    import patchkit.tour
    from patchkit.__main__ import main

    seen: list = []
    monkeypatch.setattr(patchkit.tour, "run_tour", lambda out, device=None, echo=print: (
        seen.append((out, device)) or patchkit.tour.TourResult(out=Path(out))))
    monkeypatch.setattr(patchkit.demo, "run_demo", lambda device=None, echo=print: (
        seen.append(device) or True))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(patchkit.io, "_checked_device", torch.device)  # (no CUDA to check)
    monkeypatch.chdir(tmp_path)
    assert main(["tour"]) == 0 and main(["demo"]) == 0
    device = torch.device("cuda" if cuda else "cpu")
    assert seen == [("patchkit-tour", device), device]
    assert os.listdir(tmp_path) == []  # (the check that it can be made left nothing)


def test_no_command_is_a_usage_error(capsys):
    from patchkit.__main__ import main

    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    o, err = capsys.readouterr()
    assert o == "" and err.startswith("usage: ") and "required: command" in err


def test_a_command_out_of_memory_says_so_and_exits_1(monkeypatch, capsys):
    import patchkit.demo
    from patchkit.__main__ import main

    def fake_run_demo(device=None, echo=print):
        echo("patchkit demo: ...")
        raise MemoryError

    monkeypatch.setattr(patchkit.demo, "run_demo", fake_run_demo)
    assert main(["demo", "--device", "cpu"]) == 1
    assert capsys.readouterr() == ("patchkit demo: ...\n", "error: out of memory\n")


def test_tour_and_demo_refuse_a_bad_out_or_device_cleanly(tmp_path, monkeypatch, capsys):
    import torch

    from patchkit.__main__ import main
    from patchkit.errors import PatchValueError
    from patchkit.tour import run_tour

    afile = tmp_path / "afile"
    afile.write_text("x")
    for out in (afile, afile / "sub"):
        assert main(["tour", "--out", str(out), "--device", "cpu"]) == 2
        o, err = capsys.readouterr()
        assert o == "" and err.startswith("error: ") and err.count("\n") == 1
        assert f"{str(afile)!r} is a file, not a folder" in err and str(out) in err
        # (the sentence, not OSError's "[Errno 20] " before it)
        assert err.startswith("error: cannot write"), err
    assert afile.read_text() == "x"

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv in (["tour", "--out", str(tmp_path / "t"), "--device", "cuda"],
                 ["demo", "--device", "cuda"], ["demo", "--device", "meta"],
                 ["tour", "--out", str(tmp_path / "t"), "--device", "bogus"]):
        assert main(argv) == 2, argv
        o, err = capsys.readouterr()
        assert o == "" and err.startswith(f"error: device '{argv[-1]}'") and "Traceback" not in err
    assert not (tmp_path / "t").exists()  # refused before anything was written
    with pytest.raises(PatchValueError, match="not available"):
        run_tour(tmp_path / "t", device="cuda")
    assert not (tmp_path / "t").exists()
    with pytest.raises(NotADirectoryError, match="is a file, not a folder"):
        run_tour(afile, device="cpu")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_a_tour_out_that_cannot_be_made_is_bad_input(capsys):
    # /proc passes the cheap checks for root (os.access says it can be written) but
    # takes no folder: exit 2 before anything runs (was 1, as if the tour had failed)
    from patchkit.__main__ import main

    assert main(["tour", "--out", "/proc/no-such/tour", "--device", "cpu"]) == 2
    o, err = capsys.readouterr()
    assert o == "" and err.startswith("error: ") and "'/proc/no-such/tour'" in err


def test_a_tour_out_through_dot_dot_is_made_as_given(tmp_path, capsys):
    # (the check that --out can be made tried to remove "new/..": exit 2)
    from patchkit.__main__ import main

    out = tmp_path / "new" / ".." / "tour"
    assert main(["tour", "--out", str(out), "--device", "cpu"]) == 0
    assert (tmp_path / "tour" / "index.html").is_file()
    assert "existing folder" not in capsys.readouterr().out  # (still new to the command)


def test_commands_that_draw_say_which_extra_they_need_when_matplotlib_is_missing(tmp_path):
    f = _mixed_patch_file(tmp_path / "p.safetensors")
    code = (
        "import sys\n"
        "sys.modules['matplotlib'] = None  # the notebooks extra not installed\n"
        "from patchkit.__main__ import main\n"
        f"print(main(['tour', '--out', {str(tmp_path / 't')!r}]))\n"
        f"print(main(['inspect', {str(f)!r}, '--out', {str(tmp_path / 'figs')!r}]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, check=False)
    assert done.stdout.split() == ["2", "2"], done.stdout + done.stderr
    assert done.stderr.splitlines() == 2 * [
        "error: patchkit.plot (the figures: plot_*, report.plot_*) needs matplotlib: "
        "pip install 'patchkit[notebooks]'"]
    assert not (tmp_path / "t").exists() and not (tmp_path / "figs").exists()


def test_tour_result_ok_is_documented():
    from patchkit.tour import TourResult

    assert "check" in (TourResult.ok.__doc__ or "")
    assert TourResult(out=Path("x"), checks={"a": True}).ok
    assert not TourResult(out=Path("x"), checks={"a": True, "b": False}).ok


@pytest.mark.parametrize(
    ("script", "columns", "rows", "later"),
    [
        ("bench_loader.py",
         ["patchkit ms", "validate ms", "floor ms", "ratio", "peak extra MiB"], 16,
         # the mixture-of-experts table: a whole checkpoint, mostly expert patches
         ["experts", "patches", "patches are", "floor ms", "per patch us"]),
        ("bench_build.py",
         ["patchkit ms", "one-shot ms", "ratio", "patchkit peak MiB", "one-shot peak MiB",
          "patch MiB"], 2, []),
        ("bench_scaling.py",
         ["case", "n", "plain ms", "report ms", "report / plain", "growth"], 8, []),
        ("bench_inspect.py",
         ["plain ms", "report ms", "ratio", "reuse ms", "torch-ops report ms", "written MiB",
          "changed MiB"],
         6,
         # the whole-model table: the floor of the report's mode, and the references of a
         # report that only saves, next to the report
         ["model", "floor ms", "floor ratio", "save ref", "kept ref", "report ms"]),
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
    if script == "bench_inspect.py":
        # the figures' table: plot_delta timed and its memory measured, beside its floor
        rows_of = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in body}
        for step in ("density_map 64x64", "plot_density", "plot_delta",
                     "one float32 pass over the tensor, in bands (floor)"):
            assert step in rows_of, step
        seconds, mib = (c.strip() for c in rows_of["plot_delta"])
        assert float(seconds) > 0 and float(mib) >= 0
        # the target table: one row per report row of the single-tensor (6) and the
        # whole-model (2) tables, each time verdict read off its own ratio
        lines = out.stdout.splitlines()
        at = next(i for i, line in enumerate(lines) if "+ tables ratio" in line)
        verdicts = [[c.strip() for c in line.split("|")[1:-1]]
                    for line in lines[at + 2:] if line.startswith("| ")]
        assert len(verdicts) == 8
        for load, ratio, within, *_ in verdicts:
            assert within == ("yes" if float(ratio.rstrip("x")) <= 1.5 else "no"), load


def test_the_report_benchmark_offers_a_row_of_real_model_shapes():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_inspect.py"), "--help"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--big" in out.stdout and "Llama-3-8B" in out.stdout


def test_tour_and_demo_refuse_an_empty_out_or_device(tmp_path, monkeypatch, capsys):
    """``--out ''`` would be the current folder (Path('') is '.'), ``--device ''`` the
    default device: both are refused, before anything is written."""
    from patchkit.__main__ import main
    from patchkit.errors import PatchValueError
    from patchkit.tour import run_tour

    monkeypatch.chdir(tmp_path)
    (tmp_path / "index.html").write_text("mine")
    assert main(["tour", "--out", "", "--device", "cpu"]) == 2
    o, err = capsys.readouterr()
    assert o == "" and err.startswith("error: ") and err.count("\n") == 1
    assert "--out" in err and "empty" in err and "Traceback" not in err
    for argv in (["demo", "--device", ""], ["tour", "--out", "t", "--device", ""]):
        assert main(argv) == 2, argv
        o, err = capsys.readouterr()
        assert o == "" and err.startswith("error: device ''") and err.count("\n") == 1
    assert sorted(os.listdir(tmp_path)) == ["index.html"]
    assert (tmp_path / "index.html").read_text() == "mine"
    with pytest.raises(PatchValueError, match="empty") as info:
        run_tour("", device="cpu")
    assert info.value.value == ""
    with pytest.raises(PatchValueError, match="device ''"):
        run_tour(tmp_path / "t", device="")
    assert sorted(os.listdir(tmp_path)) == ["index.html"]


def _mixed_patch_file(path: Path, sparse_name: str = "layers.0.w") -> Path:
    """A patch file of a dense patch (position 0) and two sparse ones (1 and 2)."""
    import torch

    from patchkit import CheckpointWeightPatch, save_patches

    save_patches(path, [
        CheckpointWeightPatch("dense.w", (4, 8), torch.float32, torch.arange(32.0)),
        CheckpointWeightPatch(sparse_name, (16, 32), torch.bfloat16,
                              values=torch.ones(3), indices=torch.tensor([0, 40, 511])),
        CheckpointWeightPatch("lm_head.weight", (64, 8), torch.bfloat16,
                              values=torch.ones(2), indices=torch.tensor([5, 6])),
    ])
    return path


def test_inspect_out_writes_the_chunk_plans_and_each_sparse_patch_density(tmp_path, capsys):
    from patchkit.__main__ import main

    f = _mixed_patch_file(tmp_path / "p.safetensors")
    assert main(["inspect", str(f), "--out", str(tmp_path / "figs")]) == 0
    out = capsys.readouterr().out
    names = sorted(os.listdir(tmp_path / "figs"))
    # a file of dense and sparse patches is planned as two loads; the dense patch has no
    # density figure (it writes every element)
    figures = ["chunks_dense.png", "chunks_sparse.png",
               "density_1_layers.0.w.png", "density_2_lm_head.weight.png"]
    assert names == [*figures, "index.html"]
    for n in figures:
        assert (tmp_path / "figs" / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.startswith("patch file: ")  # the summary first, then one line a figure
    assert [line.split(" wrote ")[0] for line in out.splitlines() if " wrote " in line] == [
        "[1/4]", "[2/4]", "[3/4]", "[4/4]"]
    assert out.rstrip().endswith(f"wrote 4 figures and index.html to {tmp_path / 'figs'}")
    page = (tmp_path / "figs" / "index.html").read_text()
    assert page.count("<img") == 4
    for n in figures:
        assert f'src="{n}"' in page
    # (the summary as printed, each row of it on the page)
    summary = out.split("\n\n[1/4]")[0]
    assert "lm_head.weight" in summary and all(
        html.escape(line) in page for line in summary.splitlines())


def test_inspect_out_keeps_a_patch_name_inside_the_folder(tmp_path, capsys):
    from patchkit.__main__ import main

    f = _mixed_patch_file(tmp_path / "p.safetensors", sparse_name="../../escape/ w:x<b>")
    (tmp_path / "figs").mkdir()
    assert main(["inspect", str(f), "--out", str(tmp_path / "figs")]) == 0
    capsys.readouterr()
    assert sorted(os.listdir(tmp_path)) == ["figs", "p.safetensors"]
    assert "density_1_.._.._escape_w_x_b_.png" in os.listdir(tmp_path / "figs")
    page = (tmp_path / "figs" / "index.html").read_text()
    assert "<b>" not in page and "w:x&lt;b&gt;" in page  # (the name as text, not markup)


@pytest.mark.parametrize("out", ["", "file"])
def test_inspect_out_refuses_an_empty_or_file_folder_with_exit_2(out, tmp_path, capsys,
                                                                 monkeypatch):
    from patchkit.__main__ import main

    monkeypatch.chdir(tmp_path)
    f = _mixed_patch_file(tmp_path / "p.safetensors")
    (tmp_path / "file").write_text("mine")
    assert main(["inspect", str(f), "--out", out]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # --out is refused before the summary is printed
    err = captured.err
    assert err.startswith("error: ") and err.count("\n") == 1 and "figures" in err
    assert ("empty" in err) if out == "" else ("is a file" in err)
    assert sorted(os.listdir(tmp_path)) == ["file", "p.safetensors"]
    assert (tmp_path / "file").read_text() == "mine"


def test_inspect_out_of_a_bad_file_writes_nothing(tmp_path, capsys):
    from patchkit.__main__ import main

    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a patch file")
    assert main(["inspect", str(bad), "--out", str(tmp_path / "figs")]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert not (tmp_path / "figs").exists()
    # (nor the folders above a new one: the check that --out can be made removes every
    # folder it made, not the last alone)
    assert main(["inspect", str(bad), "--out", str(tmp_path / "new" / "deeper" / "figs")]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert os.listdir(tmp_path) == ["bad.safetensors"]


def test_inspect_out_through_dot_dot_of_a_bad_file_leaves_no_folder_and_keeps_its_own(
        tmp_path, capsys):
    # (the check that --out can be made took the path made absolute and normal first:
    # "new/../figs" made "new" and "figs", and removed "figs" alone; where the folder
    # after ".." existed, nothing of what it made was its own to remove but "new")
    from patchkit.__main__ import main

    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a patch file")
    assert main(["inspect", str(bad), "--out", str(tmp_path / "new" / ".." / "figs")]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert os.listdir(tmp_path) == ["bad.safetensors"]
    (tmp_path / "kept").mkdir()  # empty: rmdir would take it
    out = tmp_path / "a" / ".." / "kept" / "b" / ".." / "c"
    assert main(["inspect", str(bad), "--out", str(out)]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert sorted(os.listdir(tmp_path)) == ["bad.safetensors", "kept"]
    assert os.listdir(tmp_path / "kept") == []
    # (a ".." after a link goes up from where the link points)
    elsewhere = tmp_path / "kept" / "deep"
    elsewhere.mkdir()
    (tmp_path / "link").symlink_to(elsewhere)
    assert main(["inspect", str(bad), "--out", str(tmp_path / "link" / ".." / "n" / "f")]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert sorted(os.listdir(tmp_path / "kept")) == ["deep"]
    assert sorted(os.listdir(tmp_path)) == ["bad.safetensors", "kept", "link"]


def test_inspect_out_names_density_figures_by_padded_position_and_a_cut_name(tmp_path):
    # (the figures' file names: the position zero-padded to the widest position of the
    # file, so that a listing sorts them in file order; a long name cut to 80 characters)
    import torch

    from patchkit import CheckpointWeightPatch, save_patches
    from patchkit.__main__ import _inspect_figures
    from patchkit.io import read_patch_index

    def stems(names: list[str]) -> list[str]:
        f = tmp_path / f"{len(names)}.safetensors"
        save_patches(f, [CheckpointWeightPatch(n, (4,), torch.float32, torch.ones(1),
                                               torch.tensor([0])) for n in names])
        return [stem for stem, _ in _inspect_figures(read_patch_index(f))]

    ten = stems([f"w{i}" if i != 3 else "x" * 100 for i in range(10)])  # positions 0..9
    assert ten == ["chunks", *(f"density_{i}_w{i}" for i in range(3)),
                   "density_3_" + "x" * 80, *(f"density_{i}_w{i}" for i in range(4, 10))]
    eleven = stems([f"w{i}" for i in range(11)])  # positions 0..10
    assert eleven == ["chunks", *(f"density_{i:02d}_w{i}" for i in range(11))]


def test_inspect_out_reads_no_dense_values(tmp_path, capsys, monkeypatch):
    # (a file of a whole model's dense weights: its plan needs only the header)
    import patchkit.io
    from patchkit.__main__ import main

    f = _mixed_patch_file(tmp_path / "p.safetensors")
    read: list[tuple[int, ...]] = []
    real = patchkit.io._read_tensor

    def reading(*args, **kwargs):
        t = real(*args, **kwargs)
        read.append(tuple(t.shape))
        return t

    monkeypatch.setattr(patchkit.io, "_read_tensor", reading)
    assert main(["inspect", str(f), "--out", str(tmp_path / "figs")]) == 0
    capsys.readouterr()
    # the sparse values and indices only: read to check them, then to draw them
    assert sorted(read) == [(2,), (2,), (2,), (2,), (3,), (3,), (3,), (3,)]
    read.clear()
    # --header-only with --out: the sparse patches are read for their figures all the
    # same, so they are checked first (a bad one was found after a summary that said "not
    # checked" was printed, and exited 2 then)
    assert main(["inspect", str(f), "--out", str(tmp_path / "figs"), "--header-only"]) == 0
    assert "not checked: the header alone was read" not in capsys.readouterr().out
    assert sorted(read) == [(2,), (2,), (2,), (2,), (3,), (3,), (3,), (3,)]
    read.clear()
    assert main(["inspect", str(f), "--header-only"]) == 0  # (without --out: nothing read)
    assert "not checked: the header alone was read" in capsys.readouterr().out
    assert read == []


def _failing_savefig(monkeypatch, on_call: int) -> None:
    """Figure.savefig fails (a full disk) on call ``on_call`` (1-based), writing nothing."""
    import errno

    import matplotlib.figure

    real = matplotlib.figure.Figure.savefig
    calls = []

    def savefig(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == on_call:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)


@pytest.mark.parametrize("command", ["tour", "inspect"])
def test_an_out_holding_a_folder_where_a_file_goes_is_refused_before_anything_runs(
        command, tmp_path, capsys):
    from patchkit.__main__ import main

    f = _mixed_patch_file(tmp_path / "p.safetensors")
    out = tmp_path / "out"
    blocked = "sparse_density.png" if command == "tour" else "chunks_sparse.png"
    (out / blocked).mkdir(parents=True)
    (out / "mine.txt").write_text("mine")
    argv = (["tour", "--out", str(out), "--device", "cpu"] if command == "tour"
            else ["inspect", str(f), "--out", str(out)])
    assert main(argv) == 2
    o, err = capsys.readouterr()
    assert o == "" and err.startswith("error: ") and err.count("\n") == 1
    assert f"{str(out / blocked)!r} is a folder, not a file" in err
    assert sorted(os.listdir(out)) == sorted([blocked, "mine.txt"])  # nothing written


def test_an_out_that_cannot_be_written_is_refused_before_anything_runs(
        tmp_path, capsys, monkeypatch):
    # (these tests may run as root, for whom every mode bit allows writing: os.access says
    # what a user without the right would be told)
    from patchkit.__main__ import main

    f = _mixed_patch_file(tmp_path / "p.safetensors")
    out = tmp_path / "out"
    out.mkdir()
    (out / "index.html").write_text("mine")
    real = os.access
    for locked, what in ((out, "the folder"), (out / "index.html", "the file")):
        monkeypatch.setattr(os, "access", lambda p, mode, locked=locked, **kw: (
            False if Path(p) == locked else real(p, mode, **kw)))
        for argv in (["tour", "--out", str(out), "--device", "cpu"],
                     ["inspect", str(f), "--out", str(out)]):
            assert main(argv) == 2, argv
            o, err = capsys.readouterr()
            assert o == "" and err.startswith("error: ") and err.count("\n") == 1
            assert f"{what} {str(locked)!r} cannot be" in err
    assert sorted(os.listdir(out)) == ["index.html"]
    # (a folder that can be written but not entered, no x bit, takes no file either)
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: (
        not mode & os.X_OK if Path(p) == out else real(p, mode, **kw)))
    for argv in (["tour", "--out", str(out), "--device", "cpu"],
                 ["inspect", str(f), "--out", str(out)]):
        assert main(argv) == 2, argv
        o, err = capsys.readouterr()
        assert o == "" and f"the folder {str(out)!r} cannot be written" in err
    assert sorted(os.listdir(out)) == ["index.html"]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_an_out_holding_a_pipe_where_a_file_goes_is_refused_before_anything_runs(
        tmp_path, capsys):
    # (a figure saved into a named pipe would wait for a reader for ever)
    from patchkit.__main__ import main

    f = _mixed_patch_file(tmp_path / "p.safetensors")
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / "chunks_dense.png")
    assert main(["inspect", str(f), "--out", str(out)]) == 2
    o, err = capsys.readouterr()
    assert o == "" and err.startswith("error: ") and err.count("\n") == 1
    assert f"{str(out / 'chunks_dense.png')!r} is not a regular file" in err
    assert os.listdir(out) == ["chunks_dense.png"]


@pytest.mark.parametrize("broken", ["dense", "sparse", "repeated", "repeated, earlier dropped"])
def test_tour_says_so_and_exits_1_when_a_check_fails(broken, tmp_path, capsys, monkeypatch):
    # (a loader that went wrong in one case: a dense or a sparse patch's first value off,
    # a repeated name's patches applied in the other order, or the earlier of them dropped.
    # The tour's own check of that case must see it, on the terminal, on the page and in
    # the exit status; the checks of the cases before it hold)
    import patchkit.inspect
    from patchkit.__main__ import main

    real = patchkit.inspect.inspect_load

    def inspect_load(model, patches, **kwargs):
        repeated = len(patches) > 1 and patches[0].name == patches[1].name
        case = "repeated" if repeated else "sparse" if patches[0].indices is not None else "dense"
        if case == broken and case != "repeated":
            first = patches[0]
            values = first.values.clone()
            values.view(-1)[0] += 1
            patches = [first._replace(values=values), *patches[1:]]
        elif case == "repeated" == broken:
            patches = [patches[1], patches[0], *patches[2:]]
        elif case == "repeated" and broken == "repeated, earlier dropped":
            patches = patches[1:]
        return real(model, patches, **kwargs)

    monkeypatch.setattr(patchkit.inspect, "inspect_load", inspect_load)
    assert main(["tour", "--out", str(tmp_path / "t"), "--device", "cpu"]) == 1
    out = capsys.readouterr().out.splitlines()
    page = (tmp_path / "t" / "index.html").read_text()
    cases = {"dense": "dense: ranks gathered == checkpoint",
             "sparse": "sparse: ranks gathered == new checkpoint",
             "repeated": "repeated names: the later patch wins"}
    failed = broken.split(",")[0]
    # (a state one load left wrong is still wrong after the next: the checks after the
    # broken one are not asserted)
    for case, check in list(cases.items())[:list(cases).index(failed) + 1]:
        verdict = "NO" if case == failed else "yes"
        assert f"    {check}: {verdict}" in out
        assert f"<li>{html.escape(check)}: <b>{verdict}</b></li>" in page


def test_run_tour_refuses_an_out_holding_a_folder_where_a_figure_goes_before_it_runs(
        tmp_path):
    # (its docstring: raised before anything runs, not when the tour reaches that figure)
    from patchkit.tour import run_tour

    out = tmp_path / "t"
    (out / "repeated_chunks.png").mkdir(parents=True)  # (the tour's last figure)
    lines: list[str] = []
    with pytest.raises(IsADirectoryError, match="is a folder, not a file"):
        run_tour(out, device="cpu", echo=lines.append)
    assert lines == [] and os.listdir(out) == ["repeated_chunks.png"]


@pytest.mark.parametrize("cuda", [True, False])
def test_run_tour_and_run_demo_default_to_cuda_where_available(cuda, tmp_path, monkeypatch):
    # (their docstrings; the command's own default is pinned above, this is the functions')
    import torch

    import patchkit.io
    from patchkit.demo import run_demo
    from patchkit.tour import run_tour

    class Asked(Exception):
        pass

    def checked_device(device):
        raise Asked(device)  # (stops the run at its device: none is needed for the test)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(patchkit.io, "_checked_device", checked_device)
    for run in (lambda: run_tour(tmp_path / "t", echo=print), lambda: run_demo(echo=print)):
        with pytest.raises(Asked) as info:
            run()
        assert info.value.args == ("cuda" if cuda else "cpu",)
    assert not (tmp_path / "t").exists()


def test_tour_that_fails_at_its_first_file_raises_that_error_saying_so(tmp_path, monkeypatch):
    import errno

    import matplotlib.figure

    from patchkit.tour import run_tour

    def savefig(self, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    with pytest.raises(PermissionError) as info:  # (its own type, as the docstring says)
        run_tour(tmp_path / "t", device="cpu", echo=lambda _: None)
    assert (f"Permission denied; stopped part-way: wrote none of its 7 files to "
            f"{str(tmp_path / 't')!r}, no index.html") in str(info.value)
    assert os.listdir(tmp_path / "t") == []


def test_tour_that_fails_part_way_says_what_it_wrote_and_exits_1(tmp_path, capsys,
                                                                  monkeypatch):
    from patchkit.__main__ import main

    _failing_savefig(monkeypatch, on_call=4)  # the sparse density figure
    assert main(["tour", "--out", str(tmp_path / "t"), "--device", "cpu"]) == 1
    o, err = capsys.readouterr()
    assert o.startswith("patchkit tour: ") and f"writing to {tmp_path / 't'}/" in o
    written = ["dense_chunks.png", "dense_placement_rank0.png", "dense_placement_rank1.png"]
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert "No space left on device" in err
    assert (f"stopped part-way: wrote 3 of 7 files ({', '.join(written)}) to "
            f"{str(tmp_path / 't')!r}, no index.html") in err
    assert sorted(os.listdir(tmp_path / "t")) == written


def test_inspect_that_fails_part_way_says_what_it_wrote_and_exits_1(tmp_path, capsys,
                                                                     monkeypatch):
    from patchkit.__main__ import main

    f = _mixed_patch_file(tmp_path / "p.safetensors")
    _failing_savefig(monkeypatch, on_call=2)
    assert main(["inspect", str(f), "--out", str(tmp_path / "figs")]) == 1
    o, err = capsys.readouterr()
    assert o.startswith("patch file: ") and "[1/4] wrote " in o
    assert err.startswith("error: ") and err.count("\n") == 1
    assert (f"stopped part-way: wrote 1 of 5 files (chunks_dense.png) to "
            f"{str(tmp_path / 'figs')!r}, no index.html") in err
    assert os.listdir(tmp_path / "figs") == ["chunks_dense.png"]


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX")
@pytest.mark.parametrize("command", ["tour", "inspect"])
def test_a_figure_whose_write_fails_leaves_the_earlier_one_whole_and_no_part_of_it(
        command, tmp_path):
    # (a real failed write, not a savefig that writes nothing: no file may grow past 20 kB,
    # and every figure is larger. savefig wrote into the figure's own name, so the run
    # left a cut-off PNG there, over the earlier run's figure, while its message said
    # "wrote none of its files")
    import resource
    import signal

    figs = tmp_path / "figs"
    figs.mkdir()
    first = {"tour": "dense_chunks.png", "inspect": "chunks_dense.png"}[command]
    (figs / first).write_bytes(b"an earlier figure")
    args = ["tour", "--device", "cpu"] if command == "tour" else [
        "inspect", str(_mixed_patch_file(tmp_path / "p.safetensors"))]

    def small_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (a write past it fails: EFBIG)
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))

    code = ("import sys\nfrom patchkit.__main__ import main\n"
            f"sys.exit(main({[*args, '--out', str(figs)]!r}))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, check=False, preexec_fn=small_files)
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("error: File too large; stopped part-way: wrote none of ")
    assert os.listdir(figs) == [first]  # (no temporary either)
    assert (figs / first).read_bytes() == b"an earlier figure"


@pytest.mark.parametrize("earlier", [False, True])
def test_inspect_whose_page_cannot_be_written_keeps_an_earlier_one_and_no_temporary(
        tmp_path, capsys, monkeypatch, earlier):
    import errno

    from patchkit.__main__ import main

    f = _mixed_patch_file(tmp_path / "p.safetensors")
    figs = tmp_path / "figs"
    if earlier:
        figs.mkdir()
        (figs / "index.html").write_text("an earlier one")
    real = os.replace

    def replace(src, dst, *a, **k):
        if os.path.basename(dst) == "index.html":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(src, dst, *a, **k)

    monkeypatch.setattr(os, "replace", replace)
    assert main(["inspect", str(f), "--out", str(figs)]) == 1
    err = capsys.readouterr().err
    figures = sorted(n for n in os.listdir(figs) if n.endswith(".png"))
    assert len(figures) == 4 and err.count("\n") == 1 and "No space left on device" in err
    page = ("index.html not written (the one there is an earlier run's, as it was)"
            if earlier else "no index.html")
    assert "stopped part-way: wrote 4 of 5 files (" in err and f"{str(figs)!r}, {page}" in err
    assert sorted(os.listdir(figs)) == sorted(figures + ["index.html"] * earlier)
    if earlier:
        assert (figs / "index.html").read_text() == "an earlier one"


def test_inspect_out_into_an_existing_folder_says_so_and_leaves_other_files(tmp_path, capsys):
    from patchkit.__main__ import main

    f = _mixed_patch_file(tmp_path / "p.safetensors")
    (tmp_path / "figs").mkdir()
    (tmp_path / "figs" / "mine.txt").write_text("mine")
    (tmp_path / "figs" / "index.html").write_text("an earlier one")
    assert main(["inspect", str(f), "--out", str(tmp_path / "figs")]) == 0
    out = capsys.readouterr().out
    assert f"writing into the existing folder {tmp_path / 'figs'} (" in out
    assert (tmp_path / "figs" / "mine.txt").read_text() == "mine"
    assert "<img" in (tmp_path / "figs" / "index.html").read_text()
    assert len(os.listdir(tmp_path / "figs")) == 6  # 4 figures, index.html, mine.txt


def test_ctrl_c_is_one_line_and_exit_130(tmp_path, capsys, monkeypatch):
    import patchkit.tour
    from patchkit.__main__ import main

    def interrupted(out, device=None, echo=print):
        echo("patchkit tour: ...")
        raise KeyboardInterrupt

    monkeypatch.setattr(patchkit.tour, "run_tour", interrupted)
    try:
        code = main(["tour", "--out", str(tmp_path / "t"), "--device", "cpu"])
    except KeyboardInterrupt:  # (not let through: pytest would stop the whole run)
        pytest.fail("KeyboardInterrupt went through main")
    assert code == 130
    o, err = capsys.readouterr()
    assert o == "patchkit tour: ...\n" and err == "interrupted\n"
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "130 when interrupted (Ctrl-C)" in " ".join(capsys.readouterr().out.split())
    for command in ("tour", "inspect"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "other files are left" in " ".join(capsys.readouterr().out.split())


def test_demo_into_a_closed_pipe_stops_quietly():
    # (``patchkit demo | head -0``: what the demo prints waits in stdout's buffer; without
    # the flush in main the closed pipe showed at exit, as "Exception ignored ...
    # BrokenPipeError" on stderr and status 120)
    code = (
        "import sys\n"
        "import patchkit.demo\n"
        "from patchkit.__main__ import main\n"
        "patchkit.demo.run_demo = lambda device=None, echo=print: echo('demo') or True\n"
        "sys.exit(main(['demo', '--device', 'cpu']))\n"
    )
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the first write
    try:
        done = subprocess.run([sys.executable, "-c", code], stdout=w, stderr=subprocess.PIPE,
                              text=True, cwd=ROOT, timeout=120, check=False,
                              env={k: v for k, v in os.environ.items()  # (buffered, as
                                   if k != "PYTHONUNBUFFERED"})  # a plain run's stdout is)
    finally:
        os.close(w)
    assert (done.returncode, done.stderr) == (1, "")


@pytest.mark.parametrize("option", [["--help"], ["--version"], ["inspect", "--help"]])
@pytest.mark.parametrize("stdout", ["closed pipe", "full disk"])
def test_help_and_version_into_a_closed_pipe_or_a_full_disk_exit_1_without_a_traceback(
        option, stdout):
    # (``patchkit --help | true``, ``patchkit --version > /dev/full``: argparse prints into
    # stdout's buffer and exits through SystemExit; the buffer was flushed as main put
    # stdout's error handler back, so the failure came out as two chained tracebacks,
    # SystemExit then BrokenPipeError or OSError, and status 120)
    code = f"import sys\nfrom patchkit.__main__ import main\nsys.exit(main({option!r}))\n"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # (buffered)
    if stdout == "full disk":
        if not os.path.exists("/dev/full"):
            pytest.skip("no /dev/full here")
        with open("/dev/full", "w") as full:
            done = subprocess.run([sys.executable, "-c", code], stdout=full,
                                  stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=120,
                                  check=False, env=env)
        said = "error: No space left on device\n"
    else:
        r, w = os.pipe()
        os.close(r)  # the reader is gone before the first write
        try:
            done = subprocess.run([sys.executable, "-c", code], stdout=w,
                                  stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=120,
                                  check=False, env=env)
        finally:
            os.close(w)
        said = ""  # (it stops quietly, as a command does)
    assert (done.returncode, done.stderr) == (1, said)


@pytest.mark.parametrize("error", ["OSError(28, 'No space left on device')", "MemoryError()",
                                   "KeyboardInterrupt()"])
def test_the_error_line_comes_after_what_the_command_printed(error):
    # (``patchkit tour > log 2>&1``: stdout is buffered, stderr is not; the error line was
    # printed before stdout was flushed, so the log began with it, above the lines the
    # command printed before it failed)
    code = (
        "import sys\n"
        "import patchkit.demo\n"
        "from patchkit.__main__ import main\n"
        "def fail(device=None, echo=print):\n"
        "    echo('patchkit demo: ...')\n"
        f"    raise {error}\n"
        "patchkit.demo.run_demo = fail\n"
        "sys.exit(main(['demo', '--device', 'cpu']))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, cwd=ROOT, timeout=120,
                          check=False, env={k: v for k, v in os.environ.items()
                                            if k != "PYTHONUNBUFFERED"})
    code, said = {"OSError": (1, "error: No space left on device"),
                  "MemoryError": (1, "error: out of memory"),
                  "KeyboardInterrupt": (130, "interrupted")}[error.split("(")[0]]
    assert (done.returncode, done.stdout) == (code, f"patchkit demo: ...\n{said}\n")


def test_a_real_sigint_stops_the_command_with_one_line_and_exit_130(tmp_path):
    import signal

    # the tour, made to wait for the signal: stdout says when it runs
    code = (
        "import sys, time\n"
        "import patchkit.tour\n"
        "from patchkit.__main__ import main\n"
        "def slow(out, device=None, echo=print):\n"
        "    print('running', flush=True)\n"
        "    time.sleep(60)\n"
        "patchkit.tour.run_tour = slow\n"
        f"sys.exit(main(['tour', '--out', {str(tmp_path / 't')!r}, '--device', 'cpu']))\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         # (a shell's background job would ignore SIGINT: not this one)
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert p.stdout.readline() == "running\n"
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130, err
    assert err == "interrupted\n"


@pytest.mark.skipif(sys.platform == "win32", reason="file names are bytes on POSIX only")
def test_inspect_out_of_a_file_whose_name_is_not_utf8_writes_its_page(tmp_path, capsys):
    from patchkit.__main__ import main

    # (a Latin-1 name: a lone surrogate in str; U+202E, which would reverse the title; and
    # markup, shown as text)
    name = os.fsdecode(b"caf\xe9\xe2\x80\xae<i>.safetensors")
    f = _mixed_patch_file(tmp_path / "p.safetensors")
    os.rename(f, tmp_path / name)
    (tmp_path / "figs").mkdir()
    (tmp_path / "figs" / "index.html").write_text("an earlier one")
    assert main(["inspect", str(tmp_path / name), "--out", str(tmp_path / "figs")]) == 0
    capsys.readouterr()
    page = (tmp_path / "figs" / "index.html").read_text(encoding="utf-8")
    assert "<title>patch file caf\\udce9\\u202e&lt;i&gt;.safetensors</title>" in page
    assert "<h1>patch file caf\\udce9\\u202e&lt;i&gt;.safetensors</h1>" in page
    assert page.count("<img") == 4


@pytest.mark.parametrize("encoding", ["ascii", "latin-1"])
def test_inspect_out_to_a_folder_its_output_cannot_spell_escapes_the_name(tmp_path, encoding):
    f = _mixed_patch_file(tmp_path / "p.safetensors")
    out = tmp_path / "figures 层 ü"
    r = subprocess.run([sys.executable, "-m", "patchkit", "inspect", str(f), "--out", str(out)],
                       capture_output=True, cwd=ROOT,
                       env={**os.environ, "PYTHONIOENCODING": encoding})
    assert (r.returncode, r.stderr) == (0, b"")
    shown = str(out).encode(encoding, "backslashreplace")
    assert r.stdout.rstrip().endswith(b"wrote 4 figures and index.html to " + shown)
    assert len(os.listdir(out)) == 5
    # (and the process's own streams are as they were after main())
    from patchkit.__main__ import main

    errors = sys.stdout.errors
    main(["inspect", str(f)])
    assert sys.stdout.errors == errors


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="pins files by /proc/self/fd")
def test_inspect_out_reads_one_file_when_another_replaces_it_meanwhile(tmp_path, capsys,
                                                                       monkeypatch):
    # (a trainer writing the next step over the same path: the command read the file up
    # to four times, and could show one file's summary with another's figures)
    import torch

    import patchkit.io as pk_io
    from patchkit import CheckpointWeightPatch, save_patches
    from patchkit.__main__ import main

    f = _mixed_patch_file(tmp_path / "p.safetensors")
    other = tmp_path / "next.safetensors"
    save_patches(other, [CheckpointWeightPatch("next.w", (2,), torch.float32, torch.ones(2))])
    real = pk_io.read_patch_index
    replaced = []

    def then_replace(path):
        out = real(path)
        if not replaced:  # (once the figures' names are known, the path is another file)
            os.replace(other, f)
            replaced.append(True)
        return out

    monkeypatch.setattr(pk_io, "read_patch_index", then_replace)
    assert main(["inspect", str(f), "--out", str(tmp_path / "figs")]) == 0
    out = capsys.readouterr().out
    assert replaced and "next.w" not in out
    assert "layers.0.w" in out and "lm_head.weight" in out  # the first file's, throughout
    page = (tmp_path / "figs" / "index.html").read_text()
    assert "next.w" not in page and "lm_head.weight" in page
    assert sorted(p.name for p in (tmp_path / "figs").iterdir() if p.name.startswith("density"))
    # and the file at the path is the new one, unread
    assert [e.name for e in real(f)] == ["next.w"]


_FULL_DISK_PAGE = r"""
import resource, signal, sys
from patchkit.__main__ import main
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # (a write past the limit: EFBIG, no kill)
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), resource.RLIM_INFINITY))
sys.exit(main(sys.argv[2:]))
"""


def test_a_page_write_that_fails_leaves_the_earlier_page_whole(tmp_path):
    # index.html was truncated, then written in place: a full disk left a cut-off page
    # where the earlier report had been, and the error said "no index.html"
    import torch

    from patchkit import CheckpointWeightPatch, save_patches

    f = tmp_path / "p.safetensors"
    save_patches(f, [CheckpointWeightPatch(f"layer.{i}." + "w" * 150, (2,), torch.float32,
                                           torch.ones(2)) for i in range(2000)])
    out = tmp_path / "figs"
    out.mkdir()
    (out / "index.html").write_text("an earlier report")
    run = [sys.executable, "-c", _FULL_DISK_PAGE]
    # the limit lets the figure through (tens of KiB) and stops the page (hundreds)
    free = subprocess.run([*run, str(1 << 40), "inspect", str(f), "--out",
                           str(tmp_path / "sizes")], capture_output=True, text=True)
    assert free.returncode == 0, free.stderr
    png = (tmp_path / "sizes" / "chunks.png").stat().st_size
    page = (tmp_path / "sizes" / "index.html").stat().st_size
    assert 2 * png < page
    r = subprocess.run([*run, str(2 * png), "inspect", str(f), "--out", str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith("error: ") and "File too large" in r.stderr
    assert ("index.html not written (the one there is an earlier run's, as it was)"
            in r.stderr)
    assert (out / "index.html").read_text() == "an earlier report"
    assert sorted(os.listdir(out)) == ["chunks.png", "index.html"]  # no temporary


def test_write_page_keeps_a_replaced_pages_mode_and_gives_a_new_one_opens(tmp_path):
    from patchkit.tour import _write_page

    old = tmp_path / "index.html"
    old.write_text("old")
    old.chmod(0o640)
    _write_page(old, b"new")
    assert old.read_bytes() == b"new" and (old.stat().st_mode & 0o777) == 0o640
    mask = os.umask(0o022)
    try:
        _write_page(tmp_path / "fresh.html", b"x")
    finally:
        os.umask(mask)
    assert ((tmp_path / "fresh.html").stat().st_mode & 0o777) == 0o644
    assert sorted(os.listdir(tmp_path)) == ["fresh.html", "index.html"]


def test_an_inspect_out_that_cannot_be_made_is_bad_input_before_the_summary(tmp_path, capsys):
    # a dangling link, /proc/x: the summary was printed, then exit 1 as if a write failed
    from patchkit.__main__ import main

    f = _mixed_patch_file(tmp_path / "p.safetensors")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for out in (str(tmp_path / "dangling"), "/proc/no-such/figs"):
        assert main(["inspect", str(f), "--out", out]) == 2
        o, err = capsys.readouterr()
        assert o == "" and err.startswith("error: ") and "for the figures" in err
    assert not (tmp_path / "nowhere").exists()


def test_a_closed_stdout_is_bad_input_before_anything_runs(tmp_path, monkeypatch, capsys):
    # (``>&-``: Python sets sys.stdout to None; every command ran, then a traceback)
    from patchkit.__main__ import main

    f = _mixed_patch_file(tmp_path / "p.safetensors")
    monkeypatch.setattr(sys, "stdout", None)
    assert main(["inspect", str(f), "--out", str(tmp_path / "figs")]) == 2
    assert main(["tour", "--out", str(tmp_path / "t"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("error: standard output is closed") == 2
    assert not (tmp_path / "figs").exists() and not (tmp_path / "t").exists()


def test_the_tour_shows_its_folder_escaped_as_inspect_does(tmp_path):
    # a folder name holding a newline was printed raw ("writing to a", then a line of
    # its own "b/"), where inspect --out escapes it (distinct_name)
    from patchkit.tour import run_tour

    lines: list[str] = []
    out = tmp_path / "a\nb"
    run_tour(out, device="cpu", echo=lines.append)
    assert all("\n" not in line for line in lines), lines
    shown = distinct_name_of(out)
    assert "a\\nb" in shown and lines[0].endswith(f"writing to {shown}/")
    assert lines[-1] == f"wrote {distinct_name_of(out / 'index.html')} and 6 figures"
    assert (out / "index.html").is_file()


def distinct_name_of(path) -> str:
    from patchkit.units import distinct_name

    return distinct_name(str(path))


def _graded_patch_file(path: Path) -> Path:
    """A patch file of a dense patch (position 0) and five sparse ones of 64 elements
    each (positions 1-5) writing 1, 5, 2, 4 and 3 elements: densest is patch 2, then 4,
    5, 3 and 1."""
    import torch

    from patchkit import CheckpointWeightPatch, save_patches

    patches = [CheckpointWeightPatch("dense.w", (4, 8), torch.float32, torch.arange(32.0))]
    for i, n in enumerate([1, 5, 2, 4, 3], 1):
        patches.append(CheckpointWeightPatch(f"s{i}.w", (8, 8), torch.bfloat16,
                                             values=torch.ones(n), indices=torch.arange(n)))
    save_patches(path, patches)
    return path


def test_inspect_out_page_lists_the_sparse_patches_densest_first_with_their_figures(
        tmp_path, capsys):
    # (the page of a file of hundreds of sparse patches: a table of them, densest first,
    # each linking to its figure, so that the interesting ones can be found; each figure
    # says whose it is and how dense; images load as they are scrolled to)
    from patchkit.__main__ import main

    f = _graded_patch_file(tmp_path / "p.safetensors")
    assert main(["inspect", str(f), "--out", str(tmp_path / "figs")]) == 0
    capsys.readouterr()
    page = (tmp_path / "figs" / "index.html").read_text()
    table = page.split('<table class="by-density">')[1].split("</table>")[0]
    rows = re.findall(r"<tr><td>(\d+)</td><td>([^<]*)</td><td>([^<]*)</td>"
                      r"<td>(\d+)</td><td>([^<]*)</td><td>(.*?)</td></tr>", table)
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [
        ("2", "s2.w", "7.81%", "5"), ("4", "s4.w", "6.25%", "4"), ("5", "s5.w", "4.69%", "3"),
        ("3", "s3.w", "3.12%", "2"), ("1", "s1.w", "1.56%", "1")]
    for position, name, *_, link in rows:
        stem = f"density_{position}_{name}"
        assert link == f'<a href="#{stem}">{stem}.png</a>'
        assert f'<figure id="{stem}"><img src="{stem}.png"' in page
    assert page.count('loading="lazy"') == page.count("<img") == 7
    assert "<figcaption>density_2_s2.w.png: patch 2, s2.w, 7.81% written</figcaption>" in page


def test_inspect_out_max_density_figures_draws_the_densest_and_says_what_it_left_out(
        tmp_path, capsys):
    # (drawing a density figure takes a fifth of a second or so: a file of hundreds of
    # sparse patches takes a minute; --max-density-figures N draws the N densest, in the
    # file's order, and the page says which were left out)
    from patchkit.__main__ import main

    f = _graded_patch_file(tmp_path / "p.safetensors")
    figs = tmp_path / "figs"
    assert main(["inspect", str(f), "--out", str(figs), "--max-density-figures", "2"]) == 0
    out = capsys.readouterr().out
    assert sorted(os.listdir(figs)) == ["chunks_dense.png", "chunks_sparse.png",
                                        "density_2_s2.w.png", "density_4_s4.w.png",
                                        "index.html"]
    assert ("drawing the density figures of the 2 densest of 5 sparse patches "
            "(--max-density-figures 2); index.html lists the 3 others") in out
    assert [line.split(" wrote ")[0] for line in out.splitlines() if " wrote " in line] == [
        "[1/4]", "[2/4]", "[3/4]", "[4/4]"]
    page = (figs / "index.html").read_text()
    assert page.count("<img") == 4
    assert ("density figures of the 2 densest of 5 sparse patches "
            "(--max-density-figures 2): 3 not drawn") in page
    table = page.split('<table class="by-density">')[1].split("</table>")[0]
    assert [link for *_, link in re.findall(r"<tr>(<td>.*?</td>)*<td>(.*?)</td></tr>",
                                            table)] == [
        '<a href="#density_2_s2.w">density_2_s2.w.png</a>',
        '<a href="#density_4_s4.w">density_4_s4.w.png</a>',
        "not drawn", "not drawn", "not drawn"]
    # none at all: the chunk plans alone; more than there are: every one
    assert main(["inspect", str(f), "--out", str(tmp_path / "none"),
                 "--max-density-figures", "0"]) == 0
    assert ("drawing no density figures of the 5 sparse patches (--max-density-figures 0); "
            "index.html lists them all\n") in capsys.readouterr().out
    assert ("<p>no density figures of the 5 sparse patches (--max-density-figures 0): 5 not "
            "drawn</p>") in (tmp_path / "none" / "index.html").read_text()
    assert sorted(os.listdir(tmp_path / "none")) == ["chunks_dense.png", "chunks_sparse.png",
                                                     "index.html"]
    assert main(["inspect", str(f), "--out", str(tmp_path / "all"),
                 "--max-density-figures", "5"]) == 0
    out = capsys.readouterr().out
    assert "drawing the density figures" not in out and "[7/7]" in out
    assert "not drawn" not in (tmp_path / "all" / "index.html").read_text()
    # one left out, one figure written: said in the singular
    assert main(["inspect", str(f), "--out", str(tmp_path / "four"),
                 "--max-density-figures", "4"]) == 0
    assert "index.html lists the other one\n" in capsys.readouterr().out
    assert main(["inspect", str(f), "--out", str(tmp_path / "one-drawn"),
                 "--max-density-figures", "1"]) == 0
    assert ("drawing the density figure of the densest of 5 sparse patches "
            "(--max-density-figures 1); index.html lists the 4 others\n") in (
        capsys.readouterr().out)
    import torch

    from patchkit import CheckpointWeightPatch, save_patches

    dense = tmp_path / "dense.safetensors"
    save_patches(dense, [CheckpointWeightPatch("w", (2,), torch.float32, torch.ones(2))])
    assert main(["inspect", str(dense), "--out", str(tmp_path / "one")]) == 0
    assert capsys.readouterr().out.rstrip().endswith(
        f"wrote 1 figure and index.html to {tmp_path / 'one'}")


def test_inspect_out_of_a_file_of_no_patches_writes_its_page_and_says_0_figures(tmp_path,
                                                                                 capsys):
    # (mutation testing: the plural kept for 0 only where len(figures) > 1, "wrote 0
    # figure", passed every test: no test wrote the page of an empty file)
    from patchkit import save_patches
    from patchkit.__main__ import main

    f = tmp_path / "empty.safetensors"
    save_patches(f, [])
    for limit in ([], ["--max-density-figures", "0"]):
        out = tmp_path / f"figs{len(limit)}"
        assert main(["inspect", str(f), "--out", str(out), *limit]) == 0
        printed = capsys.readouterr().out
        assert printed.rstrip().endswith(f"wrote 0 figures and index.html to {out}")
        assert "drawing the density figures" not in printed
        assert os.listdir(out) == ["index.html"]
        page = (out / "index.html").read_text()
        assert "<table" not in page and "<figure" not in page and "<h2>" not in page


def _entry(position: int, name: str, shape: tuple[int, ...], nnz: int, sparse: bool = True):
    import torch

    from patchkit.io import PatchFileEntry

    return PatchFileEntry(position, name, shape, torch.float32, sparse, nnz, torch.float32,
                          torch.int64 if sparse else None)


def test_density_figures_of_equal_density_go_in_the_files_order_and_one_of_no_elements_last():
    # (mutation testing: ties broken backwards, or a patch of no elements, whose density
    # is None, sorted first, passed every test: the graded file has neither)
    from patchkit.__main__ import _figures_html, _inspect_figures

    entries = [_entry(0, "none", (0, 4), 0), _entry(1, "zero", (8,), 0),
               _entry(2, "a", (8,), 2), _entry(3, "b", (16,), 4), _entry(4, "c", (8,), 2)]
    assert [what for _, what in _inspect_figures(entries, 2)] == ["sparse", 2, 3]
    assert [what for _, what in _inspect_figures(entries, 4)] == ["sparse", 1, 2, 3, 4]
    page = _figures_html(entries, _inspect_figures(entries, 4), 4)
    assert re.findall(r"<tr><td>(\d+)</td>", page) == ["2", "3", "4", "1", "0"]
    assert "<tr><td>0</td><td>none</td><td>-</td><td>0</td><td>(0, 4)</td><td>not drawn" in page


def test_the_page_shows_each_name_escaped_for_html_and_told_apart_in_table_and_caption():
    # (mutation testing: the table's or the caption's name written without distinct_name,
    # a newline raw, passed every test)
    from patchkit.__main__ import _figures_html, _inspect_figures

    tag, lines = '<img src=x onerror="alert(1)">&amp;', "a\nb"
    entries = [_entry(0, tag, (8,), 2), _entry(1, lines, (8,), 1)]
    page = _figures_html(entries, _inspect_figures(entries))
    assert "<img src=x" not in page and "a\nb" not in page
    shown = html.escape(tag)
    assert f"<td>0</td><td>{shown}</td><td>25%</td>" in page
    assert f": patch 0, {shown}, 25% written</figcaption>" in page
    escaped = html.escape(repr(lines))  # (quoted, the newline as \\n)
    assert f"<td>1</td><td>{escaped}</td><td>12.5%</td>" in page
    assert f": patch 1, {escaped}, 12.5% written</figcaption>" in page


def test_the_page_of_a_file_without_sparse_patches_has_no_table_and_one_with_heads_its_figures():
    # (mutation testing: the "sparse patches" heading on a page of dense patches only, and
    # no "figures" heading between the table and the figures, passed every test)
    from patchkit.__main__ import _figures_html, _inspect_figures

    dense = [_entry(0, "w", (2,), 2, sparse=False)]
    page = _figures_html(dense, _inspect_figures(dense, 0), 0)
    assert "<h2>" not in page and "<table" not in page and page.count("<figure ") == 1
    both = [*dense, _entry(1, "s", (8,), 1)]
    page = _figures_html(both, _inspect_figures(both))
    assert page.index("</table>") < page.index("<h2>figures</h2>") < page.index("<figure ")


@pytest.mark.parametrize(("text", "count"), [("0", 0), ("+2", 2), (" 3 ", 3), ("007", 7),
                                             ("1_000", 1000)])
def test_inspect_max_density_figures_takes_a_whole_number_as_int_does(text, count):
    # (mutation testing: a "+2" refused passed every test)
    from patchkit.__main__ import _figure_count

    assert _figure_count(text) == count


@pytest.mark.parametrize("value", ["-1", "two", "1.5", "1__0", "_1", "1_"])
def test_inspect_max_density_figures_must_be_a_count(value, tmp_path, capsys):
    from patchkit.__main__ import main

    f = _graded_patch_file(tmp_path / "p.safetensors")
    with pytest.raises(SystemExit) as info:
        main(["inspect", str(f), "--out", str(tmp_path / "figs"), "--max-density-figures",
              value])
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"--max-density-figures: {value!r} is not a count" in captured.err
    assert not (tmp_path / "figs").exists()


@pytest.mark.parametrize("count", ["3", "0"])
def test_inspect_max_density_figures_without_out_is_a_usage_error(count, tmp_path, capsys):
    # (it bounds the figures --out draws: alone it would do nothing, silently; mutation
    # testing: 0, which is falsy, let through without --out passed every test)
    from patchkit.__main__ import main

    f = _graded_patch_file(tmp_path / "p.safetensors")
    with pytest.raises(SystemExit) as info:
        main(["inspect", str(f), "--max-density-figures", count])
    assert info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "--max-density-figures needs --out" in captured.err
