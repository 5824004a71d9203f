"""Which patch fed a write: staged tensors that share a storage, storages freed during a
call, data moved by ops (cat, gather, flip), and what an observed loader's NaN does."""

from __future__ import annotations

import collections
import functools
import math

import pandas as pd
import pytest
import torch
from test_report_oracle import check, logged_load
from torch import nn

import patchkit
from patchkit import CheckpointWeightPatch as CWP
from patchkit import native
from patchkit._marks import _Provenance
from patchkit._regions import _storage_key
from patchkit.bitwise import bits
from patchkit.errors import ContractViolation


def _dev():
    return torch.get_default_device()


# -- staged tensors cut from one flat bucket ------------------------------------------


class _Shards(nn.Module):
    """Rank 1 of 2: q and k rows packed into qkv, o split by columns."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Parameter(torch.zeros(8, 8, dtype=torch.bfloat16), requires_grad=False)
        self.o = nn.Parameter(torch.zeros(8, 4, dtype=torch.bfloat16), requires_grad=False)

    def load_weights(self, weights):
        for n, w in weights:
            if n == "q":
                self.qkv.data.narrow(0, 0, 4).copy_(w.narrow(0, 4, 4))
            elif n == "k":
                self.qkv.data.narrow(0, 4, 4).copy_(w.narrow(0, 4, 4))
            else:
                self.o.data.copy_(w.narrow(1, 4, 4))
        return {n for n, _ in weights}


def test_dense_patches_cut_from_one_bucket_are_credited_each_to_its_own_patch():
    bucket = torch.randn(3 * 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    patches = [CWP(n, (8, 8), torch.bfloat16, bucket[64 * i: 64 * (i + 1)])
               for i, n in enumerate("qko")]
    for loader in (None, patchkit.load_checkpoint_weight_patches):
        w = patchkit.inspect_load(_Shards(), patches, loader=loader).writes
        assert w["position"].tolist() == [0, 1, 2]
        assert w["name"].tolist() == ["q", "k", "o"]
        assert w["checkpoint_offset"].tolist() == [32, 32, 4]
        assert w["checkpoint_region"].tolist() == ["[4:8, :]", "[4:8, :]", "[:, 4:8]"]


def test_a_loader_that_stages_a_whole_call_in_one_buffer_is_followed_by_position():
    class Three(nn.Module):
        def __init__(self):
            super().__init__()
            for n in "abc":
                self.register_parameter(n, nn.Parameter(torch.zeros(2, 3), requires_grad=False))

        def load_weights(self, weights):
            for n, w in weights:
                getattr(self, n).data.copy_(w)
            return {n for n, _ in weights}

    def one_buffer_loader(model, patches, **kw):
        buf = torch.cat([p.values.reshape(-1) for p in patches])
        views = [buf[6 * i: 6 * (i + 1)].view(2, 3) for i in range(len(patches))]
        return set(model.load_weights([(p.name, v) for p, v in zip(patches, views)]))

    patches = [CWP(n, (2, 3), torch.float32, torch.full((6,), float(i + 1)))
               for i, n in enumerate("abc")]
    w = patchkit.inspect_load(Three(), patches, loader=one_buffer_loader).writes
    assert w["position"].tolist() == [0, 1, 2]
    assert w["checkpoint_offset"].tolist() == [0, 0, 0]


def test_stretches_of_one_storage_replace_exactly_the_ones_they_overlap():
    # Against a plain list kept the obvious way: a put (or a forget) takes the bytes it
    # covers from every stretch it overlaps, whose bytes outside it keep their patch; a
    # lookup finds the stretch holding the view's first byte. Many patches staged in one
    # bucket (bisected, not scanned) must give the same answers.
    g = torch.Generator().manual_seed(7)
    flat = torch.zeros(512)
    key = _storage_key(flat)
    prov, ref = _Provenance(), []
    for step in range(3000):
        a = int(torch.randint(0, 512, (1,), generator=g))
        b = min(512, a + int(torch.randint(1, 40, (1,), generator=g)))
        if step % 3 or (step % 5 == 0 and key in prov._by_key):
            lo, hi = 4 * a, 4 * b
            ref = ([e for e in ref if e[1] <= lo or hi <= e[0]]
                   + [(e[0], lo, *e[2:]) for e in ref if e[0] < lo < e[1]]
                   + [(hi, e[1], *e[2:]) for e in ref if e[0] < hi < e[1]])
            if step % 3:
                prov.add_staged(step, f"p{step}", flat[a:b])
                ref.append((lo, hi, step, a))
            else:
                prov._forget(key, lo, hi)
        hit = [e for e in ref if e[0] <= 4 * a < e[1]]
        want = (hit[0][2], f"p{hit[0][2]}", a - hit[0][3]) if hit else None
        assert prov.lookup(flat[a:b]) == want, step
    assert len(prov._by_key.get(key, [])) == len(ref)


# -- a storage freed during the call --------------------------------------------------


def test_a_freed_storage_is_forgotten_even_when_its_address_comes_back():
    prov = _Provenance()
    staged = torch.arange(8.0)
    prov.add_staged(0, "a", staged)
    out = staged.to(torch.float64)
    assert prov.derive(staged, out, whole=True)
    key, probe = _storage_key(out), out[2:]
    assert prov.lookup(probe, key=key) == (0, "a", 2)
    del out, probe
    # Any tensor now at that address (here: any tensor, handed the old key) is not a's.
    assert prov.lookup(torch.zeros(8, dtype=torch.float64), key=key) is None
    assert prov.lookup(staged) == (0, "a", 0)  # the staged tensor itself stays


class _CastThenFlip(nn.Module):
    """a is cast (a temporary, freed); b is flipped (a new, untraced-by-offset temporary
    that the allocator often puts where a's cast was)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = nn.Parameter(torch.randn(64, 64, generator=g).bfloat16(), requires_grad=False)
        self.b = nn.Parameter(torch.randn(64, 64, generator=g).bfloat16(), requires_grad=False)

    def load_weights(self, weights):
        for n, w in weights:
            if n == "a":
                t = w.to(torch.bfloat16)
                self.a.data.copy_(t)
                del t
            elif n == "b":
                self.b.data.copy_(torch.flip(w, [0]))
            else:
                raise KeyError(n)
        return {n for n, _ in weights}


def test_rollback_and_report_stay_exact_when_a_freed_cast_address_is_reused():
    g = torch.Generator().manual_seed(1)
    ia = torch.randperm(4096, generator=g)[:100].sort().values
    ib = torch.randperm(4096, generator=g)[:100].sort().values
    pa = CWP("a", (64, 64), torch.float32, torch.randn(100, generator=g), ia)
    pb = CWP("b", (64, 64), torch.bfloat16, torch.randn(100, generator=g).bfloat16(), ib)
    fails = CWP("c", (4,), torch.float32, torch.ones(1), torch.tensor([0]))
    for _ in range(10):  # the allocator reuses the address in most tries, not all
        m = _CastThenFlip()
        before = {k: bits(v).clone() for k, v in m.state_dict().items()}
        with pytest.raises(KeyError):
            patchkit.load_checkpoint_weight_patches(m, [pa, pb, fails], transactional=True)
        assert all(torch.equal(before[k], bits(v)) for k, v in m.state_dict().items())
        m = _CastThenFlip()
        report = patchkit.inspect_load(m, [pa, pb])
        row = report.writes[report.writes["target"] == "b"].iloc[0]
        assert (row["position"], row["name"]) == (1, "b")
        assert torch.equal(bits(report.before("b")), before["b"])


# -- data moved by ops ---------------------------------------------------------------


class _Moves(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how
        self.w = nn.Parameter(torch.zeros(8, 4), requires_grad=False)

    def load_weights(self, weights):
        for _, w in weights:
            src = {"plain": lambda w=w: w, "cat": lambda w=w: torch.cat([w[:4], w[4:]]),
                   "gather": lambda w=w: w[torch.arange(7, -1, -1)],
                   "flip": lambda w=w: torch.flip(w, [0]),
                   "transposed": lambda w=w: w.t().contiguous().t(),
                   "clone": lambda w=w: w.clone(),
                   "reshaped": lambda w=w: w.reshape(32).reshape(8, 4),
                   "cast": lambda w=w: w.double().float()}[self.how]()
            self.w.data.copy_(src)
        return {n for n, _ in weights}


@pytest.mark.parametrize("how", ["cat", "gather", "flip"])
@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_a_write_from_data_an_op_moved_names_the_patch_at_no_offset(how, kind):
    if kind == "dense":
        p = CWP("w", (8, 4), torch.float32, torch.arange(32.0))
    else:
        p = CWP("w", (8, 4), torch.float32, torch.tensor([1.0, 2.0]), torch.tensor([3, 17]))
    w = patchkit.inspect_load(_Moves(how), [p]).writes
    assert (w["position"].tolist(), w["name"].tolist()) == ([0], ["w"])
    assert w["checkpoint_offset"].isna().all() and w["checkpoint_region"].isna().all()


class _Ops(nn.Module):
    """Writes each patch with an op other than ``copy_``: rows in reverse order
    (``index_copy_``, ``param[idx] = w``) or an ``out=`` op."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.a = nn.Parameter(torch.zeros(4, 3), requires_grad=False)
        self.b = nn.Parameter(torch.zeros(4, 3), requires_grad=False)

    def load_weights(self, weights):
        rows = torch.tensor([3, 2, 1, 0])
        for n, w in weights:
            t = getattr(self, n).data
            if self.how == "index_copy_":
                t.index_copy_(0, rows, w)
            elif self.how == "setitem":
                t[rows] = w
            else:
                torch.mul(w, 1.0, out=t)
        return {n for n, _ in weights}


@pytest.mark.parametrize("how", ["index_copy_", "setitem", "out="])
def test_a_dense_write_by_an_op_other_than_a_copy_names_its_patch_at_no_offset(how):
    # (was: no patch at all, though the op's source is one staged tensor)
    ps = [CWP(n, (4, 3), torch.float32, torch.arange(12.0) + i) for i, n in enumerate("ab")]
    w = patchkit.inspect_load(_Ops(how), ps).writes
    assert w[["target", "position", "name"]].values.tolist() == [["a", 0, "a"], ["b", 1, "b"]]
    assert w["checkpoint_offset"].isna().all()


@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_a_staged_tensor_overwritten_from_an_untraced_source_names_no_patch(kind):
    # ``t.copy_(ones)`` leaves nothing of the patch in ``t``: the write from it afterwards
    # holds no patch's data, and naming the patch (at offset 0) would be false.
    class Overwrites(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(8, 4), requires_grad=False)

        def load_weights(self, weights):
            for _, t in weights:
                t.copy_(torch.ones(8, 4))
                self.w.data.copy_(t)
            return {n for n, _ in weights}

    if kind == "dense":
        p = CWP("w", (8, 4), torch.float32, torch.arange(32.0))
    else:
        p = CWP("w", (8, 4), torch.float32, torch.tensor([1.0, 2.0]), torch.tensor([3, 17]))
    w = patchkit.inspect_load(Overwrites(), [p]).writes
    assert len(w) == 1
    assert w["position"].isna().all() and w["name"].isna().all()
    assert w["checkpoint_offset"].isna().all()


@pytest.mark.parametrize("how", ["plain", "clone", "reshaped", "cast", "transposed"])
def test_a_patch_traced_exactly_keeps_its_offset(how):
    # (through a clone, a view or a cast too: mutation testing found a clone, or a view
    # the dispatch mode sees, taken for data an op moved, with every test passing; and
    # through the contiguous copy of a transposed view, transposed back: each element
    # of the copy is known to be the checkpoint element of the view at its index)
    p = CWP("w", (8, 4), torch.float32, torch.arange(32.0))
    w = patchkit.inspect_load(_Moves(how), [p]).writes
    assert w["checkpoint_offset"].tolist() == [0] and w["checkpoint_region"].tolist() == ["[:, :]"]


def test_a_cat_of_two_patches_names_neither():
    class Cat(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.zeros(8), requires_grad=False)

        def load_weights(self, weights):
            ws = dict(weights)
            self.w.data.copy_(torch.cat([ws["a"], ws["b"]]))
            return set(ws)

    ps = [CWP(n, (4,), torch.float32, torch.full((4,), float(i))) for i, n in enumerate("ab")]
    w = patchkit.inspect_load(Cat(), ps).writes
    assert w["position"].isna().all()


def test_an_error_of_index_put_names_the_patch_whose_values_it_writes():
    class Put(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.zeros(4, 4), requires_grad=False)
            self.b = nn.Parameter(torch.zeros(4, 4), requires_grad=False)

        def load_weights(self, weights):
            for n, w in weights:
                if n == "a":
                    self.a.data.copy_(w)
                else:
                    self.b.data[torch.tensor([3, 2, 1, 0])] = w
            return {n for n, _ in weights}

    ps = [CWP(n, (4, 4), torch.float32, torch.tensor([1.0]), torch.tensor([0])) for n in "ab"]
    with pytest.raises(ContractViolation) as info:
        patchkit.load_checkpoint_weight_patches(Put(), ps)
    assert (info.value.position, info.value.name) == (1, "b")
    assert "patch 1 ('b')" in str(info.value)


# -- an observed loader's NaN ---------------------------------------------------------


def _staged(p):
    t = torch.full(p.shape, float("nan"), dtype=p.dtype).reshape(-1)
    bits(t).index_copy_(0, p.indices.long(), bits(p.values.to(p.dtype)))
    return t.reshape(p.shape)


def _copying_loader(model, patches, *, prefix="", **kw):
    """Stages NaN-masked tensors and leaves the merge to nobody (no sparse support)."""
    loaded = set()
    with torch.no_grad():
        for p in patches:
            loaded |= set(model.load_weights([(prefix + p.name, _staged(p))]) or ())
    return loaded


@pytest.mark.parametrize("how", ["plain", "cat", "gather", "renamed"])
def test_observed_nan_copied_is_caught_whatever_builds_the_source(how):
    m = _Moves("plain" if how == "renamed" else how)
    p = CWP("w", (8, 4), torch.float32, torch.tensor([1.0, 2.0]), torch.tensor([3, 17]))
    loader = functools.partial(_copying_loader, prefix="hf." if how == "renamed" else "")
    with pytest.raises(ContractViolation) as info:
        patchkit.inspect_load(m, [p], loader=loader)
    assert info.value.reason == "NaN copied" and info.value.value == 30
    assert info.value.report is not None


def test_observed_merging_loader_through_a_cat_reports_what_the_built_in_does():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Merge(TorchDispatchMode):
        def __init__(self, keys):
            super().__init__()
            self.keys = keys

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.copy_.default and _storage_key(args[0]) in self.keys:
                d, s = args[0], args[1].to(args[0].dtype)
                return func(d, torch.where(torch.isnan(s), d, s))
            return func(*args, **(kwargs or {}))

    def merging_loader(model, patches, **kw):
        keys = {_storage_key(t) for t in model.parameters()}
        with torch.no_grad(), Merge(keys):
            return set(model.load_weights([(p.name, _staged(p)) for p in patches]))

    p = CWP("w", (8, 4), torch.float32, torch.tensor([1.0, 2.0]), torch.tensor([3, 17]))
    for how in ("cat", "gather"):
        ours = patchkit.inspect_load(_Moves(how), [p])
        theirs = patchkit.inspect_load(_Moves(how), [p], loader=merging_loader)
        for r in (ours, theirs):
            assert r.writes["written"].tolist() == [2]
            assert r.deltas.loc["w", "elements"] == 2 and r.deltas.loc["w", "changed"] == 2


# -- the dtype a patch's bytes are, through ops that move them ------------------------


@pytest.mark.parametrize(("dtype", "as_dtype"), [(torch.float16, torch.bfloat16),
                                                 (torch.float32, torch.float64)])
@pytest.mark.parametrize("move", [
    pytest.param(lambda v: v.clone(), id="clone"),  # (an element-for-element copy)
    pytest.param(lambda v: v.flip(0), id="flip"),  # (data moved to no known place)
])
def test_patch_bytes_read_as_another_dtype_stay_refused_after_an_op_moves_them(
        dtype, as_dtype, move):
    # An op that keeps its input's dtype moves bits, not numbers: a clone or flip of
    # ``w.view(bfloat16)`` of a float16 patch still holds float16 NaN, which bfloat16
    # reads as a number (two float32 NaN as one float64 number). Taken for the op's own
    # dtype, the copy would be merged, writing the staged NaN bits into the model.
    class Moves(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter((torch.arange(12.0).reshape(3, 4) + 100.3).to(dtype),
                                  requires_grad=False)

        def load_weights(self, weights):
            for _, t in weights:
                self.w.view(as_dtype).copy_(move(t.view(as_dtype)))
            return {n for n, _ in weights}

    m = Moves()
    before = bits(m.w.detach()).clone()
    p = CWP("w", (3, 4), dtype, torch.tensor([-1.0, -2.0]), torch.tensor([0, 5]))
    with pytest.raises(ContractViolation, match="another dtype") as e:
        patchkit.load_checkpoint_weight_patches(m, [p])
    assert (e.value.position, e.value.reason, e.value.value) == (
        0, "reinterpreted source", (dtype, as_dtype))
    assert torch.equal(bits(m.w.detach()), before)


@pytest.mark.parametrize("half", [0, 1])
def test_patch_bytes_read_as_another_dtype_from_a_buffer_of_two_patches_are_refused(half):
    # Two float32 patches copied into one scratch buffer: its storage holds two
    # stretches (no quick answer from one). Either half read as float16 reads float32
    # NaN ("keep") as two float16 numbers, and is refused, naming the patch it holds.
    class Scratch(nn.Module):
        def __init__(self):
            super().__init__()
            self.h = nn.Parameter(torch.arange(16.0).to(torch.float16), requires_grad=False)

        def load_weights(self, weights):
            w = dict(weights)
            buf = torch.empty(16)
            buf[:8].copy_(w["a"])
            buf[8:].copy_(w["b"])
            self.h.data.copy_(buf[8 * half:8 * half + 8].view(torch.float16))
            return {"h"}

    m = Scratch()
    before = bits(m.h.detach()).clone()
    ps = [CWP(n, (8,), torch.float32, torch.tensor([1.0, 2.0]), torch.tensor([0, 5]))
          for n in ("a", "b")]
    with pytest.raises(ContractViolation, match="another dtype") as e:
        patchkit.load_checkpoint_weight_patches(m, ps)
    assert (e.value.position, e.value.name, e.value.reason, e.value.value) == (
        half, "ab"[half], "reinterpreted source", (torch.float32, torch.float16))
    assert torch.equal(bits(m.h.detach()), before)


_U8 = torch.uint8

# A loader that moves a float32 patch's bytes by a number of bytes that is no multiple of
# 4, then reads them as float32 again: each element it reads holds the end of one
# element and the start of the next, so the staged NaN ("keep") reads as numbers.
_SHIFTED = {
    "a clone of bytes 1:13": lambda t: t.view(_U8)[1:13].clone().view(torch.float32),
    "a clone of int16 words 1:7": lambda t: t.view(torch.int16)[1:7].clone().view(
        torch.float32),
    "then cast": lambda t: t.view(_U8)[1:13].clone().view(torch.float32).double(),
    "then flipped": lambda t: t.view(_U8)[1:13].clone().view(torch.float32).flip(0),
    "then scaled": lambda t: t.view(_U8)[1:13].clone().view(torch.float32) * 1,
    # (the clone of a clone keeps the shift its source's elements have)
    "a clone of bytes 1:13, cloned again": lambda t: t.view(_U8)[1:13].clone().clone().view(
        torch.float32),
}


def _scratch_read_3_bytes_on(t):
    buf = torch.zeros(20, dtype=_U8)
    buf[1:17].copy_(t.view(_U8))  # (patch element k at bytes 1+4k: read from byte 4)
    return buf[4:16].view(torch.float32)


_SHIFTED["a scratch copy read 3 bytes on"] = _scratch_read_3_bytes_on


def _scratch_copy_of_bytes_1_on_to_byte_1(t):
    buf = torch.zeros(20, dtype=_U8)
    buf[1:16].copy_(t.view(_U8)[1:])  # (patch element k at bytes 4k, as in t)
    return buf[4:16].view(torch.float32)


# The same moves by whole elements: the patch's elements, bit for bit.
_ALIGNED = {
    "a clone of all its bytes": lambda t: t.view(_U8).clone().view(torch.float32)[1:],
    "a clone of bytes 4:16": lambda t: t.view(_U8)[4:16].clone().view(torch.float32),
    "a clone of int16 words 2:8": lambda t: t.view(torch.int16)[2:8].clone().view(
        torch.float32),
    "moved by 1 byte, then by 3 more": lambda t: t.view(_U8)[1:].clone()[3:15].clone().view(
        torch.float32),
}
_ALIGNED["bytes 1: copied to byte 1 of a scratch"] = _scratch_copy_of_bytes_1_on_to_byte_1


class _Bytes(nn.Module):
    """Copies patch "a" into ``p`` as it is, then what ``move`` makes of patch "b" (four
    float32 elements) into the three elements of ``h``."""

    def __init__(self, move):
        super().__init__()
        self.p = nn.Parameter(torch.arange(4.0) + 10.5, requires_grad=False)
        self.h = nn.Parameter(torch.arange(3.0) + 0.5, requires_grad=False)
        self.move = move

    def load_weights(self, weights):
        w = dict(weights)
        self.p.data.copy_(w["a"])
        self.h.data.copy_(self.move(w["b"]))
        return {"p", "h"}


def _a_and_b():
    return [CWP("a", (4,), torch.float32, torch.tensor([9.0]), torch.tensor([1])),
            CWP("b", (4,), torch.float32, torch.tensor([7.0, -3.0]), torch.tensor([1, 2]))]


@pytest.mark.parametrize("how", list(_SHIFTED))
@pytest.mark.parametrize("kind", ["plain", "transactional", "inspected"])
def test_patch_bytes_moved_off_their_elements_then_read_as_their_dtype_are_refused(how, kind):
    # Before, such a copy was merged: the NaN of b's staged tensor, shifted by a byte,
    # reads as float32 numbers (1e-38 and the like), which landed in h where b keeps.
    m = _Bytes(_SHIFTED[how])
    before = [bits(t.detach()).clone() for t in (m.p, m.h)]
    with pytest.raises(ContractViolation, match="no multiple of its 4-byte") as e:
        if kind == "inspected":
            patchkit.inspect_load(m, _a_and_b())
        else:
            patchkit.load_checkpoint_weight_patches(m, _a_and_b(),
                                                    transactional=kind == "transactional")
    assert (e.value.position, e.value.name, e.value.reason, e.value.value) == (
        1, "b", "reinterpreted source", (torch.float32, torch.float32))
    assert torch.equal(bits(m.h.detach()), before[1])  # (refused before it wrote)
    # a's write, made before, stays unless the load is transactional
    assert torch.equal(bits(m.p.detach()), before[0]) == (kind == "transactional")


@pytest.mark.parametrize("how", list(_ALIGNED))
def test_patch_bytes_moved_by_whole_elements_still_merge_bit_for_bit(how):
    m = _Bytes(_ALIGNED[how])
    staged = patchkit.stage(_a_and_b()[1])
    moved = _ALIGNED[how](staged)
    want = torch.where(moved.isnan(), m.h.detach(), moved)
    assert int((~moved.isnan()).sum()) == 2  # (both of b's entries land in h)
    r = patchkit.inspect_load(m, _a_and_b())
    assert torch.equal(bits(m.h.detach()), bits(want))
    assert r.writes["written"].tolist() == [1, 2]
    m = _Bytes(_ALIGNED[how])
    patchkit.load_checkpoint_weight_patches(m, _a_and_b(), transactional=True)
    assert torch.equal(bits(m.h.detach()), bits(want))


@pytest.mark.skipif(not native.status().startswith("compiled"),
                    reason="the positions are recomputed on the compiled path only")
def test_a_rollback_puts_back_what_a_merge_wrote_after_the_loader_moved_the_staged_entries():
    # A staged tensor written in place no longer holds its patch's entries where the patch
    # says. The loader below moves them from positions {1, 2, 6} to {0, 4, 5}: as many, of
    # the same sum and the same sum of squares, so the merge's check of where it wrote
    # cannot tell. Had the write left the staged stretch "exact", the rollback would have
    # recomputed the merge's positions from the patch and put the saved values back at
    # {1, 2, 6}, leaving {0, 4, 5} patched.
    class Moves(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.arange(10.0, 18.0), requires_grad=False)

        def load_weights(self, weights):
            for _, t in weights:
                t[[0, 4, 5]] = t[[1, 2, 6]]
                t[[1, 2, 6]] = float("nan")
                self.w.data.copy_(t)
            raise RuntimeError("after the merge")

    m = Moves()
    start = bits(m.w.detach()).clone()
    p = CWP("w", (8,), torch.float32, torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1, 2, 6]))
    with pytest.raises(RuntimeError, match="after the merge"):
        patchkit.load_checkpoint_weight_patches(m, [p], transactional=True)
    assert torch.equal(bits(m.w.detach()), start)


@pytest.mark.skipif(not native.status().startswith("compiled"),
                    reason="the positions are recomputed on the compiled path only")
def test_a_rollback_puts_back_what_a_merge_wrote_from_a_scratch_part_filled_from_the_patch():
    # A copy into part of a scratch tensor traces that part to the patch, but a view that
    # starts there may reach bytes the patch never filled. Here the first 3 elements come
    # from the patch (all NaN), the rest are the loader's: values at {4, 5, 9}, where the
    # patch has entries at {3, 7, 8} (as many, same sum and sum of squares: the merge's
    # check of where it wrote cannot tell). Taken as exactly the patch's, the scratch
    # would have had the merge's positions recomputed from the patch, and the rollback
    # put the saved values back at {3, 7, 8}, leaving {4, 5, 9} patched.
    class Scratch(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.arange(10.0, 20.0), requires_grad=False)

        def load_weights(self, weights):
            for _, t in weights:
                scratch = torch.full((10,), float("nan"))
                scratch[:3].copy_(t[:3])
                rest = scratch[3:]
                rest[[1, 2, 6]] = torch.tensor([1.0, 2.0, 3.0])
                self.w.data.copy_(scratch)
            raise RuntimeError("after the merge")

    m = Scratch()
    start = bits(m.w.detach()).clone()
    p = CWP("w", (10,), torch.float32, torch.tensor([1.0, 2.0, 3.0]), torch.tensor([3, 7, 8]))
    with pytest.raises(RuntimeError, match="after the merge"):
        patchkit.load_checkpoint_weight_patches(m, [p], transactional=True)
    assert torch.equal(bits(m.w.detach()), start)


# -- the provenance's own bookkeeping (a mutation pass found these untested) -----------


def test_prune_forgets_the_stretches_of_storages_freed_since_the_last_call():
    # A staged tensor of the call before that nothing holds, and a clone made then and
    # freed: both forgotten before the next call (their addresses may come back as
    # tensors of no patch). A staged tensor still held is kept.
    prov = _Provenance()
    kept, freed = torch.zeros(8), torch.zeros(8)
    staged = [("kept", kept), ("freed", freed)]
    keys = [_storage_key(t) for _, t in staged]
    prov.add_staged(0, "kept", kept, keys[0])
    prov.add_staged(1, "freed", freed, keys[1])
    clone = freed.clone()
    assert prov.derive(freed, clone, whole=True)
    clone_key = _storage_key(clone)
    prov.keep_past_call(keys, staged)
    del staged, freed, clone
    prov.prune()
    assert set(prov._by_key) == {keys[0]}
    assert prov.lookup(kept) == (0, "kept", 0)
    del kept
    prov.prune()  # (kept's stretch now lives as long as its storage)
    assert not prov._by_key and clone_key not in prov._weak


def test_a_float32_read_of_float16_stretches_keeps_the_element_that_holds_their_end():
    # Three float16 elements of patch a end halfway into the second float32 element of
    # a float32 view of them: its clone's second element still holds a's bytes (so a
    # float32 read of them stays refused), not data of no patch.
    prov = _Provenance()
    flat = torch.zeros(8, dtype=torch.float16)
    prov.add_staged(0, "a", flat[:3])
    src = flat.view(torch.float32)[:2]
    out = src.clone()
    assert prov.derive(src, out, whole=True)
    assert [(e.name, e.dtype) for e in prov.stretches(out[1:])] == [("a", torch.float16)]


@pytest.mark.parametrize("starts", ["in its patch", "in padding"])
def test_a_copy_into_part_of_a_scratch_buffer_is_never_exact(starts):
    # Only a whole new tensor made from staged data (a clone, a cast) is exact; a copy
    # into part of a buffer of the loader's own keeps the name and offset, not exactness
    # (the one-stretch path and the one for a source that reaches several alike).
    prov = _Provenance()
    flat = torch.zeros(16)
    prov.add_staged(0, "a", flat[4:12])
    src = flat[4:12] if starts == "in its patch" else flat[2:10]
    buf = torch.zeros(32)
    assert prov.derive(src, buf[8:16], whole=False)
    got = prov.stretches(buf)
    assert [(e.name, e.exact) for e in got] == [("a", False)]
    assert prov.lookup(buf[10:]) == (0, "a", 2 if starts == "in its patch" else 0)


# -- casts and clones of strided views of a patch ----------------------------------------

_BF = torch.bfloat16


def _overwrite_row_0(c):
    c[0].copy_(torch.zeros(c.shape[1:], dtype=c.dtype))  # (what is left of the patch's
    return c  # data starts a row in: its copy's rows are still counted from c's start)


# name -> (the bfloat16 parameter's shape, the loader's copy, checkpoint_region; None:
# no box of the checkpoint tells where the source's elements are)
_STRIDED_COPIES = {
    "a column slice, cast": ((4, 3), lambda w: w[:, 2:5].to(_BF), "[:, 2:5]"),
    "rows 1:3 of a column slice's cast": ((2, 3), lambda w: w[:, 2:5].to(_BF)[1:3],
                                          "[1:3, 2:5]"),
    "a column of a column slice's cast": ((4,), lambda w: w[:, 2:5].to(_BF)[:, 1],
                                          "[:, 3:4]"),
    "a column slice's cast, transposed": ((3, 4), lambda w: w[:, 2:5].to(_BF).t(),
                                          "[:, 2:5]"),
    "every other row, cast": ((2, 8), lambda w: w[::2].to(_BF), "[0:4:2, :]"),
    "a transposed view, cast": ((8, 4), lambda w: w.t().to(_BF), "[:, :]"),
    "a column slice, cloned, then cast": ((4, 3), lambda w: w[:, 2:5].clone().to(_BF),
                                          "[:, 2:5]"),
    "rows 1: of a column slice's cast, its row 0 overwritten": (
        (3, 3), lambda w: _overwrite_row_0(w[:, 2:5].to(_BF))[1:], "[1:4, 2:5]"),
    # (a flat view of the cast runs over the ends of its rows: no box)
    "a column slice's cast, flattened": ((12,), lambda w: w[:, 2:5].to(_BF).reshape(-1),
                                         None),
    # (nor do 3 of it from its element 1, over the end of its row 0)
    "3 of a column slice's cast, flattened, over a row's end": (
        (3,), lambda w: w[:, 2:5].to(_BF).reshape(-1)[1:4], None),
    # (nor 2 x 2 of it: two dimensions that both step along its columns, together past
    # their end)
    "4 of a column slice's cast, flattened, as 2 x 2": (
        (2, 2), lambda w: w[:, 2:5].to(_BF).reshape(-1)[:4].view(2, 2), None),
}


class _StridedCopy(nn.Module):
    def __init__(self, shape, make):
        super().__init__()
        self.w = nn.Parameter(torch.arange(math.prod(shape), dtype=_BF).reshape(shape) / 3,
                              requires_grad=False)
        self.make = make

    def load_weights(self, weights):
        for _, w in weights:
            self.w.data.copy_(self.make(w))
        return {n for n, _ in weights}


@pytest.mark.parametrize("kind", ["dense", "sparse"])
@pytest.mark.parametrize("how", list(_STRIDED_COPIES))
def test_a_cast_of_a_strided_view_of_a_patch_names_where_its_elements_are(how, kind):
    # Before, a cast (or clone) of a column slice of a patch was data an op moved:
    # checkpoint_offset None, as for a flip. Its elements are the slice's, at the same
    # index: the offset of its first element and the checkpoint strides say where, and
    # the oracle replays each row from the patch at those.
    shape, make, region = _STRIDED_COPIES[how]
    if kind == "dense":
        p = CWP("w", (4, 8), torch.float32, torch.arange(32.0) * 1.5)
    else:
        p = CWP("w", (4, 8), torch.float32, torch.tensor([3.0, 12.0, 21.0, 26.0]),
                torch.tensor([3, 12, 21, 26]))
    m = _StridedCopy(shape, make)
    L = logged_load(m, [p])
    row = L["report"].writes.iloc[0]
    assert (row["position"], row["name"]) == (0, "w")
    if region is None:
        assert pd.isna(row["checkpoint_offset"]) and row["checkpoint_region"] is None
        return
    assert row["checkpoint_region"] == region
    assert check(L, collections.Counter()) == []


_F8 = torch.float8_e4m3fn


@pytest.mark.parametrize("how", [
    # (bytes 1:4 of element 0: inside one element, of a stretch not moved)
    pytest.param(lambda t: t.view(_F8)[1:4], id="bytes 1:4 of the patch"),
    # (a clone of bytes 1:13, whose byte 3 starts patch element 1: its bytes 3:6 are
    # three of that element's four)
    pytest.param(lambda t: t.view(_U8)[1:13].clone()[3:6].view(_F8),
                 id="bytes 3:6 of a byte-shifted clone"),
])
def test_a_float8_view_of_patch_data_is_refused_as_read_as_float8_not_as_shifted(how):
    # Bytes read as one-byte float8 hold no part of two elements: the refusal says the
    # patch's float32 bit patterns are read as another dtype, not that its elements are
    # shifted.
    m = _Bytes(how)
    with pytest.raises(ContractViolation, match="as another dtype \\(a view such as") as e:
        patchkit.load_checkpoint_weight_patches(m, _a_and_b())
    assert "no multiple of its" not in str(e.value)
    assert (e.value.reason, e.value.value) == ("reinterpreted source", (torch.float32, _F8))


@pytest.mark.parametrize("how", ["of the patch", "of a column slice's cast"])
def test_a_row_of_a_strided_copy_has_the_checkpoint_strides_of_the_same_row_of_the_patch(how):
    # (a dimension of one element steps as the patch's rows do: 8 elements)
    make = ((lambda w: w[1:2, 2:5].to(_BF)) if how == "of the patch"
            else (lambda w: w[:, 2:5].to(_BF)[1:2]))
    p = CWP("w", (4, 8), torch.float32, torch.arange(32.0) * 1.5)
    L = logged_load(_StridedCopy((1, 3), make), [p])
    row = L["report"].writes.iloc[0]
    assert (row["checkpoint_offset"], row["checkpoint_region"]) == (10, "[1:2, 2:5]")
    assert tuple(row["checkpoint_stride"]) == (8, 1)


def test_a_strided_copy_read_as_halves_of_its_elements_names_no_checkpoint_box():
    # (bfloat16 halves of the float32 copy of a column slice are no checkpoint elements:
    # no offset, no region, where a box counted in halves would name other elements)
    p = CWP("w", (4, 8), torch.float32, torch.arange(32.0) * 1.5)
    L = logged_load(_StridedCopy((2, 2), lambda w: w[:, 2:5].clone().view(_BF)[0:2, 0:2]),
                     [p])
    row = L["report"].writes.iloc[0]
    assert (row["position"], row["name"]) == (0, "w")
    assert pd.isna(row["checkpoint_offset"]) and row["checkpoint_region"] is None
