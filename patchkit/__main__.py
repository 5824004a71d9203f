"""Command line: ``python -m patchkit {tour,demo,inspect} ...`` (or ``patchkit ...``).

``--out`` may name an existing folder: the files of the same names as the command's
(``index.html`` and its figures) are replaced, other files are left as they are, and
the command says that it writes into an existing folder.

Exit status: 0 when the command did what it says (every check of ``tour``/``demo`` held);
1 when a check of ``tour``/``demo`` failed, when the output's reader went away (a
closed pipe, as in ``patchkit tour | head -1``: the command stops quietly; an output
short enough to be in the pipe before the reader left ends with 0), or
when the output could not be written once the command ran (stdout or ``--out`` on a
full disk, say: ``error: ...`` on stderr, for ``--out`` naming the files written before
it stopped), or when the system could not read a patch file that is not at fault (no
memory to map or read it, an I/O error: ``error: ...``);
2 for bad input, found before anything runs or is written: an unreadable patch file,
or one :func:`~patchkit.load_patches` would refuse (``inspect`` reads and checks each
sparse patch first, unless ``--header-only`` without ``--out``), an unusable or empty
``--device`` or ``--out`` (a file, a folder that cannot be written or made, or one that
holds a folder where ``index.html`` or a figure goes), a closed stdout (``>&-``), a bad option,
matplotlib missing for a command that draws (``tour``, ``inspect --out``), with
``error: ...`` on stderr;
130 when interrupted (Ctrl-C): ``interrupted`` on stderr, the files written so far
left in ``--out`` (a Ctrl-C in the second or so before the command starts, while
Python imports torch, shows Python's own traceback instead, with 130 all the same).
"""

from __future__ import annotations

import argparse
import contextlib
import decimal
import html
import io
import os
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .units import _UNITS

if TYPE_CHECKING:
    import torch

    from .io import PatchFileEntry

__all__ = ["main"]


def _error(e: BaseException) -> int:
    print(f"error: {_said(e)}", file=sys.stderr)
    return 2


def _said(e: BaseException) -> str:
    """What an error line says of ``e``: its text, without the ``[Errno 20] `` an
    ``OSError`` puts before it (the reason is in words after it: "'out' is a file, not
    a folder", "No space left on device")."""
    text = str(e)
    return re.sub(r"^\[Errno -?[0-9]+\] ", "", text) if isinstance(e, OSError) else text


def _device(device: str | None) -> torch.device:
    """The demo's and tour's device: ``device`` (``None`` when ``--device`` was not given:
    cuda when available, else cpu), checked: an empty ``--device ''`` is refused like
    any string that is no torch device, not taken for the default."""
    import torch

    from .io import _checked_device

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return _checked_device(device)


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo
    from .errors import PatchError

    try:
        device = _device(args.device)
    except PatchError as e:
        return _error(e)
    return 0 if run_demo(device=device) else 1


def _figures() -> None:
    """Import :mod:`patchkit.plot`: ``ImportError`` naming the extra where matplotlib is
    missing (checked before a command that draws runs)."""
    from . import plot  # noqa: F401


def _can_make(out: str, what: str = "the tour") -> None:
    """Make the folder ``out`` (as the tour, or ``inspect --out``, will) and remove what it
    made: the ``OSError`` of one the cheap checks pass but that cannot be made
    (``/proc/x`` as root, a dangling link), before anything runs; a folder that did not
    exist is still new to the command."""
    from .tour import _out_folder

    # The folders mkdir will make, each where the system finds it once made (realpath):
    # ``new/../x`` makes ``new`` and ``x`` beside it, ``new/../kept`` only ``new`` (a
    # ``kept`` that exists is not the command's), and a ``..`` after a link goes up from
    # where the link points.
    path = Path.cwd() / out
    missing: list[str] = []
    for p in (*reversed(path.parents), path):  # (the outermost first, as mkdir makes them)
        real = os.path.realpath(p)
        if not os.path.exists(real) and real not in missing:
            missing.append(real)
    try:
        _out_folder(out, what)
    finally:
        for p in reversed(missing):  # (the deepest first; where make failed, what it made)
            with contextlib.suppress(OSError):
                os.rmdir(p)


def _cmd_tour(args: argparse.Namespace) -> int:
    from .errors import PatchError
    from .tour import OUTPUTS, _check_out, run_tour

    try:
        _figures()
        device = _device(args.device)
        _check_out(args.out, "the tour", OUTPUTS)
        _can_make(args.out)
    except (PatchError, OSError, ImportError) as e:
        return _error(e)
    # (a write that fails from here on is an OSError: exit 1, see main)
    return 0 if run_tour(args.out, device=device).ok else 1


# B and the units format_bytes writes, KiB to TiB, by power of 1024 (lower case)
_BINARY_UNITS = {"b": 0} | {u.lower(): k for k, u in enumerate(_UNITS[:4], 1)}


def _byte_count(text: str) -> int:
    """``--max-chunk-bytes``: a whole number of bytes (``536870912``), or a number and a
    binary unit, as the summary writes sizes (``512MiB``, ``"512 MiB"``, ``1.5GiB``,
    any case), that comes to a whole number of bytes. Anything else is argparse's usage
    error (exit 2) naming what was given: ``1.5`` bytes, ``1e3``, a decimal unit such as
    ``KB`` (1000 or 1024?). Whether the count is positive is checked later, with the
    option's own message."""
    number = r"[+-]?[0-9](?:_?[0-9])*(?:\.[0-9](?:_?[0-9])*)?"  # (1_024 as int() takes)
    found = re.fullmatch(rf"\s*({number})\s*([A-Za-z]*)\s*", text)
    unit = None if found is None else _BINARY_UNITS.get(found.group(2).lower() or "b")
    if found is not None and unit is not None:
        n = decimal.Decimal(found.group(1)) * 1024**unit
        if n == n.to_integral_value():
            return int(n)
    raise argparse.ArgumentTypeError(
        f"{text!r} is not a number of bytes: write a whole number (536870912) or one with "
        "a binary unit (512MiB, 1.5GiB; B, KiB, MiB, GiB, TiB)")


def _figure_count(text: str) -> int:
    """``--max-density-figures``: a whole number, 0 or more (else argparse's usage
    error, exit 2, naming what was given)."""
    if re.fullmatch(r"\s*\+?[0-9](_?[0-9])*\s*", text):  # (as int() reads one: 1_000)
        return int(text)
    raise argparse.ArgumentTypeError(f"{text!r} is not a count of figures: write a whole "
                                     "number, 0 or more")


def _cmd_inspect(args: argparse.Namespace) -> int:
    from .errors import PatchError
    from .io import _pinned
    from .patch import check_max_chunk_bytes

    try:
        check_max_chunk_bytes(args.max_chunk_bytes)
    except PatchError:  # (said here by the option's name, not the parameter's)
        print(f"error: --max-chunk-bytes must be a positive number of bytes, got "
              f"{args.max_chunk_bytes}", file=sys.stderr)
        return 2

    # (the summary and the figures read the file several times: all of one file, even
    # where another replaces it meanwhile)
    with _pinned(args.file):
        return _inspect(args)


def _inspect(args: argparse.Namespace) -> int:
    from .errors import PatchError
    from .io import print_patch_file_summary, read_patch_index

    figures: list[tuple[str, str | int]] = []
    entries = None
    if args.out is not None:
        # --out is checked before the summary is printed; its figures' names need the
        # file's header (a bad file: the summary says so, and nothing is written)
        from .tour import _check_out

        try:
            _figures()
        except ImportError as e:
            return _error(e)
        with contextlib.suppress(PatchError, ValueError, TypeError, ImportError):
            entries = read_patch_index(args.file)
        figures = _inspect_figures(entries or [], args.max_density_figures)
        try:
            _check_out(args.out, "the figures",
                       [*(f"{stem}.png" for stem, _ in figures), "index.html"])
            _can_make(args.out, "the figures")
        except (PatchError, OSError) as e:
            return _error(e)
    # (--out reads every sparse patch for its figure: checked first, before anything is
    # printed, so a file load_patches would refuse is bad input with it too)
    check = not args.header_only or args.out is not None
    code = print_patch_file_summary(args.file, max_chunk_bytes=args.max_chunk_bytes,
                                    check=check)
    if code or args.out is None:
        return code
    try:
        return _write_inspect_figures(args.file, args.out, args.max_chunk_bytes,
                                      entries or [], figures, check, args.max_density_figures)
    except PatchError as e:
        return _error(e)


def _file_stem(name: str, limit: int = 80) -> str:
    """A patch name as part of a file name: runs of anything but letters, digits, ``.``,
    ``_`` and ``-`` as one ``_`` (no ``/``: a name cannot reach outside the folder), cut
    to ``limit`` characters."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)[:limit] or "_"


def _densest_first(e: PatchFileEntry) -> tuple[float, int]:
    """Sort key of sparse patches, densest first, ties (and no elements, last) in the
    file's order."""
    return (-(e.density if e.density is not None else -1.0), e.position)


def _inspect_figures(entries: Sequence,
                     limit: int | None = None) -> list[tuple[str, str | int]]:
    """The figures ``inspect --out`` draws for a file of ``entries`` (its header's
    :class:`~patchkit.io.PatchFileEntry` list), as ``(file stem, what)``: the chunk
    plan's (``chunks``; a file of dense and sparse patches is two loads: ``chunks_dense``
    and ``chunks_sparse``, each numbering its own patches from 0; ``what`` is the kind),
    then where each sparse patch writes (``density_<position>_<name>``; ``what`` is the
    position), in the file's order; with ``limit`` (``--max-density-figures``), only the
    ``limit`` densest sparse patches' (:func:`_densest_first`)."""
    kinds = [k for k in ("dense", "sparse") if any(e.sparse == (k == "sparse") for e in entries)]
    digits = len(str(max(len(entries) - 1, 0)))
    figures: list[tuple[str, str | int]] = [
        (f"chunks_{k}" if len(kinds) > 1 else "chunks", k) for k in kinds]
    sparse = [e for e in entries if e.sparse]
    if limit is not None and limit < len(sparse):
        chosen = {e.position for e in sorted(sparse, key=_densest_first)[:limit]}
        sparse = [e for e in sparse if e.position in chosen]
    figures += [(f"density_{e.position:0{digits}d}_{_file_stem(e.name)}", e.position)
                for e in sparse]
    return figures


def _write_inspect_figures(path: str, out: str, max_chunk_bytes: int, entries: Sequence,
                           figures: list[tuple[str, str | int]], checked: bool,
                           limit: int | None = None) -> int:
    """``inspect --out``: ``figures`` (see :func:`_inspect_figures`; ``entries``, the
    file's header) with a line per figure as it is written, then ``index.html``: the
    summary (``checked``: as printed after a check) and the figures on one page. Reads
    the data of the sparse patches drawn only (``limit``: ``--max-density-figures``,
    which :func:`_inspect_figures` applied), one patch at a time (a patch is dropped once its
    figure is written: the memory of the largest, not of the file's), and the plans need
    the file's header alone. A write that fails raises its ``OSError``, saying which
    files were written before it."""
    from .io import _escaped, _print_summary, _read_each, _stand_in, _validated
    from .plot import plot_chunks, plot_density
    from .tour import _out_folder, _save_figure, _stopped, _write_page
    from .units import distinct_name as _shown

    existed = os.path.isdir(out)
    folder = _out_folder(out, "the figures")
    groups = {kind: [_stand_in(e) for e in entries if e.sparse == (kind == "sparse")]
              for kind in ("dense", "sparse")}
    print()
    if existed:
        print(f"writing into the existing folder {_shown(str(folder))} (its index.html and "
              "figures of these names are replaced, other files are left)")
    drawn = {what for _, what in figures if not isinstance(what, str)}
    n_sparse = sum(e.sparse for e in entries)
    if len(drawn) < n_sparse:
        left = n_sparse - len(drawn)
        print(f"drawing {_densest_text(len(drawn), n_sparse)} (--max-density-figures "
              f"{limit}); index.html lists "
              + ("them all" if not drawn else "the other one" if left == 1
                 else f"the {left} others"))
    done: list[str] = []
    # (the sparse patches drawn, in the file's order, which is the density figures' order)
    with contextlib.closing(_read_each(path, "cpu", lambda e: e.position in drawn)) as sparse:
        for k, (stem, what) in enumerate(figures):
            target = folder / f"{stem}.png"
            if isinstance(what, str):
                fig = plot_chunks(groups[what], max_chunk_bytes)
            else:
                position, patch = next(sparse)
                if position != what:  # (the file is pinned: it cannot change meanwhile)
                    raise RuntimeError(f"read patch {position} of {path!r} for patch {what}")
                _validated(path, [patch], [position])
                fig = plot_density(patch)
                del patch  # (the figure keeps its pixels, not the patch)
            try:
                _save_figure(fig, target, dpi=110, bbox_inches="tight")
            except OSError as e:
                raise _stopped(e, done, len(figures) + 1, folder) from e
            done.append(target.name)
            print(f"[{k + 1}/{len(figures)}] wrote {_shown(str(target))}", flush=True)
    summary = io.StringIO()
    _print_summary(path, max_chunk_bytes, summary, False, checked)
    page = _figures_html(entries, figures, limit)
    # (encoded first: a name that is no text, from a file name that is not UTF-8, is
    # escaped; the old page is replaced only by a whole new one)
    data = _INSPECT_PAGE.format(
        title=html.escape(_escaped(os.path.basename(path))),
        summary=html.escape(summary.getvalue()), figures=page,
    ).encode("utf-8", "backslashreplace")
    try:
        _write_page(folder / "index.html", data)
    except OSError as e:
        raise _stopped(e, done, len(figures) + 1, folder) from e
    print(f"wrote {len(figures)} figure{'s' if len(figures) != 1 else ''} and index.html to "
          f"{_shown(str(folder))}")
    return 0


def _densest_text(drawn: int, sparse: int) -> str:
    """Which density figures ``inspect --out --max-density-figures`` draws: ``"the
    density figures of the 2 densest of 5 sparse patches"``, ``"the density figure of
    the densest of 5 sparse patches"``, ``"no density figures of the 5 sparse
    patches"``."""
    patches = f"{sparse} sparse patch{'' if sparse == 1 else 'es'}"
    if drawn == 0:
        return f"no density figures of the {patches}"
    if drawn == 1:
        return f"the density figure of the densest of {patches}"
    return f"the density figures of the {drawn} densest of {patches}"


def _figures_html(entries: Sequence, figures: list[tuple[str, str | int]],
                  limit: int | None = None) -> str:
    """The page's part below the summary: a table of the sparse patches, densest first
    (ties in the file's order), each linking to its density figure or saying it was not
    drawn (``limit``: ``--max-density-figures``, said above the table), then the figures,
    each captioned with its patch and density (images load as they are scrolled to: a
    page may hold hundreds)."""
    from .io import _percent, _shape_text
    from .units import distinct_name

    drawn = {what: stem for stem, what in figures if not isinstance(what, str)}
    by_position = {e.position: e for e in entries}
    sparse = sorted((e for e in entries if e.sparse), key=_densest_first)
    parts = ["<h2>sparse patches, densest first</h2>"] if sparse else []
    if len(drawn) < len(sparse):
        parts.append(f"<p>{_densest_text(len(drawn), len(sparse))} "
                     f"(--max-density-figures {limit}): "
                     f"{len(sparse) - len(drawn)} not drawn</p>")
    if sparse:
        rows = []
        for e in sparse:
            stem = drawn.get(e.position)
            link = ("not drawn" if stem is None else
                    f'<a href="#{html.escape(stem)}">{html.escape(stem)}.png</a>')
            rows.append(f"<tr><td>{e.position}</td><td>{html.escape(distinct_name(e.name))}"
                        f"</td><td>{_percent(e.density)}</td><td>{e.nnz}</td>"
                        f"<td>{_shape_text(list(e.shape))}</td><td>{link}</td></tr>")
        parts += ['<table class="by-density"><tr><th>#</th><th>name</th><th>density</th>'
                  "<th>written</th><th>shape</th><th>figure</th></tr>", *rows, "</table>",
                  "<h2>figures</h2>"]
    for stem, what in figures:
        caption = f"{stem}.png"
        if not isinstance(what, str):
            e = by_position[what]
            caption += (f": patch {e.position}, {distinct_name(e.name)}, "
                        f"{_percent(e.density)} written")
        parts.append(f'<figure id="{html.escape(stem)}"><img src="{html.escape(stem)}.png" '
                     f'alt="{html.escape(stem)}" loading="lazy">'
                     f"<figcaption>{html.escape(caption)}</figcaption></figure>")
    return "\n".join(parts)


_INSPECT_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>patch file {title}</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 70rem; margin: 2rem auto; }}
img {{ max-width: 100%; }} pre {{ font-size: 0.8rem; overflow-x: auto; }}
table.by-density {{ border-collapse: collapse; font-size: 0.8rem; }}
table.by-density td, table.by-density th {{ padding: 0 0.6rem; text-align: left; }}
</style></head><body>
<h1>patch file {title}</h1>
<pre>{summary}</pre>
{figures}
</body></html>
"""


def _prog() -> str:
    """``python -m patchkit`` when run so, else ``patchkit`` (the console script)."""
    argv0 = sys.argv[0] if sys.argv and sys.argv[0] else ""
    if os.path.basename(argv0) == "__main__.py" and os.path.basename(
        os.path.dirname(os.path.abspath(argv0))
    ) == "patchkit":
        return "python -m patchkit"
    return "patchkit"


def _version() -> str:
    """``patchkit.__version__``, else the installed distribution's, else ``"unknown"``."""
    import patchkit

    v = getattr(patchkit, "__version__", None)
    if isinstance(v, str) and v:
        return v
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("patchkit")
    except PackageNotFoundError:
        return "unknown"


def _plain(rst: str) -> str:
    """reStructuredText inline literals (double backticks) as plain quotes, and roles
    (``:func:`~patchkit.load_patches```) as the whole name they refer to
    (``patchkit.load_patches()``), for --help."""
    rst = re.sub(r":(?:func|meth):`~?([\w.]+)`", r"\1()", rst)
    rst = re.sub(r":(?:class|data|mod|attr|exc):`~?([\w.]+)`", r"\1", rst)
    return re.sub(r"``(.+?)``", r"'\1'", rst)


def _stdout_to_devnull() -> None:
    """Point stdout at devnull, so that the flush at exit does not fail again on a stdout
    that cannot be written (the recipe of Python's signal docs for a closed pipe)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):  # stdout is no real file (tests)
        pass


def _flush_stdout() -> None:
    """Flush stdout before an error line goes to stderr, so that the line comes after
    what the command printed where both are one file (``> log 2>&1``: stdout is
    buffered, stderr is not); a stdout that cannot be written (it is what failed) is
    pointed at devnull instead."""
    try:
        sys.stdout.flush()
    except OSError:
        _stdout_to_devnull()


@contextlib.contextmanager
def _escaping_output() -> Iterator[None]:
    """Within the block, stdout and stderr write what their encoding cannot hold (a path
    or name on an ASCII or Latin-1 terminal, ``PYTHONIOENCODING=ascii``) as backslash
    escapes, instead of raising ``UnicodeEncodeError`` halfway through a command; as
    they were after it."""
    changed = []
    for stream in (sys.stdout, sys.stderr):
        errors = getattr(stream, "errors", None)
        try:
            stream.reconfigure(errors="backslashreplace")  # type: ignore[union-attr]
        except (AttributeError, ValueError, io.UnsupportedOperation):
            continue  # (not a text stream that can change: written as it is)
        changed.append((stream, errors))
    try:
        yield
    finally:
        for stream, errors in changed:
            with contextlib.suppress(AttributeError, ValueError, io.UnsupportedOperation):
                stream.reconfigure(errors=errors)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m patchkit`` and the ``patchkit`` script; returns the
    exit status (see the module docstring). As with any argparse program, ``--help``,
    ``--version`` and a usage error exit through ``SystemExit`` (status 0, 0 and 2)
    instead of returning; ``--help`` or ``--version`` whose stdout cannot be written
    (a closed pipe, a full disk) exits with 1, as a command does."""
    with _escaping_output():
        try:
            return _main(argv)
        except SystemExit:
            _flush_after_argparse()
            raise


def _flush_after_argparse() -> None:
    """Flush what argparse printed (``--help``, ``--version``) before it exits through
    ``SystemExit``: a reader that went away raises ``SystemExit(1)`` quietly, and a
    stdout that cannot be written (a full disk) says ``error: ...`` and raises
    ``SystemExit(1)``, as a command does, instead of a traceback at the flush that
    follows (status 120)."""
    if sys.stdout is None:  # (``>&-``: argparse printed to stderr)
        return
    try:
        sys.stdout.flush()
    except OSError as e:
        _stdout_to_devnull()
        if not isinstance(e, BrokenPipeError):  # (the reader went away: quietly)
            print(f"error: {_said(e)}", file=sys.stderr)
        raise SystemExit(1) from None


def _main(argv: Sequence[str] | None) -> int:
    parser = argparse.ArgumentParser(
        prog=_prog(), description=_plain(__doc__ or ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser(
        "demo", help="a dense, a sparse and a repeated-name load, shown in the terminal",
        description="Load a tiny tensor-parallel Llama-shaped model densely, sparsely and "
                    "with a repeated name, and print what each load did and whether its "
                    "checks held (exit 0; 1 when a check failed; 2 for a bad --device).",
    )
    demo.add_argument("--device", default=None, help="torch device (default: cuda if available)")
    demo.set_defaults(run=_cmd_demo)

    tour = sub.add_parser(
        "tour", help="dense, sparse and repeated-name loads, written as figures + index.html",
        description="The demo's loads with reports: print what each did and write its "
                    "figures and an index.html into --out (exit 0; 1 when a check failed "
                    "or a file could not be written; 2 for a bad --out or --device, or "
                    "without matplotlib).",
    )
    tour.add_argument(
        "--out", default="patchkit-tour",
        help="folder (default patchkit-tour/), made if missing; in an existing one, "
             "index.html and the tour's figures are replaced, other files are left",
    )
    tour.add_argument("--device", default=None, help="torch device (default: cuda if available)")
    tour.set_defaults(run=_cmd_tour)

    insp = sub.add_parser(
        "inspect", help="summarise a patch file (.safetensors)",
        description="Print one line per patch of a file written by patchkit.save_patches "
                    "(kind, shape, dtype, density, bytes), its metadata and the chunk plan "
                    "a load of it would make (exit 0; 2 when the file is unreadable or "
                    "load_patches would refuse it, for a bad option or --out, or for --out "
                    "without matplotlib; 1 when the system could not read it or an output "
                    "could not be written).",
    )
    insp.add_argument("file", help="a patch file written by patchkit.save_patches")
    insp.add_argument(
        "--max-chunk-bytes", type=_byte_count, default=512 << 20,
        help="budget for the chunk plan: bytes, or a number with a binary unit as the "
             "summary writes sizes (64KiB, '512 MiB', 1.5GiB; B, KiB, MiB, GiB, TiB, any "
             "case) (default 536870912, 512 MiB)",
    )
    insp.add_argument(
        "--out", default=None,
        help="also write figures to this folder: the chunk plan, and where each sparse "
             "patch writes, with an index.html (the summary, the sparse patches densest "
             "first, linked to their figures); made if missing; in an existing one, "
             "files of those names are replaced, other files are left",
    )
    insp.add_argument(
        "--header-only", action="store_true",
        help="read the file's header alone: quicker for a file of large sparse patches, "
             "but their values are not checked (by default every sparse patch, and "
             "every dense patch of an integer dtype its values may not fit, is read and "
             "checked, one at a time, so that a file load_patches would refuse is bad "
             "input, exit 2); with --out they are read for their "
             "figures, and checked first all the same",
    )
    insp.add_argument(
        "--max-density-figures", type=_figure_count, default=None, metavar="N",
        help="with --out: draw the density figures of the N densest sparse patches only "
             "(ties in the file's order; drawing takes a fraction of a second a figure, "
             "about a minute for a few hundred); index.html lists the others as not "
             "drawn (default: every sparse patch's)",
    )
    insp.set_defaults(run=_cmd_inspect)

    args = parser.parse_args(argv)
    if getattr(args, "max_density_figures", None) is not None and args.out is None:
        insp.error("--max-density-figures needs --out (it bounds the figures --out draws)")
    if sys.stdout is None:  # (started with stdout closed, ``>&-``: Python sets it to None)
        print("error: standard output is closed, so what the command prints would be lost: "
              "run it with stdout open, or sent to /dev/null", file=sys.stderr)
        return 2
    try:
        code = args.run(args)
        sys.stdout.flush()  # a closed pipe shows here, not at exit
    except BrokenPipeError:
        # The reader went away (``... | head``): stop quietly.
        _stdout_to_devnull()
        return 1
    except KeyboardInterrupt:
        # Ctrl-C: one line, not a traceback; 128 + SIGINT, as a shell reports it.
        _flush_stdout()
        print("interrupted", file=sys.stderr)
        return 130
    except MemoryError:
        # (a patch file too big to read into this process's memory, say)
        _flush_stdout()
        print("error: out of memory", file=sys.stderr)
        return 1
    except OSError as e:
        # The output could not be written (stdout on a full disk, a figure in --out), or
        # the system could not read a patch file: say so on stderr, not as a traceback.
        _flush_stdout()
        print(f"error: {_said(e)}", file=sys.stderr)
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
