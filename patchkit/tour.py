"""``python -m patchkit tour``: the dense, sparse and repeated-name cases, as a report.

Runs the three cases on :class:`~patchkit.toymodels.TinyLlamaRuntime` with two
tensor-parallel ranks, prints a short summary (with progress) and writes to a folder the
figures as PNG files and an ``index.html`` that shows them beside the tables.
"""

from __future__ import annotations

import contextlib
import errno
import html
import io
import os
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .bitwise import bits, same_state
from .build import dense_patches, sparse_patches_from_diff
from .errors import PatchValueError
from .patch import CheckpointWeightPatch
from .toymodels import TinyLlamaConfig, TinyLlamaRuntime, gather_checkpoint, tiny_llama_checkpoint

__all__ = ["TourResult", "run_tour"]

TP = 2
DENSE_BUDGET = 64 << 10


@dataclass
class TourResult:
    """What :func:`run_tour` wrote and whether every bit-exactness check held."""

    out: Path
    figures: list[Path] = field(default_factory=list)
    checks: dict[str, bool] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when every check in :attr:`checks` held (each a bit-exact comparison of
        the ranks gathered back with the checkpoint the load should give); the
        ``tour`` command exits 1 when it is False."""
        return all(self.checks.values())


OUTPUTS = (
    "dense_chunks.png", "dense_placement_rank0.png", "dense_placement_rank1.png",
    "sparse_density.png", "sparse_delta_qkv_rank0.png", "repeated_chunks.png", "index.html",
)
"""The files :func:`run_tour` writes into its folder, in the order it writes them."""


def _check_out(out: str | Path, what: str = "the tour", files: Iterable[str] = ()) -> Path:
    """Check, writing nothing, that the folder ``out`` can take ``what``; return it as a
    Path.

    Raises what :func:`_out_folder` would raise for ``out``, found before anything is
    made: :class:`~patchkit.errors.PatchValueError` (``reason`` ``"empty folder name"``)
    for the empty string, :class:`NotADirectoryError` when ``out``, or a folder above it,
    is a file, :class:`PermissionError` when the folder (or the nearest one above it that
    exists) cannot be written. Where ``out`` exists, each of ``files`` (names in it)
    that exists must be a file that can be written: a folder of that name raises
    :class:`IsADirectoryError`, anything else that is no regular file
    :class:`OSError`, a file that cannot be written :class:`PermissionError`. Each
    message names ``out``, the problem and ``what`` was to be written there. Cheap
    checks only: a write can still fail later (a full disk).
    """
    if isinstance(out, str) and not out:
        raise PatchValueError(
            f"cannot write {what} to '': the folder name (--out) is empty; pass '.' "
            "for the current folder", reason="empty folder name", value=out,
        )
    out = Path(out)
    where = f"cannot write {what} to {str(out)!r}"
    nearest = next((p for p in (out, *out.parents) if p.exists()), None)
    if nearest is None:  # (no folder above it exists: mkdir says why)
        return out
    if not nearest.is_dir():
        raise NotADirectoryError(
            errno.ENOTDIR, f"{where}: {str(nearest)!r} is a file, not a folder")
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise PermissionError(
            errno.EACCES, f"{where}: the folder {str(nearest)!r} cannot be written")
    if nearest != out:
        return out
    for name in files:
        target = out / name
        if target.is_dir():
            raise IsADirectoryError(
                errno.EISDIR, f"{where}: {str(target)!r} is a folder, not a file")
        if target.exists() and not target.is_file():
            raise OSError(f"{where}: {str(target)!r} is not a regular file")
        if target.exists() and not os.access(target, os.W_OK):
            raise PermissionError(
                errno.EACCES, f"{where}: the file {str(target)!r} cannot be replaced")
    return out


def _out_folder(out: str | Path, what: str = "the tour") -> Path:
    """Make the folder ``out`` (and its parents) if needed; return it as a Path.

    Raises the errors of :func:`_check_out` (an empty name, a file in the way, a folder
    that cannot be written), and the ``OSError`` of any other failure to make it, with a
    message naming ``out``, the problem and ``what`` was to be written there.
    """
    out = _check_out(out, what)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        blocker = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
        if blocker is not None:
            raise NotADirectoryError(
                errno.ENOTDIR,
                f"cannot write {what} to {str(out)!r}: {str(blocker)!r} is a file, "
                "not a folder",
            ) from None
        raise type(e)(
            e.errno, f"cannot create the folder {str(out)!r} for {what}: {e.strerror}"
        ) from None
    return out


def _write_page(page: Path, data: bytes) -> None:
    """Write ``data`` to ``page`` through a new file beside it that is then renamed over
    it: a write that fails (a full disk) leaves an earlier page whole, and no temporary
    file. A new page gets the mode ``open()`` gives; a replaced one keeps its own."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    for _ in range(100):
        tmp = page.with_name(f".{page.name}.{os.urandom(6).hex()}.tmp")
        try:
            fd = os.open(tmp, flags, 0o666)  # (the umask applied by the system)
        except FileExistsError:
            continue
        break
    else:
        raise FileExistsError(errno.EEXIST, f"no free temporary name beside {str(page)!r}")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        with contextlib.suppress(FileNotFoundError):
            os.chmod(tmp, stat.S_IMODE(os.stat(page).st_mode))
        os.replace(tmp, page)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _save_figure(fig, path: Path, **kwargs) -> None:
    """``fig.savefig`` as a PNG at ``path`` (``kwargs``: savefig's), written as
    :func:`_write_page` writes a page: a write that fails (a full disk) leaves no part of
    the figure, and an earlier figure of that name whole."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", **kwargs)
    _write_page(path, buf.getvalue())


def _stopped(e: OSError, done: list[str], of: int, folder: Path) -> OSError:
    """``e`` (a write into ``folder`` that failed) with what was written before it: the
    error a command stopped part-way through reports."""
    wrote = f"wrote {len(done)} of {of} files ({', '.join(done)})" if done else \
        f"wrote none of its {of} files"
    page = ("index.html not written (the one there is an earlier run's, as it was)"
            if (folder / "index.html").is_file() else "no index.html")
    message = f"{e}; stopped part-way: {wrote} to {str(folder)!r}, {page}"
    try:
        return type(e)(message)
    except TypeError:  # (a subclass that takes other arguments)
        return OSError(message)


def _sparse_step(ckpt: dict[str, torch.Tensor], seed: int = 1) -> dict[str, torch.Tensor]:
    """A new checkpoint: 2 % of every attention and MLP weight of layer 0 nudged, in bf16."""
    g = torch.Generator().manual_seed(seed)
    new = {k: v.clone() for k, v in ckpt.items()}
    for name, t in new.items():
        if ".layers.0." in name and name.endswith("proj.weight"):
            flat = t.view(-1)
            pos = torch.randperm(flat.numel(), generator=g, device="cpu")[: flat.numel() // 50]
            flat[pos] = (flat[pos].float() * 1.5 + 0.01).to(flat.dtype)
    return new


def _repeated(ckpt: dict[str, torch.Tensor]) -> list[CheckpointWeightPatch]:
    """Two updates of one weight, overlapping on 64 positions, then one of another."""
    name = "model.layers.1.mlp.down_proj.weight"
    shape = tuple(ckpt[name].shape)
    g = torch.Generator().manual_seed(2)
    a = torch.arange(0, 256, device="cpu")
    b = torch.arange(192, 448, device="cpu")
    va = torch.randn(a.numel(), generator=g, device="cpu").to(torch.bfloat16)
    vb = torch.randn(b.numel(), generator=g, device="cpu").to(torch.bfloat16)
    norm = "model.norm.weight"
    return [
        CheckpointWeightPatch(name, shape, torch.bfloat16, va, a),
        CheckpointWeightPatch(name, shape, torch.bfloat16, vb, b),
        CheckpointWeightPatch(norm, tuple(ckpt[norm].shape), torch.bfloat16,
                              torch.ones(4, dtype=torch.bfloat16, device="cpu"),
                              torch.arange(4, device="cpu")),
    ]


def figure_words(fig) -> str:
    """The words a figure shows, one line each: its title, then each axes' title and
    axis labels, in drawing order. What the figure says, without its pixels: two
    drawings of the same data on another machine (other fonts) give the same words."""
    texts = [fig._suptitle] if fig._suptitle is not None else []
    for ax in fig.axes:
        texts += [ax.title, ax._left_title, ax._right_title, ax.xaxis.label, ax.yaxis.label]
    texts += [t for t in fig.texts if t is not fig._suptitle]
    return "\n".join(t.get_text() for t in texts if t is not None and t.get_text())


def run_tour(
    out: str | Path = "patchkit-tour",
    *,
    device: str | torch.device | None = None,
    echo: Callable[[str], None] = print,
) -> TourResult:
    """Run the tour, write ``out/index.html`` and its PNG figures, return what was written.

    ``device`` defaults (``None``) to cuda when available, else cpu. Before anything
    runs, a device this machine cannot use (``"cuda"`` without CUDA, ``"meta"``, a bad
    or empty string) raises :class:`~patchkit.errors.PatchValueError` naming it, and so
    does an empty ``out`` (``""``, which would be the current folder: pass ``"."``); an
    ``out`` that cannot be made a folder (it, or a folder above it, is a file) or cannot
    be written, or that holds a folder (or another file that cannot be replaced) under
    the name of one of :data:`OUTPUTS`, raises an ``OSError`` naming it (see
    :func:`_check_out`); ``out`` is created only after the device passed.

    An existing ``out`` is written into: the files of :data:`OUTPUTS` are replaced,
    other files are left as they are (the first line ``echo``-ed says so). A write that
    fails once the tour runs (a full disk) raises its ``OSError``, with a message that
    says which files were written before it.
    """
    from .io import _checked_device

    dev = _checked_device(("cuda" if torch.cuda.is_available() else "cpu")
                          if device is None else device)
    existed = _check_out(out, "the tour", OUTPUTS).is_dir()
    out = _out_folder(out)

    from . import plot
    from .inspect import inspect_load
    from .units import distinct_name, format_bytes

    result = TourResult(out=out)
    cfg = TinyLlamaConfig()
    ckpt = tiny_llama_checkpoint(cfg, seed=0, dtype=torch.bfloat16)
    ranks = [TinyLlamaRuntime(cfg, tp_rank=r, tp_size=TP, device=dev) for r in range(TP)]
    sections: list[str] = []
    steps = ["dense load", "dense figures", "sparse load", "sparse figures",
             "repeated-name load", "repeated-name figures", "index.html"]
    t0 = time.perf_counter()

    def progress(i: int) -> None:
        echo(f"[{i + 1}/{len(steps)}] {steps[i]} (starting at {time.perf_counter() - t0:.1f} s)")

    def save(fig, stem: str) -> str:
        path = out / f"{stem}.png"
        # The figure's words go into the file (no version or time): a test compares them
        # with the README's copies, which `make readme-figures` takes from here.
        try:
            _save_figure(fig, path, dpi=110, bbox_inches="tight",
                         metadata={"Software": None, "Description": figure_words(fig)})
        except OSError as e:
            raise _stopped(e, [f.name for f in result.figures], len(OUTPUTS), out) from e
        result.figures.append(path)
        return path.name

    # (the folder's name escaped as the inspect command shows it: a newline in it cannot
    # make a line of its own)
    shown = distinct_name(str(out))
    where = (f"writing into the existing folder {shown}/ (its index.html and figures are "
             "replaced, other files are left)") if existed else f"writing to {shown}/"
    echo(f"patchkit tour: tiny Llama, bf16, {TP} tensor-parallel ranks, on {dev.type}; "
         f"{where}")

    # 1. dense --------------------------------------------------------------------------
    progress(0)
    patches = [p._replace(values=p.values.to(dev)) for p in dense_patches(ckpt)]
    reports = [inspect_load(rt, patches, max_chunk_bytes=DENSE_BUDGET) for rt in ranks]
    gathered = gather_checkpoint(ranks)
    result.checks["dense: ranks gathered == checkpoint"] = same_state(gathered, ckpt)
    progress(1)
    figs = [save(reports[0].plot_chunks(), "dense_chunks"),
            save(reports[0].plot_placement(), "dense_placement_rank0"),
            save(reports[1].plot_placement(), "dense_placement_rank1")]
    echo(f"    {len(patches)} patches, {len(reports[0].calls)} load_weights calls per rank "
         f"at max_chunk_bytes={format_bytes(DENSE_BUDGET)}")
    sections.append(_section(
        "1. Dense: the whole checkpoint",
        f"{len(patches)} dense patches go through each rank's own <code>load_weights</code> "
        f"in {len(reports[0].calls)} calls of at most {format_bytes(DENSE_BUDGET)}. The "
        "placement figures show how q, k and v land in the packed <code>qkv_proj</code> "
        "of each rank and how row-parallel weights split by columns.",
        figs, [("chunks (rank 0)", reports[0].chunks.drop(columns=["note"])),
               ("writes (rank 0)", reports[0].writes)]))

    # 2. sparse -------------------------------------------------------------------------
    progress(2)
    new = _sparse_step(ckpt)
    sparse = [p._replace(values=p.values.to(dev), indices=p.indices.to(dev))
              for p in sparse_patches_from_diff(ckpt, new)]
    reports = [inspect_load(rt, sparse) for rt in ranks]
    result.checks["sparse: ranks gathered == new checkpoint"] = same_state(
        gather_checkpoint(ranks), new
    )
    progress(3)
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    figs = [save(plot.plot_density(sparse[0]), "sparse_density"),
            save(reports[0].plot_delta(qkv), "sparse_delta_qkv_rank0")]
    changed = int(sum(r.deltas["changed"].sum() for r in reports))
    echo(f"    {len(sparse)} sparse patches, {sum(p.values.numel() for p in sparse)} changed "
         f"checkpoint elements, {changed} runtime elements changed over both ranks")
    sections.append(_section(
        "2. Sparse: NaN-masked patches from a bit-level diff",
        "Two percent of every projection of layer 0 changed. Each patch carries only the "
        "changed positions; staged as a NaN-filled checkpoint tensor, it changes exactly "
        "those elements in each rank and nothing else.",
        figs, [("patches", reports[0].chunks.drop(columns=["note"])),
               ("deltas (rank 0)", reports[0].deltas)]))

    # 3. repeated names -----------------------------------------------------------------
    progress(4)
    rep = [p._replace(values=p.values.to(dev), indices=p.indices.to(dev))
           for p in _repeated(ckpt)]
    reports = [inspect_load(rt, rep) for rt in ranks]
    name = rep[0].name
    got = gather_checkpoint(ranks)[name].view(-1)
    later_wins = torch.equal(bits(got[192:448]), bits(rep[1].values.cpu())) and torch.equal(
        bits(got[:192]), bits(rep[0].values[:192].cpu())
    )
    result.checks["repeated names: the later patch wins"] = later_wins
    progress(5)
    figs = [save(reports[0].plot_chunks(), "repeated_chunks")]
    sections.append(_section(
        "3. Repeated names: one weight updated twice",
        "Two patches for the same weight never share a call: the second starts a new "
        "<code>load_weights</code> call, so they apply in order and the later one wins "
        "on the 64 positions both touch.",
        figs, [("chunks (rank 0)", reports[0].chunks.drop(columns=["note"])),
               ("calls (rank 0)", reports[0].calls.drop(columns=["seconds"]))]))

    progress(6)
    checks = "".join(
        f"<li>{html.escape(k)}: <b>{'yes' if v else 'NO'}</b></li>"
        for k, v in result.checks.items()
    )
    try:
        _write_page(out / "index.html",
                    _PAGE.format(checks=checks, sections="".join(sections)).encode("utf-8"))
    except OSError as e:
        raise _stopped(e, [f.name for f in result.figures], len(OUTPUTS), out) from e
    for k, v in result.checks.items():
        echo(f"    {k}: {'yes' if v else 'NO'}")
    echo(f"wrote {distinct_name(str(out / 'index.html'))} and {len(result.figures)} figures")
    return result


def _section(title: str, text: str, figures: list[str], tables) -> str:
    figs = "".join(f'<figure><img src="{html.escape(f)}" alt="{html.escape(f)}"></figure>'
                   for f in figures)
    tabs = "".join(
        f"<details><summary>{html.escape(t)}</summary>{df.to_html(float_format='{:.4g}'.format)}"
        "</details>"
        for t, df in tables
    )
    return f"<section><h2>{html.escape(title)}</h2><p>{text}</p>{figs}{tabs}</section>"


_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>patchkit tour</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 70rem; margin: 2rem auto; }}
img {{ max-width: 100%; }} table {{ border-collapse: collapse; font-size: 0.85rem; }}
td, th {{ border: 1px solid #ccc; padding: 0.2rem 0.4rem; }}
</style></head><body>
<h1>patchkit tour</h1>
<p>A tiny Llama-shaped model in bf16, split over two tensor-parallel ranks the way vLLM
lays it out, updated through its own <code>load_weights</code> by
<code>patchkit.load_checkpoint_weight_patches</code>.</p>
<ul>{checks}</ul>
{sections}
</body></html>
"""
