"""A model's runtime tensors: the storage a load writes, and who owns each piece of it.

A *runtime tensor* is one of the model's parameters or buffers, as
:func:`named_tensors` lists them: ``named_parameters(remove_duplicate=False)`` followed
by ``named_buffers(remove_duplicate=False)``, from one walk of the module tree
(:func:`_module_tree`) where no module overrides torch's ways of listing them.
:class:`RuntimeIndex` is built from that list for a watched load: it finds the
parameter or buffer that owns a piece of storage (tied weights under their first name,
tensors that share a storage told apart by byte range); it refuses, before anything is
written, the runtime tensors whose writes a watched load could not see (values in inner
tensors of a wrapper subclass, lazy conjugate or negative views, no strided memory of
their own); and it tells what a loader changed in the tree during the load (tensors
rebound, replaced, added, registries swapped), which a rollback undoes.

:class:`RuntimeIndex` is public API, importable from :mod:`patchkit.intercept` as before.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import operator
import sys
from collections.abc import Iterable, Iterator, Sequence
from functools import cached_property

import torch

from ._regions import Region, _byte_span, _Owner, _owner, _position_of, _storage_key
from .bitwise import _PLAIN
from .errors import ContractViolation, PatchTypeError

_WRAP_KINDS: dict[type, int] = {}  # a tensor subclass -> _may_wrap(it)


def _may_wrap(cls: type) -> int:
    """Whether a tensor of subclass ``cls`` may hold its values in inner tensors: 2 when
    it always does (``__tensor_flatten__``: a DTensor, a traceable wrapper), 1 when it
    dispatches ops itself (a wrapper that may have no memory of its own), 0 when not (a
    Parameter subclass as vLLM's: its storage is its own). Once per class."""
    if hasattr(cls, "__tensor_flatten__"):
        return 2
    return 0 if cls.__torch_dispatch__ is torch.Tensor.__torch_dispatch__ else 1


_UNINITIALIZED = torch.nn.parameter.UninitializedTensorMixin
_STRIDED = torch.strided


def _storageless_kind(t: torch.Tensor) -> str:
    """What a runtime tensor with no strided memory of its own is, for a message."""
    if isinstance(t, _UNINITIALIZED):
        return (f"an {type(t).__name__} (a lazy module's tensor, not materialized yet: "
                "its first forward pass does that)")
    if t.is_nested:
        return "a nested tensor, whose elements are no single strided view of its memory"
    return f"a tensor of layout {str(t.layout).removeprefix('torch.')}"


def _holds_no_memory(t: torch.Tensor) -> bool:
    """Whether ``t`` (not empty) reads as data pointer 0 off the meta device: a tensor
    subclass with no memory of its own."""
    try:
        return not t.is_meta and t.data_ptr() == 0
    except RuntimeError:  # ("has no storage": the same thing, said otherwise)
        return True


_REGISTRY_NAMES = ("_parameters", "_buffers", "_modules")
_SCAN_MAX = 16  # owners of one storage looked through one by one; more are bisected
# Tensor methods as plain functions, for checks over every runtime tensor that run as C
# loops (``map``) and not as Python ones.
_DETACH = torch.Tensor.detach
_DATA_PTR = torch.Tensor.data_ptr
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_IS_CUDA = operator.attrgetter("is_cuda")
_ATTRIBUTES = operator.attrgetter("__dict__")
_MODULE_WALK = (
    torch.nn.Module.named_modules,
    torch.nn.Module.named_parameters,
    torch.nn.Module.named_buffers,
    torch.nn.Module._named_members,
)


def _module_tree(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]] | None:
    """``(prefix, module)`` in the order ``named_modules(remove_duplicate=False)`` visits
    them, or ``None`` where a module overrides torch's ways of listing its tensors (or
    the tree is deeper than the recursion limit): then only torch's own walk is right."""
    mods: list[tuple[str, torch.nn.Module]] = []
    stack = [("", model, 0)]
    deepest = sys.getrecursionlimit()
    plain: set[type] = set()  # (module classes seen to list their tensors as torch does)
    while stack:
        prefix, m, depth = stack.pop()
        if depth > deepest:
            return None
        kind = type(m)
        if kind not in plain:
            if not _lists_as_torch(kind):
                return None
            plain.add(kind)
        mods.append((prefix, m))
        below = m.__dict__.get("_modules")  # (as _registry reads it, without its call)
        if isinstance(below, dict) and below:  # (most modules are leaves: nothing to list)
            children = [(f"{prefix}.{k}" if prefix else k, c, depth + 1)
                        for k, c in below.items() if c is not None]
            children.reverse()
            stack += children
    return mods


def _lists_as_torch(kind: type) -> bool:
    """Whether module class ``kind`` lists its tensors and submodules as ``nn.Module``
    does (a duck-typed class without one of those methods does not)."""
    return tuple(getattr(kind, a, None) for a in _WALK_NAMES) == _MODULE_WALK


_WALK_NAMES = ("named_modules", "named_parameters", "named_buffers", "_named_members")


def _registers_twice(model: torch.nn.Module) -> bool | None:
    """Whether a parameter that ``named_parameters(remove_duplicate=False)`` lists is
    listed twice (tied, or under a submodule registered twice), without building a name:
    ``True`` at the first one found. ``None`` where :func:`_module_tree` is (a module
    that lists its tensors its own way, a tree deeper than the recursion limit, or one
    that loops): only torch's own walk is right there."""
    seen: set[int] = set()
    listed = 0
    empty = id(None)  # (an empty slot, ``bias=None``)
    level = [model]
    modules: set[int] = set()
    plain: set[type] = set()  # (module classes seen to list their tensors as torch does)
    for depth in range(sys.getrecursionlimit() + 1):  # (a level per depth)
        modules.update(map(id, level))
        if depth > len(modules):  # (deeper than a tree of its modules can be: a loop)
            return None
        ids: list[int] = []
        below: list = []
        for m in level:
            kind = type(m)
            if kind not in plain:
                if not _lists_as_torch(kind):
                    return None
                plain.add(kind)
            attributes = m.__dict__  # (as _registry reads them, without its calls)
            params, children = attributes.get("_parameters"), attributes.get("_modules")
            if isinstance(params, dict):
                ids += map(id, params.values())
            if isinstance(children, dict):
                below += children.values()
        # (checked a level at a time: the sets and counts of C loops, not Python ones)
        seen.update(ids)
        seen.discard(empty)
        listed += len(ids) - ids.count(empty)
        if len(seen) < listed:
            return True
        level = [c for c in below if c is not None]
        if not level:
            return False
    return None


_FIRST = operator.itemgetter(0)
_SECOND = operator.itemgetter(1)
_LAYOUT = operator.attrgetter("layout")
_IS_NESTED = operator.attrgetter("is_nested")
_IS_NEG = torch.Tensor.is_neg
_IS_CONJ = torch.Tensor.is_conj
_DTYPE = operator.attrgetter("dtype")
_COLUMNS_FROM = 20  # (modules: from about this many, RuntimeIndex._index_plain is the quicker)


def _entries(
    dicts: list[dict], sizes: Sequence[int], prefixes: Sequence[str] | None = None,
    partners: Sequence[dict] | None = None,
) -> tuple[list[dict], list, list, list | None, list | None]:
    """Every entry of ``dicts`` (of ``sizes``) as columns, in order: the dict holding
    it, its key, its value, and (given each dict's module ``prefixes``) its qualified
    name, as :func:`_tensors_of` makes it, and (given them) its dict's ``partners``.
    Empty dicts are passed over first (most of a module tree's registries)."""
    if not all(sizes):
        dicts = list(itertools.compress(dicts, sizes))
        prefixes = None if prefixes is None else itertools.compress(prefixes, sizes)
        partners = None if partners is None else itertools.compress(partners, sizes)
    names = None if prefixes is None else [
        f"{p}.{k}" if p else k for p, d in zip(prefixes, dicts) for k in d]
    return (_each(dicts, dicts), list(itertools.chain.from_iterable(dicts)),
            list(itertools.chain.from_iterable(map(dict.values, dicts))), names,
            None if partners is None else _each(partners, dicts))


def _each(items: Iterable, dicts: Iterable[dict]) -> list:
    """Each of ``items`` once for every entry of its dict of ``dicts``, in order."""
    return [x for x, d in zip(items, dicts) for _ in d]


def _not_none(values: list) -> list[bool] | None:
    """Which of ``values`` are not ``None`` (by identity: a tensor is never compared),
    or ``None`` where all are not."""
    kept = list(map(operator.is_not, values, itertools.repeat(None)))
    return None if all(kept) else kept


def _kept(mask: list, *columns: list) -> tuple[list, ...]:
    """``columns``, each cut to the places where ``mask`` is true."""
    return tuple(list(itertools.compress(c, mask)) for c in columns)


def _registry(m: torch.nn.Module, attr: str) -> dict:
    """``m._parameters`` (``attr``), or an empty dict where a loader deleted it from the
    module's attributes (a walk of such a tree goes on)."""
    d = m.__dict__.get(attr)
    return d if isinstance(d, dict) else {}


def _listed_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``named_modules(remove_duplicate=False)`` as torch lists it (for a tree that
    :func:`_module_tree` leaves to torch); empty for what is not an ``nn.Module``."""
    if not isinstance(model, torch.nn.Module):
        return []
    return list(model.named_modules(remove_duplicate=False))


def _tensors_of(
    mods: list[tuple[str, torch.nn.Module]], buffers: bool | None, registries: bool = False
) -> list[tuple]:
    """``(name, tensor)`` of each parameter (then buffer, with ``buffers``; ``None``: the
    buffers alone) of ``mods``, in torch's order; with ``registries``, ``(name, tensor,
    the dict that registers it, its key there)``."""
    def of(attr: str) -> list[tuple]:
        if registries:
            return [(f"{prefix}.{k}" if prefix else k, t, d, k)
                    for prefix, m in mods for d in (_registry(m, attr),) for k, t in d.items()
                    if t is not None]
        return [(f"{prefix}.{k}" if prefix else k, t)
                for prefix, m in mods for k, t in _registry(m, attr).items() if t is not None]

    if buffers is None:  # (the buffers alone)
        return of("_buffers")
    return of("_parameters") + of("_buffers") if buffers else of("_parameters")


def named_tensors(
    model: torch.nn.Module, *, buffers: bool = True
) -> list[tuple[str, torch.Tensor]]:
    """``model.named_parameters(remove_duplicate=False)`` followed by
    ``named_buffers(remove_duplicate=False)`` (with ``buffers``), as one list: the same
    names and tensors in the same order.

    Where no module of the model overrides torch's ways of listing them, the module tree
    is walked here, in the order ``named_modules`` visits it, at less than half the cost
    of torch's nested generators (on a model of 300 modules, 0.3 ms against 0.7 ms; a
    load pays it once: a watched load's :class:`RuntimeIndex` walks the tree, and knows
    the tied parameters a plain one finds with this; more only where a loader changed the
    tree). A module that overrides one gets torch's own answer.
    """
    mods = _module_tree(model)
    if mods is None:  # torch's own walk (which raises RecursionError on a tree that loops)
        named = list(model.named_parameters(remove_duplicate=False))
        return named + list(model.named_buffers(remove_duplicate=False)) if buffers else named
    return _tensors_of(mods, buffers)


def _named_now(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], set[str]]:
    """:func:`named_tensors` as a dict, and which of its names are parameters (a tensor
    moved to the other registry under its own name keeps its place in the dict). A name
    listed twice for two tensors (a buffer beside the parameter of that name, a dotted key
    ``root._parameters["lin.weight"]``) maps to ``None``: it names no one tensor."""
    mods = _module_tree(model)
    if mods is None:
        params = list(model.named_parameters(remove_duplicate=False))
        named = params + list(model.named_buffers(remove_duplicate=False))
    else:
        params = _tensors_of(mods, False)
        named = params + _tensors_of(mods, None)
    now = dict(named)
    if len(now) < len(named):
        for n, t in named:
            if now[n] is not t:
                now[n] = None
    return now, {n for n, _ in params}


class RuntimeIndex:
    """Which parameter or buffer owns a piece of storage: the one lookup patchkit has.

    Built from ``model.named_parameters(remove_duplicate=False)`` and
    ``named_buffers(remove_duplicate=False)`` (as :func:`named_tensors` lists them); a
    tensor registered under several names (tied weights) is reported under the first.
    Tensors that share one storage at different offsets (a flat weight buffer) are told
    apart by byte range.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._owners: dict[tuple, list[_Owner]] = {}
        # For overlapping(): a storage's owners sorted by start, where it has many
        self._spans: dict[tuple, tuple[list[int], list[int], list[int]]] = {}
        self._by_key: dict[tuple, list[tuple[str, torch.Tensor]]] = {}
        self.tensors: dict[str, torch.Tensor] = {}
        self.aliases: dict[str, str] = {}
        # The aliases among the parameters alone, each with the parameter's first name:
        # what CONTRACT §6 renames (see patchkit.loader.canonicalize_tied).
        self.tied_parameters: dict[str, str] = {}
        # Tensors whose values live in inner tensors of their own (a DTensor, a quantized
        # wrapper subclass): writes into those are not seen, see refuse_wrappers().
        self.wrappers: list[str] = []
        # Runtime tensors that are lazy views (torch's negative or conjugate bit): their
        # memory does not hold their values, see refuse_wrappers().
        self.lazy: list[str] = []
        # Runtime tensors with no strided memory of their own (a lazy module's
        # UninitializedParameter, a sparse or nested tensor, not empty), each with what it
        # is: left out of the index and of tensors (nothing can be looked up in them), see
        # refuse_wrappers().
        self.storageless: dict[str, str] = {}
        self._unindexed: set[str] = set()  # those and the empty ones of their kinds
        mods = _module_tree(model)
        # Where each tensor is registered, and the tree's links, for replaced(): checked
        # by identity after each sparse call instead of walking the tree again.
        self._slots: list[tuple[str, dict, str]] | None = None
        self._alias_slots: list[tuple[str, dict, str]] = []  # the same, of aliases
        # For added(): every registry of the tree (``_parameters``, ``_buffers``,
        # ``_modules`` of each module) and its size, and its empty slots (``bias=None``),
        # which a registration can fill without changing a size. For undo(): each
        # registry's keys in order, and the buffers left out of the state dict. All of it
        # is built in columns where it may (a tree of _COLUMNS_FROM modules or more, its
        # tensors all plain), else one tensor at a time (a small tree is quicker so).
        if mods is None or len(mods) < _COLUMNS_FROM or not self._index_plain(mods):
            self._index_listed(model, mods)

    def _index_listed(
        self, model: torch.nn.Module, mods: list[tuple[str, torch.nn.Module]] | None
    ) -> None:
        """The index's tensors and registries, as :meth:`__init__` describes them, one
        tensor at a time: for any tree (``mods``: :func:`_module_tree`'s listing, or
        ``None`` where torch's own walk is the right one)."""
        first: dict[int, str] = {}
        listed = mods if mods is not None else _listed_modules(model)
        self._links = [(m._modules, k, c) for _, m in listed
                       for k, c in m._modules.items() if c is not None]
        self._registries = [d for _, m in listed for d in (m._parameters, m._buffers, m._modules)]
        # The registries by kind (the module objects, then each module's dict of each kind):
        # a loader may put a new dict in a module's place of one (``m._parameters = {...}``),
        # which every check below, reading the dicts the index holds, would miss.
        self._holders = tuple(m for _, m in listed)
        self._holder_names = tuple(p for p, _ in listed)
        # Each module's attributes (the dict object, which undo() puts back where a loader
        # replaced it), and the places of its registries in them, one per registry.
        self._attributes = tuple(m.__dict__ for m in self._holders)
        self._registry_places = (
            tuple(a for a in self._attributes for _ in _REGISTRY_NAMES),
            _REGISTRY_NAMES * len(self._holders),
        )
        self._sizes = tuple(map(len, self._registries))
        # For undo(): each registry's items in order, as the index found them.
        self._items = [tuple(d.items()) for d in self._registries]
        self._persistence = [(m, m._non_persistent_buffers_set, set(m._non_persistent_buffers_set))
                             for _, m in listed]
        if mods is None:
            params = list(model.named_parameters(remove_duplicate=False))
            self._parameter_names = {n for n, _ in params}
            params = [(n, t, None, None) for n, t in params]
            buffers = [(n, t, None, None) for n, t in model.named_buffers(remove_duplicate=False)]
            held = None
        else:
            params = _tensors_of(mods, False, registries=True)
            buffers = _tensors_of(mods, None, registries=True)
            self._parameter_names = None  # (read from the slots' registries when needed)
            self._slots = []
            held = len(params) + len(buffers) + len(self._links)
        self._empty_slots: list[tuple[dict, str]] = (
            [] if sum(self._sizes) == held  # (no slot is None: nothing to look for)
            else [(d, k) for d in self._registries for k, v in d.items() if v is None]
        )
        for k, (name, t, registry, key) in enumerate(itertools.chain(params, buffers)):
            if id(t) in first:
                if first[id(t)] == name:  # (listed twice, by a listing of a module's own)
                    continue
                self.aliases[name] = first[id(t)]
                if k < len(params):  # (parameters come first: its first name is one too)
                    self.tied_parameters[name] = first[id(t)]
                if self._slots is not None:
                    self._alias_slots.append((name, registry, key))
                continue
            cls = type(t)
            plain = cls is torch.Tensor or cls is torch.nn.Parameter
            if not plain and not isinstance(t, torch.Tensor):
                kind = "parameter" if k < len(params) else "buffer"
                raise PatchTypeError(
                    f"model {type(model).__name__}: {kind} {name!r} is a {cls.__name__}, not "
                    "a tensor (put in a module's registry by hand?); a watched load (sparse, "
                    "transactional or inspected) needs each registered entry to be a tensor "
                    "or None",
                    reason="not a tensor", value=name,
                )
            uninitialized = not plain and issubclass(cls, _UNINITIALIZED)
            if uninitialized or t.layout is not _STRIDED or t.is_nested:
                # (nothing to index: left out; a watched load refuses the model unless the
                # tensor is empty, as an empty strided one is never written)
                self._unindexed.add(name)
                if not uninitialized and t.numel() == 0:
                    continue
                self.storageless[name] = _storageless_kind(t)
                continue
            first[id(t)] = name
            self.tensors[name] = t
            if self._slots is not None:
                self._slots.append((name, registry, key))
            if t.numel() == 0:
                continue
            if not plain:
                kind = _WRAP_KINDS.get(cls)  # (a dict, not a call: 100 k tensors of a
                if kind is None:             # Parameter subclass as vLLM's are common)
                    kind = _WRAP_KINDS[cls] = _may_wrap(cls)
                if kind == 2 or (kind == 1 and _holds_no_memory(t)):
                    self.wrappers.append(name)
            if t.is_neg() or t.is_conj():
                self.lazy.append(name)
            # Each tensor's place in its storage is worked out when a write first reaches
            # that storage (most loads write a few of a model's tensors).
            self._by_key.setdefault(_storage_key(t), []).append((name, t))
        # For _same_sizes(): each slot's key and its module's other registry (the buffers
        # of a parameter), where a tensor under the same name would stand beside it.
        other = {}
        for i in range(0, len(self._registries), 3):
            params, buffers = self._registries[i], self._registries[i + 1]
            other[id(params)], other[id(buffers)] = buffers, params
        beside = [(other[id(reg)], key) for _, reg, key in (self._slots or []) + self._alias_slots
                  if id(reg) in other]
        self._beside_places = tuple(zip(*beside)) or ((), ())

    def _index_plain(self, mods: list[tuple[str, torch.nn.Module]]) -> bool:
        """:meth:`_index_listed`'s work for the common tree, with C loops (``map``,
        ``zip``, ``itertools``) over columns of its registries and tensors where that
        loops in Python over each, and nothing done for an empty registry (most of a
        tree's): the same attributes, equal item for item. (Built one tensor at a time,
        the index took 2.9 ms of a 4.2 ms sparse load of one patch into a PlainModel of
        1000 tensors; in columns, 1.8 ms.)
        Returns ``False``, and sets nothing, where the tree is not that common one: a
        registry not a plain dict in its module's attributes, a registered entry that is
        not a tensor, or a tensor that is not indexed as a plain one is (one with no
        strided memory of its own, a lazy module's, a tensor subclass that may wrap
        inner tensors, a lazily negated or conjugated view): :meth:`_index_listed` then
        does it (and raises what it raises)."""
        holders = tuple(map(_SECOND, mods))
        attributes = tuple(map(_ATTRIBUTES, holders))
        # (each module's registries, read from its attributes as nn.Module keeps them)
        params = list(map(dict.get, attributes, itertools.repeat("_parameters")))
        buffers = list(map(dict.get, attributes, itertools.repeat("_buffers")))
        children = list(map(dict.get, attributes, itertools.repeat("_modules")))
        persistence = list(map(dict.get, attributes,
                               itertools.repeat("_non_persistent_buffers_set")))
        registries = list(itertools.chain.from_iterable(zip(params, buffers, children)))
        if set(map(type, registries)) != {dict} or set(map(type, persistence)) != {set}:
            return False
        sizes = tuple(map(len, registries))
        prefixes = tuple(map(_FIRST, mods))
        # (each entry of a module's parameters, then buffers, with its module's other
        # registry, where a tensor of the same name would stand beside it)
        p_regs, p_keys, p_vals, p_names, p_others = _entries(
            params, sizes[0::3], prefixes, buffers)
        b_regs, b_keys, b_vals, b_names, b_others = _entries(
            buffers, sizes[1::3], prefixes, params)
        c_regs, c_keys, c_vals, _, _ = _entries(children, sizes[2::3])
        held_p, held_b = _not_none(p_vals), _not_none(b_vals)
        if held_p is not None:  # (an empty slot, ``bias=None``: left out)
            p_regs, p_keys, p_vals, p_names, p_others = _kept(
                held_p, p_regs, p_keys, p_vals, p_names, p_others)
        if held_b is not None:
            b_regs, b_keys, b_vals, b_names, b_others = _kept(
                held_b, b_regs, b_keys, b_vals, b_names, b_others)
        held_c = _not_none(c_vals)
        if held_c is not None:
            c_regs, c_keys, c_vals = _kept(held_c, c_regs, c_keys, c_vals)
        tensors = p_vals + b_vals
        for cls in set(map(type, tensors)).difference(_PLAIN):
            if not issubclass(cls, torch.Tensor) or issubclass(cls, _UNINITIALIZED):
                return False
            kind = _WRAP_KINDS.get(cls)
            if kind is None:
                kind = _WRAP_KINDS[cls] = _may_wrap(cls)
            if kind:
                return False
        if (set(map(_LAYOUT, tensors)).difference((_STRIDED,)) or any(map(_IS_NESTED, tensors))
                or any(map(_IS_NEG, tensors))):
            return False
        # (torch sets the conjugate bit on complex tensors only)
        if any(d.is_complex for d in set(map(_DTYPE, tensors))) and any(map(_IS_CONJ, tensors)):
            return False
        regs = p_regs + b_regs
        keys = p_keys + b_keys
        names = p_names + b_names
        others = p_others + b_others
        ids = list(map(id, tensors))
        aliases: dict[str, str] = {}
        tied: dict[str, str] = {}
        alias_slots: list[tuple[str, dict, str]] = []
        alias_others: list[dict] = []
        if len(set(ids)) < len(ids):  # (a tensor listed again: tied, or listed twice)
            first_at = dict(zip(reversed(ids), range(len(ids) - 1, -1, -1)))
            firsts = list(map(first_at.__getitem__, ids))
            for i in [i for i, f in enumerate(firsts) if f != i]:
                first = names[firsts[i]]
                if first == names[i]:  # (under its own name again: nothing more)
                    continue
                aliases[names[i]] = first
                if i < len(p_vals):  # (parameters come first: its first name is one too)
                    tied[names[i]] = first
                alias_slots.append((names[i], regs[i], keys[i]))
                alias_others.append(others[i])
            names, tensors, regs, keys, others = _kept(
                list(map(operator.eq, firsts, itertools.count())),
                names, tensors, regs, keys, others)
        # (an empty tensor: listed, never written, not indexed by storage)
        filled = list(map(torch.Tensor.numel, tensors))
        named = _kept(filled, names, tensors) if 0 in filled else (names, tensors)
        storage = list(map(_storage_key, named[1]))
        by_key = dict(zip(storage, map(list, zip(zip(*named)))))
        if len(by_key) < len(storage):  # (a storage that several tensors share)
            by_key = {}
            for key, name, t in zip(storage, *named):
                by_key.setdefault(key, []).append((name, t))
        # Nothing can fail from here: the index takes what was found.
        self.tensors = dict(zip(names, tensors))
        self.aliases, self.tied_parameters = aliases, tied
        self._slots = list(zip(names, regs, keys))
        self._alias_slots = alias_slots
        self._by_key = by_key
        self._links = list(zip(c_regs, c_keys, c_vals))
        self._registries = registries
        self._holders = holders
        self._holder_names = prefixes
        self._attributes = attributes
        self._registry_places = (
            tuple(itertools.chain.from_iterable(zip(attributes, attributes, attributes))),
            _REGISTRY_NAMES * len(holders),
        )
        self._sizes = sizes
        self._items = [tuple(d.items()) if d else () for d in registries]
        self._persistence = list(zip(holders, persistence, map(set, persistence)))
        self._parameter_names = None  # (read from the slots' registries when needed)
        self._empty_slots = (
            [] if sum(sizes) == len(p_vals) + len(b_vals) + len(c_vals)  # (no slot is None)
            else [(d, k) for d in registries for k, v in d.items() if v is None]
        )
        # For _same_sizes(): each slot's module's other registry. _index_listed pairs each
        # registry dict with its partner in the last module that lists it: the same one,
        # unless a dict with names is listed twice (a module listed twice, or one dict
        # in two modules): then as it does.
        held = [*itertools.compress(params, sizes[0::3]),
                *itertools.compress(buffers, sizes[1::3])]
        if len(set(map(id, held))) < len(held):
            other = dict(zip(
                itertools.chain.from_iterable(zip(map(id, params), map(id, buffers))),
                itertools.chain.from_iterable(zip(buffers, params)),
            ))
            placed = regs + [reg for _, reg, _ in alias_slots]
            others, alias_others = list(map(other.__getitem__, map(id, placed))), []
        beside = (tuple(others + alias_others),
                  tuple(keys + [key for _, _, key in alias_slots]))
        self._beside_places = beside if beside[1] else ((), ())
        return True

    def refuse_wrappers(self, what: str) -> None:
        """``ContractViolation`` (before anything is written) when the model holds a
        runtime tensor with no strided memory of its own (:attr:`storageless`: a lazy
        module's tensor not yet materialized, a sparse or nested tensor), one with
        torch's lazy negative or conjugate bit (:attr:`lazy`), or a
        tensor subclass whose values live in inner tensors (:attr:`wrappers`): a write
        into it, or into what it wraps (``param.to_local().copy_(w)``), reaches storage
        this index does not know, so a load that must see its writes (``what``: a
        sparse, transactional or inspected one) could neither NaN-merge, record nor
        restore it."""
        if self.storageless:
            names = list(self.storageless)
            _refuse_before_load(
                what, names,
                f"{self.storageless[names[0]]}: patchkit saves, NaN-merges and restores "
                "strided memory only", "no strided memory")
        if self.lazy:
            name = self.lazy[0]
            _refuse_before_load(
                what, self.lazy,
                f"a lazily {_lazy_kind(self.tensors[name])} view (torch's flag, as z.conj() "
                "or torch._neg_view set it), whose memory does not hold its values, and "
                "patchkit saves, merges and compares runtime memory bit for bit; make it "
                "plain where the model is built (t.resolve_conj().resolve_neg())",
                "lazy view")
        if self.wrappers:
            _refuse_before_load(
                what, self.wrappers,
                f"a {type(self.tensors[self.wrappers[0]]).__name__}, a tensor subclass whose "
                "values live in inner tensors (a DTensor, a quantized wrapper), whose writes "
                "patchkit cannot see, NaN-merge or restore", "tensor subclass")

    def sharing(self, key: tuple) -> list[_Owner]:
        """The runtime tensors of the storage ``key`` (see :func:`_storage_key`), in the
        order of ``named_parameters`` then ``named_buffers`` (empty: none)."""
        return self._owners_of(key) or []

    def overlapping(self, key: tuple, a0: int, a1: int) -> list[_Owner]:
        """The runtime tensors of the storage ``key`` whose byte extents meet the bytes
        ``[a0, a1)``, in the order of :meth:`sharing`. A storage that many tensors share
        (views of one flat buffer) is searched by bisection, not scanned: a load of n
        writes into n such tensors costs O(n log n), not O(n^2)."""
        owners = self._owners_of(key)
        if not owners:
            return []
        if len(owners) <= _SCAN_MAX:
            return [o for o in owners if a0 < o.end and o.start < a1]
        spans = self._spans.get(key)
        if spans is None:
            order = sorted(range(len(owners)), key=lambda i: owners[i].start)
            starts = [owners[i].start for i in order]
            # (the furthest end of the owners up to each one: where a walk back stops)
            reach = list(itertools.accumulate((owners[i].end for i in order), max))
            spans = self._spans[key] = (order, starts, reach)
        order, starts, reach = spans
        found = []
        i = bisect.bisect_left(starts, a1) - 1  # (the last owner that starts before a1)
        while i >= 0 and reach[i] > a0:
            if owners[order[i]].end > a0:
                found.append(order[i])
            i -= 1
        found.sort()
        return [owners[j] for j in found]

    def _owners_of(self, key: tuple) -> list[_Owner] | None:
        owners = self._owners.get(key)
        if owners is None:
            named = self._by_key.get(key)
            if named is None:
                return None
            owners = self._owners[key] = [_owner(name, t, key) for name, t in named]
        return owners

    def bindings(self) -> dict[str, torch.Tensor]:
        """A detached view of every runtime tensor's current storage (no copy).

        Compare with :meth:`rebound` after a loader call to notice ``param.data = w``.
        """
        return dict(zip(self.tensors, map(_DETACH, self.tensors.values())))

    def grad_flags(self) -> list[bool]:
        """Every runtime tensor's ``requires_grad``, in the order of :attr:`tensors` (one
        C loop: a transactional load reads them beside its :meth:`bindings`, since a
        loader may turn a flag off, ``p.requires_grad_(False)``, which no write shows)."""
        return list(map(_REQUIRES_GRAD, self.tensors.values()))

    def restore_grad_flags(self, flags: list[bool]) -> list[str]:
        """Set each runtime tensor's ``requires_grad`` back to ``flags`` (as
        :meth:`grad_flags` read them) where it differs; returns the names set back. A
        tensor whose flag torch will not set (one an in-place op under
        ``torch.enable_grad()`` made a non-leaf) is left as it is: the rollback of the
        values goes on."""
        now = self.grad_flags()
        if now == flags:
            return []
        back = []
        for (n, t), was, is_ in zip(self.tensors.items(), flags, now):
            if was != is_:
                try:
                    t.requires_grad_(was)
                except RuntimeError:  # (not a leaf: torch keeps its flag)
                    continue
                back.append(n)
        return back

    def rebound(self, bindings: dict[str, torch.Tensor],
                then: list[int] | None = None) -> list[str]:
        """Names whose storage is no longer the one recorded in ``bindings``.

        A load checks after each call: the data pointers first, in one C loop (the
        storages recorded are alive, so a new one has another address), and the storage
        keys only where a pointer moved or is 0 (an empty or meta tensor). ``then``: the
        data pointers of ``bindings`` in the order of :attr:`tensors`, where the caller
        keeps them (they do not change while the bindings live)."""
        now = list(map(_DATA_PTR, self.tensors.values()))
        if then is None:
            then = list(map(_DATA_PTR, map(bindings.__getitem__, self.tensors)))
        if now == then and 0 not in now:
            return []
        return [
            n
            for (n, t), p, q in zip(self.tensors.items(), now, then)
            if (p != q or p == 0) and _storage_key(t) != _storage_key(bindings[n])
        ]

    def reshaped(self, bindings: dict[str, torch.Tensor]) -> list[str]:
        """Names whose tensor views its storage with another shape, strides or offset
        than it did when ``bindings`` were taken: the loader changed the tensor's own
        view in place (``resize_``, ``unsqueeze_``, ``t_``, ``as_strided_``, an ``out=``
        op that resized it, ``set_`` to another part of its storage). (:meth:`rebound`
        sees one bound to other storage.)"""
        return [n for n, t in self.tensors.items()
                if (t.shape, t.stride(), t.storage_offset()) != (
                    (b := bindings[n]).shape, b.stride(), b.storage_offset())]

    @cached_property
    def _columns(self) -> tuple:
        """The slots as columns, for checks that run as C loops (``map``) and not as
        Python ones: (link registries, keys, children), (tensor registries, keys,
        tensors), (empty-slot registries, keys), (alias registries, keys, the tensor each
        alias names)."""
        links = tuple(zip(*self._links)) or ((), (), ())
        names, regs, keys = tuple(zip(*self._slots or ())) or ((), (), ())
        slots = (regs, keys, tuple(map(self.tensors.__getitem__, names)))
        empty = tuple(zip(*self._empty_slots)) or ((), ())
        names, regs, keys = tuple(zip(*self._alias_slots)) or ((), (), ())
        aliases = (regs, keys, tuple(map(self.tensors.__getitem__,
                                         map(self.aliases.__getitem__, names))))
        return links, slots, empty, aliases

    def unchanged(self) -> bool:
        """Whether the module tree is as the index found it, in all that
        :meth:`replaced`, :meth:`replaced_aliases` and :meth:`added` look at: the
        same module attributes and registry dicts, every submodule, tensor and alias in
        its slot, every registry of its size, every empty slot empty. Then all three are
        empty, known at the cost of one look (a load checks after each call, and most
        calls change nothing); ``False`` only says that they have to look closer (always,
        for a tree :func:`_module_tree` leaves to torch)."""
        if self._slots is None:
            return False
        _, slots, empty, aliases = self._columns
        return (
            self._same_tree()
            and self._same_sizes()
            and all(map(operator.is_, map(dict.get, slots[0], slots[1]), slots[2]))
            and all(map(operator.is_, map(dict.get, aliases[0], aliases[1]), aliases[2]))
            # (a key gone reads as its registry: not None)
            and list(map(dict.get, empty[0], empty[1], empty[0])).count(None) == len(empty[1])
        )

    def _same_registries(self) -> bool:
        """Every module the index listed holds the registry dicts it held (no
        ``m._parameters = {...}``)."""
        if self._registries_seen is not None:
            return self._registries_seen
        # (the module's attributes as the index found them, the dict object: a loader may
        # replace it too)
        if not all(map(operator.is_, map(_ATTRIBUTES, self._holders), self._attributes)):
            return False
        try:
            return all(map(operator.is_, map(operator.getitem, *self._registry_places),
                           self._registries))
        except KeyError:  # (a registry deleted outright)
            return False

    _registries_seen: bool | None = None

    @cached_property
    def _shadow_places(self) -> tuple[tuple[dict, ...], tuple[str, ...]]:
        """A plain attribute under a registered name shadows the registry for every read
        of ``m.name`` (``m.__dict__["weight"] = w``): where to look for one, as columns
        (each registered name's module attributes, the name), from the registries as the
        index found them (:attr:`_items`; only a sparse call's check and :meth:`undo`
        read them)."""
        named = self._sizes  # (the registries with names, the rest passed over)
        return (tuple(_each(itertools.compress(self._registry_places[0], named),
                            itertools.compress(self._items, named))),
                tuple(map(_FIRST, itertools.chain.from_iterable(self._items))))

    def structure_changed(self) -> str | None:
        """What a loader changed in the module tree past its registries' contents, or
        ``None``: a module's attributes or a registry dict replaced or deleted (one of
        :meth:`swapped_registries`), or a plain attribute that shadows a registered name
        (``m.__dict__["weight"] = w``, which every read of ``m.weight`` then gets)."""
        if not self._same_registries():
            swapped = self.swapped_registries()
            return (f"replaced registry {swapped[0]!r} of the module tree with a dict of its "
                    "own, or deleted it (e.g. `module._parameters = {...}`)" if swapped else
                    "replaced a module's attributes (`module.__dict__`)")
        attrs, keys = self._shadow_places
        if any(map(operator.contains, attrs, keys)):
            a, k = next((a, k) for a, k in zip(attrs, keys) if k in a)
            prefix = self._holder_names[self._attributes.index(a)]
            name = f"{prefix}.{k}" if prefix else k
            return (f"set a plain attribute {name!r} that shadows the registered one (e.g. "
                    "`module.__dict__['weight'] = w`)")
        return None

    def swapped_registries(self) -> list[str]:
        """The registries a module no longer holds, as ``"prefix._parameters"``: a loader
        replaced (``m._parameters = {...}``) or deleted them. :meth:`undo` puts them
        back."""
        return [f"{prefix}.{attr}" if prefix else attr
                for prefix, m, d, attr in zip(
                    (p for p in self._holder_names for _ in _REGISTRY_NAMES),
                    (m for m in self._holders for _ in _REGISTRY_NAMES),
                    self._registries, self._registry_places[1])
                if m.__dict__.get(attr) is not d]

    @contextlib.contextmanager
    def one_look(self, registries: bool | None = None) -> Iterator[None]:
        """Checks made in the block (:meth:`replaced`, :meth:`replaced_aliases`,
        :meth:`added`) look at the module tree's structure once: for a caller that makes
        several in a row and changes nothing in between (``registries``: whether every
        module holds its registry dicts, where the caller has just looked)."""
        self._registries_seen = self._same_registries() if registries is None else registries
        self._tree_seen = self._same_tree()
        self._sizes_seen = self._same_sizes()
        try:
            yield
        finally:
            self._tree_seen = self._sizes_seen = self._registries_seen = None

    _tree_seen: bool | None = None
    _sizes_seen: bool | None = None

    def _same_sizes(self) -> bool:
        """Every registry of the tree holds as many names as it held, and no name it
        registers stands in its module's other registry too (a buffer beside the
        parameter of that name)."""
        if self._sizes_seen is not None:
            return self._sizes_seen
        return tuple(map(len, self._registries)) == self._sizes and not any(
            map(operator.contains, *self._beside_places)
        )

    def _same_tree(self) -> bool:
        """Every submodule is the object it was, in its slot, and every registry holds
        what it held: each name then lives in the registry it lived in."""
        if self._tree_seen is not None:
            return self._tree_seen
        if self._slots is None:
            return False
        dicts, keys, children = self._columns[0]
        return all(map(operator.is_, map(dict.get, dicts, keys), children)) and (
            self._same_registries()
        )

    def replaced(self) -> list[str]:
        """Names (of :attr:`tensors`) no longer registered to the tensor they named when
        the index was built: ``module.w = nn.Parameter(w)`` or ``register_buffer`` with
        a new tensor, or the name gone, or a new tensor under the name in the other
        registry (a buffer beside the parameter: the state dict lists the last). (:meth:`rebound`
        sees ``param.data = w``.)"""
        if self._same_tree() and self._same_sizes():
            dicts, keys, tensors = self._columns[1]
            now = list(map(dict.get, dicts, keys))
            if all(map(operator.is_, now, tensors)):
                return []
            return [n for (n, _, _), t, held in zip(self._slots, now, tensors) if t is not held]
        now, params = _named_now(self.model)
        was = self._were_parameters()
        return [n for n, t in self.tensors.items()
                if now.get(n) is not t or (n in params) != (n in was)]

    @cached_property
    def tied_names(self) -> dict[str, list[str]]:
        """A tied tensor's first name -> its other names (:attr:`aliases` turned round)."""
        out: dict[str, list[str]] = {}
        for alias, first in self.aliases.items():
            out.setdefault(first, []).append(alias)
        return out

    def replaced_aliases(self) -> list[str]:
        """Aliases (the other names of a tied tensor, see :attr:`aliases`) no longer
        registered to it: ``module.lm_head.weight = nn.Parameter(w)`` unties them, ``del``
        removes them."""
        if not self.aliases:
            return []
        if self._same_tree() and self._same_sizes():
            return [n for n, reg, key in self._alias_slots
                    if reg.get(key) is not self.tensors[self.aliases[n]]]
        now, params = _named_now(self.model)
        was = self._were_parameters()
        return [n for n, first in self.aliases.items()
                if now.get(n) is not self.tensors[first] or (n in params) != (n in was)]

    def _were_parameters(self) -> set[str]:
        """The names (first names and aliases) listed as parameters when the index was
        built, not as buffers."""
        if self._parameter_names is None:
            params = set(map(id, self._registries[0::3]))  # (the dicts as they were)
            self._parameter_names = {
                n for n, reg, _ in (self._slots or []) + self._alias_slots if id(reg) in params
            }
        return self._parameter_names

    def added(self, replaced: Sequence[str] | None = None) -> list[str]:
        """Names registered since the index was built that it does not know (a new
        ``module.extra = nn.Parameter(w)``, a buffer, a submodule with tensors), in
        :func:`named_tensors` order. Found without a walk of the model when the module
        tree is the same, no registry of it changed size or emptied or filled an empty
        slot, and no name (nor alias) was :meth:`replaced` (``replaced``: both lists, where
        the caller has them)."""
        return [n for n, _ in self.added_tensors(replaced)]

    def ties_among(self, named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
        """Of names added (``(name, tensor)``, see :meth:`added_tensors`), those that hold a
        tensor the index knows (``model.again = model.c``: a new tie, no new values), each
        with the first name of that tensor."""
        first = {id(t): n for n, t in self.tensors.items()}
        return {n: first[id(t)] for n, t in named if id(t) in first}

    def added_tensors(
        self, replaced: Sequence[str] | None = None
    ) -> list[tuple[str, torch.Tensor]]:
        """:meth:`added` with the tensor each name holds."""
        if replaced is None:
            replaced = self.replaced() + self.replaced_aliases()
        if not replaced and self._same_tree() and self._same_sizes():
            dicts, keys = self._columns[2]
            # (a key gone reads as its registry: not None)
            if list(map(dict.get, dicts, keys, dicts)).count(None) == len(keys):
                return []
        known = self.tensors.keys() | self.aliases.keys() | self._unindexed
        return [(n, t) for n, t in named_tensors(self.model) if n not in known]

    def undo(self) -> bool:
        """Put the module tree's registrations back as the index found them: each
        submodule in its slot, each name registered to its original tensor again (as the
        parameter or buffer it was, in or out of the state dict), each empty slot empty,
        names the model did not have removed, every registry in its order. (The storage of
        a tensor rebound with ``param.data = w`` is the caller's: see :meth:`rebound`.) A
        registry dict the loader put in a module's place of one (``m._parameters = {...}``)
        gives way to the module's own again (and a module's attributes, where the loader
        replaced its ``__dict__``), and a plain attribute under a registered name (which
        shadows it) is removed. Every registry of the tree then holds what it held, in its
        order: a submodule the model did not have is gone too. Returns whether it put
        anything back."""
        changed = False
        for m, attrs in zip(self._holders, self._attributes):
            if m.__dict__ is not attrs:  # (the module's attributes replaced: its own back)
                object.__setattr__(m, "__dict__", attrs)
                changed = True
        for attrs, attr, d in zip(*self._registry_places, self._registries):
            if attrs.get(attr) is not d:
                attrs[attr] = d  # (past nn.Module.__setattr__: the dict itself)
                changed = True
        for d, items in zip(self._registries, self._items):
            # Each registry as it was, in its order: names registered anew back to their
            # tensors, submodules to their slots, names and empty slots the model did not
            # have gone, empty slots it had back, a tensor moved between registries back.
            if len(d) != len(items) or not all(
                k2 == k and v2 is v for (k2, v2), (k, v) in zip(d.items(), items)
            ):
                d.clear()
                d.update(items)
                changed = True
        for attrs, k in zip(*self._shadow_places):
            if k in attrs:
                # A plain attribute under a registered name (``m.__dict__["weight"] = w``)
                # shadows the registry for every read of ``m.weight``: gone.
                del attrs[k]
                changed = True
        for m, now, then in self._persistence:  # (a buffer registered again, as it was)
            if m.__dict__.get("_non_persistent_buffers_set") is not now:
                m.__dict__["_non_persistent_buffers_set"] = now
                changed = True
            if now != then:
                now.clear()
                now.update(then)
                changed = True
        return changed

    def not_undone(self) -> list[str]:
        """After :meth:`undo`: names still not registered to their original tensor (a
        model that does not keep its tensors in ``nn.Module``'s registries, which undo()
        cannot reach)."""
        return self.replaced() + self.replaced_aliases()

    def owner(
        self, t: torch.Tensor, key: tuple | None = None
    ) -> tuple[str, torch.Tensor, int] | None:
        """``(name, runtime tensor, element offset of t in it)`` or ``None``.

        ``None`` means ``t`` is not runtime storage (a scratch buffer, a staged tensor).
        ``key``: ``t``'s storage key, where the caller has it already.
        """
        key = _storage_key(t) if key is None else key
        owners = self._owners_of(key)
        if not owners:
            return None
        b = t.storage_offset() * t.element_size()
        if len(owners) == 1:  # a storage of its own: the common case, decided at once
            o = owners[0]
            if o.dense and o.start <= b < o.end:
                return o.name, o.tensor, (b - o.start) // o.step
        near = self.overlapping(key, b, b + 1)
        if len(near) > 1 or (near and not near[0].dense):
            # Strided tensors that share a storage (column slices of one fused buffer)
            # have byte ranges that interleave: prefer the one that holds t's first
            # element, and give its row-major position in it. Where several hold it
            # (a flat buffer registered beside parameters that are views of it), the
            # first whose extent also holds t's last byte: a write of the whole buffer
            # is the buffer's, not that of the parameter at its start.
            first_holder = None
            end = None
            for o in near:
                at = _position_of(o.tensor, b)
                if at is None:
                    continue
                if first_holder is None:
                    first_holder = o.name, o.tensor, at
                    if len(near) == 1:
                        break
                if end is None:
                    end = _byte_span(t)[1] if t.numel() else b
                if end <= o.end:
                    return o.name, o.tensor, at
            if first_holder is not None:
                return first_holder
        # No runtime tensor holds t's first element as one of its own (a view of another
        # element size may start inside one). t is runtime storage only where its
        # elements reach into one: the one whose extent holds t's first byte, else the
        # first that t meets (a write that starts before a parameter and runs into it),
        # at the position t's first element would have; else it is scratch space beside
        # them (a loader's own area of a flat buffer, the gap columns of a fused one),
        # which a load leaves alone.
        region = Region.of(t)
        if near and (near[0].dense or region.overlaps(Region.of(near[0].tensor))):
            return near[0].name, near[0].tensor, (b - near[0].start) // near[0].step
        for o in self.overlapping(key, *region.extent()):
            if region.overlaps(Region.of(o.tensor)):
                return o.name, o.tensor, (b - o.start) // o.step
        return None


def _refuse_before_load(what: str, names: list[str], why: str, reason: str) -> None:
    """``ContractViolation``: a watched load (``what``) refused for the runtime tensors
    ``names`` (the first named, the rest counted), each being ``why``."""
    more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
    raise ContractViolation(
        f"{what} into this model is refused before anything is written: runtime tensor "
        f"{names[0]!r}{more} is {why}; a plain dense load (load_checkpoint_weight_patches, "
        "not transactional) goes through",
        reason=reason, value=names[0],
    )


def _lazy_kind(t: torch.Tensor) -> str:
    """What lazy flag ``t`` carries, for a message."""
    return ("conjugated and negated" if t.is_conj() and t.is_neg()
            else "conjugated" if t.is_conj() else "negated")
