"""Tests of patchkit.io: patch files (safetensors), their checks, and the inspect summary."""

from __future__ import annotations

import errno
import itertools
import json
import math
import os
import re
import stat
import subprocess
import sys
import tempfile

import pytest
import safetensors
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from patchkit.__main__ import main
from patchkit.bitwise import same_bits
from patchkit.build import dense_patches, random_sparse_patch, split_patch, wire_bytes
from patchkit.chunking import plan_chunks
from patchkit.errors import PatchTypeError, PatchValueError
from patchkit.io import (
    FORMAT_KEY,
    check_patch_file,
    format_bytes,
    load_patches,
    print_patch_file_summary,
    read_patch_index,
    read_patch_metadata,
    save_patches,
    storable_dtypes,
)
from patchkit.loader import load_checkpoint_weight_patches
from patchkit.patch import CheckpointWeightPatch

FLOATS = [
    d
    for d in (
        getattr(torch, n, None)
        for n in (
            "float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e4m3fnuz",
            "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
        )
    )
    if d is not None and d in storable_dtypes()
]
INTS = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def assert_same_patches(got, want) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert isinstance(g, CheckpointWeightPatch), i
        assert (g.name, g.shape, g.dtype) == (w.name, tuple(w.shape), w.dtype), i
        assert g.values.dtype == w.values.dtype and g.values.shape == w.values.shape, i
        assert torch.equal(bits(g.values), bits(w.values)), i
        assert (g.indices is None) == (w.indices is None), i
        if w.indices is not None:
            assert g.indices.dtype == w.indices.dtype, i
            assert torch.equal(g.indices.cpu(), w.indices.cpu()), i


def random_bits(n: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """``n`` elements of ``dtype`` with uniformly random bits (NaN payloads included)."""
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    raw = torch.randint(0, 256, (n * dtype.itemsize,), generator=g, dtype=torch.uint8)
    return raw.view(dtype)


def sample_files(tmp: str) -> dict[str, str]:
    """A valid file, and the bytes it was made from, for tampering."""
    g = torch.Generator().manual_seed(0)
    ps = [
        random_sparse_patch("w", (8, 8), torch.bfloat16, 0.25, generator=g),
        CheckpointWeightPatch("d", (2, 3), torch.float32, torch.arange(6.0)),
    ]
    path = os.path.join(tmp, "good.safetensors")
    save_patches(path, ps, metadata={"step": "7"})
    return {"path": path}


def rewrite(src: str, dst: str, *, tensors=None, header=None, meta=None) -> str:
    """Copy a patch file with its tensors / JSON header / metadata changed by callbacks."""
    with safetensors.safe_open(src, "pt") as f:
        ts = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
        md = dict(f.metadata())
    if tensors is not None:
        ts = tensors(ts)
    if header is not None:
        md[FORMAT_KEY] = header(json.loads(md[FORMAT_KEY]))
        if not isinstance(md[FORMAT_KEY], str):
            md[FORMAT_KEY] = json.dumps(md[FORMAT_KEY])
    if meta is not None:
        md = meta(md)
    save_file(ts, dst, metadata=md)
    return dst


# --------------------------------------------------------------------------- round trips


@st.composite
def patch_lists(draw):
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    n = draw(st.integers(0, 6))
    out = []
    for _ in range(n):
        name = draw(st.sampled_from(["w", "model.layers.0.mlp.up_proj.weight", "é", "b"]))
        shape = draw(st.sampled_from([(), (0,), (3, 0), (5,), (2, 3), (2, 1, 4)]))
        size = math.prod(shape)
        sparse = draw(st.booleans())
        if sparse:
            dtype = draw(st.sampled_from(FLOATS))
            vdtype = draw(st.sampled_from([dtype, torch.float32]))
            k = draw(st.integers(0, size))
            idx = torch.randperm(size, generator=g)[:k]
            idx = idx.to(draw(st.sampled_from([torch.int32, torch.int64])))
            values = random_bits(k, vdtype, g)
            # NaN means "unchanged": neither the values nor their cast to the patch dtype
            # may hold one (a float32 value can overflow to NaN in the fnuz float8 types).
            nan = torch.isnan(values.float()) | torch.isnan(values.to(dtype).float())
            # (zeroed as ints of the same width: torch 2.4 has no float8 where or fill)
            values = values.clone()
            ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
            values.view(ints[values.itemsize])[nan] = 0
            out.append(CheckpointWeightPatch(name, shape, dtype, values, idx))
        else:
            dtype = draw(st.sampled_from(FLOATS + INTS))
            vdtype = draw(st.sampled_from([dtype, dtype, torch.float32]))
            values = random_bits(size, vdtype, g)
            if (not dtype.is_floating_point and dtype != torch.bool
                    and values.is_floating_point()):
                # float values for an integer patch must be finite and in its range
                # (refused otherwise)
                info = torch.iinfo(dtype)
                fits = torch.isfinite(values) & (values >= info.min) & (
                    values < float(info.max) + 1.0)
                values = torch.where(fits, values, torch.zeros((), dtype=values.dtype))
            out.append(CheckpointWeightPatch(name, shape, dtype, values))
    return out


@settings(max_examples=60, deadline=None)
@given(patches=patch_lists(), meta=st.dictionaries(st.text(max_size=5).filter(
    lambda k: k != FORMAT_KEY), st.text(max_size=8), max_size=3))
def test_round_trip_bit_exact(patches, meta):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "p.safetensors")
        save_patches(path, patches, metadata=meta)
        assert_same_patches(load_patches(path), patches)
        assert read_patch_metadata(path) == meta
        index = read_patch_index(path)
        assert [e.name for e in index] == [p.name for p in patches]
        assert [e.wire_bytes for e in index] == [wire_bytes(p) for p in patches]
        assert sorted(os.listdir(tmp)) == ["p.safetensors"]  # no temporary left behind


@pytest.mark.parametrize("dtype", FLOATS)
def test_round_trip_each_float_dtype_with_special_values(dtype, tmp_path):
    g = torch.Generator().manual_seed(0)
    dense_vals = random_bits(64, dtype, g)  # NaN payloads, infinities, -0.0, subnormals
    sp = random_sparse_patch("s", (16, 4), dtype, 0.5, generator=g, index_dtype=torch.int32)
    ps = [CheckpointWeightPatch("d", (4, 16), dtype, dense_vals), sp, sp]  # shared storage
    path = tmp_path / "p.safetensors"
    save_patches(path, ps)
    assert_same_patches(load_patches(str(path)), ps)


def test_round_trip_non_contiguous_and_shared_values(tmp_path):
    base = torch.arange(20.0)
    strided = base[::2]  # non-contiguous view
    ps = [
        CheckpointWeightPatch("a", (10,), torch.float32, strided),
        CheckpointWeightPatch("b", (2, 5), torch.float32, base[:10]),
        CheckpointWeightPatch("c", (10,), torch.float32, base[10:]),
    ]
    ps += split_patch(CheckpointWeightPatch("d", (20,), torch.float32, base), 4)
    before = base.clone()
    save_patches(tmp_path / "p.safetensors", ps)
    assert torch.equal(base, before)
    assert_same_patches(load_patches(tmp_path / "p.safetensors", device=torch.device("cpu")), ps)


def test_empty_list_round_trip(tmp_path):
    save_patches(tmp_path / "e.safetensors", [], metadata={"a": "b"})
    assert load_patches(tmp_path / "e.safetensors") == []
    assert read_patch_metadata(tmp_path / "e.safetensors") == {"a": "b"}


def test_loaded_patches_apply(tmp_path):
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(4, 4), requires_grad=False)

        def load_weights(self, weights):
            for n, t in weights:
                getattr(self, n).data.copy_(t)
            return {n for n, _ in weights}

    p = CheckpointWeightPatch("w", (4, 4), torch.float32, torch.tensor([1.0, -0.0]),
                              torch.tensor([15, 2], dtype=torch.int32))
    save_patches(tmp_path / "p.safetensors", [p])
    m = M()
    assert load_checkpoint_weight_patches(m, load_patches(tmp_path / "p.safetensors")) == {"w"}
    assert m.w.view(-1)[15] == 1.0 and torch.signbit(m.w.view(-1)[2])


# --------------------------------------------------------------------------- saving checks


def test_metadata_checks(tmp_path):
    p = [CheckpointWeightPatch("w", (1,), torch.float32, torch.zeros(1))]
    with pytest.raises(TypeError):
        save_patches(tmp_path / "a", p, metadata={"k": 1})
    with pytest.raises(TypeError):
        save_patches(tmp_path / "a", p, metadata={2: "v"})
    with pytest.raises(TypeError):
        save_patches(tmp_path / "a", p, metadata=[("k", "v")])
    with pytest.raises(ValueError, match="reserved"):
        save_patches(tmp_path / "a", p, metadata={FORMAT_KEY: "x"})
    assert not (tmp_path / "a").exists()


def test_save_validates_patches(tmp_path):
    nan = CheckpointWeightPatch("w", (4,), torch.float32, torch.tensor([float("nan")]),
                                torch.tensor([1]))
    ok = CheckpointWeightPatch("v", (1,), torch.float32, torch.zeros(1))
    with pytest.raises(PatchValueError, match=r"patch 1 \('w'\).*NaN") as info:
        save_patches(tmp_path / "a", [ok, nan])
    assert info.value.position == 1
    with pytest.raises(ValueError, match="out-of-range"):
        oob = nan._replace(values=torch.ones(1), indices=torch.tensor([4]))
        save_patches(tmp_path / "a", [oob])
    with pytest.raises(ValueError):
        save_patches(tmp_path / "a", [ok._replace(shape=(2,))])
    c128 = torch.complex128
    with pytest.raises(TypeError, match="cannot be stored"):
        save_patches(tmp_path / "a", [CheckpointWeightPatch("c", (1,), c128,
                                                            torch.zeros(1, dtype=c128))])
    with pytest.raises(TypeError, match="patch 0"):
        save_patches(tmp_path / "a", ["not a patch"])
    save_patches(tmp_path / "t", [(*ok,)])  # a plain 5-tuple is accepted
    assert_same_patches(load_patches(tmp_path / "t"), [ok])
    assert not (tmp_path / "a").exists()


def test_failed_save_leaves_old_file_and_no_temporary(tmp_path, monkeypatch):
    import patchkit.io as pk_io

    path = tmp_path / "p.safetensors"
    p = [CheckpointWeightPatch("w", (1,), torch.float32, torch.ones(1))]
    save_patches(path, p)
    old = path.read_bytes()

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(pk_io, "_write_safetensors", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        save_patches(path, [p[0]._replace(values=torch.zeros(1))])
    assert path.read_bytes() == old
    assert os.listdir(tmp_path) == ["p.safetensors"]


def test_unstorable_dtype_error_names_the_patch(tmp_path):
    c128 = torch.complex128
    ok = CheckpointWeightPatch("v", (1,), torch.float32, torch.zeros(1))
    bad = CheckpointWeightPatch("a", (2,), c128, torch.ones(2, dtype=c128))
    with pytest.raises(PatchTypeError, match=r"patch 1 \('a'\): values of dtype") as info:
        save_patches(tmp_path / "p.safetensors", [ok, bad])
    e = info.value
    assert (e.position, e.name, e.reason, e.value) == (1, "a", "unstorable dtype", c128)
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(os.name != "posix", reason="POSIX permission bits")
@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_saved_file_mode_follows_the_umask_like_open(tmp_path, umask):
    p = [CheckpointWeightPatch("w", (1,), torch.float32, torch.ones(1))]
    old = os.umask(umask)
    try:
        save_patches(tmp_path / "p.safetensors", p)
        with open(tmp_path / "plain", "w"):
            pass
    finally:
        os.umask(old)
    mode = (tmp_path / "p.safetensors").stat().st_mode & 0o777
    assert mode == 0o666 & ~umask
    assert mode == (tmp_path / "plain").stat().st_mode & 0o777


@pytest.mark.skipif(os.name != "posix", reason="POSIX permission bits")
def test_overwriting_keeps_the_existing_files_mode(tmp_path):
    path = tmp_path / "p.safetensors"
    p = [CheckpointWeightPatch("w", (1,), torch.float32, torch.ones(1))]
    old = os.umask(0o022)
    try:
        save_patches(path, p)
        os.chmod(path, 0o640)
        save_patches(path, [p[0]._replace(values=torch.zeros(1))])
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o640
    assert_same_patches(load_patches(path), [p[0]._replace(values=torch.zeros(1))])


def test_save_to_a_path_that_cannot_hold_a_file_names_it(tmp_path):
    p = [CheckpointWeightPatch("w", (1,), torch.float32, torch.ones(1))]
    (tmp_path / "afile").write_bytes(b"x")
    (tmp_path / "adir").mkdir()
    cases = [
        (tmp_path / "nope" / "p.safetensors", FileNotFoundError,
         f"folder {str(tmp_path / 'nope')!r} does not exist"),
        (tmp_path / "nope" / "deeper" / "p.safetensors", FileNotFoundError, "does not exist"),
        (tmp_path / "adir", IsADirectoryError, "is a folder"),
        (tmp_path / "afile" / "p.safetensors", NotADirectoryError,
         f"{str(tmp_path / 'afile')!r} is not a folder"),
    ]
    for path, kind, problem in cases:
        with pytest.raises(kind) as info:
            save_patches(path, p)
        e = info.value
        assert problem in str(e), str(e)
        assert e.filename == str(path) and str(path) in str(e)
        assert ".patchkit-" not in str(e) and e.filename2 is None
    # nothing was written anywhere, not even a temporary
    assert sorted(os.listdir(tmp_path)) == ["adir", "afile"]
    assert os.listdir(tmp_path / "adir") == [] and (tmp_path / "afile").read_bytes() == b"x"


def test_missing_safetensors_is_a_clear_error(tmp_path, monkeypatch, capsys):
    good = sample_files(str(tmp_path))["path"]
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    need = "patch files need the safetensors package: pip install safetensors"
    p = [CheckpointWeightPatch("w", (1,), torch.float32, torch.ones(1))]
    with pytest.raises(ModuleNotFoundError, match=need):
        save_patches(tmp_path / "new.safetensors", p)
    assert not (tmp_path / "new.safetensors").exists()
    for reader in (load_patches, read_patch_index, read_patch_metadata):
        with pytest.raises(ImportError, match=need) as info:
            reader(good)
        assert info.value.name == "safetensors"
    assert main(["inspect", good]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"error: {need}\n"


def test_without_safetensors_the_storable_dtypes_are_those_torch_and_the_format_share(
        monkeypatch):
    import patchkit.io as pio

    with_it = storable_dtypes()
    pio._readable_codes.cache_clear()
    monkeypatch.setitem(sys.modules, "safetensors", None)
    try:
        without = storable_dtypes()
    finally:
        pio._readable_codes.cache_clear()  # (read again with the package, by the next use)
    assert without == frozenset(pio._CODE_TO_DTYPE.values())
    assert with_it <= without and torch.float8_e5m2 in without


def test_load_checks_the_device_before_reading_the_file(tmp_path, monkeypatch):
    good = sample_files(str(tmp_path))["path"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cases = [
        ("bogus", "bad device", "is not a torch device"),
        ("meta", "meta device", "need real memory"),
        ("cuda", "device unavailable", "torch.cuda.is_available() is False"),
        (torch.device("cuda", 0), "device unavailable", "is not available"),
    ]
    for device, reason, problem in cases:
        with pytest.raises(PatchValueError, match=f"device '{device}'") as info:
            load_patches(good, device=device)
        e = info.value
        assert problem in str(e) and e.reason == reason and e.value == device
        assert good not in str(e)  # the file is not blamed
    with pytest.raises(PatchTypeError, match=r"device must be a str or torch\.device"):
        load_patches(good, device=1.5)
    assert len(load_patches(good, device="cpu")) == 2


# --------------------------------------------------------------------------- bad files


def _bad(path, match: str) -> None:
    """Every reader refuses ``path`` with a PatchValueError naming it and ``match``."""
    for reader in (load_patches, read_patch_index, read_patch_metadata):
        with pytest.raises(PatchValueError, match=match) as info:
            reader(path)
        assert str(path) in str(info.value)
        e = info.value
        assert e.__cause__ is None and (e.__context__ is None or e.__suppress_context__)


def test_missing_and_directory(tmp_path):
    _bad(str(tmp_path / "nope.safetensors"), "no such file")
    _bad(str(tmp_path), "not a regular file")


@pytest.mark.parametrize("cut", [0, 3, 8, 20, 100, -1, -17])
def test_truncated(tmp_path, cut):
    good = sample_files(str(tmp_path))["path"]
    with open(good, "rb") as fh:
        data = fh.read()
    bad = tmp_path / "cut.safetensors"
    bad.write_bytes(data[:cut])
    _bad(str(bad), "not a readable safetensors file")


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"hello world, not a tensor file",
        b'{"a": 1}',
        b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ",
    ],
)
def test_not_safetensors(tmp_path, content):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(content)
    _bad(str(bad), "safetensors")


def test_foreign_safetensors(tmp_path):
    plain = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(3)}, plain)
    _bad(str(plain), "not a patchkit patch file")
    save_file({"w": torch.zeros(3)}, plain, metadata={"format": "pt"})
    _bad(str(plain), "not a patchkit patch file")


def _set(i, **kv):
    def change(h):
        h["patches"][i].update(kv)
        return h

    return change


TAMPERS = {
    "invalid json": (dict(header=lambda h: "{not json"), "not valid JSON"),
    # (deeper than Python's JSON parser goes: a RecursionError, which is no ValueError;
    # Python 3.13 parses 5000 levels, and stops by 20000)
    "json nested too deep": (dict(header=lambda h: "[" * 100_000 + "]" * 100_000),
                             "nested too deep"),
    "not an object": (dict(header=lambda h: "[1, 2]"), "not a patchkit patch list"),
    "wrong format": (dict(header=lambda h: {**h, "format": "other"}), "not a patchkit patch list"),
    "future version": (dict(header=lambda h: {**h, "version": 99}), "version 99"),
    "patches not a list": (dict(header=lambda h: {**h, "patches": {}}), "not a list"),
    "entry not object": (dict(header=lambda h: {**h, "patches": [1, 2]}), "not an object"),
    "empty name": (dict(header=_set(0, name="")), "name"),
    "bad shape": (dict(header=_set(0, shape=[8, -8])), "shape"),
    "bool shape": (dict(header=_set(1, shape=[True, 6])), "shape"),
    "unknown dtype": (dict(header=_set(0, dtype="float99")), "unknown dtype 'float99'"),
    "private attr dtype": (dict(header=_set(0, dtype="_C")), "unknown dtype"),
    "non-dtype attr": (dict(header=_set(0, dtype="zeros")), "unknown dtype"),
    "bad kind": (dict(header=_set(0, kind="delta")), "kind"),
    "nnz mismatch": (dict(header=_set(0, nnz=3)), "values have shape"),
    "values dtype mismatch": (dict(header=_set(1, values_dtype="float16")), "header says"),
    "indices dtype mismatch": (dict(header=_set(0, indices_dtype="int32")), "indices are"),
    "dense shape mismatch": (dict(header=_set(1, shape=[2, 4])), "needs 8 values"),
    "sparse int dtype": (dict(header=_set(0, dtype="int16")), "non-floating"),
    "dense marked sparse": (dict(header=_set(1, kind="sparse")), "000001.indices' is missing"),
    "missing values": (dict(tensors=lambda t: {k: v for k, v in t.items()
                                               if k != "000001.values"}), "missing"),
    "missing indices": (dict(tensors=lambda t: {k: v for k, v in t.items()
                                                if k != "000000.indices"}), "missing"),
    "extra tensor": (dict(tensors=lambda t: {**t, "junk": torch.zeros(1)}), "not described"),
    "index count": (dict(tensors=lambda t: {**t, "000000.indices": t["000000.indices"][:-1]}),
                    "indices for"),
    "values count": (dict(tensors=lambda t: {**t, "000001.values": torch.zeros(5)}),
                     "values have shape"),
    "2-D values": (dict(tensors=lambda t: {**t, "000001.values": torch.zeros(2, 3)}),
                   "values have shape"),
    "one row of values": (dict(tensors=lambda t: {**t, "000001.values": torch.zeros(1, 6)}),
                          "values have shape"),
    "float indices": (dict(tensors=lambda t: {**t, "000000.indices": t["000000.indices"].float()},
                           header=_set(0, indices_dtype="float32")), "int32 or int64"),
    "index out of range": (dict(tensors=lambda t: {**t, "000000.indices":
                                                   t["000000.indices"] + 64}), "out-of-range"),
    "duplicate index": (dict(tensors=lambda t: {**t, "000000.indices":
                                                t["000000.indices"] * 0}), "more than once"),
    "NaN in sparse": (dict(tensors=lambda t: {**t, "000000.values":
                                              t["000000.values"] * float("nan")}), "NaN"),
}


@pytest.mark.parametrize("case", sorted(TAMPERS))
def test_inconsistent_files(tmp_path, case):
    good = sample_files(str(tmp_path))["path"]
    change, match = TAMPERS[case]
    bad = rewrite(good, str(tmp_path / "bad.safetensors"), **change)
    with pytest.raises(PatchValueError, match=match) as info:
        load_patches(bad)
    assert bad in str(info.value)
    assert type(info.value) is PatchValueError


def test_value_checks_need_a_full_load(tmp_path):
    """The header readers do not read data, so a bad index shows on load only."""
    good = sample_files(str(tmp_path))["path"]
    bad = rewrite(good, str(tmp_path / "bad.safetensors"),
                  tensors=lambda t: {**t, "000000.indices": t["000000.indices"] + 64})
    assert len(read_patch_index(bad)) == 2
    with pytest.raises(PatchValueError, match=r"patch 0 \('w'\).*out-of-range"):
        load_patches(bad)


def test_good_sample_reads(tmp_path):
    good = sample_files(str(tmp_path))["path"]
    assert read_patch_metadata(good) == {"step": "7"}
    index = read_patch_index(good)
    assert [(e.kind, e.nnz, e.density) for e in index] == [("sparse", 16, 0.25),
                                                           ("dense", 6, 1.0)]


# --------------------------------------------------------------------------- summary


def test_format_bytes():
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(1024) == "1 KiB"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(10 * 1024 + 512) == "10.5 KiB"
    assert format_bytes(512 << 20) == "512 MiB"
    assert format_bytes(1234567) == "1.18 MiB"
    assert format_bytes(3 << 30) == "3 GiB"
    assert format_bytes(5 << 40) == "5 TiB"
    assert format_bytes(-2048) == "-2 KiB"
    # a value that rounds to nothing has no sign (was "-0 B")
    assert [format_bytes(x) for x in (-0.0, -1e-9, -0.004, -0.006)] == [
        "0 B", "0 B", "0 B", "-0.01 B"]
    # a tie rounds to the even digit in a unit and past the last one alike
    assert format_bytes(1152) == "1.12 KiB"  # 1.125 KiB
    assert format_bytes(1125 * 1024**8) == "1.12e3 YiB"  # not 1.13e3


def test_distinct_name_writes_an_empty_name_as_its_repr():
    from patchkit.units import distinct_name

    assert distinct_name("") == "''"  # (an empty name shown as nothing at all)
    assert distinct_name("w") == "w"
    # a name opening with a double quote is quoted too: as it is, '"it's "' would read as
    # the repr of "it's " (a name with a blank at its end), which Python writes in "..."
    assert distinct_name("it's ") == '"it\'s "'
    assert distinct_name('"it\'s "') != distinct_name("it's ")


def test_shown_name_escapes_every_character_that_is_not_printable_outside_the_bmp_too():
    from patchkit.units import shown_name

    # (U+E0001, a language tag, and U+1D173, a musical format character: invisible format
    # characters past U+FFFF, written as repr writes them, as those below it are)
    assert shown_name("w\U000e0001x\U0001d173") == "w\\U000e0001x\\U0001d173"
    assert shown_name("w\u202ex\ud800") == "w\\u202ex\\ud800"
    assert shown_name("w\U0001f600") == "w\U0001f600"  # (an emoji is printable: as it is)


def test_a_percentage_is_three_significant_digits_and_never_100_for_less_than_all():
    from patchkit.units import _percent_digits

    assert [_percent_digits(x) for x in (0.105, 0.1, 0.10049, 0.5, 0.9995, 1.0, 0.0)] == [
        "10.5", "10", "10", "50", ">99.9", "100", "0"]


def _summary_file(tmp_path):
    g = torch.Generator().manual_seed(1)
    sp = random_sparse_patch("model.embed.weight", (64, 32), torch.bfloat16, 0.125, generator=g)
    ps = [sp, *split_patch(sp, 2)]
    ps += dense_patches({"model.norm.weight": torch.ones(32), "scalar": torch.tensor(2.0),
                         "empty": torch.zeros(0, 4)})
    path = tmp_path / "p.safetensors"
    save_patches(path, ps, metadata={"run": "abc", "step": "12"})
    return str(path), ps


def test_summary_of_one_patch_says_patch(tmp_path, capsys):
    path = tmp_path / "one.safetensors"
    save_patches(path, [CheckpointWeightPatch("w", (3,), torch.float32, torch.ones(1),
                                              torch.tensor([1]))])
    assert print_patch_file_summary(str(path)) == 0
    assert "\n1 patch (1 sparse, 0 dense), format " in capsys.readouterr().out


def test_summary_table_and_plan(tmp_path, capsys):
    path, ps = _summary_file(tmp_path)
    assert print_patch_file_summary(path, max_chunk_bytes=6000) == 0
    out, err = capsys.readouterr()
    assert err == ""
    lines = out.splitlines()
    assert "6 patches (3 sparse, 3 dense)" in out
    assert "run: abc" in out and "step: 12" in out
    row0 = next(line for line in lines if line.split()[:2] == ["0", "model.embed.weight"])
    assert row0.split() == ["0", "model.embed.weight", "sparse", "(64,", "32)", "bfloat16",
                            "256", "12.5%", *format_bytes(wire_bytes(ps[0])).split()]
    row5 = next(line for line in lines if line.split()[:2] == ["5", "empty"])
    assert row5.split()[-4:] == ["0", "-", "0", "B"]
    total = next(line for line in lines if line.split()[:1] == ["total"])
    assert total.split()[-2:] == format_bytes(wire_bytes(ps)).split()
    # the plan printed is plan_chunks' plan, per kind
    sparse_plan = plan_chunks([p for p in ps if p.indices is not None], 6000,
                              positions=[0, 1, 2])
    assert [c.closed_by for c in sparse_plan] == ["repeated name", "repeated name", "end"]
    assert "chunk plan for max_chunk_bytes = 6000 (5.86 KiB) (sparse patches; one load): " \
           "3 load_weights calls" in out
    assert "(dense patches; one load): 1 load_weights call\n" in out
    assert "repeated name" in out and "3-5" in out
    # (the plan's column of patch positions is headed as the patch table's "#" column:
    # "patches" read as a count)
    assert [ln.split() for ln in lines if ln.split()[:1] == ["call"]] == [
        ["call", "patches", "#", "staged", "bytes", "closed", "by"]] * 2


def test_summary_over_budget_and_cli(tmp_path, capsys):
    path, _ = _summary_file(tmp_path)
    assert main(["inspect", path, "--max-chunk-bytes", "100"]) == 0
    out = capsys.readouterr().out
    assert "over budget: travels alone" in out
    assert main(["inspect", str(tmp_path / "missing.safetensors")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "error:" in err and "no such file" in err
    assert main(["inspect", path, "--max-chunk-bytes", "0"]) == 2
    assert "--max-chunk-bytes" in capsys.readouterr().err


@pytest.mark.parametrize("given, budget", [
    ("100", "100 B"), ("64KiB", "64 KiB"), ("1 MiB", "1 MiB"), ("1.5gib", "1.5 GiB"),
    ("1_024", "1 KiB"), ("2048B", "2 KiB"),
])
def test_the_budget_option_takes_a_binary_unit_as_the_summary_writes_sizes(
        tmp_path, capsys, given, budget):
    # (the summary prints "max_chunk_bytes = 512 MiB"; "--max-chunk-bytes 512MiB" was
    # refused as "invalid int value")
    path, _ = _summary_file(tmp_path)
    assert main(["inspect", path, "--max-chunk-bytes", given]) == 0
    assert f"({budget})" in capsys.readouterr().out


@pytest.mark.parametrize("given", ["1.5", "1e3", "1KB", "1.3KiB", "MiB", "", "64 KiBs"])
def test_a_budget_that_is_no_whole_number_of_bytes_is_a_usage_error_naming_it(
        tmp_path, capsys, given):
    # (1.5 bytes, or 1.3 KiB = 1331.2; KB, a decimal unit, could mean 1000 or 1024)
    path, _ = _summary_file(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["inspect", path, "--max-chunk-bytes", given])
    assert exit_.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and f"{given!r} is not a number of bytes" in err
    assert "--max-chunk-bytes" in err


def test_summary_bad_file_and_empty_file(tmp_path, capsys):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"nope")
    assert print_patch_file_summary(str(bad)) == 2
    out, err = capsys.readouterr()
    assert out == "" and str(bad) in err
    save_patches(tmp_path / "e.safetensors", [])
    assert print_patch_file_summary(str(tmp_path / "e.safetensors")) == 0
    assert "no patches" in capsys.readouterr().out


def test_summary_file_argument(tmp_path, capsys):
    import io

    path, _ = _summary_file(tmp_path)
    buf = io.StringIO()
    assert print_patch_file_summary(path, file=buf) == 0
    assert capsys.readouterr().out == ""
    assert "model.embed.weight" in buf.getvalue()


def test_cli_subprocess(tmp_path):
    path, _ = _summary_file(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))}
    ok = subprocess.run([sys.executable, "-m", "patchkit", "inspect", path], capture_output=True,
                        text=True, env=env, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "model.norm.weight" in ok.stdout and "512 MiB" in ok.stdout


def test_summary_says_written_not_changed(tmp_path, capsys):
    """A dense patch writes every element and does not know which change."""
    path, _ = _summary_file(tmp_path)
    assert print_patch_file_summary(path) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.split()[:2] == ["#", "name"])
    assert header.split()[5] == "written" and "changed" not in header
    row3 = next(line for line in lines if line.split()[:2] == ["3", "model.norm.weight"])
    assert row3.split()[5:7] == ["32", "100%"]
    assert any("a dense patch writes every one" in line for line in lines)


def test_inspect_into_a_closed_pipe_stops_quietly(tmp_path):
    """``patchkit inspect FILE | head -1``: no BrokenPipeError traceback, status 1."""
    path, _ = _summary_file(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))}
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the first write
    try:
        out = subprocess.run([sys.executable, "-m", "patchkit", "inspect", path], stdout=w,
                             stderr=subprocess.PIPE, text=True, env=env, timeout=120)
    finally:
        os.close(w)
    assert out.returncode == 1 and out.stderr == ""


def test_storable_dtypes():
    s = storable_dtypes()
    assert {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32,
            torch.int64} <= s
    assert torch.complex128 not in s
    assert isinstance(PatchTypeError("x"), TypeError)


# --------------------------------------------------------------------------- audit cases


def test_a_bad_patch_is_named_by_its_position_in_the_file(tmp_path):
    """Dense and sparse patches are checked in two groups; an error still names the
    patch's position in the file, not in its group."""
    g = torch.Generator().manual_seed(0)
    ps = [CheckpointWeightPatch("d", (2, 3), torch.float32, torch.arange(6.0)),
          random_sparse_patch("w", (8, 8), torch.bfloat16, 0.25, generator=g)]
    good = str(tmp_path / "good.safetensors")
    save_patches(good, ps)
    bad = rewrite(good, str(tmp_path / "bad.safetensors"),
                  tensors=lambda t: {**t, "000001.indices": t["000001.indices"] + 64})
    with pytest.raises(PatchValueError, match=r"patch 1 \('w'\).*out-of-range") as info:
        load_patches(bad)
    assert (info.value.position, info.value.name) == (1, "w")


@pytest.mark.parametrize(
    ("case", "match"),
    [("bad shape", "shape must be a list of non-negative ints"),
     ("float indices", r"indices are float32.*\(int32 or int64 expected\)")],
)
def test_the_header_reader_refuses_what_the_header_alone_shows_wrong(tmp_path, case, match):
    """Negative dimensions and indices of a non-integer dtype are seen in the header, so
    read_patch_index refuses them without reading any data."""
    good = sample_files(str(tmp_path))["path"]
    change, _ = TAMPERS[case]
    bad = rewrite(good, str(tmp_path / "bad.safetensors"), **change)
    with pytest.raises(PatchValueError, match=match) as info:
        read_patch_index(bad)
    assert bad in str(info.value)


def test_a_device_index_past_the_last_device_is_unavailable(tmp_path, monkeypatch):
    good = sample_files(str(tmp_path))["path"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(PatchValueError, match=r"device 'cuda:1'.*has 1 cuda device") as info:
        load_patches(good, device="cuda:1")  # devices 0..count-1: cuda:1 is not one
    assert info.value.reason == "device unavailable" and good not in str(info.value)


def _mixed_file(tmp_path):
    """Dense, sparse, dense: the dense patches 0 and 2 plan as one load, the sparse 1 as
    another."""
    g = torch.Generator().manual_seed(2)
    ps = [CheckpointWeightPatch("a", (4, 4), torch.float32, torch.arange(16.0)),
          random_sparse_patch("w", (16, 16), torch.float32, 0.125, generator=g),
          CheckpointWeightPatch("b", (4,), torch.float32, torch.ones(4))]
    path = str(tmp_path / "mixed.safetensors")
    save_patches(path, ps)
    return path, ps


def test_summary_plans_the_dense_load_first_and_lists_its_positions_apart(tmp_path, capsys):
    path, _ = _mixed_file(tmp_path)
    assert print_patch_file_summary(path) == 0
    out = capsys.readouterr().out
    dense_at = out.index("(dense patches; one load)")
    sparse_at = out.index("(sparse patches; one load)")
    assert dense_at < sparse_at
    plan_rows = [line.split() for line in out[dense_at:sparse_at].splitlines()[2:] if line]
    assert plan_rows[0][:3] == ["0", "0,", "2"]  # call 0 sends patches 0 and 2, not 0-2


def test_summary_total_counts_the_elements_written(tmp_path, capsys):
    path, ps = _mixed_file(tmp_path)
    assert print_patch_file_summary(path) == 0
    total = next(line for line in capsys.readouterr().out.splitlines()
                 if line.split()[:1] == ["total"])
    written = 16 + ps[1].indices.numel() + 4  # every dense element, the sparse entries
    assert total.split()[1:3] == [str(written), f"{100 * written / (16 + 256 + 4):.3g}%"]


# --------------------------------------------------------------------------- review fixes


def test_conjugate_and_negative_views_are_saved_as_their_values(tmp_path):
    """torch's lazy conj/neg bits are resolved: the file holds the values the caller sees."""
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    neg = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj().imag  # a neg-bit view
    assert z.conj().is_conj() and neg.is_neg()
    # (a safetensors before 0.7 reads no complex64: the conjugate view is saved as its real
    # part's negative view then, which is all such a file can hold)
    conj = (CheckpointWeightPatch("c", (2,), torch.complex64, z.conj())
            if torch.complex64 in storable_dtypes() else
            CheckpointWeightPatch("c", (2,), torch.float32, z.conj().imag))
    ps = [
        conj,
        CheckpointWeightPatch("n", (2,), torch.float32, neg),
        CheckpointWeightPatch("s", (4,), torch.float32, neg, torch.tensor([0, 3])),
        CheckpointWeightPatch("v", (2,), torch.float32, torch._neg_view(torch.tensor([1.0, 2.0]))),
        CheckpointWeightPatch("i", (4,), torch.float32, torch.tensor([1.0, 2.0]),
                              torch._neg_view(torch.tensor([-1, -2]))),
    ]
    path = tmp_path / "p.safetensors"
    save_patches(path, ps)
    got = load_patches(path)
    assert got[0].values.tolist() == ([1 - 2j, 3 + 4j] if conj.dtype.is_complex
                                      else [-2.0, 4.0])
    assert got[1].values.tolist() == [-2.0, 4.0] and got[2].values.tolist() == [-2.0, 4.0]
    assert got[3].values.tolist() == [-1.0, -2.0] and got[4].indices.tolist() == [1, 2]
    for g, p in zip(got, ps):
        assert torch.equal(g.values, p.values.resolve_conj().resolve_neg())
    assert z.tolist() == [1 + 2j, 3 - 4j]  # the caller's tensor is untouched


def test_loaded_patches_do_not_change_when_the_file_is_rewritten(tmp_path):
    """Loaded patches are copies, not views of the file's memory map."""
    import shutil

    path, other = tmp_path / "p.safetensors", tmp_path / "q.safetensors"
    ps = [CheckpointWeightPatch("w", (4,), torch.float32, torch.ones(4)),
          CheckpointWeightPatch("s", (8,), torch.float32, torch.ones(2), torch.tensor([1, 5]))]
    save_patches(path, ps)
    save_patches(other, [p._replace(values=p.values * 5, indices=None if p.indices is None
                                    else p.indices + 1) for p in ps])
    got = load_patches(path)
    shutil.copyfile(other, path)  # rewritten in place, as `cp new old` does
    assert_same_patches(got, ps)
    with open(path, "wb"):  # truncated (a view of the old map would now fault)
        pass
    assert_same_patches(got, ps)
    got[0].values.add_(1)  # and writing to a loaded patch cannot reach the file
    assert os.path.getsize(path) == 0


@pytest.mark.parametrize(
    ("case", "position", "name", "value"),
    [
        ("nnz mismatch", 0, "w", [16]),  # the values' shape that disagrees with nnz
        ("values count", 1, "d", [5]),
        ("dense shape mismatch", 1, "d", 6),  # the nnz a dense shape (2, 4) does not hold
        ("index count", 0, "w", [15]),
        ("unknown dtype", 0, "w", "float99"),
        ("bad kind", 0, "w", "delta"),
        ("bad shape", 0, "w", [8, -8]),
        ("empty name", 0, None, ""),
        ("indices dtype mismatch", 0, "w", torch.int64),
        ("sparse int dtype", 0, "w", torch.int16),
        ("missing values", 1, "d", "000001.values"),
        ("extra tensor", None, None, "junk"),
        ("future version", None, None, 99),
    ],
)
def test_header_errors_carry_the_patch_and_the_offending_value(tmp_path, case, position,
                                                               name, value):
    good = sample_files(str(tmp_path))["path"]
    change, _ = TAMPERS[case]
    bad = rewrite(good, str(tmp_path / "bad.safetensors"), **change)
    for reader in (load_patches, read_patch_index, read_patch_metadata):
        with pytest.raises(PatchValueError) as info:
            reader(bad)
        e = info.value
        assert (e.position, e.name, e.value) == (position, name, value), (reader, str(e))
        if position is not None:
            assert f"patch {position}{':' if name is None else f' ({name!r})'}" in str(e)
        assert bad in str(e)


@pytest.mark.parametrize(
    "shape",
    [[10] * 4400,  # 10**4400 elements: more digits than Python prints by default
     [3] * 100_000,  # a long list of dims: the count stops once it passes 2**63
     [2**62, 2**62],
     [2**4000],
     [2**70, 0]],  # no elements, but a dimension no int64 holds: no tensor has it either
)
def test_a_header_shape_too_large_for_a_tensor_is_refused_without_printing_its_size(
        tmp_path, shape):
    good = sample_files(str(tmp_path))["path"]
    bad = rewrite(good, str(tmp_path / "bad.safetensors"), header=_set(1, shape=shape))
    for reader in (load_patches, read_patch_index):
        held = (r"a dimension of 2\*\*63 or more" if max(shape) >= 2**63
                else r"at least 2\*\*63 elements")
        with pytest.raises(PatchValueError, match=rf"patch 1 \('d'\): shape .* holds {held}, "
                           r"more than a tensor can") as info:
            reader(bad)
        e = info.value
        assert (e.position, e.name, e.reason, e.value) == (1, "d", "header", shape)
        assert len(str(e)) < 500  # neither the full count nor every dim is printed


def test_a_header_shape_with_a_zero_dim_holds_no_elements(tmp_path):
    good = sample_files(str(tmp_path))["path"]
    bad = rewrite(good, str(tmp_path / "bad.safetensors"),
                  header=_set(1, shape=[2**62, 2**62, 0]))
    with pytest.raises(PatchValueError, match=r"needs 0 values, the file holds 6") as info:
        read_patch_index(bad)
    assert info.value.value == 6 and "2**62" not in str(info.value)


def test_the_shape_in_a_header_error_is_shortened(tmp_path):
    good = sample_files(str(tmp_path))["path"]
    bad = rewrite(good, str(tmp_path / "bad.safetensors"),
                  header=_set(1, shape=[1] * 10_000 + [2]))
    with pytest.raises(PatchValueError, match=r"needs 2 values, the file holds 6") as info:
        read_patch_index(bad)
    assert "10001 dims" in str(info.value) and len(str(info.value)) < 500


@pytest.mark.parametrize("version", [True, 1.0, "1", None, [1]])
def test_the_format_version_must_be_the_int_1(tmp_path, version):
    good = sample_files(str(tmp_path))["path"]
    bad = rewrite(good, str(tmp_path / "bad.safetensors"),
                  header=lambda h: {**h, "version": version})
    for reader in (load_patches, read_patch_index, read_patch_metadata):
        with pytest.raises(PatchValueError, match=re.escape(f"format version {version!r} is "
                                                            "not supported")) as info:
            reader(bad)
        assert info.value.reason == "version" and info.value.value == version
        assert type(info.value.value) is type(version)


def test_saving_meta_tensors_is_refused_naming_the_patch(tmp_path):
    ok = CheckpointWeightPatch("v", (1,), torch.float32, torch.zeros(1))
    meta_values = CheckpointWeightPatch("m", (2,), torch.float32,
                                        torch.empty(2, device="meta"))
    meta_indices = CheckpointWeightPatch("s", (4,), torch.float32, torch.ones(2),
                                         torch.empty(2, dtype=torch.int64, device="meta"))
    path = tmp_path / "p.safetensors"
    for bad, what in ((meta_values, "values"), (meta_indices, "indices")):
        with pytest.raises(PatchValueError, match=rf"patch 1 \('{bad.name}'\): {what} are on "
                           "the meta device") as info:
            save_patches(path, [ok, bad])
        e = info.value
        assert (e.position, e.name, e.reason, e.value) == (1, bad.name, "meta device",
                                                           torch.device("meta"))
    assert os.listdir(tmp_path) == []


def _raising_save_file(monkeypatch, message: str) -> None:
    """safetensors' own writer, which a big-endian machine uses, failing with
    ``message``."""
    import safetensors.torch as st_torch

    monkeypatch.setattr(sys, "byteorder", "big")

    def fail(tensors, filename, metadata=None):
        with open(filename, "wb") as fh:  # a partial write, as a full disk leaves
            fh.write(b"partial")
        raise safetensors.SafetensorError(message)

    monkeypatch.setattr(st_torch, "save_file", fail)


def test_a_full_disk_is_an_oserror_naming_the_path(tmp_path, monkeypatch):
    import errno

    path = tmp_path / "p.safetensors"
    p = [CheckpointWeightPatch("w", (1,), torch.float32, torch.ones(1))]
    save_patches(path, p)
    old = path.read_bytes()
    _raising_save_file(monkeypatch, "Error while serializing: I/O error: No space left on "
                       f'device (os error 28) at path "{tmp_path}/.tmpAbC123"')
    with pytest.raises(OSError, match="No space left on device") as info:
        save_patches(path, [p[0]._replace(values=torch.zeros(1))])
    e = info.value
    assert e.errno == errno.ENOSPC and e.filename == str(path)
    # (no temporary file named: ".tmp" past the path itself, which TMPDIR may hold)
    assert str(path) in str(e) and ".tmp" not in str(e).replace(str(path), "")
    assert path.read_bytes() == old and os.listdir(tmp_path) == ["p.safetensors"]

    _raising_save_file(monkeypatch, "Error while serializing: I/O error: Permission denied "
                       '(os error 13) at path "/x/.tmp1"')
    with pytest.raises(PermissionError) as info:
        save_patches(path, p)
    assert info.value.filename == str(path)
    _raising_save_file(monkeypatch, "Error while serializing: something else")
    with pytest.raises(OSError, match="something else") as info:
        save_patches(path, p)
    assert info.value.filename == str(path)
    assert path.read_bytes() == old and os.listdir(tmp_path) == ["p.safetensors"]


def test_a_header_too_large_for_safetensors_is_refused_before_writing(tmp_path):
    path = tmp_path / "p.safetensors"
    p = [CheckpointWeightPatch("w", (1,), torch.float32, torch.ones(1))]
    save_patches(path, p)
    old = path.read_bytes()
    with pytest.raises(PatchValueError, match=r"header would take \d+ bytes .*more than the "
                       r"100000000 bytes safetensors allows.*1 patch .*100000001 bytes of user "
                       "metadata") as info:
        save_patches(path, p, metadata={"k": "x" * 100_000_000})
    assert info.value.reason == "header too large" and info.value.value > 100_000_000
    assert path.read_bytes() == old and os.listdir(tmp_path) == ["p.safetensors"]


def test_the_header_limit_counts_patches_and_names(tmp_path, monkeypatch):
    import patchkit.io

    monkeypatch.setattr(patchkit.io, "_MAX_HEADER_BYTES", 3000)
    ps = [CheckpointWeightPatch("n" * 100, (1,), torch.float32, torch.ones(1))] * 20
    with pytest.raises(PatchValueError, match=r"more than the 3000 bytes safetensors allows.*"
                       r"20 patches \(20 tensors\) with names of up to 100 characters"):
        save_patches(tmp_path / "p.safetensors", ps)
    assert os.listdir(tmp_path) == []
    save_patches(tmp_path / "p.safetensors", ps[:5])  # a smaller file fits


def test_safetensors_refusing_the_header_is_a_patch_value_error(tmp_path, monkeypatch):
    path = tmp_path / "p.safetensors"
    p = [CheckpointWeightPatch("w", (1,), torch.float32, torch.ones(1))]
    _raising_save_file(monkeypatch, "Error while serializing: header too large")
    with pytest.raises(PatchValueError, match="header is too large") as info:
        save_patches(path, p)
    assert info.value.reason == "header too large" and str(path) in str(info.value)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("meta", [{}, {"k": 'v\n"é\x7f\x01\\', "ü": "名" * 3}])
def test_the_header_size_estimate_bounds_the_written_header(tmp_path, meta):
    from patchkit.io import _header_bytes

    g = torch.Generator().manual_seed(0)
    ps = [random_sparse_patch("w\n\"é", (64, 64), torch.bfloat16, 0.25, generator=g),
          CheckpointWeightPatch("d", (2, 3), torch.float32, torch.arange(6.0)),
          CheckpointWeightPatch("e", (0,), torch.float64, torch.zeros(0))]
    path = tmp_path / "p.safetensors"
    save_patches(path, ps, metadata=meta)
    with open(path, "rb") as fh:
        raw = fh.read(int.from_bytes(fh.read(8), "little"))  # (the length read first)
    written = len(raw.rstrip(b" "))  # safetensors pads the header with spaces
    with safetensors.safe_open(path, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        md = f.metadata()
    data = sum(t.numel() * t.element_size() for t in tensors.values())
    estimate = _header_bytes(tensors, md)
    # exact but for the data offsets, each counted as wide as the largest: the estimate
    # is the written header plus those missing digits, not a byte less (a byte short, a
    # header at the limit would be written and then refused by every reader)
    offsets = [o for k, v in json.loads(raw).items() if k != "__metadata__"
               for o in v["data_offsets"]]
    assert estimate == written + sum(len(str(data)) - len(str(o)) for o in offsets)


@pytest.mark.skipif(os.name != "posix", reason="POSIX: a folder can be opened and synced")
def test_the_file_is_synced_before_it_replaces_the_old_one(tmp_path, monkeypatch):
    """A crash after the rename cannot leave an empty file where the old one was."""
    import stat

    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        st_ = os.fstat(fd)
        events.append(("fsync", "dir" if stat.S_ISDIR(st_.st_mode) else "file", st_.st_ino,
                       st_.st_size))
        real_fsync(fd)

    def replace(src, dst, **kw):
        events.append(("replace", os.stat(src).st_ino, os.fspath(dst)))
        real_replace(src, dst, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    path = tmp_path / "p.safetensors"
    save_patches(path, [CheckpointWeightPatch("w", (1,), torch.float32, torch.ones(1))])
    ino = path.stat().st_ino
    assert [e[:2] for e in events] == [("fsync", "file"), ("replace", ino), ("fsync", "dir")]
    assert events[0][2] == ino and events[0][3] == path.stat().st_size > 0
    assert events[1][2] == str(path) and events[2][2] == tmp_path.stat().st_ino


def test_a_failed_sync_keeps_the_old_file(tmp_path, monkeypatch):
    import errno

    path = tmp_path / "p.safetensors"
    p = [CheckpointWeightPatch("w", (1,), torch.float32, torch.ones(1))]
    save_patches(path, p)
    old = path.read_bytes()

    def fsync(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError, match="Input/output error") as info:
        save_patches(path, [p[0]._replace(values=torch.zeros(1))])
    assert info.value.errno == errno.EIO and info.value.filename == str(path)
    assert path.read_bytes() == old and os.listdir(tmp_path) == ["p.safetensors"]


@pytest.mark.skipif(os.name != "posix", reason="POSIX symbolic links")
def test_saving_through_a_symbolic_link_writes_its_target(tmp_path):
    old = [CheckpointWeightPatch("old", (1,), torch.float32, torch.ones(1))]
    new = [CheckpointWeightPatch("new", (1,), torch.float32, torch.zeros(1))]
    (tmp_path / "runs").mkdir()
    target = tmp_path / "runs" / "run42.safetensors"
    save_patches(target, old)
    os.chmod(target, 0o640)
    link = tmp_path / "latest.safetensors"
    os.symlink(os.path.join("runs", "run42.safetensors"), link)  # relative, as ln -s makes
    save_patches(link, new)
    assert os.path.islink(link) and os.readlink(link) == os.path.join("runs", "run42.safetensors")
    assert_same_patches(load_patches(target), new)
    assert target.stat().st_mode & 0o777 == 0o640  # the target's mode, kept
    assert sorted(os.listdir(tmp_path)) == ["latest.safetensors", "runs"]
    assert os.listdir(tmp_path / "runs") == ["run42.safetensors"]

    dangling = tmp_path / "next.safetensors"
    os.symlink(tmp_path / "runs" / "run43.safetensors", dangling)
    save_patches(dangling, old)  # as open(link, "w") would, it creates the target
    assert os.path.islink(dangling)
    assert_same_patches(load_patches(tmp_path / "runs" / "run43.safetensors"), old)

    loop = tmp_path / "loop.safetensors"
    os.symlink(loop, loop)
    with pytest.raises(OSError, match="symbolic link") as info:
        save_patches(loop, old)
    assert info.value.filename == str(loop) and os.path.islink(loop)


@pytest.mark.skipif(os.name != "posix", reason="POSIX FIFOs and sockets")
def test_saving_over_something_that_is_not_a_regular_file_is_refused(tmp_path):
    import socket
    import stat

    p = [CheckpointWeightPatch("w", (1,), torch.float32, torch.ones(1))]
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    sock_path = tmp_path / "sock"
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(sock_path))
    link = tmp_path / "link"
    os.symlink(fifo, link)
    try:
        for path, kind in ((fifo, r"a FIFO \(named pipe\)"), (sock_path, "a socket"),
                           (link, "a FIFO")):
            with pytest.raises(FileExistsError, match=f"is {kind}.*not a regular file") as info:
                save_patches(path, p)
            assert info.value.filename == str(path) and ".patchkit-" not in str(info.value)
    finally:
        sock.close()
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and stat.S_ISSOCK(os.stat(sock_path).st_mode)
    assert os.path.islink(link)
    assert sorted(os.listdir(tmp_path)) == ["fifo", "link", "sock"]


def test_inspect_escapes_what_it_prints_from_the_file(tmp_path):
    """Names, metadata and the path come from an untrusted file: newlines, terminal
    escape codes and other non-printable characters are printed escaped, as repr does."""
    import io

    good = sample_files(str(tmp_path))["path"]
    evil = "d\n  9  fake  dense  (1,)  float32\x1b[2J\u202e"
    bad = rewrite(good, str(tmp_path / "evil\x1b[31m.safetensors"), header=_set(1, name=evil),
                  meta=lambda m: {**m, "note\r": "\x1b]0;owned\x07", "back\\slash": "plain"})
    buf = io.StringIO()
    assert print_patch_file_summary(bad, file=buf) == 0
    out = buf.getvalue()
    assert all(c.isprintable() for c in out.replace("\n", ""))
    assert repr(evil) in out and "'note\\r': '\\x1b]0;owned\\x07'" in out
    assert "'back\\\\slash': plain" in out  # a backslash is shown unambiguously too
    assert f"patch file: {bad!r}" in out
    plain = print_patch_file_summary(good, file=(buf := io.StringIO()))
    assert plain == 0 and f"patch file: {good}\n" in buf.getvalue()  # plain text stays so
    assert "  d  " in buf.getvalue() or " d " in buf.getvalue()
    rows = [line for line in out.splitlines() if line.split()[:1] == ["1"]]
    assert len(rows) == 1 and len(out.splitlines()) == len(buf.getvalue().splitlines()) + 2


def test_inspect_errors_are_printed_escaped(tmp_path, capsys):
    good = sample_files(str(tmp_path))["path"]
    bad = rewrite(good, str(tmp_path / "bad.safetensors"),
                  header=_set(1, name="x\x1b[2J", nnz=1))
    assert main(["inspect", bad]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "\x1b" not in err and err.count("\n") == 1 and "x\\x1b[2J" in err


def test_inspect_into_a_narrow_encoding_escapes_what_it_cannot_encode(tmp_path):
    path = tmp_path / "p.safetensors"
    save_patches(path, [CheckpointWeightPatch("ünï.名", (1,), torch.float32, torch.ones(1))],
                 metadata={"ключ": "значение"})
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(__file__)),
           "PYTHONIOENCODING": "ascii"}
    out = subprocess.run([sys.executable, "-m", "patchkit", "inspect", str(path)],
                         capture_output=True, env=env, timeout=120)
    assert out.returncode == 0 and b"Traceback" not in out.stderr, out.stderr
    text = out.stdout.decode("ascii")
    assert "\\xfcn\\xef.\\u540d" in text and "\\u043a\\u043b" in text
    row = next(line for line in text.splitlines() if line.split()[:1] == ["0"])
    header = next(line for line in text.splitlines() if line.split()[:2] == ["#", "name"])
    assert row.index("dense") == header.index("kind")  # the table is still aligned


def test_inspect_shortens_a_shape_of_many_dims(tmp_path, capsys):
    good = sample_files(str(tmp_path))["path"]
    bad = rewrite(good, str(tmp_path / "dims.safetensors"),
                  header=_set(1, shape=[1] * 10_000 + [2, 3]))
    assert print_patch_file_summary(bad) == 0
    row = next(line for line in capsys.readouterr().out.splitlines()
               if line.split()[:2] == ["1", "d"])
    assert "(1, 1, 1, 1, 1, 1, 1, ..., 3; 10002 dims)" in row and len(row) < 200


@pytest.mark.skipif(os.name != "posix", reason="POSIX permission bits")
@pytest.mark.parametrize("mode", [0o444, 0o200, 0o000])
def test_overwriting_a_file_keeps_its_mode_and_syncs_it_whatever_the_mode(
        tmp_path, monkeypatch, mode):
    """The written file gets the kept mode and is synced through one descriptor opened
    before: a file whose mode lacks read or write bits is overwritten, as before, by a
    user who is not root."""
    path = tmp_path / "p.safetensors"
    p = [CheckpointWeightPatch("w", (1,), torch.float32, torch.ones(1))]
    save_patches(path, p)
    os.chmod(path, mode)
    real_open = os.open

    def open_as_a_user(name, flags, *args, **kw):  # root would ignore the missing bits
        if os.path.isfile(name):
            bits = os.stat(name).st_mode
            writes = flags & (os.O_WRONLY | os.O_RDWR)
            reads = flags & os.O_WRONLY == 0
            if (writes and not bits & 0o200) or (reads and not bits & 0o400):
                raise PermissionError(13, "Permission denied", name)
        return real_open(name, flags, *args, **kw)

    monkeypatch.setattr(os, "open", open_as_a_user)
    save_patches(path, [p[0]._replace(values=torch.zeros(1))])
    monkeypatch.undo()
    assert path.stat().st_mode & 0o777 == mode
    os.chmod(path, 0o644)
    assert_same_patches(load_patches(path), [p[0]._replace(values=torch.zeros(1))])


def test_a_refused_mode_change_is_reported_as_one(tmp_path, monkeypatch):
    import errno

    def refuse(*args, **kwargs):
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "fchmod", refuse, raising=False)
    monkeypatch.setattr(os, "chmod", refuse)
    path = tmp_path / "p.safetensors"
    with pytest.raises(PermissionError, match="cannot give the written file the mode") as e:
        save_patches(path, [CheckpointWeightPatch("w", (1,), torch.float32, torch.ones(1))])
    assert e.value.filename == str(path) and os.listdir(tmp_path) == []


# -- found by review -----------------------------------------------------------------------


@pytest.mark.parametrize("device", ["cpu:0", torch.device("cpu", 0)])
def test_a_cpu_device_with_an_index_loads_the_file(tmp_path, device):
    # torch takes "cpu:0"; safetensors refuses it, and the refusal read as a corrupt file
    path = tmp_path / "p.safetensors"
    save_patches(path, [CheckpointWeightPatch("w", (2,), torch.float32, torch.ones(2))])
    (p,) = load_patches(path, device=device)
    assert p.values.tolist() == [1.0, 1.0] and p.values.device.type == "cpu"


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="Linux: names are bytes there")
def test_a_file_whose_name_is_not_utf8_round_trips(tmp_path):
    # safetensors opens files by UTF-8 paths only: the save worked, the load called the
    # file corrupt
    path = os.path.join(os.fsdecode(bytes(tmp_path)), os.fsdecode(b"patch-\xff.safetensors"))
    patches = [CheckpointWeightPatch("w", (3,), torch.float32, torch.tensor([1.0, 2.0]),
                                     torch.tensor([0, 2]))]
    save_patches(path, patches)
    (p,) = load_patches(path)
    assert p.values.tolist() == [1.0, 2.0] and p.indices.tolist() == [0, 2]
    assert [e.name for e in read_patch_index(path)] == ["w"]
    junk = os.path.join(os.fsdecode(bytes(tmp_path)), os.fsdecode(b"junk-\xff.safetensors"))
    with open(junk, "wb") as f:
        f.write(b"not a safetensors file")
    with pytest.raises(PatchValueError, match="not a readable safetensors file") as info:
        load_patches(junk)
    assert info.value.reason == "not safetensors" and "junk-" in str(info.value)


@pytest.mark.parametrize("name,error", [("", FileNotFoundError),
                                        ("missing/", NotADirectoryError)])
def test_a_path_that_names_no_file_is_refused_before_anything_is_written(
    tmp_path, monkeypatch, name, error
):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(error, match="cannot save patches: the path"):
        save_patches(name, [CheckpointWeightPatch("w", (1,), torch.float32, torch.ones(1))])
    assert os.listdir(tmp_path) == []


def test_inspect_says_error_when_its_output_cannot_be_written(tmp_path):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    path = tmp_path / "many.safetensors"
    save_patches(path, [CheckpointWeightPatch(f"w{i}", (2,), torch.float32, torch.ones(2))
                        for i in range(3000)])
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "patchkit", "inspect", str(path)],
                              stdout=full, stderr=subprocess.PIPE, text=True)
    assert done.returncode == 1
    assert done.stderr.startswith("error: ") and "Traceback" not in done.stderr


def test_a_bytes_path_loads_as_its_str_does(tmp_path):
    path = tmp_path / "p.safetensors"
    save_patches(path, [CheckpointWeightPatch("w", (2,), torch.float32, torch.ones(2))])
    (p,) = load_patches(os.fsencode(path))
    assert p.values.tolist() == [1.0, 1.0]
    assert [e.name for e in read_patch_index(os.fsencode(path))] == ["w"]
    with pytest.raises(PatchValueError, match="no such file"):
        load_patches(os.fsencode(tmp_path / "missing.safetensors"))


def test_a_bytes_path_saves_as_it_loads(tmp_path):
    ps = [CheckpointWeightPatch("w", (3,), torch.float32, torch.ones(3))]
    path = os.fsencode(tmp_path / "b.safetensors")
    save_patches(path, ps)
    (got,) = load_patches(path)
    assert got.name == "w" and torch.equal(got.values, ps[0].values)


def test_a_file_cut_short_while_it_is_read_is_an_error_not_a_crash(tmp_path, monkeypatch):
    # A trainer that writes the next step onto the same path (scp, curl -o, cp) truncates
    # it: read through a memory map, the next tensor's pages were gone and the process
    # died of SIGBUS. Plain reads come back short, and say so.
    import patchkit.io as pk_io

    path = tmp_path / "p.safetensors"
    ps = [CheckpointWeightPatch(n, (256, 256), torch.float32, torch.ones(256 * 256))
          for n in ("a", "b")]
    save_patches(path, ps)
    real = pk_io._read_tensor
    reads = []

    def then_truncate(*args, **kwargs):
        out = real(*args, **kwargs)
        reads.append(1)
        if len(reads) == 1:
            os.truncate(path, 4096)
        return out

    monkeypatch.setattr(pk_io, "_read_tensor", then_truncate)
    with pytest.raises(PatchValueError, match=r"the file ended .* bytes before the data its "
                                              r"header describes") as info:
        load_patches(path)
    assert info.value.reason == "truncated" and str(path) in str(info.value)


def test_a_file_that_cannot_be_opened_says_why(tmp_path, monkeypatch):
    # (was: "not a readable safetensors file (truncated, corrupt or another format): No
    # such file or directory" for an intact file the process may not read)
    import patchkit.io as pk_io

    path = tmp_path / "p.safetensors"
    save_patches(path, [CheckpointWeightPatch("a", (2,), torch.float32, torch.ones(2))])

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(pk_io, "open", refuse, raising=False)
    for read in (load_patches, read_patch_index):
        with pytest.raises(PatchValueError, match="cannot be opened: Permission denied") as e:
            read(path)
        assert e.value.reason == "unreadable"


def _a_save_that_fails_after_writing(tmp_path, monkeypatch, error):
    """``(path, old bytes, patches)``: a patch file saved at ``path``, and patches whose
    save over it writes the temporary file whole, then raises ``error(filename)``."""
    import patchkit.io as pk_io

    path = tmp_path / "p.safetensors"
    p = [CheckpointWeightPatch("w", (1,), torch.float32, torch.ones(1))]
    save_patches(path, p)
    real = pk_io._write_safetensors

    def failing(filename, tensors, metadata):
        real(filename, tensors, metadata)
        raise error(filename)

    monkeypatch.setattr(pk_io, "_write_safetensors", failing)
    return path, path.read_bytes(), [p[0]._replace(values=torch.zeros(1))]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES, errno.EIO])
def test_a_write_that_fails_is_an_oserror_naming_the_path_and_leaves_the_old_file(
        tmp_path, monkeypatch, code):
    # (written, then the disk says no)
    path, old, new = _a_save_that_fails_after_writing(
        tmp_path, monkeypatch, lambda filename: OSError(code, os.strerror(code), filename))
    with pytest.raises(OSError) as info:
        save_patches(path, new)
    e = info.value
    assert e.errno == code and e.filename == str(path)
    assert ".tmp" not in str(e).replace(str(path), "")  # (TMPDIR may hold ".tmp")
    assert str(e).startswith(f"[Errno {code}] cannot save patches: writing the file failed")
    assert path.read_bytes() == old and os.listdir(tmp_path) == ["p.safetensors"]


def test_saving_files_of_ever_new_sizes_creates_no_lasting_types():
    # (safetensors' save_file makes two ctypes types for every byte size it meets, kept
    # for good before Python 3.14: a trainer saving a sparse patch a step leaked about
    # 11 KiB per tensor.) Counted as the live subclasses of ctypes' Array and _Pointer,
    # which is the same on every Python: ctypes._pointer_type_cache, a dict before 3.14,
    # has no len() from 3.14 on, where a pointer type hangs on the type it points to.
    import ctypes
    import gc
    import tempfile

    def lasting_types():
        gc.collect()
        return len(ctypes.Array.__subclasses__()) + len(ctypes._Pointer.__subclasses__())

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "p.safetensors")

        def save(n):
            save_patches(path, [CheckpointWeightPatch(
                "w", (1 << 20,), torch.bfloat16, torch.ones(n, dtype=torch.bfloat16),
                torch.arange(n, dtype=torch.int32))])

        save(10)
        before = lasting_types()
        for n in range(1000, 1040):
            save(n)
        assert lasting_types() == before
        (p,) = load_patches(path)
        assert p.values.numel() == 1039 and p.indices[-1] == 1038


def test_the_written_file_is_what_safetensors_reads_for_every_storable_dtype(tmp_path):
    from safetensors import safe_open

    ps = []
    for i, dt in enumerate(storable_dtypes()):
        v = torch.arange(6).to(dt) if not dt.is_complex else torch.full((6,), 1 + 2j, dtype=dt)
        ps.append(CheckpointWeightPatch(f"w{i}", (2, 3), dt, v))
    ps += [CheckpointWeightPatch("scalar", (), torch.float32, torch.tensor([7.0])),
           CheckpointWeightPatch("empty", (0, 4), torch.float32, torch.zeros(0)),
           CheckpointWeightPatch("s", (100,), torch.float32, torch.tensor([1.5, 2.5]),
                                 torch.tensor([3, 70]))]
    path = tmp_path / "p.safetensors"
    save_patches(path, ps, metadata={"k": 'v\n"é'})
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["k"] == 'v\n"é'
        keys = list(f.keys())
        assert len(keys) == len(ps) + 1  # (the sparse one: values and indices)
    for a, b in zip(ps, load_patches(path), strict=True):
        assert (a.name, tuple(a.shape), a.dtype) == (b.name, tuple(b.shape), b.dtype)
        assert same_bits(a.values, b.values)
        assert (a.indices is None and b.indices is None) or torch.equal(a.indices, b.indices)
    n = int.from_bytes(path.read_bytes()[:8], "little")
    assert n % 8 == 0  # the header is padded to 8 bytes, as safetensors pads it


def test_metadata_with_a_lone_surrogate_is_refused_by_name_before_writing(tmp_path):
    p = [CheckpointWeightPatch("w\ud800", (1,), torch.float32, torch.ones(1))]  # (a name may)
    for meta, what in (({"k": "v\ud800"}, "value"), ({"k\udc80": "v"}, "key")):
        with pytest.raises(PatchValueError, match=f"metadata {what} .* a lone surrogate") as e:
            save_patches(tmp_path / "p.safetensors", p, metadata=meta)
        assert e.value.reason == "metadata not UTF-8"
        assert os.listdir(tmp_path) == []
    save_patches(tmp_path / "p.safetensors", p)
    assert load_patches(tmp_path / "p.safetensors")[0].name == "w\ud800"


# -- fifth hunt: devices, unwritable folders, older safetensors, alignment ----------------


@pytest.mark.parametrize("device", ["hip", "xla", "lazy", "hpu", "privateuseone"])
def test_a_device_type_this_torch_cannot_use_is_named_not_blamed_on_the_file(tmp_path, device):
    # (only cuda/mps/xpu/mtia have an is_available(): the others reached safetensors,
    # which called a good file "not a readable safetensors file")
    path = tmp_path / "p.safetensors"
    save_patches(path, [CheckpointWeightPatch("w", (2,), torch.float32, torch.ones(2))])
    with pytest.raises(PatchValueError, match=rf"device '{device}' is not available here") as e:
        load_patches(path, device=device)
    assert e.value.reason == "device unavailable" and e.value.value == device
    # torch's dispatcher error runs to pages: the message keeps its first sentence only
    # (it kept it all, cut at 200 characters, with every test passing)
    said = str(e.value).split("cannot make a tensor on it (", 1)[1]
    assert ". " not in said and not said.endswith("...)") and "\n" not in said


def test_an_unwritable_folder_is_said_before_any_tensor_is_copied(tmp_path, monkeypatch):
    import patchkit.io as pio

    copies = []
    real = torch.Tensor.contiguous
    monkeypatch.setattr(torch.Tensor, "contiguous",
                        lambda self, *a, **k: copies.append(self.shape) or real(self, *a, **k))

    def refuse(dest, path):
        raise PermissionError(errno.EACCES, "cannot create a temporary file", path)

    monkeypatch.setattr(pio, "_create_temporary", refuse)
    values = torch.arange(24.0)[::2]  # (not contiguous: a save copies it)
    with pytest.raises(PermissionError):
        save_patches(tmp_path / "p.safetensors",
                     [CheckpointWeightPatch("w", (4, 3), torch.float32, values)])
    assert copies == []
    assert os.listdir(tmp_path) == []


def _refusing_the_temporary(monkeypatch, error):
    """``os.open`` raising ``error`` (an exception or a callable making one) for a save's
    temporary files only."""
    real = os.open

    def fake(path, *a, **k):
        if ".patchkit-" in os.fsdecode(path):
            raise error() if callable(error) else error
        return real(path, *a, **k)

    monkeypatch.setattr(os, "open", fake)


def test_a_folder_that_refuses_the_temporary_file_is_named(tmp_path, monkeypatch):
    _refusing_the_temporary(monkeypatch, PermissionError(errno.EACCES, "Permission denied"))
    dest = tmp_path / "p.safetensors"
    with pytest.raises(PermissionError) as e:
        save_patches(dest, [CheckpointWeightPatch("w", (2,), torch.float32, torch.ones(2))])
    assert e.value.errno == errno.EACCES and e.value.filename == str(dest)
    assert f"cannot create a temporary file in {str(tmp_path)!r}" in str(e.value)
    assert os.listdir(tmp_path) == []


def test_a_folder_with_no_free_temporary_name_is_said(tmp_path, monkeypatch):
    _refusing_the_temporary(monkeypatch, lambda: FileExistsError(errno.EEXIST, "File exists"))
    dest = tmp_path / "p.safetensors"
    with pytest.raises(FileExistsError, match="no free temporary name in") as e:
        save_patches(dest, [CheckpointWeightPatch("w", (2,), torch.float32, torch.ones(2))])
    assert e.value.filename == str(dest)
    assert os.listdir(tmp_path) == []


def test_a_temporary_file_that_cannot_be_set_up_is_removed(tmp_path, monkeypatch):
    import patchkit.io as pio

    def refuse(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(pio.os, "fstat", refuse)
    dest = tmp_path / "p.safetensors"
    with pytest.raises(OSError, match="cannot set up a temporary file in") as e:
        save_patches(dest, [CheckpointWeightPatch("w", (2,), torch.float32, torch.ones(2))])
    assert e.value.errno == errno.EIO and e.value.filename == str(dest)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []


def test_input_errors_still_come_before_the_folder_is_touched(tmp_path, monkeypatch):
    import patchkit.io as pio

    made = []
    monkeypatch.setattr(pio, "_create_temporary", lambda dest, path: made.append(dest))
    with pytest.raises(PatchTypeError, match="cannot be stored") as e:
        save_patches(tmp_path / "p.safetensors",
                     [CheckpointWeightPatch("w", (2,), torch.float32, torch.ones(2)),
                      CheckpointWeightPatch("v", (2,), torch.complex128,
                                            torch.ones(2, dtype=torch.complex128))])
    assert e.value.position == 1 and e.value.reason == "unstorable dtype"
    assert made == []


def test_every_dtype_patchkit_maps_is_read_by_the_installed_safetensors():
    import patchkit.io as pio

    # the probe behind storable_dtypes, against safetensors' own reader: the codes it
    # reads are those the probe says (every one, from safetensors 0.8; before, fewer, and
    # patchkit refuses the others by name, see the next test)
    read = set()
    for dtype, code in pio._DTYPE_TO_CODE.items():
        size = dtype.itemsize
        text = json.dumps({"t": {"dtype": code, "shape": [1], "data_offsets": [0, size]}})
        text += " " * (-len(text) % 8)
        data = len(text).to_bytes(8, "little") + text.encode() + bytes(size)
        try:
            assert dict(safetensors.deserialize(data))["t"]["dtype"]
        except Exception:  # (an unknown code: safetensors' own error, whatever its class)
            continue
        read.add(code)
    assert pio._readable_codes() == frozenset(read)
    assert {pio._DTYPE_TO_CODE[d] for d in storable_dtypes()} <= read
    if tuple(map(int, safetensors.__version__.split(".")[:2])) >= (0, 8):
        assert read == set(pio._DTYPE_TO_CODE.values())


def test_a_dtype_the_installed_safetensors_cannot_read_back_is_refused_and_named(
        tmp_path, monkeypatch):
    # safetensors 0.6.2 reads no complex64 (C64), 0.7.0 no float8 *fnuz: such a file
    # saved, and then load_patches called it "truncated, corrupt or another format"
    import patchkit.io as pio

    path = tmp_path / "c.safetensors"
    # (complex64 where the installed safetensors reads it, from 0.7; else bfloat16, which
    # every safetensors patchkit takes reads: the test takes its code away)
    dtype, code = ((torch.complex64, "C64") if torch.complex64 in storable_dtypes()
                   else (torch.bfloat16, "BF16"))
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    z = z if dtype.is_complex else z.real.to(dtype)
    save_patches(path, [CheckpointWeightPatch("z", (2,), dtype, z)])  # (read here)

    older = pio._readable_codes() - {code}
    monkeypatch.setattr(pio, "_readable_codes", lambda: older)
    assert dtype not in storable_dtypes()
    assert torch.float32 in storable_dtypes()
    with pytest.raises(PatchTypeError, match=rf"cannot read dtype code '{code}' back") as e:
        save_patches(tmp_path / "d.safetensors",
                     [CheckpointWeightPatch("z", (2,), dtype, z)])
    assert e.value.reason == "unstorable dtype" and e.value.name == "z"
    assert not (tmp_path / "d.safetensors").exists()

    # reading such a file with a safetensors that refuses its header: named
    _, save, error = pio._safetensors()

    def older_open(at, framework, device):
        raise error(f"Error while deserializing header: unknown variant `{code}`")

    monkeypatch.setattr(pio, "_safetensors", lambda: (older_open, save, error))
    for read in (load_patches, read_patch_index):
        with pytest.raises(PatchValueError, match=rf"dtype code '{code}'.*cannot read") as e:
            read(path)
        assert e.value.reason == "unreadable dtype" and e.value.value == code


def test_each_tensor_of_a_file_starts_at_a_multiple_of_its_element_size(tmp_path):
    # an odd number of bf16 values put the int64 indices after them at an odd offset:
    # readers that map the file got misaligned tensors
    path = tmp_path / "a.safetensors"
    patches = [
        CheckpointWeightPatch("s", (10,), torch.bfloat16,
                              torch.ones(3, dtype=torch.bfloat16), torch.tensor([1, 4, 7])),
        CheckpointWeightPatch("b", (3,), torch.bool, torch.tensor([True, False, True])),
        CheckpointWeightPatch("d", (2,), torch.float64, torch.ones(2, dtype=torch.float64)),
        CheckpointWeightPatch("i", (5,), torch.int32, torch.arange(5, dtype=torch.int32)),
    ]
    save_patches(path, patches)
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert (8 + n) % 8 == 0
    header = json.loads(raw[8:8 + n])
    sizes = {"BF16": 2, "I64": 8, "BOOL": 1, "F64": 8, "I32": 4}
    spans = sorted(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    for k, v in header.items():
        if k != "__metadata__":
            assert v["data_offsets"][0] % sizes[v["dtype"]] == 0, (k, v)
    with safetensors.safe_open(str(path), framework="pt") as f:
        for k in f.keys():  # noqa: SIM118 (a safe_open is no dict)
            t = f.get_tensor(k)
            assert t.data_ptr() % t.element_size() == 0, k
    got = load_patches(path)
    for a, b in zip(got, patches):
        assert a.name == b.name and same_bits(a.values, b.values)
        assert (a.indices is None) == (b.indices is None)
        if a.indices is not None:
            assert torch.equal(a.indices, b.indices)


def test_the_summary_takes_a_bytes_path_as_the_readers_do(tmp_path, capsys):
    path = tmp_path / "p.safetensors"
    save_patches(path, [CheckpointWeightPatch("w", (2,), torch.float32, torch.ones(2))])
    assert print_patch_file_summary(os.fsencode(path)) == 0
    assert "p.safetensors" in capsys.readouterr().out


def test_the_summary_never_rounds_a_partial_density_to_100_percent(tmp_path, capsys):
    path = tmp_path / "p.safetensors"
    n = 100_000
    idx = torch.arange(n - 1)  # 99.999 %
    save_patches(path, [CheckpointWeightPatch("w", (n,), torch.float32, torch.ones(n - 1), idx)])
    assert print_patch_file_summary(path) == 0
    out = capsys.readouterr().out
    assert ">99.9%" in out and "100%" not in out


# --------------------------------------------------------------------------- checking a file


def _checkable_file(tmp_path, n: int = 3):
    """A file of the first ``n`` of: a dense float patch, a dense int8 one whose int32
    values may not fit, two sparse ones."""
    ps = [
        CheckpointWeightPatch("w", (4, 4), torch.float32, torch.arange(16.0)),
        CheckpointWeightPatch("q", (4,), torch.int8, torch.tensor([1, 2, 3, 4], dtype=torch.int32)),
        CheckpointWeightPatch("e", (3, 3), torch.bfloat16, torch.tensor([1.0, 2.0]),
                              torch.tensor([0, 8])),
        CheckpointWeightPatch("m", (4,), torch.float32, torch.tensor([1.0, 2.0]),
                              torch.tensor([1, 2])),
    ]
    path = str(tmp_path / f"good{n}.safetensors")
    save_patches(path, ps[:n])
    return path


def _corrupt(key, value):
    def change(ts):
        ts = dict(ts)
        ts[key] = value
        return ts
    return change


_CORRUPTIONS = [
    ("000000.values", torch.arange(16.0).to(torch.complex64)),  # not stageable: header only
    ("000001.values", torch.tensor([1, 2, 300, 4], dtype=torch.int32)),
    ("000002.indices", torch.tensor([0, 9])),
    ("000002.values", torch.tensor([1.0, float("nan")])),
    ("000002.indices", torch.tensor([8, 8])),
    ("000003.values", torch.tensor([1, 2], dtype=torch.complex64)),  # not stageable
]


def test_checking_a_file_refuses_what_load_patches_refuses_first_whatever_is_wrong(tmp_path):
    # (the check went patch by patch in the file's order and read only some patches: a
    # dense float patch of complex values passed it, and with two faults it named the
    # other patch than load_patches)
    import random

    good = _checkable_file(tmp_path, 4)
    rng = random.Random(0)
    verdicts = set()
    # (complex64 where the installed safetensors reads and writes it: from 0.7)
    corruptions = [c for c in _CORRUPTIONS if c[1].dtype in storable_dtypes()]
    for k in range(40):
        faults = rng.sample(corruptions, rng.randint(0, 3))
        if len({key for key, _ in faults}) < len(faults):
            continue  # (one change per tensor)

        def change(ts, faults=faults):
            return {**ts, **dict(faults)}

        def header(h, faults=faults):  # (what the tensors now hold: a consistent file)
            for key, t in faults:
                if key.endswith("values"):
                    h["patches"][int(key[:6])]["values_dtype"] = str(t.dtype).split(".")[1]
            return h

        path = rewrite(good, str(tmp_path / f"f{k}.safetensors"), tensors=change,
                       header=header)
        try:
            load_patches(path)
            expected = None
        except (PatchValueError, PatchTypeError) as e:
            expected = (type(e), str(e))
        try:
            check_patch_file(path)
            got = None
        except (PatchValueError, PatchTypeError) as e:
            got = (type(e), str(e))
        assert got == expected, faults
        verdicts.add(None if expected is None else expected[1].split(": ")[1])
    # (refused, in several ways, and accepted; patch 0's only fault is complex values)
    assert len(verdicts) >= (4 if len(corruptions) == len(_CORRUPTIONS) else 3)


@pytest.mark.parametrize("key, value, reason", [
    (None, None, None),  # the file as saved
    ("000002.indices", torch.tensor([0, 9]), "out of range"),
    ("000002.indices", torch.tensor([8, 8]), "duplicate index"),
    ("000002.values", torch.tensor([1.0, float("nan")]), "NaN value"),
    ("000001.values", torch.tensor([1, 2, 300, 4], dtype=torch.int32), "integers that do not fit"),
])
def test_checking_a_file_gives_load_patches_verdict_and_the_summary_follows_it(
        tmp_path, capsys, monkeypatch, key, value, reason):
    # (the summary read the header alone: `inspect` called a file fine that load_patches
    # refused, and `inspect --out` refused it after printing that summary)
    import patchkit.io

    path = _checkable_file(tmp_path)
    if key is not None:
        path = rewrite(path, str(tmp_path / "bad.safetensors"), tensors=_corrupt(key, value))
    try:
        load_patches(path)
        refused = None
    except PatchValueError as e:
        refused = str(e)
    assert (refused is None) == (reason is None), refused
    read: list[tuple] = []
    real = patchkit.io._read_tensor
    monkeypatch.setattr(patchkit.io, "_read_tensor",
                        lambda *a, **k: read.append(a[3]) or real(*a, **k))
    if refused is None:
        assert [e.name for e in check_patch_file(path)] == ["w", "q", "e"]
    else:
        with pytest.raises(PatchValueError) as caught:
            check_patch_file(path)
        assert str(caught.value) == refused
    assert len(read) <= 3  # q's values, e's values and indices: never w's
    capsys.readouterr()
    code = print_patch_file_summary(path)
    out, err = capsys.readouterr()
    if refused is None:
        assert code == 0 and "checked: load_patches accepts this file" in out
    else:
        assert (code, out) == (2, "") and err == f"error: {refused}\n"
    assert print_patch_file_summary(path, check=False) == 0
    assert "not checked: the header alone was read" in capsys.readouterr().out
    assert main(["inspect", path]) == (0 if refused is None else 2)
    assert main(["inspect", path, "--header-only"]) == 0
    with pytest.raises(TypeError, match="check"):
        print_patch_file_summary(path, check="yes")


@pytest.mark.parametrize("fn, args", [
    (load_patches, ()), (read_patch_index, ()), (read_patch_metadata, ()),
    (check_patch_file, ()), (print_patch_file_summary, ()), (save_patches, ([],)),
])
@pytest.mark.parametrize("path", [None, 3, ["p.safetensors"]])
def test_a_path_that_is_no_path_is_a_type_error_naming_the_argument(fn, args, path, tmp_path,
                                                                    monkeypatch):
    # (was os's "expected str, bytes or os.PathLike object, not NoneType")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TypeError, match=rf"^{fn.__name__}: path must be a file's path .*, got "
                                        rf"{type(path).__name__}: "):
        fn(path, *args)
    assert list(tmp_path.iterdir()) == []  # (nothing written)


def test_inspect_header_only_with_out_refuses_a_bad_file_before_printing(tmp_path, capsys):
    # --out reads the sparse patches for their figures: a NaN among them was found after
    # a summary that said "not checked" was printed, and exited 2 then
    from patchkit.__main__ import main

    good = _checkable_file(tmp_path, 4)
    bad = rewrite(good, str(tmp_path / "bad.safetensors"),
                  tensors=_corrupt("000002.values", torch.tensor([1.0, float("nan")])))
    assert main(["inspect", bad, "--header-only"]) == 0  # (the header alone: as it says)
    assert "not checked" in capsys.readouterr().out
    assert main(["inspect", bad, "--header-only", "--out", str(tmp_path / "figs")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("error: ")
    assert "NaN" in captured.err and not (tmp_path / "figs").exists()


def test_metadata_comes_back_in_one_order_the_keys_sorted(tmp_path, capsys):
    # (safetensors hands the keys over in the order of a hash map, another in each
    # process: read_patch_metadata and `patchkit inspect` gave them so)
    from patchkit.io import print_patch_file_summary, read_patch_metadata

    keys = [f"key{k:02d}" for k in (7, 3, 19, 0, 11, 5, 16, 2, 9, 14, 1, 18, 6, 12, 4)]
    path = tmp_path / "m.safetensors"
    save_patches(path, [CheckpointWeightPatch("w", (1,), torch.float32, torch.zeros(1))],
                 metadata={k: f"v{k}" for k in keys})
    read = read_patch_metadata(path)
    assert list(read) == sorted(keys) and read == {k: f"v{k}" for k in keys}
    assert print_patch_file_summary(path) == 0
    out = capsys.readouterr().out
    assert [out.index(f"{k}: ") for k in sorted(keys)] == sorted(
        out.index(f"{k}: ") for k in keys)


# ----------------------------------------------------------- files, systems and limits


def _deep_header_file(path) -> str:
    """A safetensors-shaped file whose JSON header nests 2000 levels (safetensors refuses
    it; Python's own parser would raise RecursionError reading it again)."""
    h = ('{"t":' + "[" * 2000 + "]" * 2000 + "}").encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as fh:
        fh.write(len(h).to_bytes(8, "little") + h)
    return str(path)


@pytest.mark.parametrize("reader", [read_patch_index, read_patch_metadata, load_patches,
                                    check_patch_file])
def test_a_header_nested_too_deep_is_a_bad_file(tmp_path, reader):
    path = _deep_header_file(tmp_path / "deep.safetensors")
    with pytest.raises(PatchValueError, match="not a readable safetensors file") as info:
        reader(path)
    assert info.value.reason == "not safetensors" and path in str(info.value)


def test_inspect_of_a_header_nested_too_deep_is_bad_input(tmp_path, capsys):
    path = _deep_header_file(tmp_path / "deep.safetensors")
    assert main(["inspect", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err and len(err.splitlines()) == 1


def test_a_umask_without_the_owners_write_bit_still_saves(tmp_path, monkeypatch):
    """Under umask 0o222 open(path, "w") makes a read-only file and writes it through the
    descriptor it opened; a save writes its temporary by name, so the temporary must stay
    writable by its owner until it is given that mode (root ignores the bits, so the
    mode while writing is what is checked)."""
    import patchkit.io as pio

    modes = []
    real = pio._write_safetensors

    def write(filename, tensors, metadata):
        modes.append(os.stat(filename).st_mode & 0o777)
        return real(filename, tensors, metadata)

    monkeypatch.setattr(pio, "_write_safetensors", write)
    old = os.umask(0o222)
    try:
        path = tmp_path / "p.safetensors"
        save_patches(path, [CheckpointWeightPatch("w", (2,), torch.float32, torch.ones(2))])
    finally:
        os.umask(old)
    assert modes and modes[0] & 0o600 == 0o600
    assert os.stat(path).st_mode & 0o777 == 0o444  # what open(path, "w") would have made
    assert same_bits(load_patches(path)[0].values, torch.ones(2))
    assert os.listdir(tmp_path) == ["p.safetensors"]


@pytest.mark.parametrize("case", ["missing", "under a file", "name too long"])
def test_a_path_that_cannot_be_reached_says_why(tmp_path, case):
    (tmp_path / "file").write_bytes(b"x")
    path, reason, said = {
        "missing": (tmp_path / "none.safetensors", "missing", "no such file"),
        "under a file": (tmp_path / "file" / "p.safetensors", "unreadable",
                         os.strerror(errno.ENOTDIR)),
        "name too long": (tmp_path / ("x" * 300), "unreadable",
                          os.strerror(errno.ENAMETOOLONG)),
    }[case]
    with pytest.raises(PatchValueError) as info:
        load_patches(path)
    assert info.value.reason == reason and said in str(info.value)


def test_a_file_name_too_long_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    import patchkit.io as pio

    made = []
    monkeypatch.setattr(pio, "_create_temporary", lambda dest, path: made.append(dest))
    path = tmp_path / ("x" * 300 + ".safetensors")
    with pytest.raises(OSError) as info:
        save_patches(path, [CheckpointWeightPatch("w", (2,), torch.float32, torch.ones(2))])
    assert info.value.errno == errno.ENAMETOOLONG and info.value.filename == str(path)
    assert "312 bytes long" in str(info.value)
    assert made == [] and os.listdir(tmp_path) == []


def _loading_out_of_memory(monkeypatch, path: str, error: BaseException, match: str
                           ) -> BaseException:
    """What ``load_patches(path)`` raises where reading a tensor raises ``error`` (its
    type, with ``match`` in its message), checked not to blame the file."""
    import patchkit.io as pio

    def no_memory(*args, **kwargs):
        raise error

    monkeypatch.setattr(pio, "_read_tensor", no_memory)
    with pytest.raises(type(error), match=match) as info:
        load_patches(path)
    assert not isinstance(info.value, PatchValueError)
    return info.value


def test_running_out_of_memory_while_reading_is_no_bad_file(tmp_path, monkeypatch):
    good = sample_files(str(tmp_path))["path"]
    e = _loading_out_of_memory(monkeypatch, good, torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB"), "CUDA out of memory")
    assert any(good in note for note in e.__notes__)
    _loading_out_of_memory(monkeypatch, good, RuntimeError(
        "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: "
        "you tried to allocate 268435456 bytes"), "can't allocate memory")


def test_a_system_error_opening_the_file_is_an_oserror_naming_it(tmp_path, monkeypatch):
    import patchkit.io as pio

    good = sample_files(str(tmp_path))["path"]

    class SafetensorError(Exception):
        pass

    def refuse(at, framework, device):
        raise SafetensorError(f"unable to mmap 268435792 bytes from file <{at}>: Cannot "
                              "allocate memory (12)")

    monkeypatch.setattr(pio, "_safetensors", lambda: (refuse, None, SafetensorError))
    with pytest.raises(OSError) as info:
        read_patch_index(good)
    assert info.value.errno == errno.ENOMEM and info.value.filename == good
    assert "/proc/self/fd" not in str(info.value) and good in str(info.value)
    assert main(["inspect", good]) == 1


def test_a_torch_save_file_is_named_as_one(tmp_path):
    path = str(tmp_path / "weights.pt")
    torch.save({"w": torch.ones(2)}, path)
    with pytest.raises(PatchValueError, match=r"zip archive, as torch\.save writes"):
        load_patches(path)
    # a file that merely starts with "PK" is no zip archive: no such word
    other = tmp_path / "pk.bin"
    other.write_bytes(b"PK, not a zip archive at all")
    with pytest.raises(PatchValueError, match="not a readable safetensors file") as info:
        load_patches(other)
    assert "zip" not in str(info.value)


def test_metadata_errors_stay_short_and_name_the_offending_value(tmp_path):
    path = tmp_path / "p.safetensors"
    patch = [CheckpointWeightPatch("w", (1,), torch.float32, torch.ones(1))]
    for metadata in ({"k": "a" * 10**6 + "\ud800"}, {"k": b"x" * 10**6}):
        with pytest.raises((PatchTypeError, PatchValueError)) as info:
            save_patches(path, patch, metadata=metadata)
        assert len(str(info.value)) < 400
    with pytest.raises(PatchTypeError) as info:
        save_patches(path, patch, metadata={"step": 7})
    assert info.value.value == 7
    # (which of the two is not a str, and what to do: "got 'step': 7 (str: int)" said it
    # as types only)
    assert str(info.value) == (
        "metadata values must be str (a safetensors header holds strings only): 'step' "
        "maps to 7, of type int; pass str(value), or json.dumps(value) for a structure")
    with pytest.raises(PatchTypeError) as info:
        save_patches(path, patch, metadata={7: "step"})
    assert info.value.value == 7
    assert str(info.value) == (
        "metadata keys must be str (a safetensors header holds strings only), got the key "
        "7, of type int")
    assert not path.exists()


@pytest.mark.parametrize("reader", [read_patch_index, load_patches])
def test_a_tensor_of_a_dtype_code_this_torch_lacks_is_named(tmp_path, monkeypatch, reader):
    # (a code safetensors reads whose torch dtype this torch does not have: an older torch
    # reading float8_e8m0fnu values, played here by float32's code taken off the map)
    import patchkit.io as pio

    path = tmp_path / "p.safetensors"
    save_patches(path, [CheckpointWeightPatch("w", (2,), torch.float32, torch.ones(2))])
    monkeypatch.delitem(pio._CODE_TO_DTYPE, "F32")
    with pytest.raises(PatchValueError, match=re.escape(
            "patch 0 ('w'): tensor '000000.values' has unknown dtype 'F32'")) as e:
        reader(path)
    assert (e.value.reason, e.value.position, e.value.name, e.value.value) == (
        "dtype", 0, "w", "F32")


def test_a_long_header_value_is_cut_in_the_error(tmp_path):
    good = sample_files(str(tmp_path))["path"]
    bad = rewrite(good, str(tmp_path / "bad.safetensors"), header=_set(0, dtype="f" * 10**5))
    with pytest.raises(PatchValueError, match="unknown dtype") as info:
        load_patches(bad)
    assert len(str(info.value)) < 1000


def test_a_bytes_path_is_named_as_text(tmp_path):
    plain = tmp_path / "plain.safetensors"
    save_file({"w": torch.zeros(3)}, plain)
    for reader in (load_patches, read_patch_index, read_patch_metadata, check_patch_file):
        with pytest.raises(PatchValueError) as info:
            reader(os.fsencode(plain))
        assert f"patch file {str(plain)!r}" in str(info.value), reader.__name__
        assert info.value.value == str(plain)


def test_the_summary_tells_names_apart_that_differ_in_blanks(tmp_path, capsys):
    path = tmp_path / "p.safetensors"
    one = torch.ones(1)
    save_patches(path, [CheckpointWeightPatch(n, (1,), torch.float32, one)
                        for n in ("w", "w ", " ")], metadata={"k": "1", "k ": "2"})
    print_patch_file_summary(path)
    out = capsys.readouterr().out
    assert "'w '" in out and "' '" in out and "'k '" in out


def test_inspect_names_the_option_of_a_bad_budget(tmp_path, capsys):
    good = sample_files(str(tmp_path))["path"]
    assert main(["inspect", good, "--max-chunk-bytes", "-1"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "--max-chunk-bytes" in err and "positive" in err
    with pytest.raises(SystemExit):
        main(["inspect", "--help"])
    assert "exit 0" in capsys.readouterr().out


# --------------------------------------------------------------------------- mutation gaps


@pytest.mark.parametrize(("change", "position", "reason", "value", "match"), [
    # -1, not only -8: every negative dimension
    (dict(header=_set(0, shape=[8, -1])), 0, "header", [8, -1],
     r"shape must be a list of non-negative ints, got \[8, -1\]"),
    # a count that is negative or no int is said as such, not as a values-shape mismatch
    (dict(header=_set(0, nnz=-1)), 0, "header", -1, "nnz must be a non-negative int, got -1"),
    (dict(header=_set(1, nnz="6")), 1, "header", "6",
     "nnz must be a non-negative int, got '6'"),
    # values of the right count but 2-D (a column): only 1-D values are a patch's
    (dict(tensors=lambda t: {**t, "000001.values": torch.zeros(6, 1)}), 1, "count", [6, 1],
     r"values have shape \[6, 1\], the header says \[6\]"),
    # exactly 2**63 bytes (2**62 bfloat16 elements): one element too many for a tensor
    (dict(header=_set(0, shape=[2**62])), 0, "header", [2**62],
     r"holds 4611686018427387904 elements, more than a tensor can"),
    # JSON's true is no dimension and no count, though Python takes it for 1
    (dict(header=_set(1, shape=[True, 6])), 1, "header", [True, 6],
     r"shape must be a list of non-negative ints, got \[True, 6\]"),
    (dict(header=_set(1, nnz=True)), 1, "header", True,
     "nnz must be a non-negative int, got True"),
    # indices of the right count but 2-D (a column), as for the values
    (dict(tensors=lambda t: {**t, "000000.indices": t["000000.indices"].reshape(16, 1)}), 0,
     "count", [16, 1], r"\[16, 1\] indices for 16 values"),
    # a dtype name torch does not know is a dtype problem, with the name
    (dict(header=_set(0, dtype="float99")), 0, "dtype", "float99", "unknown dtype 'float99'"),
    # the tensor that is missing is the value: the indices' key, not the values'
    (dict(tensors=lambda t: {k: v for k, v in t.items() if k != "000000.indices"}), 0,
     "missing key", "000000.indices", r"tensor '000000\.indices' is missing"),
    # an entry that is no object is the value
    (dict(header=lambda h: {**h, "patches": [1, 2]}), 0, "header", 1,
     "patch 0: header entry is not an object"),
    # five tensors the header does not describe are all listed, with no ' ...', and the
    # first of them (sorted) is the value
    (dict(tensors=lambda t: {**t, **{f"junk{k}": torch.zeros(1) for k in (3, 0, 4, 1, 2)}}),
     None, "extra key", "junk0",
     r"tensors not described by the header: \['junk0', 'junk1', 'junk2', 'junk3', "
     r"'junk4'\]$"),
])
def test_the_header_reader_refuses_each_bad_field_at_its_edge(tmp_path, change, position,
                                                               reason, value, match):
    good = sample_files(str(tmp_path))["path"]
    bad = rewrite(good, str(tmp_path / "bad.safetensors"), **change)
    for reader in (read_patch_index, load_patches, check_patch_file):
        with pytest.raises(PatchValueError, match=match) as info:
            reader(bad)
        e = info.value
        assert (e.position, e.reason, e.value) == (position, reason, value), reader


def test_a_header_shape_one_element_below_the_byte_limit_is_read(tmp_path):
    # (the other side of the edge above: 2**63 - 2 bytes, which a tensor can hold)
    good = sample_files(str(tmp_path))["path"]
    bad = rewrite(good, str(tmp_path / "big.safetensors"), header=_set(0, shape=[2**62 - 1]))
    assert read_patch_index(bad)[0].shape == (2**62 - 1,)


def test_the_header_limit_is_inclusive_to_the_byte(tmp_path, monkeypatch):
    # a header of exactly the limit is written; one byte over it is refused (safetensors
    # reads a header of up to 100,000,000 bytes)
    import patchkit.io

    ps = [CheckpointWeightPatch("w", (3,), torch.float32, torch.ones(3))]
    path = tmp_path / "p.safetensors"
    monkeypatch.setattr(patchkit.io, "_MAX_HEADER_BYTES", 10)
    with pytest.raises(PatchValueError) as info:
        save_patches(path, ps, metadata={"k": "v"})
    size = info.value.value  # the header's size, as counted
    assert isinstance(size, int) and size > 10
    monkeypatch.setattr(patchkit.io, "_MAX_HEADER_BYTES", size - 1)
    with pytest.raises(PatchValueError,
                       match=f"more than the {size - 1} bytes safetensors allows") as info:
        save_patches(path, ps, metadata={"k": "v"})
    assert info.value.value == size and not path.exists()
    monkeypatch.setattr(patchkit.io, "_MAX_HEADER_BYTES", size)
    save_patches(path, ps, metadata={"k": "v"})
    assert_same_patches(load_patches(path), ps)


def test_safetensors_own_reader_and_writer_agree_on_every_dtype(tmp_path):
    # A patch file is a safetensors file: each tensor's dtype code is the one safetensors
    # (and every other reader) gives that dtype. A table of codes with two entries
    # swapped (F8_E4M3 / F8_E5M2, I16 / U16) round-tripped through patchkit alone, and
    # no test saw it.
    g = torch.Generator().manual_seed(3)
    dtypes = sorted(storable_dtypes(), key=str)
    ps = [CheckpointWeightPatch(f"w{i}", (2, 2), dt, random_bits(4, dt, g))
          for i, dt in enumerate(dtypes)]
    path = str(tmp_path / "p.safetensors")
    save_patches(path, ps)
    with safetensors.safe_open(path, "pt") as f:
        for i, p in enumerate(ps):
            t = f.get_tensor(f"{i:06d}.values")
            assert t.dtype == p.values.dtype, p.values.dtype
            assert torch.equal(bits(t), bits(p.values)), p.values.dtype

    # and the other way: tensors safetensors writes read back as the dtypes it wrote, each
    # dtype its torch writer knows (from 0.8 every storable one; older ones read dtypes
    # their writer leaves out: 0.4.1 writes no float8 nor uint16/32/64, a KeyError)
    def written_by_safetensors(dtype):
        try:
            save_file({"t": torch.zeros(1, dtype=dtype)}, str(tmp_path / "probe.safetensors"))
        except KeyError:
            return False
        return True

    writable = [p for p in ps if written_by_safetensors(p.values.dtype)]
    assert {torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
            torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool} <= {
        p.values.dtype for p in writable}
    if tuple(map(int, safetensors.__version__.split(".")[:2])) >= (0, 8):
        assert writable == ps
    save_patches(path, writable)
    again = rewrite(path, str(tmp_path / "again.safetensors"))
    assert_same_patches(load_patches(again), writable)


def test_the_summary_plans_with_the_checkpoint_dtype_not_the_values_dtype(tmp_path, capsys):
    # The staged bytes of a call are the checkpoint tensors' (shape x the patch's dtype):
    # float32 values carried for bfloat16 weights stage 2 bytes an element, not 4. The
    # plan printed is plan_chunks' plan of the loaded patches, row for row.
    ps = [CheckpointWeightPatch("a", (8, 8), torch.bfloat16, torch.ones(64)),
          CheckpointWeightPatch("b", (8, 8), torch.bfloat16, torch.ones(64)),
          CheckpointWeightPatch("s", (8, 8), torch.bfloat16, torch.ones(3),
                                torch.tensor([0, 9, 63])),
          CheckpointWeightPatch("t", (8, 8), torch.bfloat16, torch.ones(2),
                                torch.tensor([1, 2]))]
    path = str(tmp_path / "p.safetensors")
    save_patches(path, ps)
    loaded = load_patches(path)
    assert print_patch_file_summary(path, max_chunk_bytes=200) == 0
    out = capsys.readouterr().out
    for kind, label in (("dense", "(dense patches; one load)"),
                        ("sparse", "(sparse patches; one load)")):
        group = [(i, p) for i, p in enumerate(loaded) if (p.indices is not None) == (
            kind == "sparse")]
        plan = plan_chunks([p for _, p in group], 200, positions=[i for i, _ in group])
        assert [c.bytes for c in plan] == [128, 128]  # 8 x 8 x 2 bytes a call
        section = out[out.index(label):].split("\n\n")[0].splitlines()
        rows = [line.split() for line in section[2:]]
        assert [r[:2] for r in rows] == [[str(c.index), str(c.positions[0])] for c in plan]
        assert [" ".join(r[2:4]) for r in rows] == [format_bytes(c.bytes) for c in plan]


def test_the_summary_notes_dense_writes_only_for_dense_patches_and_aligns_its_numbers(
        tmp_path, capsys):
    path = tmp_path / "s.safetensors"
    save_patches(path, [CheckpointWeightPatch("w", (4000,), torch.float32, torch.ones(1),
                                              torch.tensor([1])),
                        CheckpointWeightPatch("v", (4,), torch.float32, torch.ones(4),
                                              torch.arange(4))])
    assert print_patch_file_summary(path) == 0
    out = capsys.readouterr().out
    assert "a dense patch writes every one" not in out  # (no dense patch here)
    # the counts, densities and byte sizes are right-aligned: every row of the table,
    # whose last column is the wire bytes, ends in the same column
    lines = out.splitlines()
    start = next(k for k, line in enumerate(lines) if line.split()[:2] == ["#", "name"])
    table = lines[start:start + 4]  # the header, the two patches, the total
    assert table[-1].split()[0] == "total"
    assert len({len(line) for line in table}) == 1, table


def test_inspect_out_of_a_file_refused_for_its_dense_values_writes_nothing(tmp_path, capsys):
    # --out reads only the sparse patches for its figures: a file load_patches refuses
    # for a dense patch's values (int32 values that do not fit its int8) must stop at the
    # summary's check, with one error, not go on to draw the sparse patches
    good = _checkable_file(tmp_path, 4)
    bad = rewrite(good, str(tmp_path / "bad.safetensors"),
                  tensors=_corrupt("000001.values",
                                   torch.tensor([1, 2, 300, 4], dtype=torch.int32)))
    assert main(["inspect", bad, "--out", str(tmp_path / "figs")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("error: ") == 1
    assert "outside torch.int8's range" in captured.err
    assert not (tmp_path / "figs").exists()


def test_inspect_out_holds_one_sparse_patch_at_a_time(tmp_path, monkeypatch, capsys):
    # the figures of a file of sparse patches read them one at a time, as the check
    # does: a patch is dropped once its figure is written, so the memory is the largest
    # patch's, not the file's (all of them were read into a dict first)
    import weakref

    import patchkit.plot

    patches = [random_sparse_patch(f"w{k}", (32, 16), torch.float32, 0.1,
                               generator=torch.Generator().manual_seed(k))
               for k in range(4)]
    patches.insert(2, CheckpointWeightPatch("d", (3,), torch.float32, torch.ones(3), None))
    path = str(tmp_path / "p.safetensors")
    patchkit.save_patches(path, patches)
    del patches
    seen: list[tuple[str, weakref.ref, weakref.ref]] = []
    draw = patchkit.plot.plot_density

    def watched(patch, *args, **kwargs):
        alive = [name for name, v, i in seen if v() is not None or i() is not None]
        assert alive == [], f"{alive} still held while drawing {patch.name}"
        seen.append((patch.name, weakref.ref(patch.values), weakref.ref(patch.indices)))
        return draw(patch, *args, **kwargs)

    monkeypatch.setattr(patchkit.plot, "plot_density", watched)
    assert main(["inspect", path, "--out", str(tmp_path / "figs")]) == 0
    assert [name for name, _, _ in seen] == ["w0", "w1", "w2", "w3"]
    figures = sorted(p.name for p in (tmp_path / "figs").iterdir())
    assert figures == ["chunks_dense.png", "chunks_sparse.png", "density_0_w0.png",
                       "density_1_w1.png", "density_3_w2.png", "density_4_w3.png",
                       "index.html"]
    capsys.readouterr()


# --------------------------------------------------------------------------- mutation gaps (2)


def test_a_file_cut_short_while_it_is_read_says_how_many_bytes_are_missing(
        tmp_path, monkeypatch):
    # cut 1000 bytes into the second tensor's 262144: the read comes back short by 261144
    # (tensors larger than the file's read buffer, which may hold the start of the data)
    import patchkit.io as pk_io

    path = tmp_path / "p.safetensors"
    save_patches(path, [CheckpointWeightPatch(n, (65536,), torch.float32, torch.ones(65536))
                        for n in ("a", "b")])
    with open(path, "rb") as fh:
        start = 8 + int.from_bytes(fh.read(8), "little")
    real = pk_io._read_tensor
    reads = []

    def then_truncate(*args, **kwargs):
        out = real(*args, **kwargs)
        reads.append(1)
        if len(reads) == 1:
            os.truncate(path, start + 262144 + 1000)
        return out

    monkeypatch.setattr(pk_io, "_read_tensor", then_truncate)
    with pytest.raises(PatchValueError, match=r"the file ended 261144 bytes before the data"):
        load_patches(path)


def _refusing_safe_open(monkeypatch, message: str) -> None:
    import patchkit.io as pk_io

    class SafetensorError(Exception):
        pass

    def refuse(at, framework, device):
        raise SafetensorError(message)

    monkeypatch.setattr(pk_io, "_safetensors", lambda: (refuse, None, SafetensorError))


def test_a_long_safetensors_error_is_cut_to_300_characters(tmp_path, monkeypatch):
    good = sample_files(str(tmp_path))["path"]
    _refusing_safe_open(monkeypatch, "x" * 400)
    with pytest.raises(PatchValueError, match="not a readable safetensors file") as info:
        read_patch_index(good)
    assert str(info.value).endswith(": " + "x" * 300 + "...")
    _refusing_safe_open(monkeypatch, "y" * 300)  # (300 characters are kept whole)
    with pytest.raises(PatchValueError, match="not a readable safetensors file") as info:
        read_patch_index(good)
    assert str(info.value).endswith(": " + "y" * 300)


@pytest.mark.parametrize("code", [errno.EIO, errno.EACCES, errno.ENOMEM])
def test_each_system_error_opening_the_file_is_an_oserror_with_its_errno(
        tmp_path, monkeypatch, code):
    good = sample_files(str(tmp_path))["path"]
    _refusing_safe_open(monkeypatch, f"reading failed: {os.strerror(code)} (os error {code})")
    with pytest.raises(OSError) as info:
        load_patches(good)
    assert not isinstance(info.value, PatchValueError)
    assert info.value.errno == code and info.value.filename == good


def test_a_device_file_is_not_a_regular_file(tmp_path):
    # (a character device is opened and read as no safetensors file otherwise; a FIFO
    # would block the open)
    with pytest.raises(PatchValueError, match="not a regular file") as info:
        load_patches(os.devnull)
    assert info.value.reason == "not a file"


def test_checking_a_file_reads_no_dense_values_that_need_no_check(tmp_path, monkeypatch):
    # dense int8 patches: int8 values always fit and are not read; int16 values may not
    # fit and are
    import patchkit.io as pk_io

    path = str(tmp_path / "p.safetensors")
    save_patches(path, [
        CheckpointWeightPatch("fits", (3,), torch.int8, torch.tensor([1, 2, 3], dtype=torch.int8)),
        CheckpointWeightPatch("f", (2,), torch.float32, torch.ones(2)),
        CheckpointWeightPatch("wide", (2,), torch.int8, torch.tensor([1, 2], dtype=torch.int16)),
    ])
    real = pk_io._read_tensor
    read = []

    def counted(*args, **kwargs):
        out = real(*args, **kwargs)
        read.append(out.dtype)
        return out

    monkeypatch.setattr(pk_io, "_read_tensor", counted)
    assert [e.name for e in check_patch_file(path)] == ["fits", "f", "wide"]
    assert read == [torch.int16]


def test_a_file_name_of_exactly_the_longest_length_is_saved(tmp_path):
    most = os.pathconf(tmp_path, "PC_NAME_MAX")
    path = tmp_path / ("x" * (most - len(".safetensors")) + ".safetensors")
    ps = [CheckpointWeightPatch("w", (2,), torch.float32, torch.ones(2))]
    save_patches(path, ps)
    assert_same_patches(load_patches(path), ps)


def test_a_header_too_large_names_the_longest_patch_name(tmp_path, monkeypatch):
    import patchkit.io

    monkeypatch.setattr(patchkit.io, "_MAX_HEADER_BYTES", 10)
    ps = [CheckpointWeightPatch(n, (1,), torch.float32, torch.ones(1)) for n in ("a", "bbbb")]
    with pytest.raises(PatchValueError, match=r"with names of up to 4 characters"):
        save_patches(tmp_path / "p.safetensors", ps)


def test_saving_meta_indices_is_refused_naming_them(tmp_path):
    p = CheckpointWeightPatch("w", (4,), torch.float32, torch.ones(2),
                              torch.empty(2, dtype=torch.int64, device="meta"))
    with pytest.raises(PatchValueError, match=r"patch 0 \('w'\): indices are on the meta "
                                              r"device, which holds no data to save$") as info:
        save_patches(tmp_path / "p.safetensors", [p])
    assert info.value.reason == "meta device"
    assert os.listdir(tmp_path) == []


def test_a_failed_rename_keeps_the_type_of_its_oserror(tmp_path, monkeypatch):
    import patchkit.io as pk_io

    def refuse(src, dst):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), src)

    path = str(tmp_path / "p.safetensors")
    monkeypatch.setattr(pk_io.os, "replace", refuse)
    with pytest.raises(PermissionError) as info:
        save_patches(path, [CheckpointWeightPatch("w", (2,), torch.float32, torch.ones(2))])
    assert info.value.errno == errno.EACCES and info.value.filename == path
    assert "cannot put the written file in place" in str(info.value)
    assert os.listdir(tmp_path) == []


def test_overwriting_keeps_the_permission_bits_only(tmp_path):
    # the set-user-ID, set-group-ID and sticky bits are not carried to the new file (as
    # writing into a file drops them)
    path = tmp_path / "p.safetensors"
    ps = [CheckpointWeightPatch("w", (2,), torch.float32, torch.ones(2))]
    save_patches(path, ps)
    os.chmod(path, 0o4755)
    if stat.S_IMODE(os.stat(path).st_mode) != 0o4755:
        pytest.skip("this file system keeps no set-user-ID bit")
    save_patches(path, ps)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o755


def _plain_summary(path, **kwargs) -> str:
    import io

    buf = io.StringIO()
    assert print_patch_file_summary(str(path), file=buf, **kwargs) == 0
    return buf.getvalue()


def test_summary_writes_two_positions_in_a_row_as_a_range(tmp_path):
    g = torch.Generator().manual_seed(3)
    path = tmp_path / "p.safetensors"
    save_patches(path, [random_sparse_patch(n, (8, 8), torch.float32, 0.25, generator=g)
                        for n in ("a", "b")])
    plan = _plain_summary(path).split("chunk plan")[1].splitlines()
    assert plan[2].split()[:2] == ["0", "0-1"]


def test_summary_right_aligns_the_density_column(tmp_path):
    path, _ = _summary_file(tmp_path)
    lines = _plain_summary(path).splitlines()
    head = next(line for line in lines if line.split()[:2] == ["#", "name"])
    end = head.index("density") + len("density")
    row5 = next(line for line in lines if line.split()[:2] == ["5", "empty"])
    assert row5[end - 2:end] == " -"


def test_summary_of_one_kind_of_empty_patches(tmp_path):
    # dense only: one plan, not labelled as one of two loads; the note on what a dense
    # patch writes; no elements at all: the total's density is '-'
    path = tmp_path / "p.safetensors"
    save_patches(path, [CheckpointWeightPatch("e", (0, 3), torch.float32, torch.zeros(0))])
    out = _plain_summary(path)
    total = next(line for line in out.splitlines() if line.split()[:1] == ["total"])
    assert total.split()[1:3] == ["0", "-"]
    assert "a dense patch writes every one" in out
    assert "one load)" not in out
    assert "(1 B): 1 load_weights call\n" in _plain_summary(path, max_chunk_bytes=1)


def test_summary_of_no_patches_shows_the_metadata_and_checks_the_budget(tmp_path, capsys):
    path = tmp_path / "p.safetensors"
    save_patches(path, [], metadata={"run": "abc"})
    out = _plain_summary(path)
    assert "metadata:\n  run: abc\n" in out and "no patches" in out
    assert print_patch_file_summary(str(path), max_chunk_bytes=0) == 2
    out, err = capsys.readouterr()
    assert out == "" and "max_chunk_bytes" in err


def _reads_watched(monkeypatch, per_patch: int) -> list[str]:
    """Watch patchkit.io's tensor reads: the returned list gets a line for each read made
    while a tensor of an earlier patch (``per_patch`` reads each) was still alive."""
    import weakref

    import patchkit.io as pk_io

    real = pk_io._read_tensor
    seen: list[tuple[int, weakref.ref]] = []
    held: list[str] = []

    def watched(*args, **kwargs):
        k = len(seen) // per_patch  # the patch this read is for
        alive = [j for j, ref in seen if j < k and ref() is not None]
        if alive:
            held.append(f"patch {k} read while patches {sorted(set(alive))} were alive")
        t = real(*args, **kwargs)
        seen.append((k, weakref.ref(t)))
        return t

    monkeypatch.setattr(pk_io, "_read_tensor", watched)
    return held


def test_checking_a_file_reads_each_patch_after_dropping_the_one_before(tmp_path, monkeypatch):
    # check_patch_file holds no more than one patch: the one it read last is dropped
    # before the next is read, not once the next is read (which held two at the peak:
    # the generator's locals and the loop's variable kept the last one while reading)
    path = str(tmp_path / "p.safetensors")
    save_patches(path, [random_sparse_patch(f"w{k}", (32, 16), torch.float32, 0.1,
                                            generator=torch.Generator().manual_seed(k))
                        for k in range(4)])
    held = _reads_watched(monkeypatch, per_patch=2)
    assert len(check_patch_file(path)) == 4
    assert held == []


def test_inspect_out_reads_each_sparse_patch_after_dropping_the_one_before(
        tmp_path, monkeypatch, capsys):
    path = str(tmp_path / "p.safetensors")
    save_patches(path, [random_sparse_patch(f"w{k}", (32, 16), torch.float32, 0.1,
                                            generator=torch.Generator().manual_seed(k))
                        for k in range(3)])
    held = _reads_watched(monkeypatch, per_patch=2)
    # (the check reads the three patches, then the figures read them again)
    assert main(["inspect", path, "--out", str(tmp_path / "figs")]) == 0
    capsys.readouterr()
    assert held == []


@pytest.mark.parametrize("metadata", [[], "", (), 0])
def test_empty_metadata_that_is_no_dict_is_refused_too(tmp_path, metadata):
    p = [CheckpointWeightPatch("w", (1,), torch.float32, torch.zeros(1))]
    with pytest.raises(PatchTypeError, match="metadata must be a dict"):
        save_patches(tmp_path / "a", p, metadata=metadata)
    assert os.listdir(tmp_path) == []


def test_a_temporary_name_taken_already_is_passed_over(tmp_path, monkeypatch):
    # (the random names collide: the save takes the next one, and leaves the other file)
    import patchkit.io as pk_io

    taken = tmp_path / ".patchkit-000000000000.tmp"
    taken.write_bytes(b"someone else's")
    draws = iter([b"\0" * 6, b"\0" * 6, b"\1" * 6])
    monkeypatch.setattr(pk_io.os, "urandom", lambda n: next(draws))
    ps = [CheckpointWeightPatch("w", (2,), torch.float32, torch.ones(2))]
    save_patches(tmp_path / "p.safetensors", ps)
    monkeypatch.undo()
    assert_same_patches(load_patches(tmp_path / "p.safetensors"), ps)
    assert taken.read_bytes() == b"someone else's"
    assert sorted(os.listdir(tmp_path)) == [taken.name, "p.safetensors"]


@pytest.mark.parametrize("said", ["int64", "int32", 16, "", 0, False])
def test_a_dense_patch_whose_header_names_an_indices_dtype_is_refused(tmp_path, said):
    # a dense patch has no indices: its header entry's indices_dtype is null
    good = sample_files(str(tmp_path))["path"]
    bad = rewrite(good, str(tmp_path / "bad.safetensors"), header=_set(1, indices_dtype=said))
    for reader in (read_patch_index, load_patches, check_patch_file):
        with pytest.raises(PatchValueError, match=r"patch 1 \('d'\): a dense patch has no "
                                                  r"indices, but the header gives them dtype "
                                                  + re.escape(repr(said))) as info:
            reader(bad)
        assert (info.value.position, info.value.reason, info.value.value) == (1, "dtype", said)


@pytest.mark.parametrize("as_bytes", [False, True])
def test_a_path_holding_a_nul_is_refused_by_name_before_anything_is_written(tmp_path,
                                                                            as_bytes):
    # (was a bare "ValueError: embedded null byte" from os.stat, naming no file)
    p = [CheckpointWeightPatch("w", (1,), torch.float32, torch.ones(1))]
    path = str(tmp_path / "a\0b.safetensors")
    with pytest.raises(PatchValueError, match="NUL") as info:
        save_patches(os.fsencode(path) if as_bytes else path, p)
    e = info.value
    assert repr(path) in str(e) and "cannot save patches" in str(e)
    assert (e.reason, e.value) == ("bad path", path)
    assert os.listdir(tmp_path) == []


def test_running_out_of_host_memory_on_windows_is_no_bad_file_either(tmp_path, monkeypatch):
    # (torch's CPU allocator on Windows says "not enough memory", not "can't allocate
    # memory": the good file was blamed, a PatchValueError "unreadable: ...")
    good = sample_files(str(tmp_path))["path"]
    e = _loading_out_of_memory(monkeypatch, good, RuntimeError(
        "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory: "
        "you tried to allocate 268435456 bytes."), "not enough memory")
    assert any(good in note for note in e.__notes__)


def test_patches_sharing_memory_save_through_safetensors_own_writer_too(tmp_path, monkeypatch):
    # (a big-endian machine writes through safetensors' save_file, which refuses tensors
    # that share memory: the save gives each its own copy first; bytes only, which need
    # no swapping, as save_file swaps wider elements when told the machine is big-endian)
    monkeypatch.setattr(sys, "byteorder", "big")
    base = torch.arange(6, dtype=torch.int8)
    ps = [
        CheckpointWeightPatch("a", (6,), torch.int8, base),
        CheckpointWeightPatch("b", (2, 3), torch.int8, base),  # the same tensor
        CheckpointWeightPatch("c", (3,), torch.int8, base[:3]),  # a view of it
        CheckpointWeightPatch("d", (2,), torch.uint8, base[4:].view(torch.uint8)),
    ]
    path = tmp_path / "p.safetensors"
    save_patches(path, ps)
    assert_same_patches(load_patches(path), ps)
    assert torch.equal(base, torch.arange(6, dtype=torch.int8))  # the caller's, untouched


@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit])
def test_a_save_interrupted_by_an_exception_that_is_no_error_leaves_no_temporary(
        tmp_path, monkeypatch, stop):
    # (Ctrl-C, or SIGTERM turned into SystemExit, while the file is written: the old file
    # stays and the temporary is removed, as for any failed save)
    path, old, new = _a_save_that_fails_after_writing(
        tmp_path, monkeypatch, lambda filename: stop())
    with pytest.raises(stop):
        save_patches(path, new)
    assert path.read_bytes() == old and os.listdir(tmp_path) == ["p.safetensors"]
