"""The compiled fast paths for the writes a load intercepts on the CPU.

Two loops in ``patchkit/_native.c``, each one pass over the written view; a view of a
quarter million elements or more is split into parts that this thread and up to
``torch.get_num_threads() - 1`` others take in turn: torch's own OpenMP threads where the
file compiles with ``-fopenmp`` (one pool of threads in the process, which matters on a
machine with few cores), else patchkit's own C threads (``PATCHKIT_OPENMP=0`` asks for
those); in a process forked after patchkit was imported, on the calling thread alone:

- :func:`compare_copy`, for a dense ``copy_`` whose regions are saved (a report, or
  ``transactional=True``): the load must know which elements' bits the copy changes,
  their old values, and for a report the ``deltas`` statistics. With torch ops that is
  six passes over the view (compare, count, ``nonzero``, gather, sum of squares, the
  copy); this reads each block of the destination and the source once and writes the
  destination only where it changes. A sample of 4096 positions first says roughly how
  many elements will change: that sizes the buffers of a compact save, or picks the
  whole-view save outright when most elements change. A view under 128 KiB is saved whole
  in one pass, without counting first. On x86 CPUs with AVX2 (float32
  and bfloat16) the loops compare and measure 32 bytes at a time.
- :func:`merge`, the NaN-merge of every sparse write (CONTRACT §4): where the source is
  not NaN the destination takes its bits. Torch ops need a 1-byte mask of the view and a
  ``where`` pass (plus ``nonzero`` and two gathers when the write is saved); this needs
  neither the mask nor the passes, and counts what it wrote and changed.

Both write their saves into buffers from :func:`reusing` when a caller lends some (a
report loop's last report: ``inspect_load(..., reuse=)``), else into fresh memory.

The C file is compiled the first time a load needs it, with the machine's C compiler
(``$CC``, else ``cc``), into a cache folder (``$PATCHKIT_CACHE_DIR``, else
``$XDG_CACHE_HOME/patchkit``, else ``~/.cache/patchkit``), once per version of the file
and CPU (where that folder cannot be written, in the temporary folder's
``patchkit-native-<uid>``: a name Python cannot import, so a script run from the
temporary folder still imports patchkit itself). A folder or build that another user
owns, or that any user may write, is never loaded (it could hold their code): torch ops
then, and :func:`status` says why.
Without a compiler, with ``PATCHKIT_NATIVE=0``, inside :func:`disabled`, or for a
write it does not cover, patchkit uses torch ops: the same bits written, saved and
counted, slower. :func:`status` says which path this process has.

What it covers: CPU tensors of float32, float64, bfloat16 or float16 (for a dense copy
without statistics, any 2-, 4- or 8-byte dtype) whose destination and source can both be
walked as rows of contiguous elements (contiguous views, and slices of rows or columns).
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import functools
import hashlib
import itertools
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

__all__ = [
    "CopyResult", "MergeResult", "PatchEntries", "compare_copy", "disabled", "fresh_empty", "merge",
    "patch_entries", "reusing", "status",
]

_SOURCE = Path(__file__).with_name("_native.c")
_KIND_OF = {torch.float32: "f32", torch.float64: "f64", torch.bfloat16: "bf16",
            torch.float16: "f16"}
_KIND_OF_SIZE = {4: "f32", 8: "f64", 2: "bf16"}  # bitwise work only: any dtype of that size
# (statistics dtype or None, element size) -> the kind of compare_copy's loops, in one look-up
_KIND_FOR = {**{(dt, dt.itemsize): k for dt, k in _KIND_OF.items()},
             **{(None, size): k for size, k in _KIND_OF_SIZE.items()}}
_BITS_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}
_U64 = (1 << 64) - 1  # sums the C side lets wrap, read back as unsigned
# Views of fewer positions run on one thread; bigger ones in parts that this thread and
# the threads take in turn (_native.c: pk_run): one a thread, or two a thread for views
# of at least two _PART a thread. Handing a part over costs microseconds (the threads
# wait for the next job awake for a while), so two threads pay from a quarter million
# elements on; more, smaller parts only cost (about 5 % at 16 M elements: the threads'
# reads interleave). (A/B runs of compare_copy, fp32 and bf16, 128 K to 16 M elements;
# with OpenMP threads, 64 K and 128 K elements were no faster in a whole-model report.)
_PARALLEL_MIN = 1 << 18
_PART = 1 << 20
# Positions looked at before a compact save of a big view, to size its buffers: blocks of
# consecutive positions (each block a cache line or two), spread evenly over the view.
_SAMPLE_BLOCKS, _SAMPLE_BLOCK = 256, 16
_SAMPLE = _SAMPLE_BLOCKS * _SAMPLE_BLOCK
_SAMPLE_MIN = 1 << 16  # smaller views are counted exactly (one cheap pass, in cache)
# Views of fewer bytes are saved whole, in one pass, without counting their changes
# first: a compact save of one would spare at most this much memory, and the count, the
# second buffer and the decision cost more time than the copy (compare_copy of a bf16
# view, 1/7 of it changed, whole against compact: 32 KiB 7.2 against 12.9 us, 64 KiB 9.8
# against 17.5; at 2 % changed 7.2 against 9.3 and 9.8 against 11.1; at 128 KiB a compact
# save of a 2 % change in float32 is as quick). The save never exceeds the bytes written.
_WHOLE_BELOW = 1 << 17


class _Acc(ctypes.Structure):
    _fields_ = [
        ("count", ctypes.c_int64),
        ("saved", ctypes.c_int64),
        ("b2", ctypes.c_double),
        ("sum_abs", ctypes.c_double),
        ("sum_d2", ctypes.c_double),
        ("max_abs", ctypes.c_double),
    ]


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_status: str | None = None
_off = 0  # depth of disabled() blocks


def _cache_dir() -> Path:
    if os.environ.get("PATCHKIT_CACHE_DIR"):
        return Path(os.environ["PATCHKIT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME")
    if not base or not os.path.isabs(base):  # (the XDG spec: a relative one is ignored)
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "patchkit"


def _fallback_dir() -> Path:
    """Where a build goes when the cache folder cannot be written: a folder of this user's
    in the temporary folder. Not ``patchkit``: the temporary folder is often the current
    one (``cd /tmp``), and a folder ``patchkit`` there would be imported as an empty
    namespace package in place of an editable install of patchkit. A hyphen keeps the
    name out of the import system; the user id keeps one user's folder (made with the
    usual 755) from refusing another's builds."""
    uid = os.getuid() if hasattr(os, "getuid") else os.getpid()
    return Path(tempfile.gettempdir()) / f"patchkit-native-{uid}"


# -fno-trapping-math lets the compiler vectorize the branch-free statistics (patchkit never
# reads floating-point exception flags); -fno-tree-loop-distribute-patterns keeps the
# copies inside the vectorized loops instead of turning them into memcpy calls.
_FLAGS = ["-O3", "-fPIC", "-shared", "-pthread", "-fno-math-errno", "-fno-trapping-math",
          "-fno-tree-loop-distribute-patterns"]


def _cpu_id() -> str:
    """What ``-march=native`` depends on: the CPU's feature flags where Linux lists them."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.machine() + platform.processor()


# A build is compiled into a file of its own first (``native-<key>.<random>.partial``),
# then renamed. A process killed while it builds (a worker stopped at start-up) leaves
# that file behind: its compiler goes on without it, and nothing renames the file. A
# later build in the folder removes such files once they are older than any build may
# take (the compiler's timeout, twice).
_PARTIAL = ".partial"
_COMPILE_TIMEOUT = 300


def _remove_stale_partials(folder: Path) -> None:
    """Remove the unfinished builds killed processes left in ``folder`` (see above)."""
    try:
        stale = time.time() - 2 * _COMPILE_TIMEOUT
        for f in folder.glob(f"native-*{_PARTIAL}"):
            with contextlib.suppress(OSError):  # (another build removed it first)
                if f.stat().st_mtime < stale:
                    f.unlink()
    except OSError:  # (a folder that cannot be listed: its files stay)
        pass


def _compile(cc: str, flags: list[str], out: Path) -> str | None:
    """Compile the C file to ``out`` (atomically); the compiler's last error line, or None."""
    _remove_stale_partials(out.parent)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f"{out.stem}.", suffix=_PARTIAL, dir=out.parent)
    except OSError as e:  # a folder this process cannot write
        return str(e)
    os.close(fd)
    try:
        done = subprocess.run(
            [cc, *flags, "-o", tmp, str(_SOURCE)],
            capture_output=True, text=True, timeout=_COMPILE_TIMEOUT, check=False,
        )
        if done.returncode != 0:
            return (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        os.replace(tmp, out)  # atomic: a concurrent build finds a whole file or none
        return None
    except (OSError, subprocess.SubprocessError) as e:
        return str(e)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _untrusted(path: Path) -> str | None:
    """Why a build (or its folder) at ``path`` must not be loaded, or ``None``: a file
    another user owns, or one any user may write, could hold their code (the temporary
    folder is everyone's, and its folder name is easy to guess), which loading it would
    run in this process. Root's files are trusted, as the system's own libraries are."""
    if not hasattr(os, "getuid"):
        return None
    try:
        st = path.stat()
    except OSError as e:
        return str(e)
    if st.st_uid not in (os.getuid(), 0):
        return f"{path} belongs to another user (uid {st.st_uid})"
    if st.st_mode & 0o002:
        return f"any user may write {path}"
    return None


def _writable(folder: Path) -> bool:
    """Whether a file can be made in ``folder`` (made first where missing, for this user
    only): tried, not read from its mode bits, which do not bind root or tell a read-only
    mount."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, suffix=".probe")
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


def _build() -> tuple[ctypes.CDLL | None, str]:
    if os.environ.get("PATCHKIT_NATIVE", "1") == "0":
        return None, "torch ops (PATCHKIT_NATIVE=0)"
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        return None, f"torch ops (no C compiler: {cc!r} not found; set CC)"
    folder = _cache_dir()
    fallback = _fallback_dir()
    source = _SOURCE.read_bytes()
    lib = lib_path = error = None
    # With OpenMP first (see _native.c: the parts of a view then run on torch's threads),
    # tuned for this CPU first (the cache key names the CPU's features, so a home folder
    # shared between machines never loads another CPU's build); then portable.
    openmp = [["-fopenmp"]] if os.environ.get("PATCHKIT_OPENMP", "1") != "0" else []
    for flags in [[*_FLAGS, *omp, *arch] for omp in [*openmp, []]
                  for arch in (["-march=native"], [])]:
        key = hashlib.sha256(
            b"\0".join([source, cc.encode(), " ".join(flags).encode(), _cpu_id().encode()])
        ).hexdigest()[:16]
        candidate = folder / f"native-{key}.so"
        if not candidate.exists() and not _writable(folder):
            # (a read-only home, a path under a file): a build there is read where one
            # exists, else made in the temporary folder
            candidate = fallback / candidate.name
            if not _writable(fallback):
                error = f"no writable folder for the build ({folder}, {fallback})"
                break
        distrust = _untrusted(candidate.parent)
        if distrust is not None:
            error = f"not building or loading in {candidate.parent}: {distrust}"
            break
        if not candidate.exists():
            failed = _compile(cc, flags, candidate)
            if failed is not None:
                error = f"compiling {_SOURCE.name} failed: {failed}"
                continue
        distrust = _untrusted(candidate)
        if distrust is not None:
            error = f"not loading {candidate.name}: {distrust}"
            break
        try:
            lib = ctypes.CDLL(str(candidate))
        except OSError as e:  # e.g. an OpenMP runtime this process cannot load
            error = f"loading {candidate.name} failed: {e}"
            continue
        lib_path = candidate
        break
    if lib is None:
        return None, f"torch ops ({error})"
    for kind in ("f32", "f64", "bf16", "f16"):
        fn = getattr(lib, f"pk_copy_{kind}")
        fn.restype = ctypes.c_int64
        fn.argtypes = [
            ctypes.c_void_p, ctypes.c_void_p,  # dst, src
            ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,  # L, drs, srs
            ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,  # doff, p, p1
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,  # idx, bef, cap
            ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Acc),  # bef_whole, stats, acc
        ]
        sample = getattr(lib, f"pk_sample_{kind}")
        sample.restype = ctypes.c_int64
        sample.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 6  # dst src L drs srs n k b
        diffs = getattr(lib, f"pk_diffs_{kind}")
        diffs.restype = ctypes.c_int64
        diffs.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 5  # dst src L drs srs p p1
        entries = getattr(lib, f"pk_entries_{kind}")
        entries.restype = None
        entries.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, *[ctypes.c_int64] * 5,
                            ctypes.POINTER(ctypes.c_int64)]  # indices isize values nnz ... out
        scatter = getattr(lib, f"pk_scatter_{kind}")
        scatter.restype = None
        scatter.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        # the parts entry points: dst, src, L, drs, srs, doff, parts, bounds, idx, bef, ...
        head = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 5 + [ctypes.c_void_p] * 3
        parts_fn = getattr(lib, f"pk_copy_parts_{kind}")
        parts_fn.restype = ctypes.c_int  # 1: every part finished, *total is set
        parts_fn.argtypes = [*head, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,  # ends, whole,
                             ctypes.POINTER(_Acc), ctypes.c_void_p,  # stats, accs, reached,
                             ctypes.c_int, ctypes.POINTER(_Acc)]  # threads, total
        count_parts = getattr(lib, f"pk_count_parts_{kind}")
        count_parts.restype = None
        count_parts.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,  # src, L, srs
                                ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,  # parts ...
                                ctypes.c_int]  # bounds, counts, threads
        merge_parts = getattr(lib, f"pk_merge_parts_{kind}")
        merge_parts.restype = None
        merge_parts.argtypes = [*head, ctypes.c_void_p,  # n (5 a part)
                                ctypes.POINTER(_Acc), ctypes.c_int]  # stats (or NULL), threads
    # the functions of each kind, looked up once (a load calls them for every write)
    lib.kinds = {
        kind: _Kind(*(getattr(lib, f"pk_{what}_{kind}") for what in _Kind._fields))
        for kind in ("f32", "f64", "bf16", "f16")
    }
    lib.pk_openmp.restype = ctypes.c_int
    threads = "OpenMP threads" if lib.pk_openmp() else "patchkit's threads"
    return lib, f"compiled ({lib_path}; parts on {threads})"


class _Kind(NamedTuple):
    copy: Any
    copy_parts: Any
    diffs: Any
    sample: Any
    scatter: Any
    count_parts: Any
    merge_parts: Any
    entries: Any


_HUGE = 2 << 20
# Buffers smaller than this are neither lent nor taken by reusing(): malloc hands out
# small ones from memory freed a moment ago, already paged in, and looking them up in a
# pool costs more than it saves (a 291-tensor model's report loop was 20 % slower).
_REUSE_MIN = 1 << 16
_LINUX = sys.platform.startswith("linux")
_MADV_HUGEPAGE = 14
_libc = None


_reuse = threading.local()  # .pool: storages that reusing() lends this thread's saves


@contextlib.contextmanager
def reusing(storages: list[torch.UntypedStorage]) -> Iterator[None]:
    """Within the block, on this thread, the compiled paths take their save buffers of 64
    KiB or more from ``storages`` where one fits (at least the bytes a buffer needs, at
    most twice as many; the smallest such), instead of fresh memory. The caller hands
    them over: nothing else may use them. What is not taken is let go when the block
    ends.

    Fresh memory is paid for when first written (the kernel zeroes each page): for a save
    of a full replacement that is about as long as the copy itself. A loop that saves the
    same tensors every step can hand the last step's buffers to the next
    (:func:`patchkit.inspect_load`'s ``reuse=``)."""
    previous = getattr(_reuse, "pool", None), getattr(_reuse, "sizes", None)
    # (a storage listed twice, or through two views, is lent once: two saves in one
    # buffer would overwrite each other)
    distinct = {st.data_ptr(): st for st in storages
                if st.device.type == "cpu" and st.nbytes() >= _REUSE_MIN}
    pool = sorted(distinct.values(), key=lambda st: st.nbytes())
    _reuse.pool, _reuse.sizes = pool, [st.nbytes() for st in pool]
    try:
        yield
    finally:
        _reuse.pool, _reuse.sizes = previous


def _lent(n: int, dtype: torch.dtype) -> torch.Tensor | None:
    """A buffer of ``n`` elements from :func:`reusing`'s storages, or ``None``."""
    pool, sizes = getattr(_reuse, "pool", None), getattr(_reuse, "sizes", None)
    need = n * dtype.itemsize
    if not pool or need < _REUSE_MIN:
        return None
    k = bisect.bisect_left(sizes, need)  # the smallest that fits
    if k == len(sizes) or sizes[k] > 2 * need:
        return None  # none fits, or the smallest that does is too big: keep it for a bigger save
    st = pool.pop(k)
    del sizes[k]
    return torch.empty(0, dtype=dtype).set_(st, 0, (n,), (1,))


def _empty(n: int, dtype: torch.dtype, shape: torch.Size | None = None) -> torch.Tensor:
    """``torch.empty(n, dtype=dtype)`` on the CPU (a buffer :func:`reusing` lends, where
    one fits), contiguous of ``shape`` (of ``n`` elements) where given; a big fresh one
    asks Linux for huge pages first. A fresh buffer is paid for page by page when first
    written: 4 KiB pages cost about 35 ms per 64 MiB on these machines, 2 MiB pages about
    a third of that."""
    small = n * dtype.itemsize < _REUSE_MIN  # never lent, never on huge pages
    if not small and getattr(_reuse, "pool", None):
        lent = _lent(n, dtype)
        if lent is not None:
            return lent if shape is None else lent.view(shape)
    if shape is None:
        out = torch.empty(n, dtype=dtype)
    else:  # sizes as arguments: torch parses them faster than a Size
        out = torch.empty(*shape, dtype=dtype) if len(shape) else torch.empty((), dtype=dtype)
    return out if small else _ask_for_huge_pages(out)


def fresh_empty(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype, device=device)``, for a buffer about to be
    written whole (a staged sparse patch, a mark per element). On the CPU, when big,
    Linux is asked for 2 MiB pages before anything touches it, which makes the first pass
    over it about three times faster on these machines (see :func:`_empty`)."""
    out = torch.empty(shape, dtype=dtype, device=device)
    return _ask_for_huge_pages(out) if out.is_cpu else out


def _ask_for_huge_pages(out: torch.Tensor) -> torch.Tensor:
    """``out`` (fresh, untouched, CPU), after advising Linux to back its whole 2 MiB
    pages with huge pages (when it spans at least two)."""
    global _libc
    nbytes = out.numel() * out.element_size()
    if nbytes < 2 * _HUGE or not _LINUX:
        return out
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        except (OSError, AttributeError):
            _libc = False
    if _libc:
        start = -(-out.data_ptr() // _HUGE) * _HUGE
        end = (out.data_ptr() + nbytes) // _HUGE * _HUGE
        if end > start:
            _libc.madvise(start, end - start, _MADV_HUGEPAGE)  # a hint: failure is harmless
    return out


def _library() -> ctypes.CDLL | None:
    global _lib, _status
    if _status is None:
        with _lock:
            if _status is None:
                try:
                    _lib, _status = _build()
                except OSError as e:  # (reading the C file, say): torch ops, said once
                    _lib, _status = None, f"torch ops (building the fast path failed: {e})"
    return _lib


def status() -> str:
    """Which path this process's dense report saves take: ``"compiled (<path>; parts on
    OpenMP threads)"`` (or ``on patchkit's threads``, see the module docstring) or
    ``"torch ops (<why>)"``. Builds the fast path first if it was not tried yet."""
    _library()
    assert _status is not None
    return _status


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within the block, reports and transactional loads use torch ops only (to compare
    the two paths, as ``benchmarks/bench_inspect.py`` does). Process-wide."""
    global _off
    with _lock:
        _off += 1
    try:
        yield
    finally:
        with _lock:
            _off -= 1


def _threads() -> int:
    """The threads a view's parts may run on: torch's count, but one in a process forked
    after this module was imported (libgomp starts no team in such a child when the
    parent had OpenMP threads, and the C side's own fork handler only exists once the
    library is loaded: one loaded first in the child would wait for that team forever)."""
    return 1 if _forked else torch.get_num_threads()


_forked = False


def _after_fork_in_child() -> None:
    """In a forked child: parts on the calling thread alone (see :func:`_threads`), and a
    fresh ``_lock``. The child has the forking thread only: a lock another thread of the
    parent held at the fork (building the library, which takes seconds, or inside
    :func:`disabled`) is held for good in the child, and its first load (or
    :func:`disabled`) waited for it forever. The build that thread ran is not the
    child's: where it had not finished, the child builds (or finds the built file)
    itself."""
    global _forked, _lock
    _forked = True
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _reset_for_tests() -> None:
    """Forget the build (tests switch ``PATCHKIT_NATIVE`` and build again)."""
    global _lib, _status
    with _lock:
        _lib, _status = None, None


@dataclass
class CopyResult:
    """What :func:`compare_copy` did.

    ``index`` holds the storage element offsets of the changed elements and ``before``
    their old values (1-D, in the view's row-major order); or ``index`` is ``None`` and
    ``before`` is a copy of the whole view as it was. ``changed`` counts elements whose
    bits changed. With statistics: ``squares`` is the sum of squares of the view's finite
    old values, and ``sum_abs``, ``sum_sq_diff`` and ``max_abs`` are over the finite
    ``|new - old|`` of the changed elements (float16 differences taken in float32, the
    others in float64), all accumulated in float64. One exception, for speed: on x86 with
    AVX2 the bfloat16 lanes measure in float32 before float64 takes over (each float32
    lane adds 16 terms), so their numbers can be off by up to 1e-6 relative: a compact
    save's ``squares``, and all four numbers of a whole save (a difference of two
    bfloat16 values is exact in float32 unless their exponents are more than 16 apart,
    then rounded once). Runs whose values float32 cannot square or sum (below about 1e-19
    or from 2^60 on, or not finite) are measured again in float64.
    """

    index: torch.Tensor | None
    before: torch.Tensor
    changed: int
    squares: float | None = None
    sum_abs: float | None = None
    sum_sq_diff: float | None = None
    max_abs: float | None = None


def _rows(dest: torch.Tensor, src: torch.Tensor) -> tuple[int, int, int] | None:
    """``(L, dest row stride, src row stride)`` when both views are rows of ``L``
    contiguous elements (a contiguous view is one row), else ``None``."""
    return _rows_of(tuple(dest.shape), dest.stride(), src.stride())


@functools.lru_cache(maxsize=4096)  # a load meets the same few geometries again and again
def _rows_of(
    shape: tuple[int, ...], dstride: tuple[int, ...], sstride: tuple[int, ...]
) -> tuple[int, int, int] | None:
    """:func:`_rows` of two views of ``shape`` given by their element strides."""
    levels: list[list[int]] = []  # [size, dest stride, src stride], innermost first
    for n, ds, ss in zip(reversed(shape), reversed(dstride), reversed(sstride)):
        if n == 1:
            continue
        if ds == 0:
            return None  # several elements of dest at one address: torch refuses that copy
        outer = levels[-1] if levels else None
        if outer is not None and ds == outer[0] * outer[1] and ss == outer[0] * outer[2]:
            outer[0] *= n  # continues the level below it in both views
        else:
            levels.append([n, ds, ss])
    if not levels:
        return 1, 1, 1
    if len(levels) > 2 or levels[0][1] != 1 or levels[0][2] != 1:
        return None
    length = levels[0][0]
    if len(levels) == 1:
        return length, length, length
    return length, levels[1][1], levels[1][2]


def _prepare(dest: torch.Tensor, src: torch.Tensor):
    """``(library, rows geometry)`` for a write the C loops cover, else ``None``: both
    tensors on the CPU, not empty, walkable as rows, the path built and not disabled."""
    ready = _ready(dest, src)
    return None if ready is None else ready[:2]


def _ready(dest: torch.Tensor, src: torch.Tensor):
    """:func:`_prepare`, and the two tensors' data pointers, which it reads anyway:
    ``(library, rows geometry, dest's pointer, src's pointer)`` or ``None``."""
    n = dest.numel()
    if _off or not dest.is_cpu or not src.is_cpu or n == 0:
        return None
    try:
        dptr, sptr = dest.data_ptr(), src.data_ptr()
    except RuntimeError:  # ("has no storage": a tensor subclass whose values live elsewhere)
        return None
    if not dptr or not sptr:
        return None  # (a tensor subclass whose values live in inner tensors: no memory)
    lib = _lib if _status is not None else _library()
    if lib is None:
        return None
    if dest.is_contiguous() and src.is_contiguous():
        return lib, (n, n, n), dptr, sptr  # one row: what _rows would say, without its work
    geometry = _rows(dest, src)
    return None if geometry is None else (lib, geometry, dptr, sptr)


def _parts(n: int) -> tuple[int, ...]:
    """The bounds of the parts of ``n`` positions that threads share (see
    ``_PARALLEL_MIN``)."""
    return _parts_of(n, _threads(), _PARALLEL_MIN, _PART)


@functools.lru_cache(maxsize=1024)  # a load meets the same few sizes again and again
def _parts_of(n: int, threads: int, parallel_min: int, part: int) -> tuple[int, ...]:
    threads = min(threads, 8)
    if threads <= 1 or n < parallel_min:
        return (0, n)
    k = min(2 * threads, max(threads, n // part))
    return tuple(n * i // k for i in range(k + 1))


def _array(ctype: type, n: int) -> type:
    """The ctypes array type of ``n`` ``ctype``, made once. ctypes keeps the types it
    makes only through weak references, and a type is a reference cycle: each garbage
    collection frees them, and the next load made them again (8 us and 3 KB each, which a
    report's load, run with the collector paused, kept until its end)."""
    t = _ARRAYS.get((ctype, n))
    if t is None:
        t = _ARRAYS[ctype, n] = ctype * n
    return t


_ARRAYS: dict[tuple[type, int], type] = {}  # (a few sizes: parts of a view, entries)


def _int64s(values) -> ctypes.Array:
    return _array(ctypes.c_int64, len(values))(*values)


@functools.lru_cache(maxsize=1024)
def _bounds_array(bounds: tuple[int, ...]) -> ctypes.Array:
    """``bounds`` as a C array, made once per bounds (the C side only reads it)."""
    return _int64s(bounds)


def compare_copy(
    dest: torch.Tensor, src: torch.Tensor, stats_dtype: torch.dtype | None
) -> CopyResult | None:
    """Copy ``src`` into ``dest`` (same shape, dtype, CPU, separate storage) and say what
    changed, or return ``None`` without touching anything when the copy is outside the
    fast path (see the module docstring), or ``src`` has another shape or dtype, and the
    caller should use torch ops.

    ``stats_dtype``: compute the statistics reading the bits as this dtype (``dest``'s
    own, or the runtime tensor's when ``dest`` reinterprets it); ``None``: no statistics.
    Saves the changed elements when that costs less memory than the whole view, else the
    whole view (always for a view under ``_WHOLE_BELOW`` bytes), so the save never exceeds
    the bytes the copy writes.
    """
    if src.dtype != dest.dtype or src.shape != dest.shape:
        # (the C side walks src by dest's shape: past src's end where dest is bigger)
        return None
    return _compare_copy(dest, src, stats_dtype)


def _compare_copy(
    dest: torch.Tensor, src: torch.Tensor, stats_dtype: torch.dtype | None
) -> CopyResult | None:
    """:func:`compare_copy` for a caller that has made sure ``src`` has ``dest``'s shape
    and dtype (the load's own, :mod:`patchkit.intercept`: not asked twice per write)."""
    # (A load makes one call per tensor written, with the caches cold from the copies
    # before it: each tensor made, each ctypes call and argument costs microseconds
    # there, so the common cases below make as few as they can.)
    size = dest.element_size()
    kind = _KIND_FOR.get((stats_dtype, size))
    if kind is None:
        return None
    n = dest.numel()
    want = 0 if stats_dtype is None else 1
    if (n * size < _WHOLE_BELOW and _lib is not None and dest.is_contiguous()
            and src.is_contiguous()):
        # The common case (a small contiguous view, a built path: a layer's shard, saved
        # whole) with _ready's checks written out: a load of many small tensors makes
        # this call for each, and the calls it went through cost about as much as the
        # copy.
        if _off or not n or not dest.is_cpu or not src.is_cpu:
            return None
        try:
            dptr, sptr = dest.data_ptr(), src.data_ptr()
        except RuntimeError:  # (as _ready: a tensor subclass whose values live elsewhere)
            return None
        if not dptr or not sptr:
            return None
        return _whole(_lib.kinds[kind], dest, (n, n, n), (0, n), want, dptr, sptr)
    ready = _ready(dest, src)
    if ready is None:
        return None
    lib, geometry, dptr, sptr = ready
    f = lib.kinds[kind]
    if n * size < _WHOLE_BELOW:  # (one part: far below _PARALLEL_MIN)
        return _whole(f, dest, geometry, (0, n), want, dptr, sptr)
    length, drs, srs = geometry
    threads = _threads()  # (asked once: torch's count is a call)
    bounds = _parts_of(n, threads, _PARALLEL_MIN, _PART)
    share, exact = _changed_share(f, dptr, sptr, length, drs, srs, n)
    if share * (8 + size) >= size:
        # Most elements change (a full replacement): a compact save would cost more than
        # the whole view and be given up; save the whole view straight away.
        return _whole(f, dest, geometry, bounds, want, dptr, sptr)
    doff = dest.storage_offset()
    # (the saved bits go into a buffer of dest's dtype: the C side writes bits, and the
    # result needs no second view of them)
    if exact is not None and len(bounds) == 2:
        # A small view, counted exactly: one call, buffers of just the right size.
        idx, bef, acc = _empty(exact, torch.int64), _empty(exact, dest.dtype), _Acc()
        f.copy(dptr, sptr, length, drs, srs, doff, 0, n, idx.data_ptr(), bef.data_ptr(), exact,
               0, want, acc)
        return _result(idx, bef, acc, want)

    # Compact: each part writes its changed elements' offsets and old bits into its own
    # slice of one pair of buffers, with room for 1.25 times the share found plus four
    # standard errors of the sample (or 4096 entries a part).
    planned = 1.25 * share
    if exact is None:
        planned += 4 * (max(share, 1 / _SAMPLE) * (1 - share) / _SAMPLE) ** 0.5
    if len(bounds) == 2:
        # One part (the formula below for it), on this thread: pk_copy itself, whose
        # numbers are the part's own (copy_parts would add them to zero: the same bits).
        cap = min(max(4096, int(n * planned)), size * n // (8 + size))
        idx, bef, total = _empty(cap, torch.int64), _empty(cap, dest.dtype), _Acc()
        reached = f.copy(dptr, sptr, length, drs, srs, doff, 0, n, idx.data_ptr(),
                         bef.data_ptr(), cap, 0, want, total)
        if reached >= n:
            # (resize_ trims in place: the storage stays, as a slice's would, and no
            # second tensor is made)
            return _result(idx.resize_(total.saved), bef.resize_(total.saved), total, want)
        return _go_on(f, dest, geometry, bounds, want, dptr, sptr, idx, bef, total, [reached])
    nparts = len(bounds) - 1
    caps = [min(max(4096, int((p1 - p0) * planned)), size * (p1 - p0) // (8 + size))
            for p0, p1 in itertools.pairwise(bounds)]
    ends = list(itertools.accumulate(caps))
    idx = _empty(ends[-1], torch.int64)
    bef = _empty(ends[-1], dest.dtype)
    scratch = _scratch(nparts)
    # (part k saves from ends[k - 1], the end of part k - 1's room: the C side sets the
    # parts' numbers up so, and packs the entries together after)
    scratch.ends[:nparts] = ends
    total = scratch.total
    if f.copy_parts(
        dptr, sptr, length, drs, srs, doff, nparts, _bounds_array(bounds), idx.data_ptr(),
        bef.data_ptr(), scratch.ends, 0, want, scratch.accs, scratch.reached, threads, total,
    ):
        # Every part had room (the C side packed the entries and summed the numbers).
        done = _result(idx.resize_(total.saved), bef.resize_(total.saved), total, want)
        _SCRATCH.append(scratch)  # (read: free for the next write)
        return done
    # A part ran out of room: the C side packed what the parts saved at the front. (The
    # scratch goes on with total: not handed back.)
    return _go_on(f, dest, geometry, bounds, want, dptr, sptr, idx, bef, total,
                  list(scratch.reached[:nparts]))


class _Scratch:
    """The ctypes objects of one :func:`compare_copy` over parts: each part's numbers, where
    it stopped, the ends of its room, and the total. A load makes a call per write: these
    are taken from :data:`_SCRATCH` and handed back once read, not made anew (each ctypes
    object costs microseconds with the caches cold). The C side sets the numbers up
    itself, so a reused one needs no clearing."""

    __slots__ = ("accs", "ends", "reached", "total")
    PARTS = 16  # (_parts_of makes at most 16: two a thread, of at most 8)

    def __init__(self, parts: int) -> None:
        self.accs = _array(_Acc, parts)()
        self.reached = _array(ctypes.c_int64, parts)()
        self.ends = _array(ctypes.c_int64, parts)()
        self.total = _Acc()


# Free scratches: a call pops one (or makes one) and appends it when done; list.pop and
# append are atomic, so two threads (or a signal handler's load inside a load) never
# share one.
_SCRATCH: list[_Scratch] = []


def _scratch(nparts: int) -> _Scratch:
    if nparts > _Scratch.PARTS:
        return _Scratch(nparts)  # (handed back too: it has room for any later call)
    try:
        return _SCRATCH.pop()
    except IndexError:
        return _Scratch(_Scratch.PARTS)


def _go_on(f: _Kind, dest, geometry, bounds, want, dptr, sptr, idx, bef, total,
           reached) -> CopyResult:
    """:func:`compare_copy` of a compact save after a part ran out of room: the parts
    stopped at ``reached``, their entries packed at the front of ``idx`` and ``bef``
    (``total.saved`` of them), their numbers in ``total``."""
    length, drs, srs = geometry
    n = dest.numel()
    size = dest.element_size()
    bits = _BITS_OF_SIZE[size]
    doff = dest.storage_offset()
    limit = size * n // (8 + size)  # entries that cost as much memory as the whole view
    parts = list(itertools.pairwise(bounds))
    covered = sum(p - p0 for p, (p0, _) in zip(reached, parts))
    rest = _Acc(saved=total.saved)
    room = len(idx)
    fits = True
    continued = False
    # Parts that ran out of room go on one after another, in the room the packing freed
    # and then in bigger buffers, until the changes are on course to cost more memory
    # than saving the whole view. Each stop either grows the room or gives up.
    for k, (_, p1) in enumerate(parts):
        p = reached[k]
        while p < p1:
            continued = True
            q = f.copy(dptr, sptr, length, drs, srs, doff, p, p1, idx.data_ptr(),
                       bef.data_ptr(), room, 0, want, rest)
            covered += q - p
            p = q
            if p >= p1:
                break
            projected = rest.saved * n / max(covered, 1)
            if room >= limit or projected > limit:
                fits = False
                break
            room = min(limit, max(2 * room, int(projected * 1.25) + 64))
            grown_idx, grown_bef = _empty(room, torch.int64), _empty(room, dest.dtype)
            grown_idx[: rest.saved] = idx[: rest.saved]
            grown_bef.view(bits)[: rest.saved] = bef.view(bits)[: rest.saved]  # (as bits)
            idx, bef = grown_idx, grown_bef
        if not fits:
            break
    if not fits:
        # Too many changes for a compact save: undo what was written, then save the whole
        # view while copying it.
        f.scatter(
            dest.untyped_storage().data_ptr(), idx.data_ptr(), bef.data_ptr(), rest.saved
        )
        del idx, bef
        return _whole(f, dest, geometry, bounds, want, dptr, sptr)
    index = idx[: rest.saved]
    before = bef[: rest.saved]
    if continued and len(parts) > 1:
        # A part went on after the later parts' entries: back to row-major order.
        order = torch.argsort(index)
        index, before = index[order], before[order]
    return _result(index, before, total, want, rest)


def _changed_share(f, dptr, sptr, length, drs, srs, n) -> tuple[float, int | None]:
    """``(share, count)``: the share of the view's elements that the copy will change,
    and their number. Views of fewer than ``_SAMPLE_MIN`` elements are counted exactly
    (``count`` is that number); bigger ones estimate the share from ``_SAMPLE_BLOCKS``
    evenly spaced blocks of ``_SAMPLE_BLOCK`` consecutive positions (``count`` is
    ``None``)."""
    if n < _SAMPLE_MIN:
        count = f.diffs(dptr, sptr, length, drs, srs, 0, n)
        return (count / n if n else 0.0), count
    hits = f.sample(dptr, sptr, length, drs, srs, n, _SAMPLE_BLOCKS, _SAMPLE_BLOCK)
    return hits / _SAMPLE, None


def _whole(f: _Kind, dest, geometry, bounds, want, dptr, sptr) -> CopyResult:
    """Copy while saving the whole view as it was (every element's old bits)."""
    length, drs, srs = geometry
    n = dest.numel()
    whole = _empty(n, dest.dtype, dest.shape)
    doff = dest.storage_offset()
    wptr = whole.data_ptr()
    total = _Acc()
    if len(bounds) == 2:
        f.copy(dptr, sptr, length, drs, srs, doff, 0, n, None, wptr, 0, 1, want, total)
    else:
        nparts = len(bounds) - 1
        f.copy_parts(dptr, sptr, length, drs, srs, doff, nparts, _bounds_array(bounds), None, wptr,
                     None, 1, want, _array(_Acc, nparts)(), _array(ctypes.c_int64, nparts)(),
                     _threads(), total)  # a whole save always finishes: total is set
    return _result(None, whole, total, want)


def _result(index, before, a: _Acc, want, rest: _Acc | None = None) -> CopyResult:
    """The result of one call's numbers ``a``, or (``rest``) of two calls' added up."""
    if rest is None:
        if not want:
            return CopyResult(index, before, a.count)
        return CopyResult(index, before, a.count, a.b2, a.sum_abs, a.sum_d2, a.max_abs)
    accs = (a, rest)
    changed = sum(a.count for a in accs)
    if not want:
        return CopyResult(index, before, changed)
    return CopyResult(
        index, before, changed,
        squares=sum(a.b2 for a in accs),
        sum_abs=sum(a.sum_abs for a in accs),
        sum_sq_diff=sum(a.sum_d2 for a in accs),
        max_abs=max(a.max_abs for a in accs),
    )


@dataclass
class MergeResult:
    """What :func:`merge` did: ``written`` elements took the source's bits, ``changed`` of
    them changed. With ``save``: ``before`` holds the written elements' old values (1-D,
    in the view's row-major order) and ``index`` their storage offsets, or ``None`` when
    the caller knew how many there would be (``known_count``) and can recompute them.
    With ``stats``, the
    numbers of :class:`CopyResult` over the written elements: ``squares`` of their old
    values, the others over those that changed. ``position_sums``: the sums of the
    written elements' row-major positions in the view and of their squares, modulo
    2**64 (compare with :attr:`PatchEntries.position_sums`)."""

    written: int
    changed: int
    index: torch.Tensor | None = None
    before: torch.Tensor | None = None
    squares: float | None = None
    sum_abs: float | None = None
    sum_sq_diff: float | None = None
    max_abs: float | None = None
    position_sums: tuple[int, int] | None = None


def merge(
    dest: torch.Tensor, src: torch.Tensor, *, save: bool, known_count: int | None = None,
    stats: bool = False,
) -> MergeResult | None:
    """The NaN-merge of a sparse load, in one pass: where ``src`` (same shape and
    floating dtype as ``dest``, CPU, separate storage) is not NaN, ``dest`` takes its
    bits. Returns ``None`` without touching anything when the merge is outside the fast
    path (the caller then uses torch ops). ``save``: also keep the written elements' old
    values and their storage offsets, in buffers of exactly their size (a first pass
    counts them); when they number ``known_count`` (the caller can recompute where they
    are, see :func:`patch_entries`), the offsets are not kept. ``stats``: also measure
    what the merge changes, reading the bits as ``dest``'s dtype (see
    :class:`MergeResult`)."""
    kind = _KIND_OF.get(dest.dtype)
    if kind is None or src.dtype != dest.dtype or src.shape != dest.shape:
        return None
    ready = _ready(dest, src)
    if ready is None:
        return None
    lib, (length, drs, srs), dptr, sptr = ready
    f = lib.kinds[kind]
    doff = dest.storage_offset()
    bounds = _parts(dest.numel())
    nparts = len(bounds) - 1
    c_bounds = _bounds_array(bounds)
    threads = _threads()
    idx = bef = None
    bases = [0] * nparts
    if save:
        sizes = _array(ctypes.c_int64, nparts)()
        f.count_parts(sptr, length, srs, nparts, c_bounds, sizes, threads)
        bases = [sum(sizes[:k]) for k in range(nparts)]
        if sum(sizes) != known_count:
            idx = _empty(sum(sizes), torch.int64)
        bef = _empty(sum(sizes), _BITS_OF_SIZE[dest.element_size()])
    # (each part's five numbers, its first the part's start in the saved buffers: one
    # part, most views, starts at 0, and a fresh ctypes array holds zeros)
    counts = (_array(ctypes.c_int64, 5)() if nparts == 1 else
              _array(ctypes.c_int64, 5 * nparts)(*[v for b in bases for v in (b, 0, 0, 0, 0)]))
    accs = _array(_Acc, nparts)() if stats else None
    f.merge_parts(
        dptr, sptr, length, drs, srs, doff, nparts, c_bounds,
        idx.data_ptr() if idx is not None else None,
        bef.data_ptr() if bef is not None else None, counts, accs, threads,
    )
    if nparts == 1 and not stats:  # (a view too small for threads: its numbers, read once)
        return MergeResult(
            written=counts[1], changed=counts[2], index=idx,
            before=None if bef is None else bef.view(dest.dtype),
            position_sums=(counts[3] & _U64, counts[4] & _U64),
        )
    done = [(counts[5 * k + 1], counts[5 * k + 2], accs[k] if stats else None)
            for k in range(nparts)]
    return MergeResult(
        written=sum(w for w, _, _ in done),
        changed=sum(c for _, c, _ in done),
        index=idx,
        before=None if bef is None else bef.view(dest.dtype),
        position_sums=(sum(counts[5 * k + 3] for k in range(nparts)) & _U64,
                       sum(counts[5 * k + 4] for k in range(nparts)) & _U64),
        **({
            "squares": sum(a.b2 for a in accs),
            "sum_abs": sum(a.sum_abs for a in accs),
            "sum_sq_diff": sum(a.sum_d2 for a in accs),
            "max_abs": max(a.max_abs for a in accs),
        } if stats else {}),
    )


@dataclass
class PatchEntries:
    """What :func:`patch_entries` found: ``count`` entries of the patch land in the view;
    ``checksums`` are two sums over their checkpoint indices ``i``: of ``i & 0x7fffffff``
    and of ``(i % 65521) * 40503 % 65521``; ``rows`` is the walk, as in
    :class:`MergeResult`; ``position_sums`` the sums of their row-major positions in the
    view and of those squared, modulo 2**64, as :func:`merge` reports the positions it
    wrote (equal sums: the merge wrote where these entries say)."""

    count: int
    checksums: tuple[int, int]
    rows: tuple[int, int, int]
    position_sums: tuple[int, int] = (0, 0)


def patch_entries(
    indices: torch.Tensor, values: torch.Tensor, start: int, dest: torch.Tensor,
    src: torch.Tensor,
) -> PatchEntries | None:
    """The entries of a sparse patch (``indices``, ``values``: 1-D, contiguous, CPU) that
    a NaN-merge from ``src`` into ``dest`` writes, when ``src`` is a view of the patch's
    staged tensor whose first element is checkpoint element ``start``: those whose value
    is not NaN and whose index lies in the view. ``None`` when the view or the patch is
    outside the compiled path. One pass over the patch, no allocation."""
    kind = _KIND_OF.get(values.dtype)
    if (
        kind is None or indices.dtype not in (torch.int32, torch.int64)
        or indices.device.type != "cpu" or values.device.type != "cpu"
        or indices.dim() != 1 or values.dim() != 1 or not indices.is_contiguous()
        or not values.is_contiguous() or indices.numel() != values.numel()
    ):
        return None
    ready = _prepare(dest, src)
    if ready is None:
        return None
    lib, (length, drs, srs) = ready
    if srs < length:
        return None  # source rows overlap (a broadcast view): one entry, several writes
    out = _array(ctypes.c_int64, 5)()
    lib.kinds[kind].entries(
        indices.data_ptr(), indices.element_size(), values.data_ptr(), indices.numel(),
        start, length, srs, dest.numel() // length, out,
    )
    return PatchEntries(out[0], (out[1], out[2]), (length, drs, srs),
                        (out[3] & _U64, out[4] & _U64))
