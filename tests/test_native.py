"""The compiled path for dense report saves (patchkit.native): same results as torch ops.

Every test here fails if the C loop saves, counts or measures differently from a
brute-force reference, or if a report made with it differs from one made with torch ops.
The tests that need the compiled path skip only where no C compiler exists; CI machines
have one, so there they all run.
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import patchkit
from patchkit import CheckpointWeightPatch, inspect_load, native
from patchkit.bitwise import bits

needs_compiler = pytest.mark.skipif(
    not native.status().startswith("compiled"), reason=f"no compiled path: {native.status()}"
)

_SPECIALS = [float("nan"), float("inf"), float("-inf"), -0.0, 0.0, 3e38, -3e38, 1e-40]


def _case(dtype, shape, view, frac, pattern, seed, specials):
    """A destination view, a source for it, and the destination's start (a clone)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=g).to(dtype)
    flat = base.view(-1)
    if specials:
        k = min(len(_SPECIALS), flat.numel())
        flat[:k] = torch.tensor(_SPECIALS[:k]).to(dtype)
    dest = base[view]
    src = dest.clone()
    n = src.numel()
    m = round(n * frac)
    if pattern == "random":
        pos = torch.randperm(n, generator=g)[:m]
    else:  # one run of consecutive elements: all changes in one thread's part
        at = int(torch.randint(0, max(1, n - m + 1), (1,), generator=g))
        pos = torch.arange(at, at + m)
    s = src.view(-1)
    s[pos] = (s[pos].float() * 1.5 + 1.0).to(dtype)
    if specials and n > 3:
        s[0] = torch.tensor(0.0).to(dtype)  # -0.0 or NaN at [0] -> +0.0: bits change
        s[2] = torch.tensor(float("nan")).to(dtype)
    return base, dest, src


def _reference(before: torch.Tensor, after: torch.Tensor, dtype: torch.dtype) -> dict:
    b, a = before.reshape(-1), after.reshape(-1)
    changed = bits(b) != bits(a)
    if dtype == torch.float16:
        d = (a.float() - b.float()).abs().double()
    else:
        d = (a.double() - b.double()).abs()
    d = torch.where(torch.isfinite(d), d, 0)[changed]
    bb = b.double()
    bb = torch.where(torch.isfinite(bb), bb, 0)
    return {
        "changed": int(changed.sum()),
        "squares": float(bb.square().sum()),
        "sum_abs": float(d.sum()),
        "sum_sq_diff": float(d.square().sum()),
        "max_abs": float(d.max()) if d.numel() else 0.0,
        "mask": changed,
    }


_VIEWS = {
    "flat": ((4099,), (slice(None),)),
    "rows": ((97, 53), (slice(5, 90), slice(None))),
    "columns": ((97, 53), (slice(None), slice(3, 50))),
    "boxes": ((6, 31, 17), (slice(1, 5), slice(None), slice(2, 15))),
    "scalar": ((1,), (0,)),
}


@needs_compiler
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
    layout=st.sampled_from(sorted(_VIEWS)),
    frac=st.sampled_from([0.0, 0.01, 0.05, 0.15, 0.3, 0.6, 1.0]),
    pattern=st.sampled_from(["random", "run"]),
    seed=st.integers(0, 1000),
    specials=st.booleans(),
    stats=st.booleans(),
    threads=st.sampled_from([1, 2, 3]),
)
def test_compare_copy_matches_a_brute_force_reference(
    dtype, layout, frac, pattern, seed, specials, stats, threads
):
    shape, view = _VIEWS[layout]
    base, dest, src = _case(dtype, shape, view, frac, pattern, seed, specials)
    start = base.clone()
    before = dest.clone()
    with pytest.MonkeyPatch.context() as mp:
        # Small parts, so that these small views are split between threads as big ones are.
        mp.setattr(native, "_PARALLEL_MIN", 256)
        mp.setattr(native, "_PART", 96)  # more parts than threads: taken in turn
        mp.setattr(native, "_threads", lambda: threads)
        got = native.compare_copy(dest, src, dtype if stats else None)
    _assert_matches_reference(got, base, start, before, dest, src, view, dtype, stats)


# The compiled bfloat16 lanes measure in float32 (squares of old values; in whole mode
# also the differences, their squares and their maximum: a difference is rounded once
# where the two exponents are more than 16 apart), each float32 lane summing 16 terms
# before float64 takes over: relative error below 16 * 2**-24 < 1e-6. Everything else is
# summed in float64, where only the order of the additions differs from torch's.
_STATS_RTOL = {torch.bfloat16: 1e-6}


def _stats_rtol(dtype):
    return _STATS_RTOL.get(dtype, 1e-12)


def _assert_matches_reference(got, base, start, before, dest, src, view, dtype, stats):
    assert got is not None
    assert torch.equal(bits(dest), bits(src)), "the copy is not the source's bits"
    outside = torch.ones_like(base, dtype=torch.bool)
    outside[view] = False
    assert torch.equal(bits(base[outside]), bits(start[outside])), "wrote outside the view"
    want = _reference(before, src, dtype)
    assert got.changed == want["changed"]
    if got.index is None:
        assert torch.equal(bits(got.before), bits(before))
        assert got.before.shape == before.shape
    else:
        offsets = torch.arange(base.numel()).view(base.shape)[view].reshape(-1)
        assert torch.equal(got.index, offsets[want["mask"]])
        assert torch.equal(bits(got.before), bits(before.reshape(-1)[want["mask"]]))
        assert got.index.numel() * (8 + dtype.itemsize) <= before.numel() * dtype.itemsize
    if stats:
        for key in ("squares", "sum_abs", "sum_sq_diff", "max_abs"):
            tol = _stats_rtol(dtype)
            assert math.isclose(getattr(got, key), want[key], rel_tol=tol, abs_tol=0), key
    else:
        assert got.squares is None and got.max_abs is None


@needs_compiler
@pytest.mark.parametrize("scale", ["tiny", "huge", "zeros", "tiny and normal", "one huge"])
@pytest.mark.parametrize("frac", [0.0, 0.02])
def test_bfloat16_squares_outside_float32s_range(scale, frac):
    # The bfloat16 lane squares in float32: values below about 1e-19 lose their squares
    # there and values above about 1e19 overflow. Runs of such values are summed again in
    # double; a lone tiny value among normal ones is below the sum's last bit anyway.
    g = torch.Generator().manual_seed(7)
    x = torch.randn(9001, generator=g)
    if scale == "tiny":
        x = x * 1e-30
    elif scale == "huge":
        x = x * 1e25
    elif scale == "zeros":
        x = torch.zeros(9001)
    elif scale == "tiny and normal":
        x[::2] *= 1e-30
    else:  # one huge value in a run of normal ones
        x[4500] = 1e30
    dest = x.to(torch.bfloat16)
    src = dest.clone()
    pos = torch.randperm(9001, generator=g)[: round(9001 * frac)]
    src[pos] = (src[pos].float() * 1.5 + 1.0).to(torch.bfloat16)
    before = dest.clone()
    got = native.compare_copy(dest, src, torch.bfloat16)
    want = _reference(before, src, torch.bfloat16)
    assert got.changed == want["changed"]
    tol = 1e-6 if scale == "tiny and normal" else 1e-12
    assert want["squares"] == 0.0 if scale == "zeros" else want["squares"] > 0.0
    assert math.isclose(got.squares, want["squares"], rel_tol=tol, abs_tol=0), (
        got.squares, want["squares"])


@needs_compiler
@pytest.mark.parametrize(
    "case", ["normal", "tiny", "tiny changes", "huge", "one huge", "not finite", "extremes"]
)
def test_bfloat16_whole_saves_measure_outside_float32s_range(case):
    """A full replacement (whole save): the bfloat16 lane measures in float32, and runs
    with values float32's squares and sums cannot hold are measured again in double:
    all four numbers as float64 torch has them (1e-6 where float32 took part)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(9001, generator=g)
    y = x * 1.5 + 1.0
    exact = True  # every run goes to double
    if case == "normal":
        exact = False
    elif case == "tiny":  # old values' squares vanish in float32
        x = x * 1e-30
        y = x * 1.5 + 1.0
    elif case == "tiny changes":  # the differences' squares vanish in float32
        x = x * 1e-30
        y = x * 1.5
    elif case == "huge":
        x, y = x * 1e25, x * 1.5e25
    elif case == "one huge":  # one run in double, the others in float32
        x[4500] = 1e30
        y = x * 1.5 + 1.0
        exact = False
    elif case == "not finite":
        x[10], x[5000], x[7000] = float("inf"), float("nan"), float("-inf")
        y = x * 1.5 + 1.0
        y[20] = float("nan")
        exact = False
    else:  # differences beyond float32's range: 3e38 - (-3e38)
        x[::3], y[::3] = -3e38, 3e38
        exact = False
    dest, src = x.to(torch.bfloat16), y.to(torch.bfloat16)
    before = dest.clone()
    got = native.compare_copy(dest, src, torch.bfloat16)
    assert got.index is None, "not a whole save"
    assert torch.equal(bits(got.before), bits(before)) and torch.equal(bits(dest), bits(src))
    want = _reference(before, src, torch.bfloat16)
    assert got.changed == want["changed"]
    tol = 1e-12 if exact else 1e-6
    for key in ("squares", "sum_abs", "sum_sq_diff", "max_abs"):
        assert want[key] > 0.0, key
        assert math.isclose(getattr(got, key), want[key], rel_tol=tol, abs_tol=0), (
            key, getattr(got, key), want[key])


_BIG_VIEWS = {
    "flat": ((300_007,), (slice(None),)),
    "columns": ((700, 301), (slice(None), slice(7, 290))),
}


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("layout", sorted(_BIG_VIEWS))
@pytest.mark.parametrize(
    ("frac", "pattern"),
    [(0.0, "random"), (0.02, "random"), (0.02, "run"), (0.3, "random"), (1.0, "random")],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_views_big_enough_to_be_sampled_first(dtype, layout, frac, pattern, threads):
    """Above ``_SAMPLE_MIN`` elements a sample sizes the compact save (too small when the
    changes sit in one run, so the save grows) or picks the whole save outright."""
    shape, view = _BIG_VIEWS[layout]
    base, dest, src = _case(dtype, shape, view, frac, pattern, 7, True)
    assert dest.numel() >= native._SAMPLE_MIN
    start, before = base.clone(), dest.clone()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native, "_PARALLEL_MIN", 1 << 15)
        mp.setattr(native, "_PART", 1 << 13)
        mp.setattr(native, "_threads", lambda: threads)
        got = native.compare_copy(dest, src, dtype)
    _assert_matches_reference(got, base, start, before, dest, src, view, dtype, True)
    if frac == 1.0:
        assert got.index is None


def _split_copy_case(seed: int, n: int = 1 << 16):
    g = torch.Generator().manual_seed(seed)
    dest = torch.randn(n, generator=g)
    src = dest.clone()
    at = torch.randperm(n, generator=g)[: n // 20]
    src[at] += 1.0
    return dest, src, at


@pytest.fixture(params=["openmp", "own threads"])
def parts_build(request, monkeypatch):
    """Each way the parts of a view can run (see _native.c): on OpenMP threads, and on
    patchkit's own pool (``PATCHKIT_OPENMP=0``); the process's build after."""
    monkeypatch.setenv("PATCHKIT_OPENMP", "1" if request.param == "openmp" else "0")
    native._reset_for_tests()
    status = native.status()
    if not status.startswith("compiled"):
        pytest.skip(f"no compiled path: {status}")
    if request.param == "openmp" and not status.endswith("parts on OpenMP threads)"):
        pytest.skip(f"the C compiler here has no OpenMP: {status}")
    if request.param == "own threads":
        assert status.endswith("parts on patchkit's threads)"), status
    yield request.param
    monkeypatch.undo()
    native._reset_for_tests()


@needs_compiler
def test_parts_from_several_python_threads_at_once(parts_build):
    """Copies, merges and counts from four Python threads at once are each right (each
    Python thread gets an OpenMP team of its own; patchkit's pool runs one job at a time,
    and a second caller runs its parts alone)."""
    import threading

    errors = []

    def work(seed):
        try:
            for r in range(20):
                dest, src, at = _split_copy_case(seed * 100 + r)
                before = dest.clone()
                got = native.compare_copy(dest, src, torch.float32)
                assert torch.equal(dest, src) and got.changed == len(at)
                assert torch.equal(got.index, at.sort().values)
                assert torch.equal(got.before, before[got.index])
                nan = torch.full_like(src, float("nan"))
                nan[at] = src[at]
                merged = native.merge(before, nan, save=True)
                assert merged.written == len(at) and torch.equal(before, src)
        except Exception as e:  # reported below, from the main thread
            errors.append(e)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native, "_PARALLEL_MIN", 1 << 12)
        mp.setattr(native, "_PART", 1 << 12)
        mp.setattr(native, "_threads", lambda: 3)
        threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)


@needs_compiler
# (Python 3.12+ warns of a fork in a process with threads running: forking after the
# threads have started is what this test is about)
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_parts_in_a_forked_child(parts_build):
    """A child forked after the parent's threads started has none of them (fork copies
    one thread): its copy still finishes, right (an OpenMP team started there would wait
    forever). The child runs the copy only (torch ops may hang in a forked child,
    patchkit's or not); the parent checks what it wrote into shared memory."""
    import os
    import signal
    import time

    if not hasattr(os, "fork"):
        pytest.skip("no fork on this platform")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native, "_PARALLEL_MIN", 1 << 12)
        mp.setattr(native, "_PART", 1 << 12)
        mp.setattr(native, "_threads", lambda: 2)
        dest, src, _ = _split_copy_case(1)
        native.compare_copy(dest, src, None)  # the parent's threads are running now
        dest, src, at = _split_copy_case(2)
        dest.share_memory_()
        pid = os.fork()
        if pid == 0:  # the child: exit status 0 when the count is right
            ok = False
            try:
                ok = native.compare_copy(dest, src, torch.float32).changed == len(at)
            finally:
                os._exit(0 if ok else 1)
        deadline = time.monotonic() + 60
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail("the forked child's copy did not finish within 60 s")
            time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0
    assert torch.equal(dest, src)


@needs_compiler
def test_a_sample_that_overestimates_the_changes_only_costs_memory():
    """Changes exactly at the sampled positions: the sample says every element changes,
    so the whole view is saved; still right, and no bigger than the bytes written."""
    n = 1 << 17
    dest = torch.randn(n)
    src = dest.clone()
    k, b = native._SAMPLE_BLOCKS, native._SAMPLE_BLOCK
    step = (n - b) // (k - 1)
    at = torch.tensor([i * step + j for i in range(k) for j in range(b)])
    src[at] += 1.0
    before = dest.clone()
    got = native.compare_copy(dest, src, torch.float32)
    assert got.index is None and torch.equal(got.before, before) and torch.equal(dest, src)
    assert got.changed == k * b


@needs_compiler
@pytest.mark.parametrize("period", [7, 50, 256, 4099])
def test_the_sample_sees_periodic_changes(period):
    # Every period-th element changes (a strided pattern, as a row or column of changes
    # in a matrix gives): blocks of consecutive positions estimate the share within a
    # few percent, where single positions spaced n/4096 apart could alias with it.
    n = 1 << 20
    dest = torch.randn(n)
    src = dest.clone()
    src[::period] += 1.0
    f32 = native._library().kinds["f32"]
    share, exact = native._changed_share(f32, dest.data_ptr(), src.data_ptr(), n, n, n, n)
    assert exact is None
    assert share == pytest.approx(1 / period, rel=0.1, abs=2 / native._SAMPLE)


@needs_compiler
@pytest.mark.parametrize("frac", [0.0, 0.01, 0.1])
@pytest.mark.parametrize("layout", ["flat", "columns"])
def test_small_views_are_counted_first_and_save_exactly_the_changes(frac, layout):
    # views of at least _WHOLE_BELOW bytes (else saved whole) and under _SAMPLE_MIN
    # elements (else sampled)
    shape, view = {"flat": ((40001,), (slice(None),)),
                   "columns": ((300, 160), (slice(None), slice(3, 150)))}[layout]
    base, dest, src = _case(torch.float32, shape, view, frac, "random", 3, False)
    assert dest.numel() * 4 >= native._WHOLE_BELOW and dest.numel() < native._SAMPLE_MIN
    start, before = base.clone(), dest.clone()
    got = native.compare_copy(dest, src, torch.float32)
    _assert_matches_reference(got, base, start, before, dest, src, view, torch.float32, True)
    # buffers of exactly the changed elements: no room reserved, none grown
    assert got.index.untyped_storage().nbytes() == 8 * got.changed
    assert got.before.untyped_storage().nbytes() == 4 * got.changed


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.int64, torch.float32])
def test_without_statistics_any_dtype_of_2_4_or_8_bytes_is_copied_bitwise(dtype):
    g = torch.Generator().manual_seed(1)
    n = native._WHOLE_BELOW // dtype.itemsize + 300  # big enough for a compact save
    dest = torch.randint(-1000, 1000, (n,), generator=g).to(dtype)
    src = dest.clone()
    src[::7] += 3
    start = dest.clone()
    got = native.compare_copy(dest, src, None)
    assert got is not None and torch.equal(dest, src)
    assert got.changed == int((start != src).sum())
    assert torch.equal(got.index, torch.nonzero(start != src).reshape(-1))
    assert torch.equal(got.before, start[start != src])


class _CopiesTransposed(torch.nn.Module):
    """Copies each weight from a transposed layout of its values (strides (1, 4))."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(3, 4), requires_grad=False)

    def load_weights(self, weights):
        for _, t in weights:
            self.w.data.copy_(t.t().contiguous().t())  # (t's values, not contiguous)
        return {n for n, _ in weights}


@needs_compiler
@pytest.mark.parametrize("how", ["transactional", "inspect"])
def test_a_small_dense_copy_from_a_transposed_source_writes_its_values(how):
    # A small contiguous destination and a strided source: the short path of
    # _compare_copy (one row, no geometry) takes contiguous pairs only. Without its
    # src.is_contiguous() (a mutation) the copy wrote the source's storage order, and
    # no test failed.
    patch = CheckpointWeightPatch("w", (3, 4), torch.float32, torch.arange(12.0))
    model = _CopiesTransposed()
    if how == "transactional":
        patchkit.load_checkpoint_weight_patches(model, [patch], transactional=True)
    else:
        inspect_load(model, [patch])
    assert torch.equal(model.w, torch.arange(12.0).reshape(3, 4))


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int16])
@pytest.mark.parametrize("view", ["contiguous", "columns"])
def test_a_small_view_is_saved_whole_in_one_pass(dtype, view):
    # Below _WHOLE_BELOW bytes a compact save would spare little memory and cost a
    # counting pass: the view is saved whole, and still counted and measured exactly.
    g = torch.Generator().manual_seed(2)
    base = torch.randn(16, 12, generator=g).to(dtype)
    dest = base if view == "contiguous" else base[:, 2:9]
    assert dest.numel() * dtype.itemsize < native._WHOLE_BELOW
    src = dest.clone()
    src[::3, 1] = (src[::3, 1].float() + 1.5).to(dtype)
    start = dest.clone()
    outside = base.clone()
    stats = dtype if dtype.is_floating_point else None
    got = native.compare_copy(dest, src, stats)
    assert got is not None and got.index is None
    assert torch.equal(got.before, start) and got.before.shape == dest.shape
    assert torch.equal(dest, src)
    changed = bits(start) != bits(src)
    assert got.changed == int(changed.sum())
    keep = torch.ones_like(base, dtype=torch.bool)
    if view == "columns":
        keep[:, 2:9] = False
        assert torch.equal(base[keep], outside[keep]), "only the view is written"
    if stats is not None:
        d = (src.double() - start.double()).abs()[changed]
        assert math.isclose(got.sum_abs, float(d.sum()), rel_tol=1e-6)
        assert math.isclose(got.max_abs, float(d.max()), rel_tol=1e-6)
        assert math.isclose(got.squares, float((start.double() ** 2).sum()), rel_tol=1e-6)


def test_copies_outside_the_compiled_path_are_left_to_torch():
    a = torch.zeros(8, 6)
    assert native.compare_copy(a.t(), torch.ones(6, 8), None) is None  # transposed rows
    assert native.compare_copy(torch.zeros(4, dtype=torch.uint8), torch.ones(4, dtype=torch.uint8),
                               None) is None  # 1-byte elements
    assert native.compare_copy(a, torch.ones(8, 6), torch.int32) is None  # no int statistics
    assert native.compare_copy(torch.zeros(0), torch.zeros(0), None) is None
    assert torch.equal(a, torch.zeros(8, 6)), "a refused copy must not write"


@needs_compiler
def test_a_destination_expanded_on_its_outer_dimension_is_left_to_torch():
    # (4, 3) of strides (0, 1): its four rows are one row of memory, which torch's copy_
    # refuses to write. Without the stride-0 check the walk took it as rows 0 elements
    # apart, (3, 0, 3), and the C loops wrote that one row four times over.
    base = torch.zeros(1, 3)
    dest = base.expand(4, 3)
    src = torch.arange(1.0, 13.0).view(4, 3)
    assert native._rows(dest, src) is None
    assert native.compare_copy(dest, src, None) is None
    assert native.compare_copy(dest, src, torch.float32) is None
    staged = src.clone()
    staged[::2] = float("nan")
    assert native.merge(dest, staged, save=True) is None
    assert native.merge(dest, staged, save=False, stats=True) is None
    assert torch.equal(base, torch.zeros(1, 3)), "a refused copy must not write"


@needs_compiler
@pytest.mark.parametrize("src", ["one row", "another shape", "int32 bits"])
def test_a_source_of_another_shape_or_dtype_is_left_to_torch(src):
    # compare_copy walked the source by the destination's shape: a (1000,) source for a
    # (4, 1000) destination was read 4000 elements long, past its end (AddressSanitizer:
    # heap-buffer-overflow; without it, whatever lay there was copied into the
    # destination), and an int32 source was copied as float32 bits, not converted.
    dest = torch.zeros(4, 1000)
    source = {
        "one row": torch.ones(1000),
        "another shape": torch.ones(1000, 4),  # (as many elements: torch's copy_ refuses it)
        "int32 bits": torch.arange(4000, dtype=torch.int32).view(4, 1000),
    }[src]
    assert native.compare_copy(dest, source, None) is None
    assert native.compare_copy(dest, source, torch.float32) is None
    assert torch.equal(dest, torch.zeros(4, 1000)), "a refused copy must not write"


def test_rows_describes_views_as_rows_of_contiguous_elements():
    w = torch.zeros(8, 6)
    assert native._rows(w, torch.zeros(8, 6)) == (48, 48, 48)
    assert native._rows(w[:, 2:4], torch.zeros(8, 2)) == (2, 6, 2)
    assert native._rows(w[2:5], torch.zeros(3, 6)) == (18, 18, 18)
    assert native._rows(torch.zeros(4, 3, 8)[:, :, 2:6], torch.zeros(4, 3, 4)) == (4, 8, 4)
    assert native._rows(w.t(), torch.zeros(6, 8)) is None
    assert native._rows(torch.zeros(4, 1)[:, :1].expand(4, 3), torch.zeros(4, 3)) is None
    assert native._rows(torch.zeros(4, 3, 8)[::2, :, 2:6], torch.zeros(2, 3, 4)) is None


class _Model(torch.nn.Module):
    """Dense weights written through rows, columns and whole tensors, and a buffer that is
    written twice (so one region is saved twice and the report rebuilds it)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.qkv = torch.nn.Parameter(torch.randn(96, 40, generator=g).to(dtype), False)
        self.o = torch.nn.Parameter(torch.randn(40, 64, generator=g).to(dtype), False)
        self.register_buffer("twice", torch.randn(50, generator=g).to(dtype))

    def load_weights(self, weights):
        for name, t in weights:
            if name in ("q", "k", "v"):
                at = "qkv".index(name) * 32
                self.qkv.data[at : at + 32].copy_(t)
            elif name == "o":
                self.o.data[:, :32].copy_(t[:, :32])  # a column split, like a TP rank
                self.o.data[:, 32:].copy_(t[:, 32:])
            else:
                self.twice.copy_(t)
                self.twice[10:20].copy_(t[10:20] * 2)
        return {n for n, _ in weights}


def _patches(dtype: torch.dtype, frac: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    m = _Model(dtype)
    out = []
    for name, shape, now in (("q", (32, 40), m.qkv[:32]), ("k", (32, 40), m.qkv[32:64]),
                             ("v", (32, 40), m.qkv[64:]), ("o", (40, 64), m.o),
                             ("t", (50,), m.twice)):
        new = now.detach().clone().reshape(shape)
        flat = new.view(-1)
        pos = torch.randperm(flat.numel(), generator=g)[: round(flat.numel() * frac)]
        flat[pos] = (flat[pos].float() + 1.0).to(dtype)
        out.append(CheckpointWeightPatch(name, tuple(new.shape), dtype, new.reshape(-1)))
    return out


def _report(dtype, frac, seed, compiled: bool):
    m = _Model(dtype)
    patches = _patches(dtype, frac, seed)
    if compiled:
        r = inspect_load(m, patches, max_chunk_bytes=4000)
    else:
        with native.disabled():
            r = inspect_load(m, patches, max_chunk_bytes=4000)
    return m, r


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("frac", [0.0, 0.03, 0.5, 1.0])
def test_reports_are_the_same_with_and_without_the_compiled_path(dtype, frac):
    m1, fast = _report(dtype, frac, 3, compiled=True)
    m2, slow = _report(dtype, frac, 3, compiled=False)
    assert patchkit.bitwise.same_state(m1.state_dict(), m2.state_dict())
    assert any(s.diff_stats is not None for s in fast._saved), "the compiled path was not used"
    assert all(s.diff_stats is None for s in slow._saved)
    assert fast.writes.equals(slow.writes)
    _assert_same_deltas(fast.deltas, slow.deltas, dtype)
    for target in fast.deltas.index:
        assert torch.equal(bits(fast.before(target)), bits(slow.before(target)))
        assert torch.equal(fast.written(target), slow.written(target))


@needs_compiler
@pytest.mark.parametrize("load", ["sparse", "transactional", "report"])
def test_a_load_on_the_compiled_path_leaves_no_garbage_for_the_collector(load):
    # ctypes keeps the array types it makes (parts, statistics, counts) only weakly, and
    # a type is a reference cycle: each load made them again, and, the collector being
    # paused during a watched load, kept them (3 KB each) to its end as garbage
    import gc

    from patchkit.toymodels import TinyLlamaConfig, TinyLlamaRuntime, tiny_llama_checkpoint

    config = TinyLlamaConfig(hidden_size=256, intermediate_size=4096, num_layers=1,
                             vocab_size=512)
    model = TinyLlamaRuntime(config, 0, 2)
    shapes = {n: tuple(t.shape) for n, t in tiny_llama_checkpoint(config).items()}
    assert max(math.prod(s) for s in shapes.values()) >= 1 << 20  # (views in parts)
    g = torch.Generator().manual_seed(0)
    if load == "sparse":
        patches = []
        for n, s in shapes.items():
            k = max(1, math.prod(s) // 50)
            patches.append(CheckpointWeightPatch(
                n, s, torch.bfloat16, torch.randn(k, generator=g),
                torch.randperm(math.prod(s), generator=g)[:k]))
    else:
        patches = [CheckpointWeightPatch(n, s, torch.bfloat16,
                                         torch.randn(math.prod(s), generator=g))
                   for n, s in shapes.items()]

    def run():
        if load == "report":
            return inspect_load(model, patches)
        return patchkit.load_checkpoint_weight_patches(
            model, patches, transactional=load == "transactional")

    run()
    gc.collect()
    out = run()
    del out
    assert gc.collect() == 0


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int32])
@pytest.mark.parametrize("frac", [0.03, 1.0])
def test_a_failed_transactional_load_restores_what_the_compiled_path_wrote(
    dtype, frac, compiled
):
    class Fails(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            g = torch.Generator().manual_seed(2)
            self.w = torch.nn.Parameter(torch.randn(64, 48, generator=g).to(dtype), False)

        def load_weights(self, weights):
            for _, t in weights:
                self.w.data[:, 8:40].copy_(t)
            raise RuntimeError("after the copy")

    m = Fails()
    start = m.w.detach().clone()
    new = m.w.detach()[:, 8:40].clone()
    flat = new.view(-1)
    flat[: round(flat.numel() * frac)] += 1
    with (
        pytest.raises(RuntimeError, match="after the copy"),
        contextlib.nullcontext() if compiled else native.disabled(),
    ):
        patchkit.load_checkpoint_weight_patches(
            m, [CheckpointWeightPatch("w", tuple(new.shape), dtype, new.reshape(-1))],
            transactional=True,
        )
    assert torch.equal(bits(m.w.detach()), bits(start))


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """A build attempt of its own, in an empty cache folder; the process's build after.
    (``PATCHKIT_NATIVE`` cleared: a run of the suite with it set to 0, the torch-ops path
    as a GPU runs it, still tests the build.)"""
    monkeypatch.setenv("PATCHKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PATCHKIT_NATIVE", raising=False)
    native._reset_for_tests()
    yield tmp_path
    monkeypatch.undo()
    native._reset_for_tests()


def test_status_says_why_torch_ops_are_used(fresh_build, monkeypatch):
    monkeypatch.setenv("PATCHKIT_NATIVE", "0")
    assert native.status() == "torch ops (PATCHKIT_NATIVE=0)"
    assert native.compare_copy(torch.zeros(4), torch.ones(4), None) is None

    native._reset_for_tests()
    monkeypatch.delenv("PATCHKIT_NATIVE")
    monkeypatch.setenv("CC", "no-such-compiler-here")
    assert native.status() == "torch ops (no C compiler: 'no-such-compiler-here' not found; set CC)"

    native._reset_for_tests()
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    assert native.status().startswith("torch ops (compiling _native.c failed")
    assert not list(fresh_build.glob("*.so")), "a failed build left a library behind"


def test_a_build_that_cannot_be_loaded_is_said_and_torch_ops_are_used(fresh_build, monkeypatch):
    # (a truncated library in the cache, as a full disk may leave: each variant is tried,
    # then the load goes on with torch ops, saying why)
    def truncated(cc, flags, out):
        out.write_bytes(b"")
        return None

    monkeypatch.setattr(native, "_compile", truncated)
    status = native.status()
    assert status.startswith("torch ops (loading native-") and ".so failed: " in status, status
    openmp = os.environ.get("PATCHKIT_OPENMP", "1") != "0"
    assert len(list(fresh_build.glob("native-*.so"))) == 2 + 2 * openmp  # (tuned or not)
    assert native.compare_copy(torch.zeros(4), torch.ones(4), None) is None


def test_a_report_without_the_compiled_path_is_still_right(fresh_build, monkeypatch):
    monkeypatch.setenv("PATCHKIT_NATIVE", "0")
    start = _Model(torch.float32).state_dict()
    m, r = _report(torch.float32, 0.03, 5, compiled=True)
    assert all(s.diff_stats is None for s in r._saved)
    for name, t in m.state_dict().items():
        differ = int((bits(t) != bits(start[name])).sum())
        assert differ > 0 and r.deltas.loc[name, "changed"] == differ, name


@needs_compiler
def test_the_build_is_cached_per_source_and_cpu(fresh_build):
    assert native.status().startswith("compiled")
    (lib,) = fresh_build.glob("native-*.so")
    stamp = lib.stat().st_mtime_ns
    native._reset_for_tests()
    assert native.status().startswith(f"compiled ({lib}; parts on ")
    assert lib.stat().st_mtime_ns == stamp, "a cached build was compiled again"


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f
                         if line.startswith("flags")), set())
    except OSError:
        return set()


@needs_compiler
@pytest.mark.skipif(not {"avx2", "fma"} <= _cpu_flags(), reason="needs a CPU with AVX2 and FMA")
def test_on_an_avx2_cpu_the_build_in_use_is_tuned_for_it(fresh_build, monkeypatch):
    # (a compile error inside the AVX2 section alone, which only -march=native reaches,
    # fell back to the portable build without a word: status still said "compiled", and
    # every test passed on the portable loops)
    tried: list[tuple[list[str], str | None]] = []
    compile_ = native._compile

    def watched(cc, flags, out, _compile=compile_):
        failed = _compile(cc, flags, out)
        tried.append((flags, failed))
        return failed

    monkeypatch.setattr(native, "_compile", watched)
    assert native.status().startswith("compiled"), native.status()
    assert len(tried) == 1, tried  # (the first build tried is the one that loaded)
    (flags, failed), = tried
    assert "-march=native" in flags and failed is None, tried
    (lib,) = fresh_build.glob("native-*.so")
    assert native.status().startswith(f"compiled ({lib}; ")


def _cache_read_only(fresh_build, monkeypatch, tmp_path) -> Path:
    """Make the cache folder ``fresh_build`` refuse new files, as a read-only mount (or a
    home shared read-only) does, and point the temporary folder at a fresh one under
    ``tmp_path``, which is returned."""
    import tempfile

    making = tempfile.mkstemp
    temporary = tmp_path / "tmp"
    temporary.mkdir()

    def refuse_the_cache(*args, dir=None, **kw):
        if dir is not None and Path(dir) == fresh_build:
            raise PermissionError(13, "Read-only file system", str(dir))
        return making(*args, dir=dir, **kw)

    monkeypatch.setattr(tempfile, "mkstemp", refuse_the_cache)
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(temporary))
    return temporary


@needs_compiler
def test_a_cache_folder_that_cannot_be_written_builds_in_the_temporary_folder(
    fresh_build, monkeypatch, tmp_path
):
    temporary = _cache_read_only(fresh_build, monkeypatch, tmp_path)
    status = native.status()
    folder = temporary / f"patchkit-native-{os.getuid()}"
    assert status.startswith(f"compiled ({folder}"), status
    dest, src, at = _split_copy_case(3)
    assert native.compare_copy(dest, src, torch.float32).changed == len(at)
    assert not list(fresh_build.glob("*.so"))
    assert [p.name for p in temporary.iterdir()] == [folder.name]
    assert folder.stat().st_mode & 0o777 == 0o700, "a folder made for the build is this user's"
    # A script run from the temporary folder (``cd /tmp``) still imports patchkit itself:
    # a folder named ``patchkit`` there would be imported instead, as an empty namespace
    # package, where patchkit is installed in editable mode (as ``make`` installs it).
    import subprocess
    import sys

    code = "import patchkit; print(patchkit.load_checkpoint_weight_patches.__name__)"
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True, text=True, cwd=temporary, timeout=120, check=False,
    )
    assert done.stdout.strip() == "load_checkpoint_weight_patches", done.stderr[-2000:]


@needs_compiler
def test_a_child_forked_before_the_library_loads_still_finishes_its_parts(tmp_path):
    # The parent's torch has OpenMP threads; the child loads the compiled path itself
    # (no fork handler of the library's own then) and copies a view big enough for parts.
    import subprocess
    import sys

    script = tmp_path / "fork_first.py"
    script.write_text(
        "import os, torch, patchkit.native as native\n"
        "torch.set_num_threads(2)\n"
        "(torch.randn(1 << 22) * 2).sum()\n"
        "a = torch.randn(1 << 20); b = a.clone(); b[::7] = 0\n"
        "want = int((a != b).sum())\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    got = native.compare_copy(a, b, torch.float32)\n"
        "    os._exit(0 if got is not None and got.changed == want else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "print('child', os.waitstatus_to_exitcode(status))\n"
    )
    try:
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                              timeout=120, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail("the forked child's copy did not finish within 120 s")
    assert done.stdout.strip() == "child 0", done.stdout + done.stderr


def test_a_child_forked_while_another_thread_builds_the_library_builds_its_own(fresh_build):
    # (was: the child inherited the lock the building thread held, and no thread of the
    # child ever let it go: its first load, its status() or disabled() waited forever)
    import signal
    import threading
    import warnings

    if not hasattr(os, "fork"):
        pytest.skip("no fork on this platform")
    building, release = threading.Event(), threading.Event()

    def slow_build():
        building.set()
        release.wait(60)
        return None, "torch ops (the parent's build)"

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native, "_build", slow_build)
        builder = threading.Thread(target=native.status)
        builder.start()
        try:
            assert building.wait(60)
            with warnings.catch_warnings():  # (3.12: "multi-threaded, use of fork()")
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
            if pid == 0:  # the child: exit status 0 when it built and disabled() works
                ok = False
                try:
                    signal.signal(signal.SIGALRM, signal.SIG_DFL)
                    signal.alarm(30)  # (a child that hangs dies of it)
                    native._build = lambda: (None, "torch ops (the child's build)")
                    with native.disabled():
                        pass
                    ok = native.status() == "torch ops (the child's build)"
                finally:
                    os._exit(0 if ok else 1)
            _, status = os.waitpid(pid, 0)
        finally:
            release.set()
            builder.join()
    assert os.waitstatus_to_exitcode(status) == 0  # (-14: SIGALRM, it hung)
    assert native.status() == "torch ops (the parent's build)"


@needs_compiler
def test_a_storage_lent_twice_is_lent_once():
    n = 65535
    g = torch.Generator().manual_seed(1)
    a = torch.randn(n, dtype=torch.float64, generator=g)
    b = a.clone()
    m = torch.rand(n, generator=g) < 0.2
    b[m] = torch.randn(int(m.sum()), dtype=torch.float64, generator=g)
    changed = torch.nonzero(bits(a) != bits(b)).reshape(-1)
    start = a.clone()
    base = torch.empty(8 * len(changed), dtype=torch.uint8)
    with native.reusing([base.untyped_storage(), base[:].untyped_storage()]):
        got = native.compare_copy(a, b, torch.float64)
    assert got.index.untyped_storage().data_ptr() != got.before.untyped_storage().data_ptr()
    assert torch.equal(got.index, changed)
    assert torch.equal(bits(got.before), bits(start[changed]))


# -- the NaN-merge of sparse loads -------------------------------------------------------


@needs_compiler
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
    layout=st.sampled_from(sorted(_VIEWS)),
    density=st.sampled_from([0.0, 0.01, 0.2, 1.0]),
    seed=st.integers(0, 1000),
    save=st.booleans(),
    threads=st.sampled_from([1, 2, 3]),
)
def test_merge_matches_torch_where_on_the_bits(dtype, layout, density, seed, save, threads):
    shape, view = _VIEWS[layout]
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=g).to(dtype)
    dest = base[view]
    n = dest.numel()
    src = torch.full(dest.shape, float("nan")).to(dtype)
    flat = src.view(-1)
    pos = torch.randperm(n, generator=g)[: round(n * density)]
    flat[pos] = torch.randn(pos.numel(), generator=g).to(dtype)
    if pos.numel() > 3:
        flat[pos[0]] = dest.reshape(-1)[pos[0]]  # written, not changed
        flat[pos[1]] = -0.0
        flat[pos[2]] = float("inf")
    keep = torch.ones(n, dtype=torch.bool)
    keep[pos] = False
    if keep.any():  # a NaN with another payload still means "keep"
        bits(flat)[int(keep.nonzero()[0])] |= 1
    start, before = base.clone(), dest.clone()
    want = torch.where(torch.isnan(src), before, src)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native, "_PARALLEL_MIN", 256)
        mp.setattr(native, "_PART", 96)  # more parts than threads: taken in turn
        mp.setattr(native, "_threads", lambda: threads)
        got = native.merge(dest, src, save=save)
    assert got is not None
    assert torch.equal(bits(dest), bits(want))
    outside = torch.ones_like(base, dtype=torch.bool)
    outside[view] = False
    assert torch.equal(bits(base[outside]), bits(start[outside]))
    written = ~torch.isnan(src.reshape(-1))
    assert got.written == int(written.sum())
    assert got.changed == int((bits(before.reshape(-1)) != bits(want.reshape(-1))).sum())
    at = written.nonzero().reshape(-1)  # row-major positions in the view
    assert got.position_sums == (int(at.sum()) % 2**64, int((at * at).sum()) % 2**64)
    if save:
        offsets = torch.arange(base.numel()).view(shape)[view].reshape(-1)
        assert torch.equal(got.index, offsets[written])
        assert torch.equal(bits(got.before), bits(before.reshape(-1)[written]))
    else:
        assert got.index is None and got.before is None


def _sparse_patches(model: _Model, dtype: torch.dtype, density: float, seed: int,
                    ordered: bool = True):
    """``ordered=False``: each patch's entries in a random order (CONTRACT §1 allows it)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, now in (("q", model.qkv[:32]), ("k", model.qkv[32:64]), ("v", model.qkv[64:]),
                      ("o", model.o)):
        n = now.numel()
        idx = torch.randperm(n, generator=g)[: max(1, round(n * density))]
        if ordered:
            idx = idx.sort().values
        vals = torch.randn(idx.numel(), generator=g).to(dtype)
        out.append(CheckpointWeightPatch(name, tuple(now.shape), dtype, vals, idx))
    return out


def _assert_same_deltas(a, b, dtype=None):
    """The same rows and counts; the sums may differ in their last bits (another order),
    and the bfloat16 lanes' by their float32 sums (see ``_STATS_RTOL``)."""
    assert list(a.index) == list(b.index)
    assert (a["elements"] == b["elements"]).all() and (a["changed"] == b["changed"]).all()
    for col in ("max_abs", "mean_abs", "rel_l2"):
        tol = _stats_rtol(dtype)
        for x, y in zip(a[col], b[col]):
            assert math.isclose(x, y, rel_tol=tol, abs_tol=0), (col, x, y)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("transactional", [False, True])
def test_sparse_reports_are_the_same_with_and_without_the_compiled_merge(dtype, transactional):
    reports, models = [], []
    for compiled in (True, False):
        m = _Model(dtype)
        patches = _sparse_patches(m, dtype, 0.05, 4)
        with contextlib.nullcontext() if compiled else native.disabled():
            reports.append(inspect_load(m, patches, max_chunk_bytes=6000,
                                        transactional=transactional))
        models.append(m)
    fast, slow = reports
    assert patchkit.bitwise.same_state(models[0].state_dict(), models[1].state_dict())
    assert fast.writes.equals(slow.writes)
    _assert_same_deltas(fast.deltas, slow.deltas, dtype)
    for target in fast.deltas.index:
        assert torch.equal(bits(fast.before(target)), bits(slow.before(target)))
        assert torch.equal(fast.written(target), slow.written(target))
    # The compiled merge kept no offsets: each save is the written values, nothing more,
    # and says where they came from by its patch (the "o" writes are column slices); it
    # measured the deltas while merging.
    assert len(fast._saved) == len(slow._saved) == 5
    for f, s in zip(fast._saved, slow._saved):
        assert f.index is None and f.positions is not None and s.index is not None
        assert f.diff_stats is not None and s.diff_stats is None
        assert torch.equal(f.storage_index(), s.index)
        assert f.before.numel() * f.before.element_size() == s.index.numel() * dtype.itemsize


@needs_compiler
@pytest.mark.parametrize("change", ["indices", "values"])
def test_a_patch_changed_after_the_load_is_not_misread(change):
    m = _Model(torch.float32)
    r = inspect_load(m, _sparse_patches(m, torch.float32, 0.05, 4), max_chunk_bytes=6000)
    assert r.before("qkv").shape == (96, 40)
    k = r._saved[1].positions  # patch 1, "k": its own tensors
    if change == "indices":  # one entry moves to a position the patch did not have
        free = sorted(set(range(k.indices.numel() * 10)) - set(k.indices.tolist()))
        k.indices[0] = free[0]
        says = "still has as many, at other positions"
    else:  # one entry becomes "keep"
        k.values[0] = float("nan")
        says = "wrote 64 of its entries here, it now has 63"
    with pytest.raises(ValueError, match=rf"patch 1 \('k'\): its indices or values.*{says}"):
        r.before("qkv")
    assert r.before("o").shape == (40, 64), "targets fed by other patches still read"


@needs_compiler
def test_duplicate_indices_keep_their_offsets():
    # Unvalidated duplicates: the staged tensor holds one of the two values, so the patch
    # has one entry more than the merge writes, and the save keeps its offsets.
    fast_slow = []
    for compiled in (True, False):
        m = _Model(torch.float32)
        patches = _sparse_patches(m, torch.float32, 0.05, 4)
        q = patches[0]
        idx = torch.cat([q.indices, q.indices[:1]])
        vals = torch.cat([q.values, q.values[:1]])
        patches[0] = q._replace(values=vals, indices=idx)
        with contextlib.nullcontext() if compiled else native.disabled():
            fast_slow.append(inspect_load(m, patches, max_chunk_bytes=6000,
                                          validate_unique_indices=False))
    fast, slow = fast_slow
    assert fast._saved[0].index is not None and fast._saved[0].positions is None
    assert all(s.positions is not None for s in fast._saved[1:])
    _assert_same_deltas(fast.deltas, slow.deltas, torch.float32)
    assert torch.equal(bits(fast.before("qkv")), bits(slow.before("qkv")))


@pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "unordered"])
@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_failed_transactional_sparse_load_restores_what_the_merge_wrote(
        dtype, compiled, ordered):
    # (unordered: the merge saves the old values in the view's order, and the offsets,
    # recomputed from the patch, must come in that order too, not in the patch's)
    class Fails(_Model):
        def load_weights(self, weights):
            super().load_weights(weights)
            raise RuntimeError("after the merge")

    m = Fails(dtype)
    start = {k: v.clone() for k, v in m.state_dict().items()}
    with (
        pytest.raises(RuntimeError, match="after the merge"),
        contextlib.nullcontext() if compiled else native.disabled(),
    ):
        patchkit.load_checkpoint_weight_patches(
            m, _sparse_patches(m, dtype, 0.2, 6, ordered), transactional=True
        )
    assert patchkit.bitwise.same_state(m.state_dict(), start)


@pytest.mark.parametrize("view", ["contiguous", "column shard"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_a_transactional_sparse_rollback_through_torch_ops_saves_no_more_than_the_view(
        monkeypatch, dtype, view):
    # CONTRACT section 5: a transactional load's extra memory is the size of the regions
    # written. Through torch ops (a GPU; float8 on the CPU) a NaN-merge saved its written
    # elements with an int64 offset each: a bf16 patch of density 1/2 kept 2.5 times its
    # view's bytes, a float8 one 4.5 times, however dense the patch was.
    from patchkit.intercept import WriteSession

    kept: list[int] = []
    save = WriteSession._save

    def counted(self, t, target, offset, write):
        saved = save(self, t, target, offset, write)
        if saved is not None:
            kept.append(saved.before.nbytes
                        + (saved.index.nbytes if saved.index is not None else 0))
        return saved

    monkeypatch.setattr(WriteSession, "_save", counted)
    shard = view == "column shard"

    class Fails(torch.nn.Module):
        def __init__(self):
            super().__init__()
            w = torch.randn(64, 128 if shard else 64, generator=torch.Generator().manual_seed(3))
            self.w = torch.nn.Parameter(w.to(dtype), requires_grad=False)

        def load_weights(self, weights):
            for _, t in weights:
                (self.w.data[:, 32:96] if shard else self.w.data).copy_(t)
            raise RuntimeError("after the merge")

    m = Fails()
    start = bits(m.w).clone()
    shape = (64, 64)
    values = torch.randn(2048, generator=torch.Generator().manual_seed(4)).to(dtype)
    p = CheckpointWeightPatch("w", shape, dtype, values, torch.arange(0, 4096, 2))
    with pytest.raises(RuntimeError, match="after the merge"), native.disabled():
        patchkit.load_checkpoint_weight_patches(m, [p], transactional=True)
    assert torch.equal(bits(m.w), start)  # put back bit for bit
    view_bytes = 64 * 64 * torch.empty(0, dtype=dtype).element_size()
    assert kept and sum(kept) <= view_bytes


def test_a_sparse_save_through_torch_ops_is_whole_from_the_count_its_scratch_passes_the_view():
    # The elements with their int64 offsets, and the offsets' scratch at its peak (two
    # int64 arrays, five for a view that is not contiguous), against the view's bytes: a
    # merge of more than an eighth of a contiguous bfloat16 view's elements, a sixteenth
    # of a float8 one's, and a fifth of a bfloat16 column shard's saves the view whole.
    from patchkit.intercept import _whole_is_smaller

    bf16 = torch.zeros(64, 64, dtype=torch.bfloat16)
    fp8 = torch.zeros(64, 64, dtype=torch.float8_e4m3fn)
    shard = torch.zeros(64, 128, dtype=torch.bfloat16)[:, 32:96]  # 8192 bytes, strided
    for view, most in ((bf16, 512), (fp8, 256), (shard, 204)):
        assert not _whole_is_smaller(view, most), (view.dtype, most)
        assert _whole_is_smaller(view, most + 1), (view.dtype, most + 1)


# -- regressions found by review ---------------------------------------------------------


@needs_compiler
def test_a_save_whose_changes_get_denser_grows_its_room_and_finishes():
    # One part; its first room fills, and the continuation once stopped a few entries
    # short of the grown room and called again with the same room, forever.
    n = 120_000
    dest = torch.randn(n, generator=torch.Generator().manual_seed(0))
    src = dest.clone()
    src[:100_000:20] += 1.0
    src[99_001:99_004] += 1.0
    src[100_000:] += 1.0
    start = dest.clone()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native, "_threads", lambda: 1)
        got = native.compare_copy(dest, src, torch.float32)
    changed = bits(start) != bits(src)
    assert torch.equal(dest, src) and got.changed == int(changed.sum())
    assert torch.equal(got.index, changed.nonzero().reshape(-1))
    assert torch.equal(got.before, start[changed])


@needs_compiler
@pytest.mark.parametrize("other", ["int16 copy", "uint8 fill"])
def test_a_later_write_of_another_element_size_is_seen_as_with_torch_ops(other):
    # The statistics measured during the dense copy are stale once a later write reaches
    # the same elements; the report must then read them again, as torch ops do.
    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.w = torch.nn.Parameter(torch.randn(40, generator=g), False)

        def load_weights(self, weights):
            for _, t in weights:
                self.w.data.copy_(t)
                if other == "uint8 fill":
                    self.w.data.view(torch.uint8)[:8].fill_(0x7F)
                else:
                    self.w.data.view(torch.int16)[:8].copy_(torch.full((8,), 0x4000,
                                                                       dtype=torch.int16))
            return {n for n, _ in weights}

    reports = []
    for compiled in (True, False):
        m = M()
        new = m.w.detach().clone()
        new[::3] += 1.0
        patch = CheckpointWeightPatch("w", (40,), torch.float32, new)
        with contextlib.nullcontext() if compiled else native.disabled():
            reports.append(inspect_load(m, [patch]))
    fast, slow = reports
    assert fast.deltas.equals(slow.deltas)
    assert torch.equal(fast.before("w"), slow.before("w"))


@pytest.mark.parametrize("change", ["one element", "every element"])
def test_a_write_into_one_column_slice_of_a_fused_buffer_is_not_credited_to_the_other(change):
    # a and b are column slices of one buffer: rows of a lie inside b's byte extent, and
    # rows of b inside a's.
    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            buf = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
            self.a = torch.nn.Parameter(buf[:, :8], False)
            self.b = torch.nn.Parameter(buf[:, 8:], False)

        def load_weights(self, weights):
            for name, t in weights:
                if name == "a":
                    self.a.data[10:20].copy_(t)
                else:
                    self.b.data[30:32].copy_(t)
            return {n for n, _ in weights}

    for compiled in (True, False):
        m = M()
        new = m.a.detach()[10:20].clone()
        if change == "one element":
            new[0, 0] += 1.0
        else:
            new += 1.0
        patch = CheckpointWeightPatch("a", (10, 8), torch.float32, new.reshape(-1))
        with contextlib.nullcontext() if compiled else native.disabled():
            r = inspect_load(m, [patch])
        assert list(r.deltas.index) == ["a"], (compiled, r.deltas)
        row = r.deltas.loc["a"]
        assert row["elements"] == 80 and row["changed"] == (1 if change == "one element" else 80)
        # the writes table names the slice written, at its row-major position in it
        # ... and its region in the slice's own coordinates (the slice is strided)
        assert r.writes[["target", "target_offset", "target_region"]].values.tolist() == [
            ["a", 80, "[10:20, :]"]]
        patch_b = CheckpointWeightPatch("b", (2, 8), torch.float32, torch.zeros(16))
        with contextlib.nullcontext() if compiled else native.disabled():
            r = inspect_load(m, [patch_b])
        assert r.writes[["target", "target_offset", "target_region"]].values.tolist() == [
            ["b", 240, "[30:32, :]"]]
        assert list(r.deltas.index) == ["b"]


def test_regions_in_a_strided_target_are_slices_of_the_target():
    # A Parameter that is a column slice of a fused buffer: writes into row blocks,
    # column blocks, single rows and every other row of it are boxes in its own
    # coordinates.
    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            buf = torch.zeros(12, 20)
            self.w = torch.nn.Parameter(buf[:, 5:15], False)  # 12 x 10, row stride 20

        def load_weights(self, weights):
            for name, t in weights:
                view = {"rows": self.w.data[3:7], "cols": self.w.data[:, 2:5],
                        "row": self.w.data[11], "box": self.w.data[4:6, 7:10],
                        "odd": self.w.data[::2]}[name]
                view.copy_(t.view(view.shape))
            return {n for n, _ in weights}

    shapes = {"rows": (4, 10), "cols": (12, 3), "row": (10,), "box": (2, 3), "odd": (6, 10)}
    patches = [CheckpointWeightPatch(n, s, torch.float32, torch.ones(math.prod(s)))
               for n, s in shapes.items()]
    r = inspect_load(M(), patches)
    got = dict(zip(r.writes["name"], r.writes["target_region"]))
    assert got == {"rows": "[3:7, :]", "cols": "[:, 2:5]", "row": "[11:12, :]",
                   "box": "[4:6, 7:10]", "odd": "[0:12:2, :]"}


@pytest.mark.parametrize("compiled", [True, False])
def test_a_sparse_source_broadcast_over_rows_is_saved_and_restored(compiled):
    # An expanded (stride 0) view of the staged row writes each entry four times: where
    # the load wrote cannot come from the patch's indices (and must not divide by the
    # zero row stride); the save keeps its offsets.
    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.arange(32.0).view(4, 8), False)

        def load_weights(self, weights):
            for _, t in weights:
                self.w.data.copy_(t.expand(4, 8))
            raise RuntimeError("after the copy")

    m = M()
    p = CheckpointWeightPatch("w", (1, 8), torch.float32, torch.tensor([100.0, 200.0]),
                              torch.tensor([1, 5]))
    with (
        pytest.raises(RuntimeError, match="after the copy"),
        contextlib.nullcontext() if compiled else native.disabled(),
    ):
        patchkit.load_checkpoint_weight_patches(m, [p], transactional=True)
    assert torch.equal(m.w.data, torch.arange(32.0).view(4, 8))


@pytest.mark.parametrize("compiled", [True, False])
def test_a_loader_that_rewrites_its_staged_tensor_first_is_saved_where_it_wrote(compiled):
    # The loader flips the staged rows in place before copying: the merge writes where
    # the flipped tensor holds values (as many as the patch has entries), not where the
    # patch's indices say, so the save must keep its offsets.
    class M(torch.nn.Module):
        def __init__(self, fail: bool) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.arange(32.0).view(4, 8), False)
            self.fail = fail

        def load_weights(self, weights):
            for _, t in weights:
                t.copy_(t.flip(0))
                self.w.data.copy_(t)
            if self.fail:
                raise RuntimeError("after the merge")
            return {n for n, _ in weights}

    def patch():
        return CheckpointWeightPatch("w", (4, 8), torch.float32, torch.tensor([100.0, 200.0]),
                                     torch.tensor([1, 10]))

    start = torch.arange(32.0).view(4, 8)
    with contextlib.nullcontext() if compiled else native.disabled():
        r = inspect_load(M(False), [patch()])
        m = M(True)
        with pytest.raises(RuntimeError, match="after the merge"):
            patchkit.load_checkpoint_weight_patches(m, [patch()], transactional=True)
    assert r._saved[0].positions is None
    assert torch.equal(r.before("w"), start)
    assert r.written("w").nonzero().tolist() == [[2, 2], [3, 1]]
    assert torch.equal(m.w.data, start)


# -- which writes reach a measured region ------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    width=st.integers(1, 9),
    other_width=st.one_of(st.none(), st.integers(1, 9)),
    boxes=st.lists(st.tuples(*[st.integers(0, 8)] * 5), min_size=2, max_size=2),
)
def test_regions_share_elements_exactly_when_their_views_do(width, other_width, boxes):
    """``Region.overlaps`` is exact, and ``columns_apart`` (which spares the measured
    statistics of an earlier write, e.g. one column slice of a TP split while the other
    is written) never says two views are apart when they share an element."""
    from patchkit.intercept import Region

    storage = torch.zeros(100)
    numbered = torch.arange(100.0)
    views, offsets = [], []
    for w, (r0, r1, c0, c1, shift) in zip((width, other_width or width), boxes):
        # a matrix that starts ``shift`` elements in: its rows can straddle another's
        m = storage[shift : shift + (90 // w) * w].view(-1, w)
        c0, c1 = sorted((c0 % w, c1 % w))
        v = m[min(r0, r1) : max(r0, r1) + 1, c0 : c1 + 1]
        views.append(v)
        seen = numbered.as_strided(v.shape, v.stride(), v.storage_offset())
        offsets.append(set(seen.reshape(-1).tolist()))
    shared = bool(offsets[0] & offsets[1])
    a, b = Region.of(views[0]), Region.of(views[1])
    assert a.overlaps(b) == shared == b.overlaps(a)
    if a.columns_apart(b):
        assert not shared


def test_column_slices_of_one_matrix_are_apart():
    from patchkit.intercept import Region

    m = torch.zeros(8, 6)
    assert Region.of(m[:, :3]).columns_apart(Region.of(m[:, 3:]))
    assert not Region.of(m[:, :4]).columns_apart(Region.of(m[:, 3:]))
    assert not Region.of(m[:4]).columns_apart(Region.of(m[2:]))  # whole rows
    assert not Region.of(m[:, :3]).columns_apart(Region.of(m.view(-1)[1:].view(47)[:3]))
    s = torch.zeros(100)  # broadcast rows (row stride 0): not columns, and no division by 0
    a, b = s.as_strided((3, 4), (0, 1), 39), s.as_strided((2, 3), (0, 1), 41)
    assert not Region.of(a).columns_apart(Region.of(b))
    assert Region.of(a).overlaps(Region.of(b))


@settings(max_examples=200, deadline=None)
@given(
    shape=st.tuples(st.integers(1, 5), st.integers(1, 6), st.integers(1, 4)),
    starts=st.tuples(*[st.integers(0, 3)] * 3),
    steps=st.tuples(*[st.integers(1, 2)] * 3),
    perm=st.permutations([0, 1, 2]),
)
def test_a_view_says_which_storage_element_is_its_which_element(shape, starts, steps, perm):
    """``_position_of`` (how a write is placed in a strided parameter) against brute
    force, for slices with steps and permutes of a dense tensor."""
    from patchkit._regions import _position_of

    base = torch.zeros(shape)
    view = base[tuple(slice(a, None, s) for a, s in zip(starts, steps))].permute(*perm)
    numbered = torch.arange(base.numel()).view(shape)
    mine = numbered[tuple(slice(a, None, s) for a, s in zip(starts, steps))].permute(*perm)
    where = {int(e): k for k, e in enumerate(mine.reshape(-1).tolist())}
    for e in range(base.numel()):
        assert _position_of(view, e * base.element_size()) == where.get(e), e


# -- inspect_load(..., reuse=): the last report's save buffers for the next load --------


def _storages(report) -> set[int]:
    return {t.untyped_storage().data_ptr() for s in report._saved for t in (s.before, s.index)
            if t is not None and t.numel()}


def _bumped(m, dtype, frac, seed):
    """Dense patches that add 1 to a share ``frac`` of ``m``'s current values."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, now in (("q", m.qkv[:32]), ("k", m.qkv[32:64]), ("v", m.qkv[64:]), ("o", m.o),
                      ("t", m.twice)):
        new = now.detach().clone()
        flat = new.view(-1)
        pos = torch.randperm(flat.numel(), generator=g)[: round(flat.numel() * frac)]
        flat[pos] = (flat[pos].float() + 1.0).to(dtype)
        out.append(CheckpointWeightPatch(name, tuple(new.shape), dtype, flat))
    return out


def _step(m, dtype, k):
    """Load k of a loop: full replacements, a few changes, sparse, full again, ..."""
    kind = k % 4
    if kind == 2:
        return _sparse_patches(m, dtype, 0.05, k)
    return _bumped(m, dtype, 0.03 if kind == 1 else 1.0, k)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_loop_that_reuses_the_last_report_reports_the_same(dtype, monkeypatch):
    # These saves are a few KiB, far below _REUSE_MIN: lend every one, so that the pool is
    # what is tested. (Below it they are freed when handed over, and malloc giving a new
    # save the address of a freed one passed for reuse, or not, with the heap's state.)
    monkeypatch.setattr(native, "_REUSE_MIN", 1)
    looped, fresh = _Model(dtype), _Model(dtype)
    last = None
    reused_any = False
    for k in range(6):
        step = _step(looped, dtype, k)
        before = {n: t.detach().clone() for n, t in looped.named_buffers()}
        before.update({n: t.detach().clone() for n, t in looped.named_parameters()})
        lent = _storages(last) if last is not None else set()
        kept_deltas = last.deltas.copy() if last is not None else None
        r = inspect_load(looped, step, max_chunk_bytes=4000, reuse=last)
        want = inspect_load(fresh, step, max_chunk_bytes=4000)
        assert patchkit.bitwise.same_state(looped.state_dict(), fresh.state_dict())
        assert r.writes.equals(want.writes)
        assert r.deltas.equals(want.deltas), "the same kernels: the same numbers, bit for bit"
        for target in want.deltas.index:
            assert torch.equal(bits(r.before(target)), bits(before[target]))
            assert torch.equal(r.written(target), want.written(target))
        reused_any |= bool(_storages(r) & lent)
        if last is not None:
            # the earlier report keeps its tables; its before-values are gone, and it says so
            assert last.deltas.equals(kept_deltas)
            with pytest.raises(ValueError, match="handed to a later load"):
                last.before("qkv")
            with pytest.raises(ValueError, match="handed to a later load"):
                last.written("qkv")
        last = r
    assert reused_any, "no save went into a buffer of the last report"


@needs_compiler
def test_reuse_leaves_a_buffer_that_is_held_elsewhere_alone(monkeypatch):
    monkeypatch.setattr(native, "_REUSE_MIN", 1)  # lend these small saves (see above)
    m = _Model(torch.float32)
    first = inspect_load(m, _bumped(m, torch.float32, 1.0, 1), max_chunk_bytes=4000)
    held = first._saved[0].before.view(-1)[:8]  # a view of a save, kept by someone
    snapshot = held.clone()
    ptr = held.untyped_storage().data_ptr()
    lent = _storages(first) - {ptr}
    second = inspect_load(m, _bumped(m, torch.float32, 1.0, 2), max_chunk_bytes=4000,
                          reuse=first)
    assert torch.equal(held, snapshot), "a buffer someone still held was written over"
    assert ptr not in _storages(second)
    assert _storages(second) & lent, "the buffers nobody held were not reused"


@needs_compiler
def test_a_report_handed_to_two_loads_at_once_lends_its_saves_to_one(monkeypatch):
    # (was: both could get the same buffers, so one load's saves overwrote the other's:
    # the report read as not handed over while its buffers were being gathered)
    import threading

    m = _Model(torch.float32)
    report = inspect_load(m, _bumped(m, torch.float32, 1.0, 1), max_chunk_bytes=4000)
    assert report._saved
    seen: list[tuple[bool, int]] = []
    others: list[int] = []

    class Spy:
        """1 (lend these small saves, see above); while the buffers are gathered, a
        second load asks for them, and what the report says is noted."""

        def __le__(self, n):
            if not seen:
                seen.append((report._handed_over, len(report._saved)))
                t = threading.Thread(target=lambda: others.append(len(report._hand_over())))
                t.start()
                t.join()
            return n >= 1

    monkeypatch.setattr(native, "_REUSE_MIN", Spy())
    first = report._hand_over()
    assert seen == [(True, 0)] and others == [0] and len(first) > 0


@needs_compiler
def test_reuse_with_a_failing_transactional_load_restores_everything():
    m = _Model(torch.float32)
    start = {n: t.detach().clone() for n, t in m.state_dict().items()}
    last = inspect_load(m, _bumped(m, torch.float32, 1.0, 1), max_chunk_bytes=4000)
    mid = {n: t.detach().clone() for n, t in m.state_dict().items()}
    assert not patchkit.bitwise.same_state(start, mid)
    bad = _bumped(m, torch.float32, 1.0, 2)
    bad[-1] = bad[-1]._replace(name="nope")  # load_weights writes "t" then fails below

    def failing(weights):
        _Model.load_weights(m, [(n if n != "nope" else "t", t) for n, t in weights])
        raise RuntimeError("the loader failed after writing")

    m.load_weights = failing
    with pytest.raises(RuntimeError, match="failed after writing") as info:
        inspect_load(m, bad, max_chunk_bytes=1 << 20, transactional=True, reuse=last)
    assert patchkit.bitwise.same_state(m.state_dict(), mid), "the failed load was not undone"
    assert info.value.report.deltas is not None


def test_reusing_lends_big_buffers_only_to_saves_that_fit():
    """Buffers below _REUSE_MIN bytes are neither lent nor taken (malloc serves those from
    memory just freed); a lent buffer goes to a save that needs at least half of it."""
    m = native._REUSE_MIN // 4  # float32 elements in _REUSE_MIN bytes
    small = torch.empty(64, dtype=torch.float32).untyped_storage()
    big = torch.empty(4 * m, dtype=torch.float32).untyped_storage()  # 4 * _REUSE_MIN bytes
    with native.reusing([small, big]):
        assert native._empty(64, torch.float32).untyped_storage().data_ptr() != small.data_ptr()
        assert native._empty(m, torch.float32).untyped_storage().data_ptr() != (
            big.data_ptr()), "a buffer four times the need was lent"
        got = native._empty(2 * m + 1, torch.int32)
        assert got.untyped_storage().data_ptr() == big.data_ptr()
        assert got.shape == (2 * m + 1,) and got.dtype == torch.int32
        assert native._empty(2 * m + 1, torch.int32).untyped_storage().data_ptr() != (
            big.data_ptr()), "a buffer was lent twice"


def test_reuse_must_be_a_report():
    with pytest.raises(TypeError, match="reuse must be a LoadReport"):
        inspect_load(_Model(torch.float32), [], reuse="last time")


# -- a sample that misses the changes: parts run out of room ------------------------------


def _outside_the_sample(n: int) -> torch.Tensor:
    """True at the positions of an ``n``-element view that ``_changed_share`` does not
    look at (it reads ``_SAMPLE_BLOCKS`` blocks of ``_SAMPLE_BLOCK`` positions, evenly
    spaced as pk_sample spaces them)."""
    k, b = native._SAMPLE_BLOCKS, native._SAMPLE_BLOCK
    step = (n - b) // (k - 1)
    seen = torch.zeros(n, dtype=torch.bool)
    for i in range(k):
        seen[i * step : i * step + b] = True
    return ~seen


@needs_compiler
@pytest.mark.parametrize("pattern", ["dense where each part starts", "sparse all over"])
def test_a_sample_that_misses_every_change_still_saves_and_measures_them_all(pattern):
    """Every change sits where the sample does not look, so the compact save is sized
    for almost none and both parts run out of room. Dense changes where each part
    starts put the save on course to cost more than the whole view: it gives up, undoes
    what it wrote, and saves the whole view. Sparse ones go on past the first room, part
    after part, in grown buffers. Either way the saved elements, the count and the
    statistics (over both parts, the largest change in the second) are torch's."""
    n = native._PARALLEL_MIN
    g = torch.Generator().manual_seed(3)
    dest = torch.randn(n, generator=g)
    where = torch.zeros(n, dtype=torch.bool)
    if pattern == "dense where each part starts":
        where[:6000] = True
        where[n // 2 : n // 2 + 6000] = True
    else:
        where[::20] = True  # ~12900 changes, three times the 4096 entries a part gets
    at = (where & _outside_the_sample(n)).nonzero().reshape(-1)
    src = dest.clone()
    src[at] += torch.rand(at.numel(), generator=g) + 0.5
    src[at[-1]] += 1000.0  # the largest change, in the second part
    f32 = native._library().kinds["f32"]
    share, _ = native._changed_share(f32, dest.data_ptr(), src.data_ptr(), n, n, n, n)
    assert share == 0.0, "the sample was meant to miss every change"
    start, before = dest.clone(), dest.clone()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native, "_threads", lambda: 2)
        assert len(native._parts(n)) == 3  # two parts
        got = native.compare_copy(dest, src, torch.float32)
    whole = pattern == "dense where each part starts"
    assert (got.index is None) == whole
    _assert_matches_reference(
        got, dest, start, before, dest, src, (slice(None),), torch.float32, True
    )
    assert got.changed == at.numel()
    largest = float((src[at[-1]].double() - start[at[-1]].double()).abs())
    assert got.max_abs == pytest.approx(largest, rel=1e-12)


@needs_compiler
@pytest.mark.parametrize("save", [False, True])
def test_merge_statistics_take_the_largest_change_of_every_part(save):
    n = native._PARALLEL_MIN
    g = torch.Generator().manual_seed(5)
    dest = torch.randn(n, generator=g)
    src = torch.full((n,), float("nan"))
    at = torch.randperm(n, generator=g)[:500]
    src[at] = dest[at] + 1.0
    src[n - 7] = dest[n - 7] + 250.0  # the largest change, in the last part
    before = dest.clone()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native, "_threads", lambda: 2)
        assert len(native._parts(n)) == 3
        got = native.merge(dest, src, save=save, stats=True)
    written = ~torch.isnan(src)
    want = _reference(before[written], dest[written], torch.float32)
    assert torch.equal(dest, torch.where(written, src, before))
    assert (got.written, got.changed) == (int(written.sum()), want["changed"])
    assert got.max_abs == want["max_abs"] == pytest.approx(250.0, rel=1e-5)
    for key in ("squares", "sum_abs", "sum_sq_diff"):
        assert math.isclose(getattr(got, key), want[key], rel_tol=1e-12), key


def test_reusing_lends_the_smallest_buffer_that_fits():
    """Of several buffers that fit a save, the smallest is lent (the bigger ones stay
    for bigger saves), whatever order they were handed over in."""
    m = native._REUSE_MIN // 4  # float32 elements in _REUSE_MIN bytes
    two = torch.empty(2 * m, dtype=torch.float32).untyped_storage()
    three = torch.empty(3 * m, dtype=torch.float32).untyped_storage()
    for order in ([two, three], [three, two]):
        with native.reusing(order):
            # 1.6 x _REUSE_MIN bytes: both fit (neither is more than twice the need)
            got = native._empty(8 * m // 5, torch.float32)
            assert got.untyped_storage().data_ptr() == two.data_ptr()
            # 2.5 x _REUSE_MIN bytes: only the bigger one fits
            got = native._empty(5 * m // 2, torch.float32)
            assert got.untyped_storage().data_ptr() == three.data_ptr()


@needs_compiler
@pytest.mark.parametrize("rows,cols", [(slice(None), slice(None)), (slice(3, 9), slice(None)),
                                       (slice(2, 7), slice(4, 11)), (slice(None), slice(5, 8))])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_a_patchs_entries_and_the_merge_from_its_staged_tensor_sum_the_same_positions(
    rows, cols, index_dtype
):
    # A sparse write keeps no offsets when it can recompute them from its patch; the
    # merge's position sums must equal the entries' for the same view, else every such
    # write would fall back to keeping them (and a wrong match would misplace a rollback).
    shape = (12, 16)
    g = torch.Generator().manual_seed(3)
    idx = torch.randperm(12 * 16, generator=g)[:40].sort().values.to(index_dtype)
    vals = torch.randn(40, generator=g)
    vals[5] = float("nan")  # a NaN entry writes nothing
    staged = torch.full(shape, float("nan"))
    staged.view(-1)[idx.long()] = vals
    src = staged[rows, cols]
    start = src.storage_offset()
    dest = torch.zeros(src.shape)
    found = native.patch_entries(idx, vals, start, dest, src)
    got = native.merge(dest, src, save=True, known_count=found.count)
    assert got.written == found.count and got.index is None
    assert got.position_sums == found.position_sums


@needs_compiler
@pytest.mark.parametrize("report", [False, True])
def test_a_staged_tensor_changed_outside_torch_is_still_restored_where_it_was_written(report):
    # A loader that edits the staged tensor through numpy (which no torch op shows) and
    # then copies it: as many elements written as the patch has entries, at other
    # positions. The rollback restored the patch's positions, so it wrote an element the
    # load never wrote and left one it did.
    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.arange(10.0, 22.0).view(4, 3), requires_grad=False)

        def load_weights(self, weights):
            for _, w in weights:
                a = w.numpy()
                a[0, 0] = float("nan")  # drop checkpoint element 0 ...
                a[2, 2] = 4.0  # ... and write element 8 instead
                self.w.copy_(w)
            raise RuntimeError("loader fails after writing")

    m = M()
    start = m.w.detach().clone()
    p = CheckpointWeightPatch("w", (4, 3), torch.float32, torch.tensor([1.0, 2.0]),
                              torch.tensor([0, 7]))
    with pytest.raises(RuntimeError, match="loader fails after writing") as info:
        if report:
            inspect_load(m, [p], transactional=True)
        else:
            patchkit.load_checkpoint_weight_patches(m, [p], transactional=True)
    assert torch.equal(bits(m.w.detach()), bits(start))
    if report:
        r = info.value.report
        assert r.rolled_back
        assert r.writes["written"].tolist() == [2]


@needs_compiler
@pytest.mark.parametrize("what", ["build", "folder"])
def test_a_build_any_user_may_write_is_never_loaded(fresh_build, what):
    # (another user could have put their code there: loading it would run it here)
    assert native.status().startswith("compiled")
    (lib,) = fresh_build.glob("native-*.so")
    bad = lib if what == "build" else fresh_build
    bad.chmod(bad.stat().st_mode | 0o002)
    native._reset_for_tests()
    try:
        status = native.status()
        assert status.startswith("torch ops (not "), status
        assert f"any user may write {bad}" in status
        assert native.compare_copy(torch.zeros(4), torch.ones(4), None) is None
    finally:
        bad.chmod(bad.stat().st_mode & ~0o002)


@needs_compiler
@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0,
                    reason="only root can give a file to another user")
def test_a_build_another_user_owns_is_never_loaded(fresh_build, monkeypatch, tmp_path):
    # The temporary folder's patchkit-native-<uid>, made first by someone else.
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    planted = temporary / "patchkit-native-0"
    planted.mkdir()
    os.chown(planted, 65534, 65534)
    monkeypatch.setattr(native, "_cache_dir", lambda: Path("/proc/no-cache-here"))
    monkeypatch.setattr(native.tempfile, "gettempdir", lambda: str(temporary))
    status = native.status()
    assert status == (f"torch ops (not building or loading in {planted}: {planted} belongs "
                      "to another user (uid 65534))"), status
    assert not list(planted.iterdir())


@pytest.mark.parametrize(("xdg", "want"), [
    ("/somewhere/cache", "/somewhere/cache/patchkit"),
    ("relative/cache", "~/.cache/patchkit"),  # the XDG spec: ignored (was: under the cwd)
    ("", "~/.cache/patchkit"),
])
def test_the_cache_folder_follows_xdg_cache_home_when_it_is_absolute(monkeypatch, xdg, want):
    monkeypatch.delenv("PATCHKIT_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", xdg)
    assert native._cache_dir() == Path(os.path.expanduser(want))


@needs_compiler
@pytest.mark.parametrize("share", [0.002, 0.2, 0.6])
@pytest.mark.parametrize("how", ["report", "rollback"])
def test_changes_that_the_sample_blocks_miss_are_saved_and_counted_exactly(share, how):
    # The compiled save estimates a big view's changes from evenly spaced sample blocks:
    # changes placed only between them read as none, so the compact buffer is planned
    # small: it grows (20 %) or overflows (60 %: what was written goes back, and the view
    # is saved whole). Every changed element must still be saved, counted and put back.
    from patchkit.toymodels import PlainModel

    n = 2 * native._SAMPLE_MIN
    step = (n - native._SAMPLE_BLOCK) // (native._SAMPLE_BLOCKS - 1)
    sampled = torch.zeros(n, dtype=torch.bool)
    for i in range(native._SAMPLE_BLOCKS):
        sampled[i * step:i * step + native._SAMPLE_BLOCK] = True
    g = torch.Generator().manual_seed(3)
    old = torch.randn(n, generator=g)
    changed = ~sampled & (torch.rand(n, generator=g) < share)
    assert int(changed.sum()) > 0
    new = torch.where(changed, old + 1.0, old)
    patch = CheckpointWeightPatch("w", (n,), torch.float32, new)
    if how == "report":
        m = PlainModel({"w": (n,)})
        m.w.data.copy_(old)
        r = inspect_load(m, [patch])
        assert torch.equal(m.w.detach(), new) and torch.equal(r.before("w"), old)
        assert r.deltas.loc["w", ["elements", "changed"]].tolist() == [n, int(changed.sum())]
        assert r.writes["changed"].tolist() == [int(changed.sum())]
        return

    class Fails(PlainModel):
        def load_weights(self, weights):
            super().load_weights(weights)
            raise RuntimeError("after writing")

    m = Fails({"w": (n,)})
    m.w.data.copy_(old)
    with pytest.raises(RuntimeError, match="after writing"):
        patchkit.load_checkpoint_weight_patches(m, [patch], transactional=True)
    assert torch.equal(bits(m.w.detach()), bits(old))


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_part_whose_room_ends_inside_a_window_saves_nothing_past_it(dtype):
    """The first of two parts has room for 4096 entries and 4097 changes, the last of
    them alone in the window after the room's end. The part must stop there (the entry
    past its room is the second part's first) and go on in a grown buffer: each change
    saved once, where it was, and none of the second part's lost."""
    n = native._PARALLEL_MIN
    g = torch.Generator().manual_seed(9)
    dest = torch.randn(n, generator=g).to(dtype)
    src = dest.clone()
    src[:4097] += 1.0  # part 0: 4096 changes fill its room, the 4097th in the next window
    src[n // 2 + 100 : n // 2 + 140] += 1.0  # part 1's own changes, from its first entry
    start, before = dest.clone(), dest.clone()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native, "_threads", lambda: 2)
        assert len(native._parts(n)) == 3  # two parts
        got = native.compare_copy(dest, src, dtype)
    assert got.index is not None, "meant to be a compact save"
    _assert_matches_reference(got, dest, start, before, dest, src, (slice(None),), dtype, True)
    assert got.changed == 4097 + 40


@needs_compiler
def test_bfloat16_compact_squares_of_tiny_old_values_that_all_change():
    """A compact save of a bfloat16 view whose first run (4096 elements) holds tiny old
    values, every one of them changed to zero: float32 squares them to 0, and the run's
    values left in the view are all zeros, so only the saved old values say that the run
    must be summed again in double. ``squares`` is theirs, not 0."""
    n = 1 << 17  # 256 KiB: a compact save
    dest = torch.zeros(n, dtype=torch.bfloat16)
    dest[:4096] = 1e-30
    src = dest.clone()
    src[:4096] = 0.0
    before = dest.clone()
    got = native.compare_copy(dest, src, torch.bfloat16)
    assert got.index is not None, "meant to be a compact save"
    want = _reference(before, src, torch.bfloat16)
    assert got.changed == want["changed"] == 4096
    assert want["squares"] > 0.0
    assert math.isclose(got.squares, want["squares"], rel_tol=1e-12, abs_tol=0), (
        got.squares, want["squares"])


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_whole_save_counts_every_change_of_a_long_row_of_2_byte_elements(dtype):
    """Whole mode counts changes in 16 lanes as wide as an element, a run of at most 4096
    elements at a time: a row of 2 M changed 2-byte elements on one thread (131072 a
    lane, past 65535) is counted whole."""
    n = 1 << 21
    dest = torch.zeros(n, dtype=dtype)
    src = torch.ones(n, dtype=dtype)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native, "_threads", lambda: 1)
        got = native.compare_copy(dest, src, dtype)
    assert got.index is None, "meant to be a whole save"
    assert got.changed == n
    assert got.sum_abs == n and got.max_abs == 1.0


# NaNs at the edges of each dtype's bits: the smallest payload (a signaling NaN whose
# only set bit is the lowest), the largest, and both signs; and the infinities beside
# them, which are values. (unsigned bit patterns, as integers of the element's width)
_EDGE_NANS = {
    torch.float64: ([0x7FF0000000000001, 0xFFF0000000000001, 0x7FFFFFFFFFFFFFFF,
                     0x7FF0000080000000], [0x7FF0000000000000, 0xFFF0000000000000]),
    torch.float32: ([0x7F800001, 0xFF800001, 0x7FFFFFFF, 0x7FC00000],
                    [0x7F800000, 0xFF800000]),
    torch.bfloat16: ([0x7F81, 0xFF81, 0x7FFF, 0x7FC0], [0x7F80, 0xFF80]),
    torch.float16: ([0x7C01, 0xFC01, 0x7FFF, 0x7E00], [0x7C00, 0xFC00]),
}


@needs_compiler
@pytest.mark.parametrize("dtype", sorted(_EDGE_NANS, key=str))
@pytest.mark.parametrize("save", [False, True])
def test_merge_keeps_the_destination_under_every_nan_and_writes_the_infinities(dtype, save):
    """Every NaN bit pattern means "keep" (CONTRACT §4), whatever its payload or sign,
    for the merge, its count and a patch's entries; an infinity is a value and is
    written."""
    nans, infs = _EDGE_NANS[dtype]
    width = dtype.itemsize * 8
    pattern = (nans + infs) * 5  # 30 elements: full blocks of 16 and a tail
    ints = torch.tensor([v - (1 << width) if v >= 1 << (width - 1) else v for v in pattern],
                        dtype=torch.int64).to({2: torch.int16, 4: torch.int32,
                                               8: torch.int64}[dtype.itemsize])
    src = ints.view(dtype)
    assert torch.isnan(src).sum() == 4 * 5 and torch.isinf(src).sum() == 2 * 5
    dest = torch.arange(len(pattern), dtype=torch.float32).to(dtype)
    before = dest.clone()
    want = torch.where(torch.isnan(src), before, src)
    got = native.merge(dest, src, save=save)
    assert torch.equal(bits(dest), bits(want))
    written = ~torch.isnan(src)
    assert (got.written, got.changed) == (10, 10)
    if save:
        assert torch.equal(got.index, written.nonzero().reshape(-1))
        assert torch.equal(bits(got.before), bits(before[written]))
    found = native.patch_entries(torch.arange(len(pattern)), src, 0, dest, src)
    assert found.count == 10


@needs_compiler
def test_a_compact_save_planned_past_the_whole_views_bytes_gives_up_at_them():
    """The sample of a one-part float32 view sees 30 % of it change, plans room for
    40 %, and 36 % changes: a compact save of that would fit the room but cost more than
    the whole view, so the room is never planned past the view's bytes (a third of its
    elements) and the save, on reaching them, turns whole."""
    n = 1 << 17
    g = torch.Generator().manual_seed(4)
    dest = torch.randn(n, generator=g)
    outside = _outside_the_sample(n)
    seen = (~outside).nonzero().reshape(-1)
    changed = outside & (torch.rand(n, generator=g) < 0.36)
    changed[seen[torch.randperm(seen.numel(), generator=g)[: round(0.3 * seen.numel())]]] = True
    src = torch.where(changed, dest + 1.0, dest)
    start, before = dest.clone(), dest.clone()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native, "_threads", lambda: 1)
        got = native.compare_copy(dest, src, torch.float32)
    assert got.index is None, "a compact save past the whole view's bytes"
    _assert_matches_reference(
        got, dest, start, before, dest, src, (slice(None),), torch.float32, True
    )


@needs_compiler
def test_a_compiler_without_openmp_still_builds_the_portable_flags(fresh_build, tmp_path):
    """A compiler that refuses -fopenmp: the build goes on to the flags without it, and
    the parts run on patchkit's own threads."""
    import shutil

    cc = tmp_path / "cc-without-openmp"
    cc.write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do [ "$a" = -fopenmp ] && { echo "no -fopenmp here" >&2; exit 1; }; done\n'
        f'exec {shutil.which(os.environ.get("CC") or "cc")} "$@"\n'
    )
    cc.chmod(0o755)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CC", str(cc))
        native._reset_for_tests()
        assert native.status().endswith("parts on patchkit's threads)"), native.status()


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_merge_statistics_leave_out_old_values_that_are_not_finite(dtype):
    """A written element whose old value is an infinity or NaN adds nothing to
    ``squares`` (the sum of squares of the finite old values, as :class:`CopyResult`'s),
    and its change, not finite, nothing to the differences."""
    dest = torch.tensor([1.0, float("inf"), 2.0, float("-inf"), float("nan"), 3.0] * 4).to(dtype)
    src = torch.full(dest.shape, float("nan")).to(dtype)
    src[:] = torch.tensor([5.0, 4.0, float("nan"), 6.0, 7.0, 3.0] * 4).to(dtype)
    before = dest.clone()
    got = native.merge(dest, src, save=False, stats=True)
    written = ~torch.isnan(src)
    want = _reference(before[written], dest[written], dtype)
    assert (got.written, got.changed) == (20, want["changed"]) == (20, 16)
    assert got.squares == want["squares"] == 4 * (1.0 + 9.0)
    for key in ("sum_abs", "sum_sq_diff", "max_abs"):
        assert getattr(got, key) == want[key], key
    assert got.sum_abs == 4 * 4.0


@needs_compiler
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_a_patchs_entry_checksums_are_the_documented_sums_of_big_indices(index_dtype):
    """:class:`PatchEntries`' checksums are the sums of ``i & 0x7fffffff`` and of
    ``(i % 65521) * 40503 % 65521`` over the entries written, for indices of every size
    (the recipe a report recomputes and compares them with)."""
    start = 2**31 - 100 if index_dtype == torch.int32 else 3 * 2**31 + 5
    idx = torch.tensor([start + 1, start + 9, start + 30, start + 62, start + 63, start + 64,
                        start - 1], dtype=torch.int64)
    vals = torch.tensor([1.0, 2.0, float("nan"), 4.0, 5.0, 6.0, 7.0])
    dest, src = torch.zeros(64), torch.zeros(64)  # the view: checkpoint elements start...+63
    found = native.patch_entries(idx.to(index_dtype), vals, start, dest, src)
    inside = [i for i, v in zip(idx.tolist(), vals.tolist())
              if v == v and start <= i < start + 64]
    assert found.count == len(inside) == 4
    assert found.checksums == (sum(i & 0x7FFFFFFF for i in inside),
                               sum((i % 65521) * 40503 % 65521 for i in inside))
    at = [i - start for i in inside]
    assert found.position_sums == (sum(at), sum(a * a for a in at))


@needs_compiler
def test_a_patchs_position_sums_wrap_modulo_2_64():
    """The sum of squared positions passes 2**63 (many entries far into a big view): the
    sums come back modulo 2**64, never negative (a merge's sums come back so too)."""
    n = 1 << 26  # (never written: the entries are counted from the patch alone)
    dest, src = torch.empty(n), torch.empty(n)
    idx = torch.full((2100,), n - 1, dtype=torch.int64)
    found = native.patch_entries(idx, torch.ones(2100), 0, dest, src)
    assert found.count == 2100
    assert 2**63 <= 2100 * (n - 1) ** 2 < 2**64
    assert found.position_sums == (2100 * (n - 1), 2100 * (n - 1) ** 2)


@needs_compiler
@pytest.mark.parametrize("save", [False, True])
@pytest.mark.parametrize("parts", [1, 2, 3])
def test_a_merge_in_one_two_or_three_parts_counts_what_every_part_wrote(parts, save):
    # (two parts: any view of 2**18 to 3 * 2**20 elements on two threads)
    n = 270
    g = torch.Generator().manual_seed(parts)
    dest = torch.randn(n, generator=g)
    src = torch.full((n,), float("nan"))
    at = torch.randperm(n, generator=g)[:100].sort().values
    src[at] = torch.randn(100, generator=g)
    src[at[:7]] = dest[at[:7]]  # written, not changed
    want = torch.where(torch.isnan(src), dest, src)
    before = dest.clone()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native, "_PARALLEL_MIN", 256)
        mp.setattr(native, "_PART", 96)
        mp.setattr(native, "_threads", lambda: parts)
        assert len(native._parts(n)) - 1 == parts
        got = native.merge(dest, src, save=save)
    assert got is not None and torch.equal(bits(dest), bits(want))
    assert (got.written, got.changed) == (100, 93)
    assert got.position_sums == (int(at.sum()), int((at * at).sum()))
    if save:
        assert torch.equal(bits(got.before), bits(before[at]))


@needs_compiler
def test_a_one_part_merges_position_sums_wrap_modulo_2_64():
    """On one thread a view of any size is one part: the squares of the last 16384 of
    2**25 written positions add up past 2**63, and come back modulo 2**64, never
    negative, as a merge of several parts gives them."""
    n, k = 1 << 25, 1 << 14
    dest = torch.zeros(n, dtype=torch.bfloat16)
    src = torch.full((n,), float("nan"), dtype=torch.bfloat16)
    src[n - k:] = 1.0
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native, "_threads", lambda: 1)
        got = native.merge(dest, src, save=False)
    assert got is not None and got.written == got.changed == k
    at = range(n - k, n)
    squares = sum(a * a for a in at)
    assert squares >= 2**63
    assert got.position_sums == (sum(at) % 2**64, squares % 2**64)
    assert bool((dest[n - k:] == 1).all()) and not bool(dest[:n - k].any())


@needs_compiler
def test_merge_leaves_a_source_of_another_shape_to_torch():
    """As :func:`compare_copy`: a source of another shape (as many elements, or fewer) is
    not walked by the destination's shape; ``None``, nothing written."""
    dest = torch.zeros(4, 1000)
    for source in (torch.ones(1000, 4), torch.ones(1000), torch.ones(4, 999)):
        assert native.merge(dest, source, save=True) is None
        assert native.merge(dest, source, save=False, stats=True) is None
        assert torch.equal(dest, torch.zeros(4, 1000)), "a refused merge must not write"


@needs_compiler
@pytest.mark.parametrize("layout", ["flat", "columns"])
def test_the_sample_reads_every_position_of_its_blocks_and_no_other(layout):
    """``_changed_share`` of a big view reads ``_SAMPLE_BLOCKS`` blocks of
    ``_SAMPLE_BLOCK`` consecutive positions each, evenly spaced: changes at all of them
    and nowhere else make a share of exactly 1, changes everywhere else one of 0."""
    base = torch.randn(1100, 130)
    dest = base if layout == "flat" else base[:, 3:123]
    n = dest.numel()
    assert n >= native._SAMPLE_MIN
    length, drs, _ = native._rows(dest, dest)
    f32 = native._library().kinds["f32"]
    outside = _outside_the_sample(n)
    for where, want in ((~outside, 1.0), (outside, 0.0)):
        src = dest.clone()
        src.view(-1)[where] += 1.0
        share, exact = native._changed_share(f32, dest.data_ptr(), src.data_ptr(), length,
                                             drs, length, n)
        assert (share, exact) == (want, None)


@needs_compiler
@pytest.mark.parametrize(("dtype", "third"), [(torch.float64, 2048), (torch.float32, 1366)],
                         ids=["float64", "float32"])
def test_a_sample_that_says_a_compact_save_would_cost_more_saves_whole_at_once(dtype, third):
    """The sample decides: where its changed share times (8 + element size) bytes reaches
    the element size (a compact save as big as the whole view: half the sampled positions
    of float64, a third of float32's), the view is saved whole straight away, whatever the
    unsampled rest holds; one change fewer in the sample, compact (here just the
    changes)."""
    n = 1 << 17
    seen = (~_outside_the_sample(n)).nonzero().reshape(-1)
    assert seen.numel() == native._SAMPLE
    for hits, whole in ((third, True), (third - 1, False)):
        dest = torch.randn(n, dtype=torch.float64).to(dtype)
        src = dest.clone()
        src[seen[:hits]] += 1.0
        before = dest.clone()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(native, "_threads", lambda: 1)
            got = native.compare_copy(dest, src, None)
        assert torch.equal(dest, src) and got.changed == hits
        if whole:
            assert got.index is None and torch.equal(got.before, before)
        else:
            assert torch.equal(got.index, seen[:hits].sort().values)


@needs_compiler
@pytest.mark.parametrize("cols", [slice(100, 356), slice(None, None, 2)], ids=["slice", "step"])
def test_a_source_is_walked_by_its_own_strides(cols):
    """The source's geometry counts as much as the destination's: a contiguous
    destination fed by a column slice of a wider matrix (its rows further apart) is copied
    and merged from the slice's elements; a source whose elements are not contiguous
    within a row is left to torch ops (``None``, nothing written)."""
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(300, 512, generator=g)
    staged = torch.full_like(wide, float("nan"))
    staged[::2] = wide[::2]
    walkable = cols.step is None
    for src in (wide[:, cols], staged[:, cols]):  # (300 x 256 float32: 300 KiB)
        assert (native._rows(torch.empty(src.shape), src) is not None) == walkable
        dest = torch.randn(src.shape, generator=g)
        dest[::3] = wide[::3, cols]
        before = dest.clone()
        if torch.isnan(src).any():
            got = native.merge(dest, src, save=True)
            want = torch.where(torch.isnan(src), before, src)
        else:
            got = native.compare_copy(dest, src, torch.float32)
            want = src
        if walkable:
            assert torch.equal(dest, want) and got.changed == int((before != want).sum())
        else:
            assert got is None and torch.equal(dest, before)


def test_rows_skip_dimensions_of_size_one_whatever_their_stride():
    """A dimension of size one moves nowhere, so its stride (torch keeps whatever a view
    gave it) does not stop a view from being rows: a row turned into a column, a column
    slice with a unit dimension moved in."""
    w = torch.zeros(3, 8)
    column = w[1:2, 2:6].t()  # (4, 1), strides (1, 8)
    assert native._rows(column, torch.zeros(4, 1)) == (4, 4, 4)
    boxed = w[:, 2:6][:, :, None].transpose(1, 2)  # (3, 1, 4), strides (8, 1, 1)
    assert native._rows(boxed, torch.zeros(3, 1, 4)) == (4, 8, 4)
    assert native._rows(torch.zeros(2, 1, 3).as_strided((2, 1, 3), (3, 0, 1)),
                        torch.zeros(2, 1, 3)) == (6, 6, 6)


def test_a_failed_build_says_the_compilers_last_error_line(fresh_build, tmp_path):
    """The status of a failed build quotes the compiler's last line on stderr (where
    compilers put the error that stopped them, after the notes that lead to it), and
    ``(no message)`` for a compiler that said nothing."""
    cc = tmp_path / "cc-that-fails"
    cc.write_text("#!/bin/sh\necho 'a note: in a file included from x.h' >&2\n"
                  "echo 'error: the last line' >&2\nexit 1\n")
    cc.chmod(0o755)
    for compiler, says in ((str(cc), "error: the last line"), ("false", "(no message)")):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("CC", compiler)
            native._reset_for_tests()
            assert native.status() == f"torch ops (compiling _native.c failed: {says})"


def test_no_writable_folder_for_the_build_means_torch_ops(fresh_build, monkeypatch, tmp_path):
    """Neither the cache folder nor the temporary folder's fallback can be written: no
    build, torch ops, and the status names both folders."""
    import tempfile

    making = tempfile.mkstemp
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    fallback = temporary / f"patchkit-native-{os.getuid()}"

    def refuse(*args, dir=None, **kw):
        if dir is not None and Path(dir) in (fresh_build, fallback):
            raise PermissionError(13, "Read-only file system", str(dir))
        return making(*args, dir=dir, **kw)

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(temporary))
    assert native.status() == (
        f"torch ops (no writable folder for the build ({fresh_build}, {fallback}))"
    )
    assert native.compare_copy(torch.zeros(4), torch.ones(4), None) is None
    assert not list(fresh_build.glob("*.so")) and not list(fallback.glob("*"))


def test_memory_handed_over_through_two_storage_objects_is_lent_once():
    """Two storage objects over the same memory (``torch.from_numpy`` of one array twice)
    are one buffer: lent to one save, never to two at once."""
    import numpy as np

    array = np.zeros(2 * native._REUSE_MIN, dtype=np.uint8)
    one, other = (torch.from_numpy(array).untyped_storage() for _ in range(2))
    assert one is not other and one.data_ptr() == other.data_ptr()
    n = native._REUSE_MIN // 4 * 2  # float32 elements in 2 * _REUSE_MIN bytes
    with native.reusing([one, other]):
        first = native._empty(n, torch.float32)
        second = native._empty(n, torch.float32)
    assert first.data_ptr() == one.data_ptr()
    assert second.data_ptr() != one.data_ptr(), "one buffer lent to two saves"


def test_reusing_blocks_nest():
    """An inner ``reusing`` block lends its own storages; when it ends the outer block's
    pool is back (what it had not lent yet), and after the outer block nothing is lent."""
    size = 2 * native._REUSE_MIN
    outer = [torch.empty(size, dtype=torch.uint8).untyped_storage() for _ in range(2)]
    inner = torch.empty(size, dtype=torch.uint8).untyped_storage()
    with native.reusing(outer):
        assert native._empty(size, torch.uint8).data_ptr() == outer[0].data_ptr()
        with native.reusing([inner]):
            assert native._empty(size, torch.uint8).data_ptr() == inner.data_ptr()
        assert native._empty(size, torch.uint8).data_ptr() == outer[1].data_ptr()
    got = native._empty(size, torch.uint8).data_ptr()
    assert got not in {st.data_ptr() for st in [*outer, inner]}


@needs_compiler
def test_disabled_blocks_nest():
    """The compiled path stays off until the outermost ``disabled`` block ends."""
    with native.disabled():
        with native.disabled():
            pass
        assert native.compare_copy(torch.zeros(4), torch.ones(4), None) is None
    assert native.compare_copy(torch.zeros(4), torch.ones(4), None) is not None


@needs_compiler
def test_a_build_for_another_cpu_is_not_loaded(fresh_build, monkeypatch):
    """The cache key names the CPU's features: a cache folder shared with a machine of
    another CPU (a home folder on several machines) holds a build per CPU, and each
    machine loads its own."""
    assert native.status().startswith("compiled")
    (first,) = fresh_build.glob("native-*.so")
    monkeypatch.setattr(native, "_cpu_id", lambda: "flags : another cpu's features")
    native._reset_for_tests()
    assert native.status().startswith("compiled")
    (second,) = set(fresh_build.glob("native-*.so")) - {first}
    assert native.status().startswith(f"compiled ({second}; ")


@needs_compiler
def test_merge_leaves_a_source_of_another_dtype_to_torch():
    """A source of another dtype is not read as the destination's bits (a float64 one
    read as float32 wrote its halves, none of them NaN): ``None``, nothing written."""
    dest = torch.zeros(4, 1000)
    for source in (torch.ones(4, 1000, dtype=torch.float64), torch.ones(4, 1000).bfloat16()):
        assert native.merge(dest, source, save=True) is None
        assert native.merge(dest, source, save=False, stats=True) is None
        assert torch.equal(dest, torch.zeros(4, 1000)), "a refused merge must not write"


@needs_compiler
@pytest.mark.parametrize("less", [1, 0])
def test_a_view_of_exactly_whole_below_bytes_is_saved_compact(less):
    """"Under 128 KiB" is strict: a view of one element less is saved whole, one of
    exactly ``_WHOLE_BELOW`` bytes saves only the elements that change."""
    n = native._WHOLE_BELOW // 4 - less
    dest, src = torch.zeros(n), torch.zeros(n)
    src[::1000] = 1.0
    start = dest.clone()
    got = native.compare_copy(dest, src, torch.float32)
    assert got is not None and got.changed == len(range(0, n, 1000))
    if less:
        assert got.index is None and torch.equal(got.before, start)
    else:
        assert got.index is not None and got.index.tolist() == list(range(0, n, 1000))
        assert got.before.tolist() == [0.0] * got.changed
    assert torch.equal(dest, src)


@needs_compiler
def test_a_build_in_a_cache_folder_that_cannot_be_written_is_still_loaded(fresh_build, monkeypatch,
                                                                          tmp_path):
    # (a read-only home with the build made before: it is read there, not made again in
    # the temporary folder)
    built = native.status()
    (lib,) = fresh_build.glob("native-*.so")
    assert built.startswith(f"compiled ({lib}"), built
    temporary = _cache_read_only(fresh_build, monkeypatch, tmp_path)
    native._reset_for_tests()
    assert native.status() == built
    assert not list(temporary.iterdir()), "nothing built in the temporary folder"


@needs_compiler
@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0,
                    reason="only root can make a file root's for another user")
def test_a_build_root_owns_is_loaded_by_another_user(fresh_build, monkeypatch):
    # Root's files are trusted, as the system's own libraries are: a build root made (in a
    # folder root owns, that no one else may write) loads in another user's process.
    built = native.status()
    assert built.startswith("compiled"), built
    monkeypatch.setattr(native.os, "getuid", lambda: 4242)
    native._reset_for_tests()
    assert native.status() == built
    os.chown(fresh_build, 65534, 65534)  # (and a folder of a third user's is refused)
    native._reset_for_tests()
    assert native.status().startswith(f"torch ops (not building or loading in {fresh_build}: ")


@needs_compiler
def test_reusing_lends_cpu_storages_only():
    # (a report loop's last report may hold saves on another device: the CPU saves of
    # this load never go there; a meta storage stands in for a GPU's here)
    elsewhere = torch.empty(1 << 17, device="meta").untyped_storage()  # (the size a save needs)
    dest, src = torch.zeros(1 << 17), torch.ones(1 << 17)
    with native.reusing([elsewhere]):
        got = native.compare_copy(dest, src, torch.float32)
    assert got is not None and got.before.device.type == "cpu"
    assert got.index is None and torch.equal(got.before, torch.zeros(1 << 17))
    assert torch.equal(dest, src)


@needs_compiler
def test_a_build_removes_the_unfinished_builds_that_killed_processes_left(fresh_build):
    # (was: a worker killed while it built left its compiler's output file in the cache
    # folder, under a name nothing ever renamed or removed; one more for every such kill)
    import time

    old = time.time() - 3600
    stale = fresh_build / "native-0123456789abcdef.k1ll3d.partial"
    recent = fresh_build / "native-0123456789abcdef.bu1ld1.partial"  # (a build going on)
    theirs = fresh_build / "tmpk1ll3d.so"  # (not a name patchkit gives: left alone)
    for f in (stale, recent, theirs):
        f.write_bytes(b"")
    for f in (stale, theirs):
        os.utime(f, (old, old))
    assert native.status().startswith("compiled")
    assert sorted(p.name for p in fresh_build.iterdir()) == sorted(
        [recent.name, theirs.name, *(p.name for p in fresh_build.glob("native-*.so"))])
    assert len(list(fresh_build.glob("native-*.so"))) == 1


def test_a_build_compiles_under_the_name_a_later_build_removes(tmp_path, monkeypatch):
    # (mutation testing: a build compiling into a file of another name, which no later
    # build would ever remove, and a clean-up of every *.partial, the user's files
    # included, each passed every test)
    import fnmatch
    import subprocess
    import time

    seen = []

    def compiler(cmd, **kwargs):  # (where the compiler is told to write the library)
        out = cmd[cmd.index("-o") + 1]
        seen.append((out, sorted(str(p) for p in tmp_path.iterdir())))
        return subprocess.CompletedProcess(cmd, 1, "", "error: no compiler here")

    monkeypatch.setattr(native.subprocess, "run", compiler)
    assert native._compile("cc", [], tmp_path / "native-0123456789abcdef.so") == (
        "error: no compiler here")
    ((out, there),) = seen
    assert there == [out]  # (in the cache folder, made before the compiler ran)
    assert fnmatch.fnmatch(os.path.basename(out), "native-0123456789abcdef.*.partial")
    assert list(tmp_path.iterdir()) == []  # (a failed build removes it)
    # a later build removes such a file once it is old, and no other *.partial
    old = time.time() - 3600
    for name in ("native-0123456789abcdef.k1ll3d.partial", "download.partial"):
        (tmp_path / name).write_bytes(b"")
        os.utime(tmp_path / name, (old, old))
    native._remove_stale_partials(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["download.partial"]
