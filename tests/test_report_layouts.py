"""A report's ``before()``, ``written()``, ``deltas`` and the reads ``plot_delta`` makes, for
writes through views of every layout a loader uses, against a snapshot taken before the
load; and what rebuilding them costs: views saved or written whole are addressed as
boxes of their tensor, with no index array of the tensor's size (see
``patchkit.inspect._Box``)."""

from __future__ import annotations

import collections
import contextlib
import math
import random

import pytest
import torch
from test_inspect import vllm_style_loader
from test_report_oracle import check, logged_load, snapshot
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import patchkit
import patchkit._marks as pk_marks
import patchkit._regions as pk_regions
import patchkit._runtime_index as pk_runtime_index
import patchkit.inspect as pk_inspect
import patchkit.intercept as pk_intercept
from patchkit import CheckpointWeightPatch, inspect_load, load_checkpoint_weight_patches, native
from patchkit._regions import _storage_offsets
from patchkit.bitwise import bits, device_passes

# The modules of the session that look up a helper by name, each for its own uses (a
# test that counts a helper's calls patches it in each)
_SESSION_MODULES = (pk_regions, pk_runtime_index, pk_marks, pk_intercept)


class Flat(torch.nn.Module):
    """Runtime tensors that are views of one flat storage (``params``: name ->
    ``(offset, shape, stride)``); ``load_weights`` writes each patch through the view its
    name is given in ``writes`` (the same kind of triple), with ``copy_``."""

    def __init__(self, size, params, writes, dtype, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.flat = torch.randn(size, generator=g).to(dtype)  # (not a runtime tensor)
        self.writes = writes
        for name, (off, shape, stride) in params.items():
            self.register_parameter(name, torch.nn.Parameter(
                self.flat.as_strided(shape, stride, off), requires_grad=False))

    def load_weights(self, weights):
        for name, t in weights:
            off, shape, stride = self.writes[name]
            self.flat.as_strided(shape, stride, off).copy_(t)
        return {n for n, _ in weights}


R, C = 48, 40  # a view of 48 x 40 float32 is 7.5 KiB: the compiled path saves it whole
R2, C2 = 192, 180  # ... and of 192 x 180, 135 KiB: compact where few elements change

# name: (storage size, runtime tensors, writes in the order sent)
LAYOUTS = {
    # param.data.t().copy_(w): a dense write through a transposed view
    "transposed": (R2 * C2, {"w": (0, (C2, R2), (R2, 1))},
                   [("w", (0, (R2, C2), (1, R2)))]),
    # one name sent twice: two saves of one view
    "repeated": (R2 * C2, {"w": (0, (R2, C2), (C2, 1))},
                 [("w", (0, (R2, C2), (C2, 1))), ("w", (0, (R2, C2), (C2, 1)))]),
    # gate and up in the halves of the columns of one fused matrix
    "columns": (R2 * 2 * C2, {"gate_up": (0, (R2, 2 * C2), (2 * C2, 1))},
                [("gate", (0, (R2, C2), (2 * C2, 1))), ("up", (C2, (R2, C2), (2 * C2, 1)))]),
    # gate and up interleaved: param[0::2] and param[1::2]
    "interleaved": (2 * R2 * C2, {"gate_up": (0, (2 * R2, C2), (C2, 1))},
                    [("gate", (0, (R2, C2), (2 * C2, 1))), ("up", (C2, (R2, C2), (2 * C2, 1)))]),
    # three tensors in one flat storage: a write over the middle one and half of the next,
    # a transposed write into the last, a small one into the first
    "shared": (3 * R * C, {"a": (0, (R, C), (C, 1)), "b": (R * C, (R, C), (C, 1)),
                           "c": (2 * R * C, (R, C), (C, 1))},
               [("bc", (R * C, (R + R // 2, C), (C, 1))),
                ("c", (2 * R * C, (C, R), (1, C))),
                ("a", (C, (2, C), (C, 1)))]),
    # a column block, then rows across it, then the whole tensor transposed: overlapping
    "crossing": (R2 * C2, {"w": (0, (R2, C2), (C2, 1))},
                 [("cols", (3, (R2, 5), (C2, 1))), ("rows", (10 * C2, (7, C2), (C2, 1))),
                  ("all", (0, (C2, R2), (1, C2)))]),
    # a runtime tensor that is not contiguous (kept transposed), written whole and in part
    "strided": (R * C, {"w": (0, (C, R), (1, C))},
                [("w", (0, (C, R), (1, C))), ("part", (2 * C, (5, R - 2), (1, C)))]),
}

PATHS = {
    "compiled": contextlib.nullcontext,
    "torch ops": native.disabled,
    "device passes": lambda: _both(native.disabled(), device_passes()),  # a GPU's, on the CPU
}


@contextlib.contextmanager
def _both(a, b):
    with a, b:
        yield


def _patches(model, writes, share, dtype, seed):
    """A dense patch per write: the view's values now, ``share`` of them changed."""
    g = torch.Generator().manual_seed(seed)
    ps = []
    for name, (off, shape, stride) in writes:
        now = model.flat.as_strided(shape, stride, off).float()
        new = torch.where(torch.rand(shape, generator=g) < share,
                          torch.randn(shape, generator=g), now)
        ps.append(CheckpointWeightPatch(name, shape, dtype, new.to(dtype).reshape(-1)))
    return ps


def _expected_written(size, params, writes):
    flat = torch.zeros(size, dtype=torch.bool)
    for _, (off, shape, stride) in writes:
        flat.as_strided(shape, stride, off).fill_(True)
    return {n: flat.as_strided(shape, stride, off).clone() for n, (off, shape, stride)
            in params.items()}


def _read_all(reader, n, step):
    """What plot_delta reads: the whole tensor, ``step`` elements at a time."""
    befores, afters, written = [], [], []
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        b, a, w = reader.read(lo, hi)
        befores.append(b.clone())
        afters.append(a.clone())
        written.append(torch.arange(lo, hi) if w is None else w + lo)
    return torch.cat(befores), torch.cat(afters), torch.cat(written)


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("share", [0.03, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_report_rebuilds_every_layout_bit_for_bit(layout, dtype, share, path):
    size, params, writes = LAYOUTS[layout]
    model = Flat(size, params, dict(writes), dtype)
    snap = {n: t.detach().clone() for n, t in model.named_parameters()}
    flat_before = model.flat.clone()
    patches = _patches(model, writes, share, dtype, seed=1)
    with PATHS[path]():
        r = inspect_load(model, patches)
    expected = _expected_written(size, params, writes)
    # the load wrote where the writes say, and only there
    outside = ~_expected_written(size, {"all": (0, (size,), (1,))}, writes)["all"]
    assert torch.equal(bits(model.flat)[outside], bits(flat_before)[outside])
    _check(r, model, snap, expected)


def _check(r, model, snap, expected):
    """``r``'s before(), written(), deltas and plot_delta reads against the snapshot
    ``snap`` taken before the load and the ``expected`` written masks."""
    for name, before in snap.items():
        after = getattr(model, name).detach()
        mask = expected[name]
        assert torch.equal(bits(r.before(name)), bits(before)), name
        assert r.before(name).is_contiguous()
        assert torch.equal(r.written(name), mask), name
        if mask.any():
            row = r.deltas.loc[name]
            d = (after.double() - before.double())[mask]
            assert row["elements"] == int(mask.sum())
            assert row["changed"] == int((bits(after) != bits(before))[mask].sum())
            assert row["max_abs"] == pytest.approx(float(d.abs().max()), rel=1e-5)
            assert row["mean_abs"] == pytest.approx(float(d.abs().mean()), rel=1e-5)
            norm = float(before.double()[mask].norm())
            assert row["rel_l2"] == pytest.approx(float(d.norm()) / norm, rel=1e-5)
        else:
            assert name not in r.deltas.index
        # plot_delta's reads, in pieces that cut rows and boxes anywhere
        n = before.numel()
        for step in (7, 100, n):
            b, a, w = _read_all(r._before_after(name), n, step)
            assert torch.equal(bits(b), bits(before.reshape(-1)))
            assert torch.equal(bits(a), bits(after.reshape(-1)))
            assert torch.equal(w, torch.nonzero(mask.reshape(-1)).reshape(-1))


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("few_first", [True, False])
@pytest.mark.parametrize("layout", ["transposed", "columns", "interleaved"])
def test_compact_and_whole_saves_of_one_view_rebuild_bit_for_bit(layout, few_first, path):
    # One name sent twice: a write that changes few elements (saved with their offsets:
    # a run of positions) and one that changes them all (saved whole: a box), overlapping
    # in one tensor; the oldest save wins.
    size, params, writes = LAYOUTS[layout]
    writes = [writes[0], writes[0]]
    model = Flat(size, params, dict(writes), torch.float32)
    snap = {n: t.detach().clone() for n, t in model.named_parameters()}
    (every,) = _patches(model, writes[:1], 1.0, torch.float32, seed=8)
    (few,) = _patches(model, writes[:1], 0.02, torch.float32, seed=7)
    if not few_first:  # a few changes to what the first write leaves
        g = torch.Generator().manual_seed(9)
        values = every.values.clone()
        at = torch.rand(values.shape, generator=g) < 0.02
        values[at] = torch.randn(int(at.sum()), generator=g)
        few = CheckpointWeightPatch(every.name, every.shape, every.dtype, values)
    with PATHS[path]():
        r = inspect_load(model, [few, every] if few_first else [every, few])
    if path != "device passes":
        whole = [s.index is None for s in r._saved]
        assert whole == ([False, True] if few_first else [True, False])
    _check(r, model, snap, _expected_written(size, params, writes))


def _reference(view, t):
    """Positions in contiguous ``t`` of ``view``'s elements (in its row-major order), and
    which of them lie in ``t``: by the storage offsets of every element."""
    pos = _storage_offsets(view, None) - t.storage_offset()
    return pos, (pos >= 0) & (pos < t.numel())


def _random_view(t, storage, rng):
    """A view a loader could write: a slice with steps of ``t`` (or of the storage around
    it), its dimensions in any order; or the storage's elements as rows of any length."""
    kind = rng.random()
    if kind < 0.2:  # a contiguous run, maybe reaching over t's edges
        lo = rng.randrange(storage.numel())
        return storage[lo:lo + rng.randrange(1, storage.numel() - lo + 1)]
    base = t if kind < 0.8 else storage.as_strided(  # t and a row either side of it
        (t.shape[0] + 2, *t.shape[1:]), t.stride(), t.storage_offset() - t.stride(0))
    index = []
    for n in base.shape:
        a = rng.randrange(n)
        b = rng.randrange(a + 1, n + 1)
        index.append(slice(a, b, rng.choice([1, 1, 2, 3])))
    view = base[tuple(index)]
    dims = list(range(view.dim()))
    rng.shuffle(dims)
    return view.permute(dims)


def test_boxes_address_exactly_the_elements_the_storage_offsets_give():
    from patchkit.inspect import _box_of

    rng = random.Random(0)
    boxes = 0
    for _ in range(400):
        shape = tuple(rng.randrange(1, 7) for _ in range(rng.randrange(1, 4)))
        n = 1
        for d in shape:
            n *= d
        pad = rng.randrange(0, 9) + n // shape[0]  # (a row of t, at least)
        storage = torch.arange(n + 2 * pad, dtype=torch.int32)
        t = storage[pad:pad + n].view(shape)
        view = _random_view(t, storage, rng)
        box = _box_of(view, t)
        pos, inside = _reference(view, t)
        if box is None:
            # only a strided view that reaches outside t goes by offsets
            assert not view.is_contiguous() and not bool(inside.all())
            continue
        boxes += 1
        values = torch.arange(1, view.numel() + 1, dtype=torch.int32)
        for lo, hi in [(0, n), *((a, rng.randrange(a, n + 1)) for a in
                                 (rng.randrange(n + 1) for _ in range(4)))]:
            at = inside & (pos >= lo) & (pos < hi)
            assert box.count(lo, hi) == int(at.sum())
            want = torch.zeros(hi - lo, dtype=torch.int32)
            want[pos[at] - lo] = values[at]
            got = torch.zeros(hi - lo, dtype=torch.int32)
            box.put(got, box.take(values.view(view.shape)), lo)
            assert torch.equal(got, want), (tuple(view.shape), view.stride(), lo, hi)
            mask = torch.zeros(hi - lo, dtype=torch.bool)
            box.fill(mask, lo)
            assert torch.equal(mask, want != 0)
    assert boxes > 300


class _Recorded(TorchDispatchMode):
    """Records the dtype and size of every tensor an op makes (not a view or an input)."""

    def __init__(self):
        super().__init__()
        self.made: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {a.untyped_storage().data_ptr() for a in tree_leaves((args, kwargs))
                 if isinstance(a, torch.Tensor)}
        for o in tree_leaves(out):
            if isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() not in given:
                self.made[(o.dtype, o.numel())] += 1
        return out

    def largest(self, dtype=None):
        return max((n for d, n in self.made if dtype is None or d == dtype), default=0)


@pytest.mark.parametrize("path", ["compiled", "torch ops", "device passes"])
@pytest.mark.parametrize("layout", ["transposed", "repeated", "columns", "interleaved",
                                    "shared", "crossing"])
def test_views_written_whole_are_rebuilt_without_an_index_of_their_size(
    monkeypatch, layout, path
):
    # Rebuilding what a dense load saved built int64 storage offsets of every element of
    # each view saved or written whole (about 46 bytes per element for two saves of one
    # tensor: 756 MiB for 32 MiB of bfloat16). Now such views are addressed as boxes.
    size, params, writes = LAYOUTS[layout]
    model = Flat(size, params, dict(writes), torch.float32)
    patches = _patches(model, writes, 1.0, torch.float32, seed=2)  # every element changes
    smallest = min(t.numel() for t in model.parameters())
    indices: list[int] = []
    for module, name in (*((m, "_storage_offsets") for m in (pk_regions, pk_marks, pk_intercept)),
                         (pk_inspect, "_storage_offsets"), (pk_inspect, "_positions")):
        original = getattr(module, name)

        def recording(*a, _original=original):
            out = _original(*a)
            indices.append(max(x.numel() for x in tree_leaves(out) if x.dtype == torch.int64))
            return out

        monkeypatch.setattr(module, name, recording)
    recorded = _Recorded()
    delta_rows = pk_inspect._delta_rows

    def measured(*a):
        with recorded:
            return delta_rows(*a)

    monkeypatch.setattr(pk_inspect, "_delta_rows", measured)
    with PATHS[path]():
        r = inspect_load(model, patches)
        assert len(r.deltas)
        with recorded:
            for name, t in model.named_parameters():
                assert r.before(name).shape == t.shape
                r.written(name)
                reader = r._before_after(name)  # plot_delta's reads
                for lo in range(0, t.numel(), 500):
                    reader.read(lo, min(t.numel(), lo + 500))
    assert max(indices, default=0) < smallest // 4
    assert recorded.largest(torch.int64) < smallest // 4


def test_the_statistics_of_overlapping_writes_work_in_blocks(monkeypatch):
    # Two saves of one tensor (a name sent twice) made the statistics rebuild the whole
    # tensor: a copy, a mask and int64 offsets of every element. Now they read it a block
    # at a time: no tensor they make holds more than a few blocks' elements.
    monkeypatch.setattr(pk_inspect, "_BLOCK", 1024)
    n = 256 * 128
    for share in (0.02, 1.0):
        model = Flat(n, {"w": (0, (256, 128), (128, 1))},
                     {"w": (0, (256, 128), (128, 1))}, torch.bfloat16)
        first = _patches(model, [("w", (0, (256, 128), (128, 1)))], share, torch.bfloat16, 3)
        second = _patches(model, [("w", (0, (256, 128), (128, 1)))], share, torch.bfloat16, 4)
        recorded = _Recorded()
        delta_rows = pk_inspect._delta_rows

        def measured(*a, _rows=delta_rows, _rec=recorded):
            with _rec:
                return _rows(*a)

        monkeypatch.setattr(pk_inspect, "_delta_rows", measured)
        before = model.w.detach().clone()
        r = inspect_load(model, first + second)
        monkeypatch.setattr(pk_inspect, "_delta_rows", delta_rows)
        changed = int((bits(model.w) != bits(before)).sum())
        assert r.deltas.loc["w", "elements"] == n and r.deltas.loc["w", "changed"] == changed
        # the positions of a compact save (in proportion to what changed), else blocks
        saved = int(share * 2 * n) if share < 1 else 0
        assert recorded.largest() <= max(4 * 1024, 2 * saved)


def test_a_dense_write_over_neighbours_in_one_storage_leaves_their_numbers_alone():
    # A write through a view over b and half of c (one flat storage): each tensor gets its
    # own part, a neither; before() of a is its own values, untouched.
    size, params, writes = LAYOUTS["shared"]
    model = Flat(size, params, {"bc": writes[0][1]}, torch.float32)
    snap = {n: t.detach().clone() for n, t in model.named_parameters()}
    r = inspect_load(model, _patches(model, writes[:1], 1.0, torch.float32, seed=5))
    assert r.deltas["elements"].to_dict() == {"b": R * C, "c": R * C // 2}
    assert not r.written("a").any() and r.written("b").all()
    assert r.written("c")[: R // 2].all() and not r.written("c")[R // 2:].any()
    for name, t in snap.items():
        assert torch.equal(bits(r.before(name)), bits(t))


def test_patchkit_reports_the_same_numbers_for_a_transposed_destination_as_for_a_plain_one():
    # The same values written through param.data.t() and into a transposed copy of the
    # parameter, which the plain write fills: the same numbers, bit for bit where exact.
    g = torch.Generator().manual_seed(6)
    w = torch.randn(R2, C2, generator=g)
    new = torch.where(torch.rand(R2, C2, generator=g) < 0.5, torch.randn(R2, C2, generator=g), w)
    p = CheckpointWeightPatch("w", (R2, C2), torch.float32, new.reshape(-1).clone())
    for path in PATHS.values():
        with path():
            model = Flat(R2 * C2, {"w": (0, (R2, C2), (C2, 1))},
                         {"w": (0, (R2, C2), (C2, 1))}, torch.float32)
            with torch.no_grad():
                model.w.copy_(w)
            plain = inspect_load(model, [p])
            model = Flat(R2 * C2, {"w": (0, (C2, R2), (R2, 1))},
                         {"w": (0, (R2, C2), (1, R2))}, torch.float32)
            with torch.no_grad():
                model.w.copy_(w.t())
            transposed = inspect_load(model, [p])
        a, b = plain.deltas.loc["w"], transposed.deltas.loc["w"]
        assert (a["elements"], a["changed"]) == (b["elements"], b["changed"])
        for k in ("max_abs", "mean_abs", "rel_l2"):
            assert a[k] == pytest.approx(b[k], rel=1e-9)
        assert torch.equal(transposed.before("w"), w.t())


class _RowByRow(torch.nn.Module):
    """Two parameters that are column slices of one buffer (``rows`` x 2 * ``cols``),
    which the loader writes a row at a time: a save per row of a strided tensor."""

    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        base = torch.zeros(rows, 2 * cols)
        self.a = torch.nn.Parameter(base[:, :cols], requires_grad=False)
        self.b = torch.nn.Parameter(base[:, cols:], requires_grad=False)

    def load_weights(self, weights):
        for name, w in weights:
            dst = getattr(self, name).data
            for r in range(dst.shape[0]):
                dst[r].copy_(w[r])
        return {n for n, _ in weights}


@pytest.mark.parametrize("path", ["compiled", "torch ops"])
def test_many_saves_of_a_strided_tensor_sort_its_offsets_once_per_read(path, monkeypatch):
    # Each save of a strided tensor sorted the tensor's storage offsets again (before(),
    # written(), plot_delta's reader) and marked its span anew in a scratch mask (the
    # deltas): a few hundred rows of a column slice written one by one took minutes to
    # report. Now each read sorts them once per tensor, and the deltas mark each once.
    rows, cols = 64, 7
    span = (rows - 1) * 2 * cols + cols  # (the elements from a's first to its last)
    model = _RowByRow(rows, cols)
    g = torch.Generator().manual_seed(3)
    patches = [CheckpointWeightPatch(n, (rows, cols), torch.float32,
                                     torch.randn(rows * cols, generator=g)) for n in "ab"]
    want = {n: p.values.view(rows, cols) for n, p in zip("ab", patches)}
    sorts = []  # (the tensors whose offsets were taken whole: each to be sorted)
    taken = pk_inspect._storage_offsets

    def taking(t, index, _taken=taken):
        sorts.append(t.numel())
        return _taken(t, index)

    monkeypatch.setattr(pk_inspect, "_storage_offsets", taking)
    recorded = _Recorded()
    with PATHS[path](), recorded:
        r = inspect_load(model, patches)
        assert r.deltas["elements"].tolist() == [rows * cols] * 2
        for name in "ab":
            assert torch.equal(r.before(name), torch.zeros(rows, cols))
            assert torch.equal(r.after(name), want[name])
            assert bool(r.written(name).all())
            reader = r._before_after(name)
            before, after, _ = reader.read(0, rows * cols)
            assert torch.equal(before, torch.zeros(rows * cols))
            assert torch.equal(after, want[name].flatten())
    # (the deltas, before(), written() and the reader each sort a tensor's offsets
    # once, where every row's save sorted them again: 64 times a read; the deltas mark
    # each span once, where they marked it for every row)
    assert sorts == [rows * cols] * len(sorts) and 0 < len(sorts) <= 4 * 2, sorts
    assert recorded.made[(torch.bool, span)] == 2, recorded.made


class _RowsTwice(torch.nn.Module):
    """One ``rows`` x ``cols`` parameter that ``load_weights`` writes a row at a time,
    all rows twice (the second time the values plus one)."""

    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(rows, cols), requires_grad=False)

    def load_weights(self, weights):
        for _, w in weights:
            for step in (0.0, 1.0):
                for r in range(self.w.shape[0]):
                    self.w.data[r].copy_(w[r] + step)
        return {n for n, _ in weights}


class _RowsTwiceThenFail(_RowsTwice):
    """:class:`_RowsTwice` whose ``load_weights`` raises after its writes: a save per row
    per pass, each row's two saves overlapping."""

    def load_weights(self, weights):
        super().load_weights(weights)
        raise RuntimeError("the model failed after its writes")


class _Touched(TorchDispatchMode):
    """Counts the elements of every tensor each op is given."""

    def __init__(self):
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.elements += sum(a.numel() for a in tree_leaves((args, kwargs))
                             if isinstance(a, torch.Tensor))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("path", ["compiled", "torch ops"])
def test_what_an_observed_loader_left_is_read_in_one_pass_over_many_saves(path, monkeypatch):
    # After an observed loader raised, telling which targets it left as written tested
    # each save's storage offsets against those of all the saves before it: a pass over
    # every earlier save per save, 7.8 s for 1024 rows of 64 written one by one (47 ms
    # with patchkit's own loader). Now one sort of all of them finds each element's
    # oldest save: the elements the check reads grow with the rows, not their square.
    touched = []
    left_as_written = pk_inspect._left_as_written

    def counted(saved):
        mode = _Touched()
        with mode:
            out = left_as_written(saved)
        touched.append(mode.elements)
        return out

    monkeypatch.setattr(pk_inspect, "_left_as_written", counted)
    cols, per_row = 16, {}
    for rows in (32, 128):
        for transactional in (False, True):
            model = _RowsTwiceThenFail(rows, cols)
            patch = CheckpointWeightPatch("w", (rows, cols), torch.float32,
                                          torch.arange(1.0, rows * cols + 1))
            touched.clear()
            with PATHS[path](), pytest.raises(RuntimeError, match="failed after") as info:
                inspect_load(model, [patch], loader=load_checkpoint_weight_patches,
                             transactional=transactional)
            r = info.value.report
            # (the oldest save of each element is its value before the load: all zero)
            assert r.rolled_back is transactional
            assert torch.equal(model.w, torch.zeros(rows, cols) if transactional
                               else patch.values.view(rows, cols) + 1)
            assert r.loaded == set()
            assert touched
            per_row[rows, transactional] = max(touched) / rows
    for transactional in (False, True):
        # (the offsets of 2 x 128 saves tested against all before: 32 times the 32 rows')
        assert per_row[128, transactional] < 2 * per_row[32, transactional], per_row


@pytest.mark.parametrize("path", ["compiled", "torch ops"])
def test_a_read_of_a_range_visits_only_the_saves_that_meet_it(path, monkeypatch):
    # Each read of a range (the overlapping writes' statistics, plot_delta's pieces) went
    # through every save of the tensor: reads x rows for a tensor written row by row,
    # 1.8 s of reads for 16384 rows of 1024 written twice. Now a read visits only the
    # saves and writes that meet its range: each row's once over the whole tensor.
    visits = collections.Counter()
    for method in ("put", "count"):
        original = getattr(pk_inspect._Box, method)

        def visiting(self, *a, _original=original, _method=method):
            visits[_method] += 1
            return _original(self, *a)

        monkeypatch.setattr(pk_inspect._Box, method, visiting)
    cols, per_row = 16, {}
    for rows in (32, 128):
        model = _RowsTwice(rows, cols)
        patch = CheckpointWeightPatch("w", (rows, cols), torch.float32,
                                      torch.arange(1.0, rows * cols + 1))
        with PATHS[path]():
            r = inspect_load(model, [patch])
        assert r.deltas.loc["w", "elements"] == rows * cols
        reader = r._before_after("w")
        visits.clear()
        step = 4 * cols  # (a read of 4 rows)
        for lo in range(0, rows * cols, step):
            before, after, written = reader.read(lo, lo + step)
            assert torch.equal(before, torch.zeros(step))
            assert torch.equal(after, patch.values[lo:lo + step] + 1)
            assert written is None or torch.equal(written, torch.arange(step))
        assert visits["put"] and visits["count"]
        per_row[rows] = (visits["put"] / rows, visits["count"] / rows)
    # (every save visited by every read: 4 times as many per row for 4 times the rows)
    assert per_row[128] == per_row[32], per_row


class _Rebinds(torch.nn.Module):
    """``n`` small parameters that ``load_weights`` rebinds (``param.data = w``)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        for i in range(n):
            self.register_parameter(f"p{i}", torch.nn.Parameter(torch.zeros(2, 2),
                                                                 requires_grad=False))

    def load_weights(self, weights):
        for name, w in weights:
            getattr(self, name).data = w.clone()
        return {n for n, _ in weights}


def _one_per_tensor(n: int) -> list[CheckpointWeightPatch]:
    """A 2 x 2 float32 patch for each of ``p0`` ... ``p{n-1}``, each of other values."""
    return [CheckpointWeightPatch(f"p{i}", (2, 2), torch.float32, torch.arange(4.0) + i)
            for i in range(n)]


@pytest.mark.parametrize("transactional", [False, True])
def test_a_load_rebinding_one_tensor_per_call_looks_at_each_rebinding_once(
        transactional, monkeypatch):
    # After every call, each tensor rebound in an earlier call was looked at again (two
    # storage keys each, in Python): a load of one rebinding per call was quadratic in
    # its tensors, 3.8 s to report 2000 of them (29 ms to load). Now a call looks at the
    # tensors rebound since the last look, and the count per tensor stays flat.
    keys = collections.Counter()
    original = pk_intercept._storage_key

    def keyed(t, _original=original):
        keys["n"] += 1
        return _original(t)

    for module in _SESSION_MODULES:
        monkeypatch.setattr(module, "_storage_key", keyed)
    per_tensor = {}
    for n in (16, 64):
        model = _Rebinds(n)
        patches = _one_per_tensor(n)
        keys.clear()
        r = inspect_load(model, patches, max_chunk_bytes=16, transactional=transactional)
        per_tensor[n] = keys["n"] / n
        assert len(r.calls) == n and r.writes["op"].tolist() == ["rebind"] * n
        assert r.deltas["elements"].tolist() == [4] * n
        assert r.deltas["changed"].tolist() == [3] + [4] * (n - 1)  # (p0's first is 0)
        for i in range(n):
            assert torch.equal(getattr(model, f"p{i}").view(-1), torch.arange(4.0) + i)
            assert torch.equal(r.before(f"p{i}"), torch.zeros(2, 2))
    # (each earlier rebinding looked at again after every call: 4 times as many storage
    # keys per tensor for 4 times the tensors)
    assert per_tensor[64] == per_tensor[16], per_tensor


class _WritesThenRebinds(torch.nn.Module):
    """``n`` small parameters and a buffer of 4 rows per parameter: each call writes its
    parameter's rows of the buffer one by one, copies into the parameter itself (a save
    whose view is the Parameter), then rebinds it (``param.data = w``)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("big", torch.zeros(4 * n, 3))
        for i in range(n):
            self.register_parameter(f"p{i}", torch.nn.Parameter(torch.zeros(2, 2),
                                                                 requires_grad=False))

    def load_weights(self, weights):
        for name, w in weights:
            k = int(name[1:])
            for r in range(4):
                self.big[4 * k + r].fill_(float(k + 1))
            p = getattr(self, name)
            p.copy_(w + 100)
            p.data = w.clone()
        return {n for n, _ in weights}


def test_a_load_rebinding_after_its_saves_finds_the_rebound_saves_by_view(monkeypatch):
    # After each call that rebound a tensor, every save of the load so far was gone
    # through to find those made through the rebound Parameter, and the report then went
    # through every save again for each rebound tensor's before-values: quadratic in the
    # saves (2000 calls of 32 row writes and a rebinding took 24 s to report, 7.5 s for
    # 1000). Now the saves are found by their view's id and their storage, and the count
    # per tensor of both stays flat.
    ids = collections.Counter()
    looked = collections.Counter()

    def counted_id(obj):
        ids["n"] += 1
        return id(obj)

    original = pk_inspect._sharing

    def sharing(saved, t, _original=original):
        looked["n"] += len(saved)
        return _original(saved, t)

    for module in (pk_regions, pk_runtime_index, pk_intercept):  # (the ones that call id)
        monkeypatch.setattr(module, "id", counted_id, raising=False)
    monkeypatch.setattr(pk_inspect, "_sharing", sharing)
    per_tensor = {}
    for n in (8, 32):
        model = _WritesThenRebinds(n)
        patches = _one_per_tensor(n)
        ids.clear()
        looked.clear()
        r = inspect_load(model, patches, max_chunk_bytes=16)
        per_tensor[n] = (ids["n"] / n, looked["n"] / n)
        assert len(r.calls) == n
        assert r.deltas.loc["big", "changed"] == 12 * n
        for i in range(n):
            assert torch.equal(getattr(model, f"p{i}").view(-1), torch.arange(4.0) + i)
            # (the copy into the Parameter before its rebinding wrote the original)
            assert torch.equal(r.before(f"p{i}"), torch.zeros(2, 2))
            assert r.deltas.loc[f"p{i}", "elements"] == 4
        assert torch.equal(r.before("big"), torch.zeros(4 * n, 3))
    # (every save gone through after each call and for each rebound tensor: 4 times as
    # many per tensor for 4 times the tensors; the ids per tensor shrink a little with
    # more tensors, the load's own few spread over more)
    assert per_tensor[32][1] == per_tensor[8][1], per_tensor
    assert per_tensor[32][0] <= per_tensor[8][0], per_tensor


# -- one copy_ over the end of one runtime tensor and the start of the next --------------

# q, k and v: views of one flat buffer of 3 x 24 float32 (q and k 4 x 6, v 24 flat, or q
# of 21 elements, so that its end falls inside a row of 6); name -> (view of the
# buffer, runtime tensors written).
_QKV = {"q": (0, (4, 6)), "k": (24, (4, 6)), "v": (48, (24,))}
_ACROSS = {
    "a flat run over q's end and k's start": (lambda f: f[10:30], ["q", "k"]),
    "rows 2:6 of the buffer as 6 wide": (lambda f: f[:48].view(8, 6)[2:6], ["q", "k"]),
    "a block of 4 x 5 over q's end (contiguous)": (lambda f: f[10:30].view(4, 5), ["q", "k"]),
    "columns 1:4 of rows 2:6": (lambda f: f[:48].view(8, 6)[2:6, 1:4], ["q", "k"]),
    "over the end of q, all of k, into v": (lambda f: f[20:60], ["q", "k", "v"]),
    "columns 0:5 of all rows, q ending inside a row": (
        lambda f: f[:48].view(8, 6)[:, :5], ["q", "k"]),
    # (q's part two boxes, k's two, v's one: still one flat run each)
    "a block of 8 x 5 over q's end, k and v's start (contiguous)": (
        lambda f: f[18:58].view(8, 5), ["q", "k", "v"]),
}


class _Across(torch.nn.Module):
    """q, k and v of :data:`_QKV` (``short``: q of 21 elements, k after it), views of one
    flat buffer that is no runtime tensor; ``load_weights`` copies patch "x" with one
    ``copy_`` into the view ``view`` makes of the buffer, then raises where ``fail``."""

    def __init__(self, view, short=False, fail=False):
        super().__init__()
        self.flat = torch.arange(72.0) * 0.25 + 0.125
        for name, (off, shape) in _QKV.items():
            if short and name == "q":
                off, shape = 0, (21,)
            if short and name == "k":
                off, shape = 21, (27,)
            self.register_parameter(name, torch.nn.Parameter(
                self.flat[off:off + math.prod(shape)].view(shape), requires_grad=False))
        self.view, self.fail = view, fail

    def load_weights(self, weights):
        for _, t in weights:
            self.view(self.flat).copy_(t)
        if self.fail:
            raise RuntimeError("after the write")
        return {"q", "k", "v"}


def _patch_over(m, view, sparse):
    shape = tuple(view(m.flat).shape)
    n = math.prod(shape)
    g = torch.Generator().manual_seed(3)
    if sparse:  # (entries in every tensor the view reaches: its first and last few)
        idx = torch.tensor(sorted({0, 1, n // 2 - 1, n // 2, n - 2, n - 1}))
        return CheckpointWeightPatch("x", shape, torch.float32,
                                     torch.randn(len(idx), generator=g) + 50, idx)
    now = view(m.flat).reshape(-1)
    new = torch.where(torch.rand(n, generator=g) < 0.5, torch.randn(n, generator=g), now)
    return CheckpointWeightPatch("x", shape, torch.float32, new)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("how", list(_ACROSS))
def test_a_copy_across_runtime_tensors_of_one_storage_is_a_row_for_each(how, sparse):
    # Before, the write was recorded once, for the tensor where it starts: q at offset 10,
    # 20 elements (q has 24), its counts those of the whole copy; the brute-force replay
    # of the report's rows (test_report_oracle.check) found a region outside q.
    view, touched = _ACROSS[how]
    m = _Across(view, short="inside a row" in how)
    p = _patch_over(m, view, sparse)
    before = snapshot(m)
    L = logged_load(m, [p])
    r = L["report"]
    seen = collections.Counter()
    assert check(L, seen) == []
    assert seen["writes"] == len(r.writes)
    # a row for each tensor reached (two each for q and k where q ends inside a row of a
    # strided view: its whole rows, and the part of the next), their elements together
    # the copy's
    assert list(dict.fromkeys(r.writes["target"])) == touched
    assert len(r.writes) == len(touched) + 2 * ("inside a row" in how)
    assert int(r.writes["elements"].sum()) == p.shape[0] * math.prod(p.shape[1:])
    assert r.writes["written"].sum() == (len(p.indices) if sparse else r.writes["elements"]
                                         .sum())
    changed = {n: int((bits(before[n]) != bits(L["after"][n])).sum()) for n in before}
    assert r.deltas["changed"].to_dict() == {n: c for n, c in changed.items() if n in touched}
    # the same load, plain, gives the same bits
    plain = _Across(view, short="inside a row" in how)
    load_checkpoint_weight_patches(plain, [p])
    assert torch.equal(bits(plain.flat), bits(m.flat))


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("how", list(_ACROSS))
def test_a_transactional_load_puts_back_a_copy_across_runtime_tensors(how, sparse):
    view, _ = _ACROSS[how]
    m = _Across(view, short="inside a row" in how, fail=True)
    p = _patch_over(m, view, sparse)
    flat = m.flat.clone()
    with pytest.raises(RuntimeError, match="after the write") as e:
        inspect_load(m, [p], transactional=True)
    assert torch.equal(bits(m.flat), bits(flat))
    assert e.value.report.rolled_back
    m = _Across(view, short="inside a row" in how, fail=True)
    with pytest.raises(RuntimeError, match="after the write"):
        load_checkpoint_weight_patches(m, [p], transactional=True)
    assert torch.equal(bits(m.flat), bits(flat))


class _Gapped(torch.nn.Module):
    """q and k, 2 x 6 views of one flat buffer with the loader's own 4 elements between
    them; ``load_weights`` copies patch "x" into the view ``view`` makes of the buffer."""

    def __init__(self, view):
        super().__init__()
        self.flat = torch.arange(32.0) * 0.25 + 0.125
        self.q = torch.nn.Parameter(self.flat[0:12].view(2, 6), requires_grad=False)
        self.k = torch.nn.Parameter(self.flat[16:28].view(2, 6), requires_grad=False)
        self.view = view

    def load_weights(self, weights):
        for _, t in weights:
            self.view(self.flat).copy_(t)
        return {"q", "k"}


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("view", [lambda f: f[8:20], lambda f: f[8:20].view(3, 4)],
                         ids=["flat", "3 x 4"])
@pytest.mark.parametrize("inspected", [False, True], ids=["plain", "inspected"])
def test_a_copy_over_the_loaders_space_between_two_runtime_tensors_writes_it_too(
        view, sparse, inspected):
    # A copy from q's end over the 4 elements between q and k (no runtime tensor's) into
    # k's start cannot be cut into one copy per runtime tensor: cut, the elements
    # between them would not be written. It is written as one copy, as torch writes it.
    m = _Gapped(view)
    shape = tuple(view(m.flat).shape)
    n = math.prod(shape)
    if sparse:
        p = CheckpointWeightPatch("x", shape, torch.float32, torch.tensor([50.0, 55.0, 60.0]),
                                  torch.tensor([1, 5, 10]))
        new = torch.full((n,), float("nan"))
        new[p.indices] = p.values
    else:
        p = CheckpointWeightPatch("x", shape, torch.float32, torch.arange(n) + 100.0)
        new = p.values
    want = m.flat.clone()
    w = view(want)
    w.copy_(torch.where(new.isnan(), w.reshape(-1), new).view(shape))
    if inspected:
        r = inspect_load(m, [p])
        assert r.writes["elements"].sum() == n
    else:
        load_checkpoint_weight_patches(m, [p])
    assert torch.equal(bits(m.flat), bits(want))


def test_a_refused_op_after_a_copy_across_runtime_tensors_tells_that_copy_for_each():
    # A sparse copy over q's end and k's start, then a fill of k (refused, no patch its
    # source): the error tells that the call last copied patch 0 into k, as it would
    # after a copy into k alone.
    class FillK(_Across):
        def load_weights(self, weights):
            for name, t in weights:
                if name == "x":
                    self.flat[10:30].copy_(t)
                else:
                    self.v.data.copy_(t)
            self.k.data[3:].fill_(0.0)
            return {"q", "k", "v"}

    m = FillK(lambda f: f[10:30])
    x = _patch_over(m, lambda f: f[10:30], sparse=True)
    y = CheckpointWeightPatch("y", (24,), torch.float32, torch.tensor([1.0]), torch.tensor([0]))
    with pytest.raises(NotImplementedError, match="fill_") as e:
        load_checkpoint_weight_patches(m, [x, y])
    assert (e.value.position, e.value.name) == (None, None)
    assert "the call last copied patch 0 ('x') into runtime tensor 'k'" in str(e.value)


class _CopiesThrough(torch.nn.Module):
    """A model whose loader copies each weight it is sent through ``target()`` (a view
    of its memory), then raises ``RuntimeError("late")`` where ``fail`` says so."""

    fail = False

    def target(self) -> torch.Tensor:
        raise NotImplementedError

    def load_weights(self, weights):
        for _, w in weights:
            self.target().copy_(w)
        if self.fail:
            raise RuntimeError("late")
        return {n for n, _ in weights}


class _Straddled(_CopiesThrough):
    """Two bfloat16 parameters of one flat buffer, p0 = elements 0-2 and p1 = 3-15, and a
    loader that copies through a float32 view of the buffer's first 8 elements: its
    second element holds p0's last element and p1's first."""

    def __init__(self, fail=False):
        super().__init__()
        self.flat = torch.zeros(16, dtype=torch.bfloat16)
        self.p0 = torch.nn.Parameter(self.flat[0:3], requires_grad=False)
        self.p1 = torch.nn.Parameter(self.flat[3:16], requires_grad=False)
        self.fail = fail

    def target(self):
        return self.flat.view(torch.float32)[0:4]


def test_a_dense_copy_whose_elements_straddle_two_runtime_tensors_is_a_row_for_each():
    # Before, the write was recorded for p0 only: p1's 3 changed elements were in
    # neither writes nor deltas (the cut into pieces of one tensor each cannot split an
    # element)
    m = _Straddled()
    p = CheckpointWeightPatch("x", (4,), torch.float32, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    before = {n: t.detach().clone() for n, t in m.named_parameters()}
    r = patchkit.inspect_load(m, [p])
    changed = {n: int((t.detach() != before[n]).sum()) for n, t in m.named_parameters()}
    assert changed == {"p0": 1, "p1": 3}
    assert r.writes["target"].tolist() == ["p0", "p1"]
    assert r.writes["elements"].tolist() == [3, 5]  # (8 bfloat16 elements written)
    assert r.writes["changed"].tolist() == [1, 3]
    assert r.deltas["changed"].to_dict() == changed


def test_a_failed_transactional_load_restores_both_tensors_a_straddling_copy_wrote():
    # Before, only p0's part was saved: p1's bytes kept the copy's values after rollback
    m = _Straddled(fail=True)
    before = m.flat.clone()
    p = CheckpointWeightPatch("x", (4,), torch.float32, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    with pytest.raises(RuntimeError, match="late"):
        patchkit.load_checkpoint_weight_patches(m, [p], transactional=True)
    assert torch.equal(m.flat.view(torch.int16), before.view(torch.int16))


@pytest.mark.parametrize("how", ["plain", "inspect", "transactional"])
def test_a_sparse_copy_whose_elements_straddle_two_runtime_tensors_is_refused(how):
    # The merge takes the float32 elements whole, and neither tensor could save or count
    # its half of one: refused before anything is written (before, p1's part was written
    # unrecorded, and a transactional rollback left it)
    m = _Straddled()
    before = m.flat.clone()
    p = CheckpointWeightPatch("x", (4,), torch.float32, torch.tensor([1.0, 3.0]),
                              torch.tensor([1, 3]))
    with pytest.raises(patchkit.ContractViolation) as e:
        if how == "inspect":
            patchkit.inspect_load(m, [p])
        else:
            patchkit.load_checkpoint_weight_patches(m, [p], transactional=how != "plain")
    assert (e.value.reason, e.value.value, e.value.name) == ("straddling view", ("p0", "p1"),
                                                             "x")
    assert torch.equal(m.flat.view(torch.int16), before.view(torch.int16))


class _StraddledStrided(_Straddled):
    """:class:`_Straddled` with a loader that copies through ``view`` of the buffer's
    float32 view (p0 = bfloat16 elements 0-2, p1 = 3-15)."""

    def __init__(self, view, fail=False):
        super().__init__(fail)
        self.view = view

    def target(self):
        return self.view(self.flat.view(torch.float32))


class _StraddledThree(_StraddledStrided):
    """Three bfloat16 parameters of one flat buffer, p0 = 0-2, p1 = 3-8, p2 = 9-15: a
    float32 view's elements 1 and 4 each hold two tensors' elements."""

    def __init__(self, view, fail=False):
        torch.nn.Module.__init__(self)
        self.flat = torch.zeros(16, dtype=torch.bfloat16)
        self.p0 = torch.nn.Parameter(self.flat[0:3], requires_grad=False)
        self.p1 = torch.nn.Parameter(self.flat[3:9], requires_grad=False)
        self.p2 = torch.nn.Parameter(self.flat[9:16], requires_grad=False)
        self.fail, self.view = fail, view


# name -> (model class, view of the float32 buffer, its shape)
STRIDED_STRADDLES = {
    "every other element": (_StraddledStrided, lambda f: f[1:8:2], (4,)),
    "a column slice of a matrix": (_StraddledStrided, lambda f: f.view(4, 2)[:, 1:], (4, 1)),
    "a transposed matrix": (_StraddledStrided, lambda f: f[:6].view(3, 2).t(), (2, 3)),
    "straddling at two places": (_StraddledThree, lambda f: f[1:8:3], (3,)),
    "columns straddling at two places": (_StraddledThree, lambda f: f.view(4, 2)[:3, 1:],
                                         (3, 1)),
}


def _touched_bf16(view, model):
    """Each parameter's elements that a byte of ``view`` of the float32 buffer lies in."""
    probe = torch.zeros(16, dtype=torch.bfloat16)
    view(probe.view(torch.float32)).view(torch.int32).fill_(-1)
    hit = probe.view(torch.int16) != 0
    return {n: hit[t.storage_offset():t.storage_offset() + t.numel()]
            for n, t in model.named_parameters()}


@pytest.mark.parametrize("how", list(STRIDED_STRADDLES))
@pytest.mark.parametrize("mode", ["inspect", "observed"])
def test_a_dense_copy_through_a_strided_straddling_view_is_rows_for_each_tensor(how, mode):
    # Before, a strided view whose element holds two tensors' elements was recorded for
    # the tensor it starts in only: deltas missed the others' changes (the contiguous
    # view's fix, _straddled, stopped at views that are not contiguous)
    cls, view, shape = STRIDED_STRADDLES[how]
    m = cls(view)
    before = {n: t.detach().clone() for n, t in m.named_parameters()}
    p = CheckpointWeightPatch("x", shape, torch.float32,  # (both halves of each change)
                              torch.arange(1.0, math.prod(shape) + 1) + 1 / 3)
    if mode == "observed":
        r = patchkit.inspect_load(m, [p], loader=vllm_style_loader)
    else:
        r = patchkit.inspect_load(m, [p])
    changed = {n: int((bits(t.detach()) != bits(before[n])).sum())
               for n, t in m.named_parameters()}
    touched = _touched_bf16(view, m)
    assert all(changed.values())
    assert r.deltas["changed"].to_dict() == changed
    assert r.deltas["elements"].to_dict() == {n: int(t.sum()) for n, t in touched.items()}
    for n, t in touched.items():
        assert torch.equal(r.written(n), t), n
        assert torch.equal(bits(r.before(n)), bits(before[n])), n
    assert set(r.writes["target"]) == set(changed)


@pytest.mark.parametrize("how", list(STRIDED_STRADDLES))
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_a_failed_transactional_load_restores_each_tensor_a_strided_straddling_copy_wrote(
        how, sparse):
    # Before, only the first tensor's part was saved: the others kept the copy's values
    # after the rollback (a sparse copy is refused before it writes: restored as well)
    cls, view, shape = STRIDED_STRADDLES[how]
    m = cls(view, fail=True)
    before = m.flat.clone()
    n = math.prod(shape)
    p = (CheckpointWeightPatch("x", shape, torch.float32, torch.arange(1.0, n + 1),
                               torch.arange(n)) if sparse
         else CheckpointWeightPatch("x", shape, torch.float32, torch.arange(1.0, n + 1)))
    with pytest.raises((RuntimeError, patchkit.ContractViolation)):
        patchkit.load_checkpoint_weight_patches(m, [p], transactional=True)
    assert torch.equal(m.flat.view(torch.int16), before.view(torch.int16))


@pytest.mark.parametrize("how", list(STRIDED_STRADDLES))
@pytest.mark.parametrize("mode", ["plain", "inspect", "transactional"])
def test_a_sparse_copy_through_a_strided_straddling_view_is_refused(how, mode):
    # Before, it loaded without a word (the contiguous one is refused), its writes
    # into the tensors after the first neither saved nor recorded
    cls, view, shape = STRIDED_STRADDLES[how]
    m = cls(view)
    before = m.flat.clone()
    p = CheckpointWeightPatch("x", shape, torch.float32, torch.tensor([7.0, 9.0]),
                              torch.tensor([0, math.prod(shape) - 1]))
    with pytest.raises(patchkit.ContractViolation) as e:
        if mode == "inspect":
            patchkit.inspect_load(m, [p])
        else:
            patchkit.load_checkpoint_weight_patches(m, [p], transactional=mode != "plain")
    assert (e.value.reason, e.value.value[0], e.value.name) == ("straddling view", "p0", "x")
    assert torch.equal(m.flat.view(torch.int16), before.view(torch.int16))


class _PastTheTensors(_CopiesThrough):
    """float16 p0 = elements 0-19 and p1 = 20-21 of a buffer of 26, and a loader that
    copies through its int32 view's elements 2-12: from p0, over all of p1, into the
    buffer's own tail (no tensor's), no element holding two tensors' parts."""

    def __init__(self, fail=False):
        super().__init__()
        self.flat = torch.zeros(26, dtype=torch.float16)
        self.p0 = torch.nn.Parameter(self.flat[0:20], requires_grad=False)
        self.p1 = torch.nn.Parameter(self.flat[20:22], requires_grad=False)
        self.fail = fail

    def target(self):
        return self.flat.view(torch.int32)[2:13]


def test_a_copy_of_another_dtype_past_two_tensors_into_the_buffer_is_saved_for_both():
    # Before (the fuzz's reinterpreting views found it), it was saved and recorded in
    # p0's elements only, where the cut into pieces failed (the tail is no tensor's):
    # p1 was missing from deltas, and a failed transactional load left p1 as written
    p = CheckpointWeightPatch("x", (11,), torch.float32, torch.arange(1.0, 12.0))
    m = _PastTheTensors()
    r = patchkit.inspect_load(m, [p])
    assert r.deltas["changed"].to_dict() == {"p0": 8, "p1": 1}
    assert r.deltas["elements"].to_dict() == {"p0": 16, "p1": 2}
    _rolled_back_bit_for_bit(_PastTheTensors(fail=True), p)


def _rolled_back_bit_for_bit(m, p) -> None:
    """A transactional load of ``p`` into ``m`` (a model made with ``fail=True``) fails
    late, and p0 and p1 (the buffer's first 22 elements) are put back bit for bit."""
    before = m.flat.clone()
    with pytest.raises(RuntimeError, match="late"):
        patchkit.load_checkpoint_weight_patches(m, [p], transactional=True)
    assert torch.equal(m.flat[:22].view(torch.int16), before[:22].view(torch.int16))


class _PastTheTensorsAsFloat32(_PastTheTensors):
    """:class:`_PastTheTensors` copying through the buffer's float32 view, which a
    NaN-merge can take."""

    def target(self):
        return self.flat.view(torch.float32)[2:13]


def test_a_sparse_copy_of_another_dtype_past_two_tensors_is_no_straddling_view():
    # No element of the view holds two tensors' parts (p0's and p1's bounds fall between
    # float32 elements): a sparse one loads, a row for each tensor, each of its own
    # elements that the merge wrote (float32 element 8 is p1's, 9 the buffer's tail)
    p = CheckpointWeightPatch("x", (11,), torch.float32, torch.tensor([1.5, 2.5, 3.5]),
                              torch.tensor([0, 8, 9]))
    m = _PastTheTensorsAsFloat32()
    r = patchkit.inspect_load(m, [p])
    assert r.writes.set_index("target")["written"].to_dict() == {"p0": 2, "p1": 2}
    assert torch.equal(r.written("p1"), torch.tensor([True, True]))
    assert r.written("p0").nonzero().reshape(-1).tolist() == [4, 5]
    _rolled_back_bit_for_bit(_PastTheTensorsAsFloat32(fail=True), p)


class _WideView(_CopiesThrough):
    """A bfloat16 parameter of 8 written through its float32 view (two of its elements
    to one of the view's)."""

    def __init__(self, fail=False):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.p = torch.nn.Parameter(torch.randn(8, generator=g).to(torch.bfloat16),
                                    requires_grad=False)
        self.fail = fail

    def target(self):
        return self.p.data.view(torch.float32)


def test_a_sparse_merge_through_a_wider_view_saves_both_halves_of_each_element():
    # Before, the merge saved only the first bfloat16 element of each float32 it wrote:
    # deltas counted 2 elements of 4 changed, and a rollback left the other halves
    p = CheckpointWeightPatch("p", (4,), torch.float32, torch.tensor([5.0, 7.0]),
                              torch.tensor([0, 2]))
    m = _WideView()
    start = m.p.detach().clone()
    r = patchkit.inspect_load(m, [p])
    changed = bits(m.p.detach()) != bits(start)
    assert int(changed.sum()) == 4
    assert (r.writes["written"].tolist(), r.deltas.loc["p", "elements"]) == ([4], 4)
    assert r.deltas.loc["p", "changed"] == 4
    assert torch.equal(r.written("p"), torch.tensor([1, 1, 0, 0, 1, 1, 0, 0]).bool())
    m = _WideView(fail=True)
    with pytest.raises(RuntimeError, match="late"):
        patchkit.load_checkpoint_weight_patches(m, [p], transactional=True)
    assert torch.equal(bits(m.p.detach()), bits(start))


class _Columns(_CopiesThrough):
    """Column slices of one bfloat16 matrix W (4, 8), p0 = W[:, :cut] and p1 =
    W[:, cut:] (strided runtime tensors, whose extents interleave), and a loader that
    copies through ``view`` of W's float32 view (4, 4)."""

    def __init__(self, cut, view, fail=False):
        super().__init__()
        g = torch.Generator().manual_seed(cut)
        self.W = torch.randn(4, 8, generator=g).to(torch.bfloat16)
        self.p0 = torch.nn.Parameter(self.W[:, :cut], requires_grad=False)
        self.p1 = torch.nn.Parameter(self.W[:, cut:], requires_grad=False)
        self.view, self.fail = view, fail

    def target(self):
        return self.view(self.W.view(torch.float32))


# name -> (p0's columns, view of W's float32 view, its shape, whether an element of the
# view holds a column of each)
COLUMN_VIEWS = {
    "a float32 column over two column slices": (3, lambda f: f[:, 1], (4,), True),
    "float32 columns, one straddling": (3, lambda f: f[:, 1:3], (4, 2), True),
    "a transposed float32 block, straddling": (3, lambda f: f[:3, 1:3].t(), (2, 3), True),
    # (inside p0's extent, its box one column past p0's last)
    "a float32 column of three rows, straddling": (3, lambda f: f[:3, 1], (3,), True),
    "float32 columns over two column slices": (2, lambda f: f[:, 0:2], (4, 2), False),
}


def _touched_columns(cut, view):
    """Each column slice's elements that a byte of ``view`` of W's float32 view lies in."""
    probe = torch.zeros(4, 8, dtype=torch.bfloat16)
    view(probe.view(torch.float32)).view(torch.int32).fill_(-1)
    hit = probe.view(torch.int16) != 0
    return {"p0": hit[:, :cut], "p1": hit[:, cut:]}


@pytest.mark.parametrize("how", list(COLUMN_VIEWS))
@pytest.mark.parametrize("mode", ["inspect", "observed"])
def test_a_dense_copy_through_a_float32_view_over_two_column_slices_is_rows_for_each(
        how, mode):
    # Before, the strided runtime tensors (column slices, not dense) were left out of
    # the tensors a view of another element size reaches: the write was recorded and
    # saved for p0 only, in p0's elements: deltas missed p1's changes
    cut, view, shape, _ = COLUMN_VIEWS[how]
    m = _Columns(cut, view)
    before = {n: t.detach().clone() for n, t in m.named_parameters()}
    n = math.prod(shape)
    p = CheckpointWeightPatch("x", shape, torch.float32, torch.arange(1.0, n + 1) + 1 / 3)
    if mode == "observed":
        r = patchkit.inspect_load(m, [p], loader=vllm_style_loader)
    else:
        r = patchkit.inspect_load(m, [p])
    changed = {k: bits(t.detach()) != bits(before[k]) for k, t in m.named_parameters()}
    assert all(c.any() for c in changed.values())
    assert r.deltas["changed"].to_dict() == {k: int(c.sum()) for k, c in changed.items()}
    assert r.writes.groupby("target")["changed"].sum().to_dict() == {
        k: int(c.sum()) for k, c in changed.items()}  # (each row of its own elements)
    touched = _touched_columns(cut, view)
    for k in ("p0", "p1"):
        assert torch.equal(bits(r.before(k)), bits(before[k])), k
        assert bool((r.written(k) | ~touched[k]).all()), k  # (at least what it touched)


@pytest.mark.parametrize("how", list(COLUMN_VIEWS))
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_a_failed_transactional_load_restores_both_column_slices_a_float32_view_wrote(
        how, sparse):
    # Before, only p0's elements were saved: p1's columns kept the copy's values
    cut, view, shape, _ = COLUMN_VIEWS[how]
    m = _Columns(cut, view, fail=True)
    before = m.W.clone()
    n = math.prod(shape)
    p = (CheckpointWeightPatch("x", shape, torch.float32, torch.arange(1.0, n + 1) + 1 / 3,
                               torch.arange(n)) if sparse
         else CheckpointWeightPatch("x", shape, torch.float32,
                                    torch.arange(1.0, n + 1) + 1 / 3))
    with pytest.raises((RuntimeError, patchkit.ContractViolation)):
        patchkit.load_checkpoint_weight_patches(m, [p], transactional=True)
    assert torch.equal(bits(m.W), bits(before))


@pytest.mark.parametrize("how", list(COLUMN_VIEWS))
def test_a_sparse_copy_through_a_float32_view_over_two_column_slices(how):
    # Before, one whose elements each hold a column of both loaded without a word (its
    # merge saved and counted p1's elements as p0's); now it is refused before it
    # writes, as over two dense tensors. One with no such element is rows for each
    # tensor, of its own elements
    cut, view, shape, straddles = COLUMN_VIEWS[how]
    m = _Columns(cut, view)
    before = {k: t.detach().clone() for k, t in m.named_parameters()}
    w0 = m.W.clone()
    n = math.prod(shape)
    p = CheckpointWeightPatch("x", shape, torch.float32, torch.tensor([7.25, 9.75]),
                              torch.tensor([0, n - 1]))
    if straddles:
        with pytest.raises(patchkit.ContractViolation) as e:
            patchkit.inspect_load(m, [p])
        assert (e.value.reason, e.value.value[:2], e.value.name) == (
            "straddling view", ("p0", "p1"), "x")
        assert torch.equal(bits(m.W), bits(w0))
        return
    r = patchkit.inspect_load(m, [p])
    changed = {k: bits(t.detach()) != bits(before[k]) for k, t in m.named_parameters()}
    assert r.deltas["changed"].to_dict() == {k: int(c.sum()) for k, c in changed.items()
                                             if c.any()}
    for k in r.deltas.index:
        assert not bool((changed[k] & ~r.written(k)).any()), k
        assert torch.equal(bits(r.before(k)), bits(before[k])), k
    assert r.writes.set_index("target")["written"].to_dict() == {"p0": 2, "p1": 2}


class _MixedSizes(_CopiesThrough):
    """Tensors of two element sizes in one uint8 buffer of 16 bytes, bfloat16 p0 = bytes
    0-6 and p1 = 6-8, float32 p2 = 8-16, and a loader that copies through ``view`` of its
    float32 view (whose element 1 holds p0's last element and p1)."""

    def __init__(self, view, fail=False):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.flat = torch.randint(0, 64, (16,), dtype=torch.uint8, generator=g)
        self.p0 = torch.nn.Parameter(self.flat[0:6].view(torch.bfloat16), requires_grad=False)
        self.p1 = torch.nn.Parameter(self.flat[6:8].view(torch.bfloat16), requires_grad=False)
        self.p2 = torch.nn.Parameter(self.flat[8:16].view(torch.float32), requires_grad=False)
        self.view, self.fail = view, fail

    def target(self):
        return self.view(self.flat.view(torch.float32))


# name -> (view of the float32 view, its shape). (A view that starts in a tensor of its
# own element size is one row for that tensor where no cut into pieces exists:
# test_a_view_starting_in_a_tensor_of_its_own_size_over_others_is_one_row_for_it)
MIXED_SIZES = {
    "contiguous": (lambda f: f[1:4], (3,)),
    "strided": (lambda f: f[1:4:2], (2,)),
}


@pytest.mark.parametrize("how", list(MIXED_SIZES))
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_a_copy_over_tensors_of_two_element_sizes_is_a_row_in_each_ones_elements(
        how, sparse):
    # Before, a reached tensor of the view's own element size (float32 p2) was saved and
    # recorded as the whole view: its row at target_offset -1, of 3 elements (p2 has 2),
    # counting p0's and p1's changes as its own (the rollback was exact)
    view, shape = MIXED_SIZES[how]
    n = math.prod(shape)
    p = (CheckpointWeightPatch("x", shape, torch.float32, torch.tensor([3.0, 7.0]),
                               torch.tensor([0, n - 1])) if sparse
         else CheckpointWeightPatch("x", shape, torch.float32, torch.arange(1.0, n + 1) + 1 / 3))
    m = _MixedSizes(view)
    before = {k: t.detach().clone() for k, t in m.named_parameters()}
    # (an observed loader's NaN-merge: patchkit's own refuses the straddling one)
    r = patchkit.inspect_load(m, [p], loader=vllm_style_loader if sparse else None)
    changed = {k: int((bits(t.detach()) != bits(before[k])).sum())
               for k, t in m.named_parameters()}
    rows = r.writes.groupby("target")
    assert set(r.writes["target"]) == {k for k, c in changed.items() if c} | {"p0"}
    assert rows["changed"].sum().to_dict() == {k: changed[k] for k in rows.groups}
    numel = {k: t.numel() for k, t in m.named_parameters()}
    for _, w in r.writes.iterrows():  # (each row in its tensor's own elements)
        assert w["target_offset"] >= 0, dict(w)
        assert w["target_offset"] + w["elements"] <= numel[w["target"]], dict(w)
    m = _MixedSizes(view, fail=True)
    start = m.flat.clone()
    with pytest.raises((RuntimeError, patchkit.ContractViolation)):  # (or refused)
        patchkit.load_checkpoint_weight_patches(m, [p], transactional=True)
    assert torch.equal(m.flat, start)


class _SkippedStraddle(_StraddledStrided):
    """Three bfloat16 parameters of a flat buffer of 24, p0 = 0-2, p1 = 3-7, p2 = 8-23,
    copied through ``view`` of its float32 view: element 1 holds p0's last element and
    p1's first."""

    def __init__(self, view, fail=False):
        torch.nn.Module.__init__(self)
        self.flat = torch.zeros(24, dtype=torch.bfloat16)
        self.p0 = torch.nn.Parameter(self.flat[0:3], requires_grad=False)
        self.p1 = torch.nn.Parameter(self.flat[3:8], requires_grad=False)
        self.p2 = torch.nn.Parameter(self.flat[8:24], requires_grad=False)
        self.fail, self.view = fail, view


@pytest.mark.parametrize("mode", ["inspect", "transactional"])
def test_a_sparse_copy_through_a_strided_view_that_skips_the_straddling_element(mode):
    # float32 elements 0, 4 and 8: p0's first two, p2's; none holds two tensors' parts,
    # and none lies in p1, which the view's extent spans. A sparse one is no straddling
    # view: it loads, a row for p0 and p2 (not p1), each of its own elements and count
    view = lambda f: f[0:12:4]  # noqa: E731
    m = _SkippedStraddle(view, fail=mode == "transactional")
    start = m.flat.clone()
    p = CheckpointWeightPatch("x", (3,), torch.float32, torch.tensor([1.5, 2.5, 3.5]) + 1 / 3,
                              torch.arange(3))
    if mode == "transactional":
        with pytest.raises(RuntimeError, match="late"):
            patchkit.load_checkpoint_weight_patches(m, [p], transactional=True)
        assert torch.equal(bits(m.flat), bits(start))
        return
    r = patchkit.inspect_load(m, [p])
    want = start.clone()
    view(want.view(torch.float32)).copy_(p.values)
    assert torch.equal(bits(m.flat), bits(want))
    assert r.writes.set_index("target")["written"].to_dict() == {"p0": 2, "p2": 4}
    assert r.deltas["changed"].to_dict() == {"p0": 2, "p2": 4}
    touched = _touched_bf16_of(view, m)
    for n in ("p0", "p2"):
        assert torch.equal(r.written(n), touched[n]), n


def _touched_bf16_of(view, model):
    """:func:`_touched_bf16` for a buffer of any length."""
    probe = torch.zeros_like(model.flat)
    view(probe.view(torch.float32)).view(torch.int32).fill_(-1)
    hit = probe.view(torch.int16) != 0
    return {n: hit[t.storage_offset():t.storage_offset() + t.numel()]
            for n, t in model.named_parameters()}


class _DenseBesideSparse(_StraddledStrided):
    """:class:`_StraddledStrided` with a parameter q of its own, which patch "q" merges
    into (NaN where it keeps q), while patch "x" is copied through ``view``."""

    def __init__(self, view):
        super().__init__(view)
        self.q = torch.nn.Parameter(torch.zeros(4), requires_grad=False)

    def load_weights(self, weights):
        for name, w in weights:
            if name == "q":
                self.q.copy_(torch.where(w.isnan(), self.q, w))
            else:
                self.view(self.flat.view(torch.float32)).copy_(w)
        return {n for n, _ in weights}


def _stage_all(model, patches, **_):
    """An observed loader that stages every patch in one call, a sparse one as NaN
    where it keeps the runtime value."""
    staged = []
    for p in patches:
        if p.indices is None:
            t = p.values.to(p.dtype).reshape(p.shape)
        else:
            t = torch.full(p.shape, float("nan"), dtype=p.dtype)
            t.view(-1)[p.indices.long()] = p.values.to(p.dtype)
        staged.append((p.name, t))
    return model.load_weights(staged)


def test_an_observed_call_with_a_sparse_patch_copies_a_dense_one_through_a_straddling_view():
    # A call the observer watches for NaN-merges (it holds a sparse patch) whose dense
    # patch's copy goes through a strided straddling view: a plain copy, each tensor's
    # part of it as in a dense call, its own elements exactly (not the span they reach)
    view = lambda f: f[1:8:2]  # noqa: E731
    m = _DenseBesideSparse(view)
    before = {n: t.detach().clone() for n, t in m.named_parameters()}
    ps = [CheckpointWeightPatch("q", (4,), torch.float32, torch.tensor([5.0]),
                                torch.tensor([2])),
          CheckpointWeightPatch("x", (4,), torch.float32, torch.arange(1.0, 5.0) + 1 / 3)]
    r = patchkit.inspect_load(m, ps, loader=_stage_all)
    touched = _touched_bf16(view, m)
    changed = {n: int((bits(t.detach()) != bits(before[n])).sum())
               for n, t in m.named_parameters()}
    assert r.deltas["changed"].to_dict() == changed
    for n in ("p0", "p1"):
        assert torch.equal(r.written(n), touched[n]), n


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_a_view_starting_in_a_tensor_of_its_own_size_over_others_is_one_row_for_it(sparse):
    # float32 p0 = bytes 0-8, bfloat16 p1 = 8-10 and p2 = 10-16, written through the
    # float32 view's elements 0 and 3 (p0's first, p2's last two): no cut into pieces
    # exists (p1 ends inside float32 element 2, which the view skips), and the view has
    # p0's element size, so it is one row for p0, saved as the view, as one over the
    # loader's space between two tensors is; dense or sparse alike. The rollback is exact
    def model(fail=False):
        m = _MixedSizes(lambda f: f[0:4:3], fail)
        for k in ("p0", "p1", "p2"):
            delattr(m, k)
        m.p0 = torch.nn.Parameter(m.flat[0:8].view(torch.float32), requires_grad=False)
        m.p1 = torch.nn.Parameter(m.flat[8:10].view(torch.bfloat16), requires_grad=False)
        m.p2 = torch.nn.Parameter(m.flat[10:16].view(torch.bfloat16), requires_grad=False)
        return m

    p = (CheckpointWeightPatch("x", (2,), torch.float32, torch.tensor([3.0, 7.0]),
                               torch.tensor([0, 1])) if sparse
         else CheckpointWeightPatch("x", (2,), torch.float32, torch.tensor([3.0, 7.0])))
    m = model()
    r = patchkit.inspect_load(m, [p])
    assert r.writes[["target", "target_offset", "elements", "written"]].values.tolist() == [
        ["p0", 0, 2, 2]]
    m = model(fail=True)
    start = m.flat.clone()
    with pytest.raises(RuntimeError, match="late"):
        patchkit.load_checkpoint_weight_patches(m, [p], transactional=True)
    assert torch.equal(m.flat, start)


@pytest.mark.parametrize("view", [lambda p: p.view(torch.int32),
                                  lambda p: p.view(torch.int32)[1:, :1]],
                         ids=["whole", "a block"])
def test_a_view_of_another_size_inside_a_column_slice_is_decided_at_once(view, monkeypatch):
    # An int32 view of p1 = W[:, 4:8] (bfloat16 columns of a fused matrix) lies in p1's
    # elements: shown on its box, without looking for tensors its elements reach
    # (_straddled: every byte of every element, O(size) each) though p1's extent holds
    # p0's columns too. One row for p1, of the elements it wrote
    m = _Columns(4, lambda f: f)
    m.load_weights = lambda weights: [view(m.p1).copy_(w) for _, w in weights] and {"x"}
    calls = []
    real = patchkit.intercept.WriteSession._straddled
    monkeypatch.setattr(patchkit.intercept.WriteSession, "_straddled",
                        lambda *a: calls.append(1) or real(*a))
    shape = tuple(view(m.p1).shape)
    p = CheckpointWeightPatch("x", shape, torch.float32,
                              torch.arange(math.prod(shape)).float() * 3e7 + 1e7 + 1)
    before = m.p1.detach().clone()
    r = patchkit.inspect_load(m, [p])
    assert not calls
    assert r.writes["target"].tolist() == ["p1"]
    probe = torch.zeros(4, 4, dtype=torch.bfloat16)
    view(probe).fill_(-1)
    assert torch.equal(r.written("p1"), probe.view(torch.int16) != 0)
    assert r.deltas.loc["p1", "changed"] == int((bits(m.p1.detach()) != bits(before)).sum())
