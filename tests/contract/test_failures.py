"""CONTRACT §5: a loader that raises part-way.

By default the writes made so far stay (earlier calls and the earlier part of the failing
call) and the exception propagates unchanged. **[patchkit]** ``transactional=True``
restores every written region bit for bit before the exception propagates.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import patchkit
from patchkit.intercept import WriteSession

from ._models import NAN, RecordingModel, assert_untouched, same_bits, snapshot

NAMES = "abcd"


class Boom(Exception):
    pass


def weird_start(k: int) -> torch.Tensor:
    """Starting values with bits a careless restore would lose: -0.0, NaN, a subnormal."""
    return torch.tensor([k + 0.5, -0.0, NAN, 1e-42, -float(k)])


def failing_model(fail_at: tuple[int, str], error: BaseException, **kwargs) -> RecordingModel:
    """Raises ``error`` when call ``fail_at[0]`` reaches the entry named ``fail_at[1]``."""

    def hook(model, call, name, staged):
        if (call, name) == fail_at:
            raise error

    return RecordingModel({n: weird_start(k) for k, n in enumerate(NAMES)}, hook=hook, **kwargs)


def patches_for(mk, kind: str, names=NAMES):
    out = []
    for k, n in enumerate(names):
        if kind == "dense":
            out.append(mk.dense(n, torch.full((5,), 10.0 + k)))
        else:
            out.append(mk.sparse(n, (5,), [0, 3], [10.0 + k, 20.0 + k]))
    return out


def expected_written(kind: str, k: int) -> torch.Tensor:
    if kind == "dense":
        return torch.full((5,), 10.0 + k)
    t = weird_start(k)
    t[[0, 3]] = torch.tensor([10.0 + k, 20.0 + k])
    return t


# Where the failure happens: (budget, (call, name) that raises, names written before it).
WHERE = [
    pytest.param(1 << 20, (0, "c"), "ab", id="mid-chunk"),
    pytest.param(1 << 20, (0, "a"), "", id="first entry"),
    pytest.param(20, (2, "c"), "ab", id="later chunk"),
    pytest.param(40, (1, "d"), "abc", id="mid later chunk"),
]


@pytest.mark.parametrize("kind", ["dense", "sparse"])
@pytest.mark.parametrize(("budget", "fail_at", "written"), WHERE)
def test_failure_keeps_earlier_writes_and_propagates_unchanged(
    load, mk, kind, budget, fail_at, written
):
    error = Boom("loader bug")
    m = failing_model(fail_at, error)
    with pytest.raises(Boom) as excinfo:
        load(m, patches_for(mk, kind), max_chunk_bytes=budget)
    assert excinfo.value is error
    assert type(excinfo.value) is Boom
    for k, n in enumerate(NAMES):
        want = expected_written(kind, k) if n in written else weird_start(k)
        assert same_bits(getattr(m, n).detach(), want), n


def test_failure_propagates_builtin_exceptions_unwrapped(load, mk):
    error = KeyError("qkv_proj")
    m = failing_model((0, "b"), error)
    with pytest.raises(KeyError) as excinfo:
        load(m, patches_for(mk, "sparse"))
    assert excinfo.value is error and excinfo.value.__cause__ is None


@pytest.mark.patchkit_only
@pytest.mark.parametrize("kind", ["dense", "sparse"])
@pytest.mark.parametrize(("budget", "fail_at", "written"), WHERE)
def test_transactional_failure_restores_everything_bit_for_bit(
    load, mk, kind, budget, fail_at, written
):
    error = Boom("loader bug")
    m = failing_model(fail_at, error)
    before = snapshot(m)
    with pytest.raises(Boom) as excinfo:
        load(m, patches_for(mk, kind), max_chunk_bytes=budget, transactional=True)
    assert excinfo.value is error
    assert_untouched(m, before)


@pytest.mark.patchkit_only
@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_transactional_restores_a_region_written_twice_before_the_failure(load, mk, kind):
    m = failing_model((1, "b"), Boom())
    before = snapshot(m)
    if kind == "dense":
        patches = [mk.dense("a", torch.full((5,), 1.0)), mk.dense("a", torch.full((5,), 2.0))]
    else:
        patches = [
            mk.sparse("a", (5,), [0, 1], [1.0, 1.0]),
            mk.sparse("a", (5,), [1, 2], [2.0, 2.0]),
        ]
    patches.append(patches_for(mk, kind, "b")[0])
    with pytest.raises(Boom):
        load(m, patches, transactional=True)
    assert m.names_per_call() == [["a"], ["a", "b"]]
    assert_untouched(m, before)


@pytest.mark.patchkit_only
def test_transactional_restores_overlapping_regions_written_in_any_order(load, mk):
    # Rows 0:2, then all of w, then rows 1:3: three different, overlapping regions.
    class Regions(RecordingModel):
        def load_weights(self, weights):
            super().load_weights([])
            for name, w in weights:
                if name == "top":
                    self.w.data[0:2].copy_(w[0:2])
                elif name == "all":
                    self.w.copy_(w)
                elif name == "bottom":
                    self.w.data[1:3].copy_(w[1:3])
                else:
                    raise Boom()
            return {"w"}

    start = torch.tensor([[NAN, -0.0], [1e-42, 4.0], [5.0, -6.0]])
    for kind in ("dense", "sparse"):
        m = Regions({"w": start})
        before = snapshot(m)
        if kind == "dense":
            patches = [mk.dense(n, torch.full((3, 2), float(k))) for k, n in
                       enumerate(["top", "all", "bottom", "fail"])]
        else:
            patches = [mk.sparse(n, (3, 2), [k, 5 - k], [7.0, 8.0]) for k, n in
                       enumerate(["top", "all", "bottom", "fail"])]
        with pytest.raises(Boom):
            load(m, patches, max_chunk_bytes=24, transactional=True)
        assert len(m.calls) == 4
        assert_untouched(m, before)


@pytest.mark.patchkit_only
@pytest.mark.parametrize(
    ("violation", "match"),
    [
        pytest.param(lambda m, w: m.c.fill_(0.0), "fill_", id="fill_"),
        pytest.param(lambda m, w: m.c.copy_(w[0]), "same-shaped", id="broadcast"),
        pytest.param(lambda m, w: m.a.copy_(w), "overlapping", id="overlap"),
    ],
)
def test_transactional_restores_after_a_contract_violation_mid_call(load, mk, violation, match):
    class Violating(RecordingModel):
        def load_weights(self, weights):
            super().load_weights([])
            for name, w in weights:
                if name == "c":
                    violation(self, w)
                getattr(self, name).copy_(w)
            return {n for n, _ in weights}

    m = Violating({n: weird_start(k) for k, n in enumerate(NAMES)})
    before = snapshot(m)
    with pytest.raises(NotImplementedError, match=match) as excinfo:
        load(m, patches_for(mk, "sparse"), transactional=True)
    assert isinstance(excinfo.value, patchkit.ContractViolation)
    assert_untouched(m, before)


# A loader may change a runtime tensor's own view in place (its shape, strides or offset),
# which moves no element but changes what the tensor holds; a rollback puts the view
# back, and writes each saved region back through the view it was saved from.
VIEW_CHANGES = [
    (lambda m, w: m.b.unsqueeze_(0), ("dense", "sparse"), "unsqueeze_"),
    (lambda m, w: m.w.t_(), ("dense", "sparse"), "t_ of the parameter"),
    (lambda m, w: (m.b.as_strided_((2,), (2,), 1), m.b.copy_(w[0, :2])),
     ("dense", "sparse"), "as_strided_, then a copy through it"),
    # (a sparse load refuses these writes before they run)
    (lambda m, w: (m.b.copy_(w[0]), m.b.resize_(64)), ("dense",), "a copy, then resize_ (grown)"),
    (lambda m, w: m.b.resize_(2), ("dense",), "resize_ (shrunk)"),
    (lambda m, w: m.w.data[1:].resize_(2, 2), ("dense",), "resize_ of a view"),
    (lambda m, w: torch.mul(w, 2.0, out=m.b), ("dense",), "an out= op that resizes"),
    # (copy_ returns the .data alias it wrote through, then bound to other memory)
    (lambda m, w: m.b.data.copy_(w[0]).set_(torch.zeros(4)), ("dense",),
     "a copy through an alias, then set_ of the alias"),
]


@pytest.mark.patchkit_only
@pytest.mark.filterwarnings("ignore:An output with one or more elements was resized")
@pytest.mark.parametrize(("kind", "change"), [
    pytest.param(kind, change, id=f"{kind}-{what}")
    for change, kinds, what in VIEW_CHANGES for kind in kinds
])
def test_transactional_restores_a_runtime_tensor_whose_view_the_loader_changed(
    load, mk, kind, change
):
    class ChangesAView(RecordingModel):
        def load_weights(self, weights):
            for _, w in weights:
                self.w.copy_(w)
                change(self, w)
            raise Boom()

    m = ChangesAView({"w": torch.tensor([[0.5, -0.0, NAN, 1e-42]] * 3),
                      "b": torch.tensor([1.5, -2.0, 3.0, NAN])}, buffers=["b"])
    before = snapshot(m)
    views = lambda: {n: (t.shape, t.stride(), t.storage_offset())  # noqa: E731
                     for n, t in (("w", m.w), ("b", m.b))}
    views_before = views()
    patch = (mk.dense("w", torch.full((3, 4), 7.0)) if kind == "dense"
             else mk.sparse("w", (3, 4), [0, 5, 11], [7.0, 8.0, 9.0]))
    with pytest.raises(Boom):
        load(m, [patch], transactional=True)
    assert_untouched(m, before)
    assert views() == views_before


class MovesAView(nn.Module):
    """Buffer ``b`` views the first half of a storage of eight elements; the loader
    copies into it, then moves it onto the second half (``as_strided_``: the same shape
    and strides, another offset), then raises."""

    def __init__(self) -> None:
        super().__init__()
        storage = torch.tensor([1.5, -0.0, NAN, 1e-42, 5.0, 6.0, 7.0, 8.0])
        self.register_buffer("b", storage[:4])

    def load_weights(self, weights):
        for _, w in weights:
            self.b.copy_(w)
            self.b.as_strided_((4,), (1,), 4)
        raise Boom()


@pytest.mark.patchkit_only
@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_transactional_restores_a_runtime_tensor_moved_within_its_storage(load, mk, kind):
    m = MovesAView()
    before = m.b.clone()
    storage = m.b.untyped_storage()
    patch = (mk.dense("b", torch.full((4,), 9.0)) if kind == "dense"
             else mk.sparse("b", (4,), [0, 2], [9.0, 9.5]))
    with pytest.raises(Boom):
        load(m, [patch], transactional=True)
    assert (m.b.shape, m.b.stride(), m.b.storage_offset()) == ((4,), (1,), 0)
    assert m.b.untyped_storage().data_ptr() == storage.data_ptr()
    assert same_bits(m.b, before)
    assert m.b.as_strided((4,), (1,), 4).tolist() == [5.0, 6.0, 7.0, 8.0]


@pytest.mark.patchkit_only
def test_transactional_restores_on_keyboard_interrupt(load, mk):
    m = failing_model((1, "b"), KeyboardInterrupt())
    before = snapshot(m)
    with pytest.raises(KeyboardInterrupt):
        load(m, patches_for(mk, "sparse"), max_chunk_bytes=20, transactional=True)
    assert_untouched(m, before)


@pytest.mark.patchkit_only
@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_transactional_success_keeps_the_writes(load, mk, kind):
    m = failing_model((-1, ""), Boom())
    assert load(m, patches_for(mk, kind), max_chunk_bytes=20, transactional=True) == set(NAMES)
    for k, n in enumerate(NAMES):
        assert same_bits(getattr(m, n).detach(), expected_written(kind, k))


@pytest.mark.patchkit_only
def test_transactional_saves_only_the_regions_written(load, mk, monkeypatch):
    saved_bytes = []
    restore = WriteSession.restore

    def spy(self):
        saved_bytes.append(sum(s.before.numel() * s.before.element_size() for s in self.saved))
        restore(self)

    monkeypatch.setattr(WriteSession, "restore", spy)

    class Big(RecordingModel):
        def load_weights(self, weights):
            for _, w in weights:
                self.big.data[0:2].copy_(w[0:2])  # 2 rows of 1000 float32 = 8000 bytes
            raise Boom()

    m = Big({"big": torch.zeros(100, 1000), "other": torch.zeros(100, 1000)})
    with pytest.raises(Boom):
        load(m, [mk.dense("big", torch.ones(100, 1000))], transactional=True)
    assert saved_bytes == [2 * 1000 * 4]  # the 2 rows written, not the 2 parameters
    # A NaN-merged write can change only the elements its source does not keep: those
    # are all it saves (one float32 here), however large the view it copies into.
    with pytest.raises(Boom):
        load(m, [mk.sparse("big", (100, 1000), [5], [1.0])], transactional=True)
    assert saved_bytes[1] == 4
    assert m.big.detach().eq(0).all()


@pytest.mark.patchkit_only
def test_transactional_dense_load_only_observes_and_writes_nan_as_sent(load, mk):
    m = RecordingModel({"a": torch.ones(3)})
    load(m, [mk.dense("a", torch.tensor([NAN, 2.0, -0.0]))], transactional=True)
    assert same_bits(m.a.detach(), torch.tensor([NAN, 2.0, -0.0]))


@pytest.mark.patchkit_only
@pytest.mark.parametrize("kind", ["dense", "sparse"])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16])
def test_transactional_restores_a_partly_changed_view_of_any_float_dtype(load, kind, dtype):
    # A dense copy that changes one element saves just that element; the restore writes it
    # back on the bits (float8 has no index_copy_ kernel on the CPU), and the loader's own
    # error is the one that propagates.
    class Fails(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            start = torch.linspace(-2, 2, 64, device="cpu").to(dtype)
            self.w = torch.nn.Parameter(start, requires_grad=False)

        def load_weights(self, weights):
            for _, t in weights:
                self.w.data.copy_(t)
            raise Boom("after the copy")

    m = Fails()
    before = m.w.detach().clone()
    if kind == "dense":
        v = before.clone()
        v[3] = torch.tensor(1.5).to(dtype)
        patch = patchkit.CheckpointWeightPatch("w", (64,), dtype, v)
    else:
        patch = patchkit.CheckpointWeightPatch(
            "w", (64,), dtype, torch.tensor([1.5], device="cpu").to(dtype),
            torch.tensor([3], device="cpu"))
    with pytest.raises(Boom):
        load(m, [patch], transactional=True)
    assert same_bits(m.w.detach(), before)
