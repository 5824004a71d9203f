"""Seeded random loads whose one ``copy_`` runs over the ends of runtime tensors that are
adjacent (or gapped) views of one flat buffer, checked against brute force: the model
bit for bit as a plain ``copy_`` (NaN-merged for a sparse patch) leaves it, the report
replayed by ``test_report_oracle.check``, a transactional load that fails after its
writes rolled back byte for byte. Also ``_in_layout`` and ``region_text`` against brute
force on random strided views of casts and clones of random views of a patch."""
from __future__ import annotations

import collections
import itertools
import math
import random

import pytest
import torch
from test_inspect import vllm_style_loader
from test_report_oracle import bits, check, snapshot

import patchkit
from patchkit import CheckpointWeightPatch, inspect_load, load_checkpoint_weight_patches
from patchkit.errors import ContractViolation

DTYPES = [torch.float32, torch.bfloat16]
# (buffer dtype, dtype of the view the loader writes through): a float32 / int32 / int16
# view of a bfloat16 or float16 buffer (a 4-byte element of the view may hold the end of
# one tensor and the start of the next), a bfloat16 view of a float32 one
REINTERPRETED = [(b, v) for b in (torch.bfloat16, torch.float16)
                 for v in (torch.float32, torch.int32, torch.int16)] + [
    (torch.float32, torch.bfloat16)]


class Failed(RuntimeError):
    pass


# -- the models and views -----------------------------------------------------------------


def _layout(rng):
    """``(flat size, [(offset, shape)])``: 2 to 4 tensors of one flat buffer, 1-d or 2-d,
    mostly adjacent, sometimes a gap before one or a tail after the last."""
    out, off = [], rng.choice([0, 0, 0, 2])
    for _ in range(rng.randint(2, 4)):
        if out and rng.random() < 0.2:
            off += rng.randint(1, 3)
        shape = ((rng.randint(1, 14),) if rng.random() < 0.4
                 else (rng.randint(1, 4), rng.randint(1, 6)))
        out.append((off, shape))
        off += math.prod(shape)
    return off + rng.choice([0, 0, 3]), out


class Flat(torch.nn.Module):
    """Parameters ``p0``, ``p1``, ... that are views of one flat buffer (no runtime tensor
    itself); ``load_weights`` copies each patch with one ``copy_`` into the view of the
    buffer its entry of ``views`` makes, from the view of the patch ``sources`` makes,
    then raises where ``fail``."""

    def __init__(self, size, layout, dtype, views, sources, fail=False):
        super().__init__()
        g = torch.Generator().manual_seed(size)
        self.flat = torch.randn(size, generator=g).to(dtype)
        for i, (off, shape) in enumerate(layout):
            self.register_parameter(f"p{i}", torch.nn.Parameter(
                self.flat[off:off + math.prod(shape)].view(shape), requires_grad=False))
        self.views, self.sources, self.fail = views, sources, fail

    def load_weights(self, weights):
        for name, t in weights:
            i = int(name[1:])
            _apply(self.views[i], self.flat).copy_(_apply(self.sources[i], t))
        if self.fail:
            raise Failed("after the writes")
        return {n for n, _ in self.named_parameters()}


def _apply(ops, t):
    for op, *a in ops:
        if op == "slice":
            dim, lo, hi, step = a
            t = t[(slice(None),) * dim + (slice(lo, hi, step),)]
        elif op == "view":
            t = t.view(a[0])
        elif op == "reshape":
            t = t.reshape(a[0])
        elif op == "t":
            t = t.t()
        elif op == "index":
            t = t[a[0]]
        elif op == "as":  # (the buffer's bytes as another dtype)
            t = t.view(a[0])
    return t


def _random_view(rng, size):
    """ops making a view of a flat buffer of ``size`` elements: a run, a strided run,
    rows and columns of a matrix view of a run (sliced, stepped, transposed), a 3-d one."""
    n = rng.randint(1, size)
    lo = rng.randint(0, size - n)
    ops = [("slice", 0, lo, lo + n, 1)]
    kind = rng.random()
    if kind < 0.25:
        return ops
    if kind < 0.4:
        return [("slice", 0, lo, lo + n, rng.randint(2, 3))]
    divisors = [d for d in range(1, n + 1) if n % d == 0]
    cols = rng.choice(divisors)
    rows = n // cols
    if kind < 0.55 and len(divisors) > 2:
        inner = rng.choice([d for d in range(1, cols + 1) if cols % d == 0])
        ops.append(("view", (rows, cols // inner, inner)))
        if rng.random() < 0.5 and cols // inner > 1:
            a = rng.randrange(cols // inner)
            ops.append(("slice", 1, a, rng.randint(a + 1, cols // inner), 1))
        return ops
    ops.append(("view", (rows, cols)))
    if rng.random() < 0.6:
        a = rng.randrange(rows)
        ops.append(("slice", 0, a, rng.randint(a + 1, rows), rng.choice([1, 1, 2])))
    if rng.random() < 0.6:
        a = rng.randrange(cols)
        ops.append(("slice", 1, a, rng.randint(a + 1, cols), rng.choice([1, 1, 2])))
    if rng.random() < 0.25:
        ops.append(("t",))
    return ops


def _random_source(rng, shape):
    """``(patch shape, ops)``: the patch the loader copies, and the view of it the copy
    reads, of ``shape`` or broadcast to it."""
    r = rng.random()
    if r < 0.45 or not shape:
        return shape, []
    if r < 0.6:
        return (math.prod(shape),), [("reshape", shape)]
    if r < 0.75 and len(shape) == 2:
        return (shape[1], shape[0]), [("t",)]
    if r < 0.88:  # a larger patch, sliced along its first dim
        extra = rng.randint(1, 2)
        return (shape[0] + extra, *shape[1:]), [("slice", 0, extra, shape[0] + extra, 1)]
    return shape[1:] if len(shape) > 1 else (1,), []  # broadcast along the first dim


def _patch(rng, g, i, shape, dtype, sparse, now):
    n = math.prod(shape)
    if not sparse:
        v = torch.randn(n, generator=g)
        if now is not None and now.numel() == n and rng.random() < 0.5:
            keep = torch.rand(n, generator=g) < 0.5
            v = torch.where(keep, now.float().reshape(-1), v)
        return CheckpointWeightPatch(f"p{i}", shape, dtype, v.to(dtype))
    k = rng.randint(0, n)
    idx = torch.randperm(n, generator=g)[:k].sort().values
    return CheckpointWeightPatch(f"p{i}", shape, dtype,
                                 (torch.randn(k, generator=g) * 4).to(dtype), idx)


def _staged(p):
    if p.indices is None:
        return p.values.reshape(p.shape)
    s = torch.full((math.prod(p.shape),), float("nan"), dtype=p.dtype)
    s[p.indices.long()] = p.values
    return s.view(p.shape)


def _brute(flat, views, sources, patches):
    """The flat buffer after each patch's copy, NaN-merged where sparse."""
    flat = flat.clone()
    for i, p in enumerate(patches):
        dst = _apply(views[i], flat)
        src = _apply(sources[i], _staged(p)).expand(dst.shape)
        old = dst.clone()
        dst.copy_(src)
        if p.indices is not None:
            dst.copy_(torch.where(torch.isnan(src), old, dst))
    return flat


def _case(seed, reinterpret=False):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    size, layout = _layout(rng)
    dtype = rng.choice(DTYPES)
    sparse = rng.random() < 0.5
    k = rng.randint(1, 2)
    views, sources, shapes = [], [], []
    head, units = [], size
    if reinterpret:
        # (an observed loader's merge casts to the view's dtype first: an integer view
        # has no NaN to keep, so it is only sent dense patches)
        dtype, as_ = rng.choice([(b, v) for b, v in REINTERPRETED
                                 if v.is_floating_point or not sparse or seed % 4 != 3])
        wide, narrow = as_.itemsize, dtype.itemsize
        if wide > narrow:
            size += -size % (wide // narrow)  # (a tail of the buffer: no tensor's)
        head, units = [("as", as_)], size * narrow // wide
    probe = torch.zeros(size, dtype=dtype)
    for _ in range(k):
        v = head + _random_view(rng, units)
        shape, src = _random_source(rng, tuple(_apply(v, probe).shape))
        views.append(v)
        sources.append(src)
        shapes.append(shape)
    base = Flat(size, layout, dtype, views, sources).flat
    patches = [_patch(rng, g, i, s, rng.choice(DTYPES), sparse,
                      _apply(views[i], base) if not sources[i] else None)
               for i, s in enumerate(shapes)]
    return size, layout, dtype, views, sources, patches


def _logged(m):
    sent, returned, at_fail = [], [], {}
    own = m.load_weights

    def load_weights(weights):
        weights = list(weights)
        sent.append(tuple(n for n, _ in weights))
        try:
            r = own(weights)
        except BaseException:
            at_fail.update(snapshot(m))
            raise
        returned.append(r)
        return r

    m.load_weights = load_weights
    return sent, returned, at_fail


def _bytes_of(t):
    """The storage bytes each element of view ``t`` holds: ``(numel, element size)``."""
    at = torch.tensor(t.storage_offset())
    for n, s in zip(t.shape, t.stride()):
        at = at[..., None] + torch.arange(n) * s
    return (at.reshape(-1, 1) * t.element_size()
            + torch.arange(t.element_size())).reshape(-1, t.element_size())


def _covered(size, layout, views, dtype):
    """Whether every element each view writes lies in runtime tensors (a view that
    reaches the buffer's space between or after them is reported as one row, for the
    tensor where it starts: not checked by the oracle here)."""
    step = dtype.itemsize
    owned = torch.zeros(size * step, dtype=torch.bool)
    for off, shape in layout:
        owned[off * step:(off + math.prod(shape)) * step] = True
    probe = torch.zeros(size, dtype=dtype)
    return all(bool(owned[_bytes_of(_apply(v, probe))].all()) for v in views)


def _touched(m, views):
    """Each runtime tensor's elements that a byte of a view lies in, as a bool mask."""
    hit = torch.zeros(m.flat.numel() * m.flat.element_size(), dtype=torch.bool)
    for v in views:
        hit[_bytes_of(_apply(v, m.flat))] = True
    hit = hit.view(-1, m.flat.element_size()).any(1)
    return {n: hit[t.storage_offset():t.storage_offset() + t.numel()].view(t.shape)
            for n, t in m.named_parameters()}


def _forward(size, views, dtype=torch.float32):
    """Whether each view's row-major order runs forward through the buffer (each dim
    steps past all those inside it): a transposed view over several tensors is reported
    as one row, for the tensor where it starts (the writes docstring says so)."""
    for v in views:
        t = _apply(v, torch.zeros(size, dtype=dtype))
        inner = 0
        for n, st in zip(reversed(t.shape), reversed(t.stride())):
            if n > 1:
                if st <= inner:
                    return False
                inner += st * (n - 1)
    return True


def _owned(m, flat):
    """The bits of the model's runtime tensors, and those of ``flat`` at their places
    (the buffer's space outside them is no runtime tensor's: a sparse load does not
    follow a copy into it)."""
    mask = torch.zeros(flat.numel(), dtype=torch.bool)
    for _, t in m.named_parameters():
        mask[t.storage_offset():t.storage_offset() + t.numel()] = True
    return bits(m.flat)[mask], bits(flat)[mask]


def _owned_bits(m):
    return [bits(t.detach()).clone() for _, t in m.named_parameters()]


def _run(seed, seen, reinterpret=False):
    size, layout, dtype, views, sources, patches = _case(seed, reinterpret)
    mode = ["plain", "inspect", "transactional", "observed"][seed % 4]
    covered = _covered(size, layout, views, dtype)
    seen["covered" if covered else "reaching outside the tensors"] += 1
    forward = _forward(size, views, dtype)
    seen["forward" if forward else "transposed"] += 1
    fail = mode == "transactional"
    m = Flat(size, layout, dtype, views, sources, fail=fail)
    flat0 = m.flat.clone()
    owned0 = _owned_bits(m)
    want = _brute(flat0, views, sources, patches)
    if mode == "plain":
        try:
            load_checkpoint_weight_patches(m, patches)
        except ContractViolation as e:
            seen["refused"] += 1
            done = _brute(flat0, views, sources, patches[:e.position])
            assert torch.equal(*_owned(m, done)), (seed, "a refused copy wrote")
            return
        assert torch.equal(*_owned(m, want)), (seed, "plain load")
        seen["plain"] += 1
        return
    before = snapshot(m)
    sent, returned, at_fail = _logged(m)
    err = None
    try:
        if mode == "observed":
            r = inspect_load(m, patches, loader=vllm_style_loader)
        else:
            r = inspect_load(m, patches, transactional=fail)
    except Failed as e:
        err, r = e, e.report
    except ContractViolation as e:
        seen["refused"] += 1
        if fail:
            assert all(map(torch.equal, _owned_bits(m), owned0)), (seed, "refusal rollback")
        else:
            done = _brute(flat0, views, sources, patches[:e.position])
            assert torch.equal(*_owned(m, done)), (seed, "a refused copy wrote")
        return
    finally:
        del m.load_weights
    assert (err is not None) == fail, seed
    if fail:  # (every byte of every runtime tensor as it was)
        assert all(map(torch.equal, _owned_bits(m), owned0)), (seed, "rollback")
    else:
        assert torch.equal(*_owned(m, want)), (seed, mode)
    broadcast = any(_apply(s, _staged(p)).shape != _apply(v, torch.zeros(size, dtype=dtype)
                                                          ).shape
                    for p, v, s in zip(patches, views, sources))
    seen["broadcast"] += broadcast
    if reinterpret:
        # (rows in the tensors' own elements, of a copy from the patch's: no replay of
        # theirs; each tensor's changes counted, and within the elements it wrote, which
        # a dense copy through views of whole elements that stay in the tensors gives
        # exactly; a narrower view's bytes that make no box of them, the span they reach)
        changed = {n: bits(before[n]) != bits(t.detach()) for n, t in m.named_parameters()}
        if not fail:
            assert r.deltas["changed"].to_dict() == {
                n: int(c.sum()) for n, c in changed.items()
                if c.any() or n in r.deltas.index}, (seed, mode, views)
            touched = _touched(m, views)
            for n in r.deltas.index:
                w = r.written(n)
                assert not (changed[n] & ~w).any(), (seed, mode, n, "changed, not written")
                if (covered and patches[0].indices is None and mode != "observed"
                        and views[0][0][1].itemsize >= dtype.itemsize):
                    assert torch.equal(w, touched[n]), (seed, mode, n, views)
                    seen["reinterpreted, written exactly"] += 1
        seen["reinterpreted " + mode] += 1
        return
    # (a broadcast source's row keeps the source's own strides, by design:
    # test_inspect.py's test_a_broadcast_copy_names_the_checkpoint_region_it_read_...;
    # the oracle replays only sources of the row's shape)
    if not covered or not forward or broadcast or (
            mode == "observed" and patches[0].indices is not None):
        # (an observed NaN-merging copy_ writes a torch.where of the model's and the
        # patch's values, traced to no patch: rows without checkpoint_offset)
        changed = {n: int((bits(before[n]) != bits(t.detach())).sum())
                   for n, t in m.named_parameters()}
        if not fail:
            assert r.deltas["changed"].to_dict() == {n: c for n, c in changed.items()
                                                     if c or n in r.deltas.index}, seed
        return
    L = dict(patches=patches, report=r, err=err, before=before, after=snapshot(m),
             at_fail=at_fail, sent=sent, returned=returned,
             plan=patchkit.plan_chunks(patches, 512 << 20),
             sent_as={i: p.name for i, p in enumerate(patches)}, transactional=fail)
    problems = check(L, seen)
    assert problems == [], (seed, mode, views, sources, problems)
    seen[mode] += 1
    seen["rows"] += len(r.writes)


@pytest.mark.parametrize("block", range(4))
def test_copies_across_runtime_tensors_of_one_buffer_agree_with_brute_force(block):
    seen = collections.Counter()
    for seed in range(block * 400, block * 400 + 400):
        _run(seed, seen)
    print(dict(seen))


@pytest.mark.parametrize("block", range(2))
def test_copies_through_views_of_another_dtype_across_runtime_tensors(block):
    # The buffer's bytes written as another dtype (a float32 view of bfloat16
    # parameters, cut at an odd element: a float32 element holds parts of two), through
    # contiguous, strided, 2-d and transposed views
    seen = collections.Counter()
    for seed in range(10**5 + block * 400, 10**5 + block * 400 + 400):
        _run(seed, seen, reinterpret=True)
    print(dict(seen))
    assert seen["reinterpreted transactional"] > 50 and seen["refused"] > 10, seen


# -- casts and clones of strided views of a patch, read through views of their own --------


def _random_strided(rng, t):
    """A random view of ``t``: slices with steps on some dims, then maybe a permutation."""
    for d in range(t.dim()):
        n = t.shape[d]
        if n > 1 and rng.random() < 0.6:
            a = rng.randrange(n)
            t = t.narrow(d, 0, n)[(slice(None),) * d + (
                slice(a, rng.randint(a + 1, n), rng.choice([1, 1, 2, 3])),)]
    if t.dim() > 1 and rng.random() < 0.4:
        order = list(range(t.dim()))
        rng.shuffle(order)
        t = t.permute(order)
    if rng.random() < 0.25:
        t = t.reshape(-1)  # (a copy, where ``t`` is no contiguous view)
    return t


def _region_indices(shape, region):
    """The flat indices a region text names ("[a:b:k, ...]"; None for "n elements")."""
    if not region.startswith("["):
        return None
    parts = [p.strip() for p in region[1:-1].split(",")] if shape else []
    ranges = []
    for p, d in zip(parts, shape):
        if p == ":":
            ranges.append(range(d))
        else:
            a, b, *k = (int(x) for x in p.split(":"))
            ranges.append(range(a, b, k[0] if k else 1))
    idx = torch.arange(math.prod(shape)).view(shape)
    for d, r in enumerate(ranges):
        idx = idx.index_select(d, torch.tensor(list(r), dtype=torch.long))
    return set(idx.reshape(-1).tolist())


def _is_box(shape, flat):
    """Whether a set of flat indices of a tensor of ``shape`` is a product of one
    arithmetic progression per dimension."""
    coords = torch.tensor(sorted(flat))
    per = []
    for d in reversed(shape):
        per.append(coords % d)
        coords = coords // d
    prod = 1
    for c in per:
        vals = sorted(set(c.tolist()))
        if len(vals) > 1 and len({b - a for a, b in itertools.pairwise(vals)}) > 1:
            return False
        prod *= len(vals)
    return prod == len(flat)


class _One(torch.nn.Module):
    def __init__(self, shape, dtype, read):
        super().__init__()
        self.x = torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
        self.read = read

    def load_weights(self, weights):
        for _, t in weights:
            self.x.copy_(self.read(t))
        return {"x"}


def test_casts_of_strided_views_are_located_as_brute_force_finds_them():
    seen = collections.Counter()
    for seed in range(300):
        rng = random.Random(seed)
        g = torch.Generator().manual_seed(seed)
        shape = tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 3)))
        sparse = rng.random() < 0.4
        n = math.prod(shape)
        if sparse:
            idx = torch.randperm(n, generator=g)[:rng.randint(1, n)].sort().values
            p = CheckpointWeightPatch("x", shape, torch.float32,
                                      torch.randn(len(idx), generator=g), idx)
        else:
            p = CheckpointWeightPatch("x", shape, torch.float32, torch.randn(n, generator=g))
        cast = rng.choice(["bf16", "clone", "f64"])

        def read(t, seed=seed, cast=cast):
            r = random.Random(seed + 10**6)
            v = _random_strided(r, t)
            v = v.clone() if cast == "clone" else v.to(
                torch.bfloat16 if cast == "bf16" else torch.float64)
            return _random_strided(r, v)

        where = read(torch.arange(n, dtype=torch.float64).view(shape)).long()
        dtype = {"bf16": torch.bfloat16, "clone": torch.float32, "f64": torch.float64}[cast]
        m = _One(tuple(where.shape), dtype, read)
        before = snapshot(m)
        sent, returned, at_fail = _logged(m)
        try:
            r = inspect_load(m, [p])
        finally:
            del m.load_weights
        L = dict(patches=[p], report=r, err=None, before=before, after=snapshot(m),
                 at_fail=at_fail, sent=sent, returned=returned,
                 plan=patchkit.plan_chunks([p], 512 << 20), sent_as={0: "x"},
                 transactional=False)
        row = r.writes.iloc[0]
        read_set = set(where.reshape(-1).tolist())
        if row["checkpoint_offset"] is None or str(row["checkpoint_offset"]) == "<NA>":
            # no place given: the elements read must be no box of the patch, in the
            # view's own order (the copy's strides in the checkpoint)
            seen["no place"] += 1
            seen["no place, though a box"] += _is_box(shape, read_set)
            continue
        assert check(L, seen) == [], (seed, r.writes.to_dict("records"))
        got = _region_indices(shape, row["checkpoint_region"])
        if got is None:
            # (a box read through a 1-d view that steps over two dimensions, w[:, :, 5]
            # of a (3, 6, 6) w as 18 elements of stride 6, is named "18 elements from
            # 5": region_text splits no view dimension; counted, not asserted)
            seen["no box named" if not _is_box(shape, read_set) else "box named as none"] += 1
        else:
            assert got == read_set, (seed, row["checkpoint_region"], where)
            seen["box"] += 1
    assert seen["box"] > 100 and seen["no place"] > 5, seen
    print(dict(seen))
