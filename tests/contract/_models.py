"""Small models and helpers shared by the contract tests.

Every model here has a ``load_weights(weights)`` written the way inference engines write
theirs (copy into a parameter, narrow for a tensor-parallel rank, copy a shard into its
slice of a packed parameter), and records each call so tests can see exactly what the
loader under test handed it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

NAN = float("nan")

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


# -- bit-exact comparison ------------------------------------------------------------------


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` as same-width integers: ``-0.0 != 0.0`` and NaN payloads compare exactly."""
    t = t.detach()
    if t.dtype.is_floating_point:
        return t.contiguous().view(_INT_OF_SIZE[t.element_size()])
    return t


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits, wherever each lives (compared on the CPU)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a).cpu(), bits(b).cpu())


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """A copy of every parameter and buffer (for "the model is untouched" checks)."""
    out = {n: t.detach().clone() for n, t in model.named_parameters()}
    out.update({n: t.detach().clone() for n, t in model.named_buffers()})
    return out


def assert_untouched(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    now = snapshot(model)
    assert now.keys() == before.keys()
    for name, t in before.items():
        assert same_bits(now[name], t), f"{name} changed"


# -- patch construction ---------------------------------------------------------------------


class PatchMaker:
    """Builds patches with the ``CheckpointWeightPatch`` of the implementation under test."""

    def __init__(self, patch_type: type) -> None:
        self.Patch = patch_type

    def dense(
        self,
        name: str,
        value: torch.Tensor,
        dtype: torch.dtype | None = None,
        *,
        values_dtype: torch.dtype | None = None,
    ):
        """A dense patch whose full tensor is ``value`` (dtype defaults to value's)."""
        flat = value.detach().reshape(-1).clone()
        if values_dtype is not None:
            flat = flat.to(values_dtype)
        return self.Patch(name, tuple(value.shape), dtype or value.dtype, flat)

    def sparse(
        self,
        name: str,
        shape: Sequence[int],
        indices: Sequence[int] | torch.Tensor,
        values: Sequence[float] | torch.Tensor,
        dtype: torch.dtype = torch.float32,
        *,
        index_dtype: torch.dtype = torch.int64,
        values_dtype: torch.dtype | None = None,
    ):
        idx = torch.as_tensor(indices, dtype=index_dtype).reshape(-1)
        vals = torch.as_tensor(values, dtype=values_dtype or dtype).reshape(-1)
        return self.Patch(name, tuple(shape), dtype, vals, idx)


def staged_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def reference_chunks(patches: Sequence, budget: int) -> list[list[int]]:
    """CONTRACT §2 written out independently: the positions each ``load_weights`` call gets."""
    chunks: list[list[int]] = []
    cur: list[int] = []
    cur_names: set[str] = set()
    cur_bytes = 0
    for i, p in enumerate(patches):
        nbytes = staged_bytes(p.shape, p.dtype)
        if cur and (cur_bytes + nbytes > budget or p.name in cur_names):
            chunks.append(cur)
            cur, cur_names, cur_bytes = [], set(), 0
        cur.append(i)
        cur_names.add(p.name)
        cur_bytes += nbytes
    if cur:
        chunks.append(cur)
    return chunks


# -- models ---------------------------------------------------------------------------------

Hook = Callable[["RecordingModel", int, str, torch.Tensor], None]


class RecordingModel(nn.Module):
    """Checkpoint name == attribute name; ``load_weights`` copies each tensor into it.

    Records every call: ``calls[i]`` is the list of ``(name, staged tensor clone)`` the
    i-th call received; ``arg_types`` and ``grad_enabled`` what it saw. ``hook(model,
    call_index, name, staged)`` runs before each entry is copied (to raise, to wait, to
    do a forbidden write). ``returns`` is ``"names"`` (the names copied), ``"none"`` or
    ``"empty"``. ``via`` picks how the copy is written: ``"copy_"`` (``param.copy_(w)``),
    ``"data"`` (``param.data.copy_(w)``) or ``"slice"`` (``param.data[:] = w``).
    """

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        *,
        buffers: Sequence[str] = (),
        returns: str = "names",
        hook: Hook | None = None,
        via: str = "copy_",
    ) -> None:
        super().__init__()
        for name, t in tensors.items():
            if name in buffers or not t.is_floating_point():
                self.register_buffer(name, t.clone())
            else:
                self.register_parameter(name, nn.Parameter(t.clone()))
        self.returns = returns
        self.hook = hook
        self.via = via
        self.calls: list[list[tuple[str, torch.Tensor]]] = []
        self.arg_types: list[type] = []
        self.grad_enabled: list[bool] = []

    def names_per_call(self) -> list[list[str]]:
        return [[n for n, _ in call] for call in self.calls]

    def load_weights(self, weights):
        self.arg_types.append(type(weights))
        self.grad_enabled.append(torch.is_grad_enabled())
        call = len(self.calls)
        self.calls.append([(n, w.detach().clone()) for n, w in weights])
        loaded = set()
        for name, w in weights:
            if self.hook is not None:
                self.hook(self, call, name, w)
            dest = getattr(self, name)
            if self.via == "copy_":
                dest.copy_(w)
            elif self.via == "data":
                dest.data.copy_(w)
            else:
                dest.data[:] = w
            loaded.add(name)
        return {"names": loaded, "none": None, "empty": set()}[self.returns]


class SinkModel(nn.Module):
    """Owns no weights: records what each call received and copies nothing.

    Returns an empty set (fine for sparse and dense calls) unless ``returns="names"``.
    Works with ``meta`` tensors (nothing is read).
    """

    def __init__(self, returns: str = "empty") -> None:
        super().__init__()
        self.returns = returns
        self.calls: list[list[tuple[str, tuple[int, ...], torch.dtype, torch.device]]] = []

    def names_per_call(self) -> list[list[str]]:
        return [[n for n, *_ in call] for call in self.calls]

    def load_weights(self, weights):
        self.calls.append([(n, tuple(w.shape), w.dtype, w.device) for n, w in weights])
        if self.returns == "names":
            return {n for n, *_ in self.calls[-1]}
        return set()


class TensorParallelModel(nn.Module):
    """One tensor-parallel rank of a tiny transformer block, loaded the vLLM way.

    Checkpoint weights (full shapes) and where rank ``rank`` of ``tp`` keeps them:

    - ``attn.{q,k,v}_proj.weight`` -> the rank's rows of each, packed into
      ``attn.qkv_proj.weight`` through ``stacked_params_mapping`` (a shard copied into
      its slice of the packed parameter);
    - ``mlp.up_proj.weight`` (column-parallel): the rank's rows (narrow on the output dim);
    - ``mlp.down_proj.weight`` (row-parallel): the rank's columns (narrow on the input dim);
    - ``norm.weight``: replicated.
    """

    stacked_params_mapping = (
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
    )

    def __init__(
        self, rank: int, tp: int, hidden: int = 4, q: int = 4, kv: int = 2, inter: int = 6,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        assert q % tp == 0 and kv % tp == 0 and inter % tp == 0
        self.rank, self.tp = rank, tp
        self.sizes = {"q": q // tp, "k": kv // tp, "v": kv // tp}
        self.offsets = {"q": 0, "k": q // tp, "v": q // tp + kv // tp}

        def param(*shape):
            return nn.Parameter(torch.zeros(*shape, dtype=dtype))

        self.attn = nn.Module()
        self.attn.qkv_proj = nn.Module()
        self.attn.qkv_proj.weight = param((q + 2 * kv) // tp, hidden)
        self.attn.qkv_proj.weight.weight_loader = self._qkv_loader
        self.mlp = nn.Module()
        self.mlp.up_proj = nn.Module()
        self.mlp.up_proj.weight = param(inter // tp, hidden)
        self.mlp.up_proj.weight.weight_loader = self._column_loader
        self.mlp.down_proj = nn.Module()
        self.mlp.down_proj.weight = param(hidden, inter // tp)
        self.mlp.down_proj.weight.weight_loader = self._row_loader
        self.norm = nn.Module()
        self.norm.weight = param(hidden)
        self.norm.weight.weight_loader = self._replicated_loader
        self.calls: list[list[str]] = []

    @staticmethod
    def checkpoint_shapes(hidden: int = 4, q: int = 4, kv: int = 2, inter: int = 6):
        return {
            "attn.q_proj.weight": (q, hidden),
            "attn.k_proj.weight": (kv, hidden),
            "attn.v_proj.weight": (kv, hidden),
            "mlp.up_proj.weight": (inter, hidden),
            "mlp.down_proj.weight": (hidden, inter),
            "norm.weight": (hidden,),
        }

    def _column_loader(self, param, w):
        size = param.shape[0]
        param.data.copy_(w.narrow(0, self.rank * size, size))

    def _row_loader(self, param, w):
        size = param.shape[1]
        param.data.copy_(w.narrow(1, self.rank * size, size))

    def _qkv_loader(self, param, w, shard_id):
        size, off = self.sizes[shard_id], self.offsets[shard_id]
        param.data.narrow(0, off, size).copy_(w.narrow(0, self.rank * size, size))

    @staticmethod
    def _replicated_loader(param, w):
        param.data.copy_(w)

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        loaded = set()
        names = []
        for name, w in weights:
            names.append(name)
            for param_name, shard_name, shard_id in self.stacked_params_mapping:
                if shard_name in name:
                    target = name.replace(shard_name, param_name)
                    params[target].weight_loader(params[target], w, shard_id)
                    break
            else:
                target = name
                params[target].weight_loader(params[target], w)
            loaded.add(target)
        self.calls.append(names)
        return loaded


class TiedModel(nn.Module):
    """An input embedding tied to ``lm_head``: one Parameter under two names.

    ``embed_tokens.weight`` is registered first (canonical), ``lm_head.weight`` is the
    alias. The loader copies each name it is given into the parameter of that name, so a
    call that names both writes the shared storage twice.
    """

    def __init__(self, vocab: int = 5, hidden: int = 3) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.norm = nn.Parameter(torch.ones(hidden))
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.embed_tokens.weight
        with torch.no_grad():
            self.embed_tokens.weight.copy_(torch.arange(vocab * hidden, dtype=torch.float32)
                                           .reshape(vocab, hidden))
        self.calls: list[list[str]] = []

    def load_weights(self, weights):
        params = dict(self.named_parameters(remove_duplicate=False))
        names = []
        for name, w in weights:
            names.append(name)
            params[name].copy_(w)
        self.calls.append(names)
        return set(names)
