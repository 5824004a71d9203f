"""One wording per problem: errors that mean the same thing in different modules carry
the same ``reason`` (and messages the same phrase), so a caller matching reasons, or a
user grepping a log, finds every case by one word. Each test here failed before its fix."""

from __future__ import annotations

import pytest
import torch

import patchkit
from patchkit import CheckpointWeightPatch as CWP
from patchkit import density_map
from patchkit.build import changed_fraction, sparse_patches_from_diff
from patchkit.errors import PatchValueError
from patchkit.io import load_patches, read_patch_index, save_patches
from patchkit.toymodels import PlainModel


def test_a_number_outside_what_it_may_be_is_out_of_range_for_indices_and_integer_values():
    # (an integer value outside its dtype was reason "out of range", an index outside its
    # tensor "out-of-range")
    m = PlainModel({"w": (4,)})
    with pytest.raises(PatchValueError) as index:
        patchkit.load_checkpoint_weight_patches(
            m, [CWP("w", (4,), torch.float32, torch.ones(1), torch.tensor([9]))])
    m = PlainModel({"i": (2,)}, dtype=torch.uint8)
    with pytest.raises(PatchValueError) as value:
        patchkit.load_checkpoint_weight_patches(
            m, [CWP("i", (2,), torch.uint8, torch.tensor([7, 300]))])
    assert (index.value.reason, index.value.value) == ("out-of-range", 9)
    assert (value.value.reason, value.value.value) == ("out-of-range", 300)
    assert str(value.value).startswith("patch 0 ('i'): value 300 at values[1] ")


def test_a_tensor_on_the_meta_device_is_reason_meta_device_and_said_so_everywhere(tmp_path):
    # (the builders said "meta tensor", density_map "meta indices", a device argument
    # "meta tensors hold no data"; the loader and patch files "meta device")
    meta = torch.empty(4, device="meta")
    sparse = CWP("w", (4,), torch.float32, torch.ones(2, device="meta"),
                 torch.tensor([0, 1], device="meta"))
    dense = CWP("w", (4,), torch.float32, torch.ones(4, device="meta"))
    raisers = [
        lambda: sparse_patches_from_diff({"w": meta}, {"w": meta}),
        lambda: changed_fraction({"w": meta}, {"w": meta}),
        lambda: density_map(sparse),
        lambda: load_patches(str(tmp_path / "x.safetensors"), device="meta"),
        lambda: save_patches(str(tmp_path / "y.safetensors"), [dense]),
        lambda: patchkit.load_checkpoint_weight_patches(PlainModel({"w": (4,)}), [dense]),
    ]
    for raise_it in raisers:
        with pytest.raises(PatchValueError) as info:
            raise_it()
        assert info.value.reason == "meta device", str(info.value)
        assert "the meta device" in str(info.value)


@pytest.mark.parametrize("fn", [sparse_patches_from_diff, changed_fraction])
def test_both_diff_builders_refuse_a_changed_shape_or_dtype_in_the_same_words(fn):
    # (changed_fraction said "'w': before is (2, 3) torch.float32, after is ...", reason
    # "shape or dtype differs", where sparse_patches_from_diff says which of the two)
    with pytest.raises(PatchValueError) as info:
        fn({"w": torch.zeros(2, 3)}, {"w": torch.zeros(3, 2)})
    e = info.value
    assert str(e) == "weight 'w' changed shape: before (2, 3), after (3, 2)"
    assert (e.name, e.reason, e.value) == ("w", "shape differs", ((2, 3), (3, 2)))
    with pytest.raises(PatchValueError) as info:
        fn({"w": torch.zeros(4)}, {"w": torch.zeros(4, dtype=torch.float64)})
    e = info.value
    assert str(e) == "weight 'w' changed dtype: before torch.float32, after torch.float64"
    assert (e.name, e.reason, e.value) == ("w", "dtype differs", (torch.float32, torch.float64))


@pytest.mark.parametrize("read", [load_patches, read_patch_index])
def test_reading_a_path_holding_a_nul_says_what_saving_to_it_says(tmp_path, read):
    # (a reader said "cannot be opened: embedded null byte", os's words, reason
    # "unreadable"; save_patches "the path holds a NUL character", reason "bad path")
    path = str(tmp_path / "a\0b.safetensors")
    with pytest.raises(PatchValueError) as saved:
        save_patches(path, [CWP("w", (1,), torch.float32, torch.ones(1))])
    with pytest.raises(PatchValueError) as info:
        read(path)
    e = info.value
    assert str(e) == f"patch file {path!r}: the path holds a NUL character, which no " \
        "file's path can hold"
    assert str(saved.value).endswith(str(e).split(": ", 1)[1])
    assert (e.reason, e.value) == (saved.value.reason, path) == ("bad path", path)


@pytest.mark.parametrize("read", [load_patches, read_patch_index])
def test_reading_a_path_no_file_name_can_encode_says_what_saving_to_it_says(tmp_path, read):
    # (os.stat's ValueError is also a lone surrogate's UnicodeEncodeError: the readers
    # said such a path "holds a NUL character", which it does not; then "cannot be
    # opened", reason "unreadable", where save_patches says "bad path")
    path = str(tmp_path / "a\ud800b.safetensors")
    with pytest.raises(PatchValueError) as saved:
        save_patches(path, [])
    with pytest.raises(PatchValueError) as info:
        read(path)
    e = info.value
    assert "NUL" not in str(e)
    assert str(e).startswith(f"patch file {path!r}: the path cannot be written as a file "
                             "name (")
    assert "surrogates not allowed" in str(e)
    assert str(saved.value).endswith(str(e).split(": ", 1)[1])
    assert (e.reason, e.value) == (saved.value.reason, path) == ("bad path", path)


@pytest.mark.parametrize("fn", ["save", "load", "index"])
def test_a_huge_path_no_file_name_can_encode_is_cut_in_the_message_and_whole_on_the_error(
        fn):
    # (the readers printed such a path whole, and mutation testing: save_patches' cut
    # of it reverted to the path's whole repr passed every test)
    path = "\ud800" + "p" * 10**6
    run = {"save": lambda: save_patches(path, []), "load": lambda: load_patches(path),
           "index": lambda: read_patch_index(path)}[fn]
    with pytest.raises(PatchValueError) as info:
        run()
    assert f"'\\ud800{'p' * 193}...: the path cannot be written as a file name (" in _bounded(
        info.value)
    assert (info.value.reason, info.value.value) == ("bad path", path)


def test_saving_to_a_path_no_file_name_can_encode_is_a_bad_path_naming_it(tmp_path):
    # (os.stat raised the lone surrogate's UnicodeEncodeError bare, naming no path; the
    # readers already named it in a PatchValueError)
    path = str(tmp_path / "a\ud800b.safetensors")
    with pytest.raises(PatchValueError) as info:
        save_patches(path, [])
    e = info.value
    assert str(e).startswith(f"cannot save patches to {path!r}: the path cannot be written "
                             "as a file name (")
    assert "surrogates not allowed" in str(e)
    assert (e.reason, e.value) == ("bad path", path)
    assert list(tmp_path.iterdir()) == []


# -- names: whole up to 200 characters of repr, cut past that --------------------------------

BIG = "w" * 10**6  # (a file's text passed as a name, say)


def _bounded(e: BaseException) -> str:
    text = str(e)
    assert len(text) < 2000, len(text)  # (was over a megabyte: the name whole)
    return text


def test_where_shows_a_name_whole_up_to_200_characters_of_repr_and_cuts_a_longer_one():
    from patchkit.errors import where

    fits, over = "n" * 198, "n" * 199  # (reprs of 200 and 201 characters)
    assert where(3, fits) == f"patch 3 ('{fits}')"
    assert where(None, "model.norm.weight") == "patch 'model.norm.weight'"
    assert where(3, over) == f"patch 3 ('{over[:199]}...)"
    assert where(3, BIG) == f"patch 3 ('{BIG[:199]}...)"


def test_a_huge_patch_name_is_cut_in_a_loads_message_and_whole_on_the_error():
    m = PlainModel({"w": (4,)})
    for p in (CWP(BIG, (4,), torch.float32, torch.ones(3)),
              CWP(BIG, (4,), torch.float32, torch.ones(1), torch.tensor([9]))):
        with pytest.raises(PatchValueError) as info:
            patchkit.load_checkpoint_weight_patches(m, [p])
        assert _bounded(info.value).startswith(f"patch 0 ('{BIG[:199]}...): ")
        assert (info.value.position, info.value.name) == (0, BIG)


def test_the_diff_builders_cut_a_huge_weight_name():
    z = torch.zeros(2)
    with pytest.raises(PatchValueError) as info:
        sparse_patches_from_diff({BIG: z}, {BIG: torch.zeros(3)})
    assert _bounded(info.value).startswith(f"weight '{BIG[:199]}... changed shape")
    assert info.value.name == BIG
    with pytest.raises(PatchValueError) as info:
        changed_fraction({BIG: z, "a": z}, {"w": z, "a": z})
    assert _bounded(info.value) == (
        f"before and after name different weights: only in before: ['{BIG[:199]}...]; "
        "only in after: ['w']")
    assert info.value.value == ([BIG], ["w"])


def test_a_report_asked_for_a_huge_name_cuts_it():
    report = patchkit.inspect_load(PlainModel({"w": (4,)}),
                                   [CWP("w", (4,), torch.float32, torch.ones(4))])
    with pytest.raises(KeyError) as info:
        report.before(BIG)
    assert _bounded(info.value).startswith(f"'{BIG[:199]}... is not a runtime tensor")
    with pytest.raises(KeyError) as info:
        report.plot_density(BIG)
    assert _bounded(info.value).startswith(f"no patch named '{BIG[:199]}... in this report")


def test_a_report_cuts_the_huge_names_it_lists_as_known():
    # (the names a report lists after "some are:" or "its writes went to" were shown
    # whole, by repr, for an unknown runtime name: a megabyte name, a megabyte message;
    # and mutation testing: the patch names listed for an unknown patch shown by repr
    # passed every test)
    report = patchkit.inspect_load(PlainModel({BIG: (4,)}),
                                   [CWP(BIG, (4,), torch.float32, torch.ones(4))])
    cut = f"'{BIG[:199]}..."
    with pytest.raises(KeyError) as info:
        report.plot_density("x")
    assert _bounded(info.value).endswith(f" (some are: {cut})")
    with pytest.raises(KeyError) as info:
        report.before("x")
    assert _bounded(info.value).endswith(f" (some are: {cut})")

    class Renames(torch.nn.Module):  # (patch 'a' loads into the runtime tensor BIG)
        def __init__(self):
            super().__init__()
            self.register_parameter(BIG, torch.nn.Parameter(torch.zeros(4),
                                                             requires_grad=False))

        def load_weights(self, weights):
            for _, t in weights:
                getattr(self, BIG).data.copy_(t)
            return {BIG}

    report = patchkit.inspect_load(Renames(), [CWP("a", (4,), torch.float32, torch.ones(4))])
    with pytest.raises(KeyError) as info:
        report.before("a")
    assert f"its writes went to the runtime tensor {cut} (report.writes" in _bounded(
        info.value)


def _returning(names: set[str]) -> patchkit.ContractViolation:
    """The error of a sparse load into a model whose loader reads its weights, copies
    nothing and returns ``names``."""
    class Quiet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(4), requires_grad=False)

        def load_weights(self, weights):
            list(weights)
            return names  # (and copies nothing)

    with pytest.raises(patchkit.ContractViolation) as info:
        patchkit.load_checkpoint_weight_patches(
            Quiet(), [CWP("w", (4,), torch.float32, torch.ones(1), torch.tensor([1]))])
    return info.value


def test_a_huge_name_a_loader_returns_is_cut():
    assert f"returned ['{BIG[:199]}...] without copying" in _bounded(_returning({BIG}))


@pytest.mark.parametrize(("names", "said"), [
    ("abcde", "['a', 'b', 'c', 'd', 'e']"), ("abcdef", "6 names, ['a', 'b', 'c', 'd', 'e', ...]")])
def test_the_names_a_loader_returns_are_listed_whole_up_to_five(names, said):
    # (mutation testing: five names said as "5 names, [..., ...]" passed every test)
    assert f"returned {said} without copying" in str(_returning(set(names)))


# -- toy models: user values cut with errors.brief, names with errors.quoted ------------------

HUGE_INT = 10**5000  # (more digits than Python prints: str() of it raises ValueError)


def _toy_cases():
    from patchkit.toymodels import (
        FailingModel,
        TinyLlamaConfig,
        TinyLlamaRuntime,
        WritesThenFillsModel,
        gather_checkpoint,
        tiny_llama_checkpoint,
    )

    rt = TinyLlamaRuntime(TinyLlamaConfig(), dtype=torch.float32)
    qkv = rt.get_parameter("model.layers.0.self_attn.qkv_proj.weight")
    q = torch.zeros(TinyLlamaConfig().hidden_size, TinyLlamaConfig().hidden_size)
    return {
        "unknown weight": lambda: PlainModel({"w": (4,)}).load_weights([(BIG, torch.zeros(4))]),
        "weight no tensor": lambda: PlainModel({BIG: (4,)}).load_weights([(BIG, [0.0])]),
        "empty part": lambda: PlainModel({BIG + ".": (4,)}),
        "name no str": lambda: PlainModel({("x",) * 10**5: (4,)}),
        "fill type": lambda: PlainModel({"w": (4,)}, fill=[0.0] * 10**5),
        "fill value": lambda: PlainModel({"w": (4,)}, dtype=torch.int8, fill=HUGE_INT),
        "dtype": lambda: PlainModel({"w": (4,)}, dtype=[torch.float32] * 10**5),
        "fail_on": lambda: FailingModel({"w": (4,)}, fail_on=BIG),
        "seed type": lambda: tiny_llama_checkpoint(seed=str(BIG)),
        "seed range": lambda: tiny_llama_checkpoint(seed=HUGE_INT),
        "config field": lambda: TinyLlamaConfig(num_heads=[1] * 10**5),
        "config divide": lambda: TinyLlamaConfig(num_heads=HUGE_INT),
        "tp_size type": lambda: TinyLlamaRuntime(tp_size=[1] * 10**5),
        "tp_size divide": lambda: TinyLlamaRuntime(tp_size=HUGE_INT),
        "tp_rank": lambda: TinyLlamaRuntime(tp_rank=HUGE_INT),
        "shard_id": lambda: qkv.weight_loader(qkv, q, BIG),
        "pad_rows": lambda: WritesThenFillsModel({"w": (4,)}, pad_rows=-HUGE_INT),
        "loaded before": lambda: FailingModel({BIG: (4,), "w": (4,)}, fail_on="w").load_weights(
            [(BIG, torch.zeros(4)), ("w", torch.zeros(4))]),
        "gather config": lambda: gather_checkpoint(_ranks_of_configs(
            TinyLlamaConfig(), TinyLlamaConfig(vocab_size=10**400))),
    }


def _ranks_of_configs(first, second):
    """Two ranks of a tp_size=2 runtime, the second's config replaced by ``second``."""
    from patchkit.toymodels import TinyLlamaRuntime

    rts = [TinyLlamaRuntime(first, tp_size=2, tp_rank=r, dtype=torch.float32) for r in (0, 1)]
    rts[1].config = second
    return rts


TOY_CASES = ["unknown weight", "weight no tensor", "empty part", "name no str", "fill type",
             "fill value", "dtype", "fail_on", "seed type", "seed range", "config field",
             "config divide", "tp_size type", "tp_size divide", "tp_rank", "shard_id",
             "pad_rows", "loaded before", "gather config"]


def test_every_toy_case_is_run():
    assert sorted(_toy_cases()) == sorted(TOY_CASES)


@pytest.mark.parametrize("case", TOY_CASES)
def test_toy_models_cut_the_values_and_names_their_errors_show(case):
    # (each printed the value whole: a megabyte name or list made a megabyte message, and
    # an int of 5000 digits made Python's own "Exceeds the limit (4300 digits)" ValueError
    # escape in place of the toy's message)
    with pytest.raises((TypeError, ValueError, KeyError, RuntimeError)) as info:
        _toy_cases()[case]()
    text = _bounded(info.value)
    assert "Exceeds the limit" not in text
    assert "..." in text or "-bit int>" in text, text


# -- a path holding a NUL: cut as a value is ----------------------------------------------


@pytest.mark.parametrize("fn", ["save", "load", "index"])
def test_a_huge_path_holding_a_nul_is_cut_in_the_message_and_whole_on_the_error(tmp_path, fn):
    # (save_patches and the readers printed such a path whole: a megabyte of text passed
    # as a path made a megabyte message)
    path = "\0" + "p" * 10**6
    run = {"save": lambda: save_patches(path, [CWP("w", (1,), torch.float32, torch.ones(1))]),
           "load": lambda: load_patches(path), "index": lambda: read_patch_index(path)}[fn]
    with pytest.raises(PatchValueError) as info:
        run()
    text = _bounded(info.value)
    assert f"'\\x00{'p' * 195}...: the path holds a NUL character" in text
    assert (info.value.reason, info.value.value) == ("bad path", path)


class _ZeroesTheLast(PlainModel):
    """Copies each patch, then zeroes the last tensor in place: an op no patch fed."""

    def load_weights(self, weights):
        weights = list(weights)
        loaded = super().load_weights(weights)
        self._param(weights[-1][0]).data.zero_()
        return loaded


def test_a_call_of_many_patches_is_named_by_its_first_five_and_a_count_in_every_message():
    # (a refused op that no patch fed listed the first four "and N more", a loader's own
    # error's note the first three "and N more", a bad return value the first three ", N
    # more", other refusals the first five ", and N more")
    names = [f"w{i}" for i in range(7)]
    five = ", ".join(f"patch {i} ('w{i}')" for i in range(5)) + ", and 2 more"
    m = _ZeroesTheLast({n: (4,) for n in names})
    sparse = [CWP(n, (4,), torch.float32, torch.ones(1), torch.tensor([0])) for n in names]
    with pytest.raises(NotImplementedError) as refused:
        patchkit.load_checkpoint_weight_patches(m, sparse)
    assert f"the call's 7 patches ({five}) it served is not known" in str(refused.value)

    class Returns7(PlainModel):
        def load_weights(self, weights):
            super().load_weights(weights)
            return 7

    dense = [CWP(n, (4,), torch.float32, torch.ones(4)) for n in names]
    with pytest.raises(patchkit.ContractViolation) as returned:
        patchkit.load_checkpoint_weight_patches(Returns7({n: (4,) for n in names}), dense)
    assert str(returned.value).startswith(f"load_weights (call 0, {five}) returned 7")

    class Raises(PlainModel):
        def load_weights(self, weights):
            raise KeyError("x")

    with pytest.raises(KeyError) as raised:
        patchkit.load_checkpoint_weight_patches(Raises({n: (4,) for n in names}), dense)
    assert raised.value.__notes__ == [f"(raised in load_weights call 0, sent {five})"]


class _CopiesThenFills(PlainModel):
    """Copies the first half of each tensor, then fills the rest: an op no patch fed."""

    def load_one(self, name, param, w):
        param.data[:2].copy_(w[:2])
        param.data[2:].fill_(0.0)


def test_a_refused_ops_message_cuts_a_huge_runtime_tensor_name():
    # (the runtime tensor's name was shown whole, by repr: a megabyte name made a megabyte
    # message, where every patch name in it is cut)
    long = "w" * 100_000
    m = _CopiesThenFills({long: (4,), "b": (4,)})
    patches = [CWP(n, (4,), torch.float32, torch.ones(1), torch.tensor([0])) for n in (long, "b")]
    with pytest.raises(NotImplementedError, match="fill_") as refused:
        patchkit.load_checkpoint_weight_patches(m, patches)
    text = str(refused.value)
    assert len(text) < 3000
    assert text.count(f"runtime tensor {patchkit.errors.quoted(long)}") == 2  # (and the note)
    assert refused.value.value == "aten::fill_.Scalar"


@pytest.mark.parametrize("read", [load_patches, read_patch_index])
def test_a_megabyte_path_is_cut_in_a_reading_error_and_any_real_path_is_shown_whole(
    read, tmp_path
):
    # (a path no system could open, a megabyte of text passed as a path, made a megabyte
    # message; the NUL and lone-surrogate paths were cut already)
    huge = str(tmp_path / ("a" * 1_000_000))
    with pytest.raises(PatchValueError) as cut:
        read(huge)
    assert len(str(cut.value)) < 4096 + 200 and cut.value.value == huge
    assert str(cut.value).startswith(f"patch file {repr(huge)[:4098]}...: ")
    # (the longest path Linux opens, 4095 bytes, is shown whole)
    real = str(tmp_path / "b") + "/" * (4095 - len(str(tmp_path / "b")))
    with pytest.raises(PatchValueError) as whole:
        read(real)
    assert str(whole.value).startswith(f"patch file {real!r}: ")
