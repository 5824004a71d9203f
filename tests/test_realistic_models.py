"""patchkit on runtime models shaped like the ones vLLM serves, beyond TinyLlamaRuntime.

Three small models whose ``load_weights`` works the way vLLM's loaders do (written here
from how those loaders behave, not from their code):

- :class:`MoERuntime`: fused experts, ``w13_weight`` (E, 2*I, H) with each expert's gate
  and up stacked, ``w2_weight`` (E, H, I), fed per expert and per shard through
  ``weight_loader(param, w, weight_name, shard_id, expert_id)``; tensor parallel over the
  intermediate size, expert parallel over the experts (a rank skips the experts it does
  not hold and returns only the names it loaded).
- :class:`Fp8Runtime`: float8_e4m3fn weights with float32 ``weight_scale`` tensors from
  the checkpoint: per tensor for attention (q, k and v scales into one (3,) param of the
  fused ``qkv_proj``), per output channel for the MLP (sharded with the rows).
- :class:`TiedGptqRuntime`: an input embedding that ``lm_head`` shares (the loader skips
  ``lm_head.weight``) and GPTQ-like packed int32 ``qweight``/``qzeros``, fp16 ``scales``
  and int32 ``g_idx``, loaded raw (column-parallel: column slices of the packed tensors).

Each load is checked against brute force: every runtime tensor's bits before and after,
and an expected map, written here independently of the loaders, from each checkpoint
region to its runtime region (:meth:`regions`), which the ``writes`` table of
:func:`patchkit.inspect_load` must match row for row.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import pytest
import torch
from torch import nn

import patchkit
from patchkit import CheckpointWeightPatch as Patch
from patchkit import load_checkpoint_weight_patches

FP8 = torch.float8_e4m3fn


class InjectedFailure(RuntimeError):
    pass


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
        t.element_size()])


def _param(shape, dtype, gen: torch.Generator) -> nn.Parameter:
    if dtype.is_floating_point:
        t = (torch.randn(shape, generator=gen) * 4).to(dtype)
    else:
        t = torch.randint(-2**31, 2**31 - 1, shape, generator=gen, dtype=torch.int64).to(dtype)
    return nn.Parameter(t, requires_grad=False)


class _Runtime(nn.Module):
    """What the three models share: parameters registered by dotted name, a counter of
    copies that can raise part-way (``fail_at``: the copy number that raises instead of
    writing), and the brute-force helpers."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.gen = torch.Generator().manual_seed(seed)
        self.copies = 0
        self.fail_at: int | None = None

    def add(self, name: str, shape, dtype) -> nn.Parameter:
        *path, leaf = name.split(".")
        mod: nn.Module = self
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, nn.Module())
            mod = getattr(mod, part)
        p = _param(shape, dtype, self.gen)
        mod.register_parameter(leaf, p)
        return p

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.fail_at is not None and self.copies == self.fail_at:
            raise InjectedFailure(f"injected failure at copy {self.copies}")
        self.copies += 1
        dst.copy_(src)

    def checkpoint(self, seed: int) -> dict[str, torch.Tensor]:
        """A full checkpoint of random values (each name's shape and dtype)."""
        g = torch.Generator().manual_seed(seed)
        out = {}
        for name, (shape, dtype) in self.ckpt_shapes().items():
            if dtype.is_floating_point:
                out[name] = (torch.randn(shape, generator=g) * 3).to(dtype)
            else:
                out[name] = torch.randint(-2**31, 2**31 - 1, shape, generator=g,
                                          dtype=torch.int64).to(dtype)
        return out


# -- MoE ------------------------------------------------------------------------------


class MoERuntime(_Runtime):
    """Fused experts per layer (vLLM's FusedMoE layout), a router and a norm.

    Checkpoint: ``model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight``,
    ``model.layers.{l}.mlp.gate.weight`` (E, H), ``model.layers.{l}.input_layernorm.weight``.
    """

    def __init__(self, *, layers=2, hidden=8, inter=6, experts=4, tp_size=1, tp_rank=0,
                 ep_size=1, ep_rank=0, dtype=torch.bfloat16, fp8=False, seed=0) -> None:
        super().__init__(seed)
        self.fp8 = fp8
        wdtype = FP8 if fp8 else dtype
        assert inter % tp_size == 0 and experts % ep_size == 0
        self.L, self.H, self.I, self.E = layers, hidden, inter, experts
        self.tp_size, self.tp_rank, self.ep_rank = tp_size, tp_rank, ep_rank
        self.Il, self.El = inter // tp_size, experts // ep_size
        for layer in range(layers):
            p = f"model.layers.{layer}"
            self.add(f"{p}.input_layernorm.weight", (hidden,), dtype)
            self.add(f"{p}.mlp.gate.weight", (experts, hidden), dtype)
            w13 = self.add(f"{p}.mlp.experts.w13_weight", (self.El, 2 * self.Il, hidden), wdtype)
            w2 = self.add(f"{p}.mlp.experts.w2_weight", (self.El, hidden, self.Il), wdtype)
            w13.weight_loader = w2.weight_loader = self.expert_weight_loader
            if fp8:  # per-tensor scales of each expert's gate, up (E, 2) and down (E,)
                s13 = self.add(f"{p}.mlp.experts.w13_weight_scale", (self.El, 2), torch.float32)
                s2 = self.add(f"{p}.mlp.experts.w2_weight_scale", (self.El,), torch.float32)
                s13.weight_loader = s2.weight_loader = self.expert_weight_loader
        # (param_part, weight_part, expert_id, shard_id), as a FusedMoE model maps them
        self.expert_mapping = [
            ("experts.w13_" if shard in ("w1", "w3") else "experts.w2_",
             f"experts.{e}.{ckpt}.", e, shard)
            for e in range(experts)
            for ckpt, shard in (("gate_proj", "w1"), ("down_proj", "w2"), ("up_proj", "w3"))
        ]

    def expert_weight_loader(self, param, loaded_weight, weight_name, shard_id, expert_id):
        local = expert_id - self.ep_rank * self.El
        if not 0 <= local < self.El:
            return False  # another rank's expert
        expert = param.data[local]
        if weight_name.endswith("weight_scale"):  # a checkpoint scale of shape (1,)
            scale = loaded_weight.reshape(())
            self.copy(expert if shard_id == "w2" else expert[0 if shard_id == "w1" else 1],
                      scale)
        elif shard_id == "w2":  # down: (H, I), row-parallel, sharded on its input dim
            self.copy(expert, loaded_weight.narrow(1, self.tp_rank * self.Il, self.Il))
        else:  # gate (w1) or up (w3): (I, H), sharded on its output dim
            src = loaded_weight.narrow(0, self.tp_rank * self.Il, self.Il)
            self.copy(expert.narrow(0, 0 if shard_id == "w1" else self.Il, self.Il), src)
        return True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        for name, w in weights:
            for param_part, weight_part, expert_id, shard_id in self.expert_mapping:
                if weight_part in name:
                    mapped = name.replace(weight_part, param_part)
                    param = params[mapped]
                    if param.weight_loader(param, w, mapped, shard_id=shard_id,
                                           expert_id=expert_id):
                        loaded.add(mapped)
                    break
            else:
                self.copy(params[name].data, w)  # replicated: router, norm
                loaded.add(name)
        return loaded

    def ckpt_shapes(self):
        out = {}
        for layer in range(self.L):
            p = f"model.layers.{layer}"
            out[f"{p}.input_layernorm.weight"] = ((self.H,), torch.float32)
            out[f"{p}.mlp.gate.weight"] = ((self.E, self.H), torch.float32)
            for e in range(self.E):
                out[f"{p}.mlp.experts.{e}.gate_proj.weight"] = ((self.I, self.H), torch.float32)
                out[f"{p}.mlp.experts.{e}.up_proj.weight"] = ((self.I, self.H), torch.float32)
                out[f"{p}.mlp.experts.{e}.down_proj.weight"] = ((self.H, self.I), torch.float32)
                if self.fp8:
                    for proj in ("gate_proj", "up_proj", "down_proj"):
                        out[f"{p}.mlp.experts.{e}.{proj}.weight"] = (
                            out[f"{p}.mlp.experts.{e}.{proj}.weight"][0], FP8)
                        out[f"{p}.mlp.experts.{e}.{proj}.weight_scale"] = ((1,), torch.float32)
        return out

    def regions(self, name):
        """[(target, target index, checkpoint index)] for one checkpoint name."""
        parts = name.split(".")
        layer = f"model.layers.{parts[2]}"
        if "experts" not in parts:
            return [(name, (), ())]
        e = int(parts[parts.index("experts") + 1])
        kind = parts[-2]
        local = e - self.ep_rank * self.El
        if not 0 <= local < self.El:
            return []
        rows = slice(self.tp_rank * self.Il, (self.tp_rank + 1) * self.Il)
        if parts[-1] == "weight_scale":
            if kind == "down_proj":
                return [(f"{layer}.mlp.experts.w2_weight_scale", (local,), (0,))]
            return [(f"{layer}.mlp.experts.w13_weight_scale",
                     (local, 0 if kind == "gate_proj" else 1), (0,))]
        if kind == "down_proj":
            return [(f"{layer}.mlp.experts.w2_weight", (local, slice(None), slice(None)),
                     (slice(None), rows))]
        start = 0 if kind == "gate_proj" else self.Il
        return [(f"{layer}.mlp.experts.w13_weight",
                 (local, slice(start, start + self.Il), slice(None)), (rows, slice(None)))]

    def returned_name(self, name):
        parts = name.split(".")
        if "experts" not in parts:
            return name
        i = parts.index("experts")
        kind, leaf = parts[i + 2], parts[-1]
        return ".".join([*parts[:i + 1], ("w2_" if kind == "down_proj" else "w13_") + leaf])


class FusedCheckpointMoE(_Runtime):
    """Experts already fused in the checkpoint, stored (E, in, out) as Llama 4 and gpt-oss
    checkpoints store them: ``model.layers.{l}.feed_forward.experts.gate_up_proj``
    (E, H, 2*I, gate columns then up columns) and ``...experts.down_proj`` (E, I, H). The
    loader narrows this rank's experts and intermediate columns and copies the transposed
    view into ``w13_weight`` (E_l, 2*I_l, H) and ``w2_weight`` (E_l, H, I_l).
    """

    def __init__(self, *, layers=1, hidden=8, inter=6, experts=4, tp_size=1, tp_rank=0,
                 ep_size=1, ep_rank=0, seed=3) -> None:
        super().__init__(seed)
        self.L, self.H, self.I, self.E = layers, hidden, inter, experts
        self.tp_rank, self.ep_rank = tp_rank, ep_rank
        self.Il, self.El = inter // tp_size, experts // ep_size
        for layer in range(layers):
            p = f"model.layers.{layer}.feed_forward.experts"
            self.add(f"{p}.w13_weight", (self.El, 2 * self.Il, hidden), torch.bfloat16)
            self.add(f"{p}.w2_weight", (self.El, hidden, self.Il), torch.bfloat16)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        for name, w in weights:
            prefix, leaf = name.rsplit(".", 1)
            mine = w.narrow(0, self.ep_rank * self.El, self.El)
            cols = self.tp_rank * self.Il
            if leaf == "gate_up_proj":
                w13 = params[f"{prefix}.w13_weight"].data
                for k in range(2):  # gate, then up
                    src = mine.narrow(2, k * self.I + cols, self.Il).transpose(1, 2)
                    self.copy(w13.narrow(1, k * self.Il, self.Il), src)
                loaded.add(f"{prefix}.w13_weight")
            else:
                src = mine.narrow(1, cols, self.Il).transpose(1, 2)
                self.copy(params[f"{prefix}.w2_weight"].data, src)
                loaded.add(f"{prefix}.w2_weight")
        return loaded

    def ckpt_shapes(self):
        out = {}
        for layer in range(self.L):
            p = f"model.layers.{layer}.feed_forward.experts"
            out[f"{p}.gate_up_proj"] = ((self.E, self.H, 2 * self.I), torch.float32)
            out[f"{p}.down_proj"] = ((self.E, self.I, self.H), torch.float32)
        return out

    def regions(self, name):
        prefix, leaf = name.rsplit(".", 1)
        full = slice(None)
        es = slice(self.ep_rank * self.El, (self.ep_rank + 1) * self.El)
        c0 = self.tp_rank * self.Il
        if leaf == "down_proj":
            return [(f"{prefix}.w2_weight", (full, full, full),
                     (es, slice(c0, c0 + self.Il), full), (0, 2, 1))]
        return [(f"{prefix}.w13_weight", (full, slice(k * self.Il, (k + 1) * self.Il), full),
                 (es, full, slice(k * self.I + c0, k * self.I + c0 + self.Il)), (0, 2, 1))
                for k in range(2)]

    def returned_name(self, name):
        prefix, leaf = name.rsplit(".", 1)
        return f"{prefix}.{'w2_weight' if leaf == 'down_proj' else 'w13_weight'}"


# -- fp8 ------------------------------------------------------------------------------


class Fp8Runtime(_Runtime):
    """float8_e4m3fn linear weights with float32 scales, as an fp8 checkpoint stores them.

    Attention: per-tensor scales; the fused ``qkv_proj.weight_scale`` is (3,), one per
    shard, each filled from the checkpoint's scalar ``{q,k,v}_proj.weight_scale``.
    ``o_proj`` is row parallel (weight sharded on dim 1), its per-tensor scale scalar.
    MLP: per-output-channel scales (rows, 1), sharded with the weight's rows for the
    column-parallel ``gate_up_proj``, whole for the row-parallel ``down_proj``.
    """

    def __init__(self, *, layers=1, hidden=8, heads=4, kv_heads=2, inter=8, tp_size=1,
                 tp_rank=0, seed=1) -> None:
        super().__init__(seed)
        d = hidden // heads
        self.L, self.H, self.I = layers, hidden, inter
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.Q, self.KV = heads * d, kv_heads * d
        self.Ql, self.KVl, self.Il = self.Q // tp_size, self.KV // tp_size, inter // tp_size
        self.Hl = hidden // tp_size
        for layer in range(layers):
            p = f"model.layers.{layer}"
            self.add(f"{p}.self_attn.qkv_proj.weight", (self.Ql + 2 * self.KVl, hidden), FP8)
            self.add(f"{p}.self_attn.qkv_proj.weight_scale", (3,), torch.float32)
            self.add(f"{p}.self_attn.o_proj.weight", (hidden, self.Hl), FP8)
            self.add(f"{p}.self_attn.o_proj.weight_scale", (), torch.float32)
            self.add(f"{p}.mlp.gate_up_proj.weight", (2 * self.Il, hidden), FP8)
            self.add(f"{p}.mlp.gate_up_proj.weight_scale", (2 * self.Il, 1), torch.float32)
            self.add(f"{p}.mlp.down_proj.weight", (hidden, self.Il), FP8)
            self.add(f"{p}.mlp.down_proj.weight_scale", (hidden, 1), torch.float32)
        self.stacked = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"),
                        ("qkv_proj", "v_proj", "v"), ("gate_up_proj", "gate_proj", 0),
                        ("gate_up_proj", "up_proj", 1)]

    def _rows(self, shard):
        """(offset in the fused param, rows per rank) of a shard."""
        return {"q": (0, self.Ql), "k": (self.Ql, self.KVl), "v": (self.Ql + self.KVl, self.KVl),
                0: (0, self.Il), 1: (self.Il, self.Il)}[shard]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        for name, w in weights:
            parts = name.split(".")
            for fused, part, shard in self.stacked:
                if part in parts:
                    parts[parts.index(part)] = fused
                    mapped = ".".join(parts)
                    param = params[mapped]
                    off, n = self._rows(shard)
                    if mapped.endswith("weight_scale") and param.dim() == 1:  # per tensor
                        self.copy(param.data[("q", "k", "v").index(shard)], w)
                    else:  # weight, or per-channel scale: this rank's rows
                        self.copy(param.data.narrow(0, off, n),
                                  w.narrow(0, self.tp_rank * n, n))
                    break
            else:
                mapped = name
                param = params[name]
                if name.endswith("o_proj.weight"):
                    self.copy(param.data, w.narrow(1, self.tp_rank * self.Hl, self.Hl))
                elif name.endswith("down_proj.weight"):
                    self.copy(param.data, w.narrow(1, self.tp_rank * self.Il, self.Il))
                else:  # scales of the row-parallel layers: replicated
                    self.copy(param.data, w)
            loaded.add(mapped)
        return loaded

    def ckpt_shapes(self):
        out = {}
        f32 = torch.float32
        for layer in range(self.L):
            a, m = f"model.layers.{layer}.self_attn", f"model.layers.{layer}.mlp"
            for proj, rows in (("q_proj", self.Q), ("k_proj", self.KV), ("v_proj", self.KV)):
                out[f"{a}.{proj}.weight"] = ((rows, self.H), FP8)
                out[f"{a}.{proj}.weight_scale"] = ((), f32)
            out[f"{a}.o_proj.weight"] = ((self.H, self.H), FP8)
            out[f"{a}.o_proj.weight_scale"] = ((), f32)
            for proj in ("gate_proj", "up_proj"):
                out[f"{m}.{proj}.weight"] = ((self.I, self.H), FP8)
                out[f"{m}.{proj}.weight_scale"] = ((self.I, 1), f32)
            out[f"{m}.down_proj.weight"] = ((self.H, self.I), FP8)
            out[f"{m}.down_proj.weight_scale"] = ((self.H, 1), f32)
        return out

    def regions(self, name):
        parts = name.split(".")
        proj, leaf = parts[-2], parts[-1]
        prefix = ".".join(parts[:-2])
        r = self.tp_rank
        full = slice(None)
        if proj in ("q_proj", "k_proj", "v_proj"):
            tgt = f"{prefix}.qkv_proj.{leaf}"
            if leaf == "weight_scale":
                return [(tgt, ("qkv".index(proj[0]),), ())]
            n = {"q_proj": self.Ql, "k_proj": self.KVl, "v_proj": self.KVl}[proj]
            off = {"q_proj": 0, "k_proj": self.Ql, "v_proj": self.Ql + self.KVl}[proj]
            return [(tgt, (slice(off, off + n), full), (slice(r * n, (r + 1) * n), full))]
        if proj in ("gate_proj", "up_proj"):
            off = 0 if proj == "gate_proj" else self.Il
            rows = slice(r * self.Il, (r + 1) * self.Il)
            return [(f"{prefix}.gate_up_proj.{leaf}", (slice(off, off + self.Il), full),
                     (rows, full))]
        if leaf == "weight_scale":
            return [(name, (), ())]
        n = self.Hl if proj == "o_proj" else self.Il
        return [(name, (full, full), (full, slice(r * n, (r + 1) * n)))]

    def returned_name(self, name):
        for fused, part, _ in self.stacked:
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{fused}.")
        return name


# -- tied embeddings and GPTQ-like packed int32 --------------------------------------


class TiedGptqRuntime(_Runtime):
    """A vocab-parallel embedding tied to ``lm_head`` and a GPTQ-like column-parallel
    ``gate_up_proj`` (4-bit, 8 values per int32, groups of ``group`` input rows).

    Runtime: ``qweight`` (H/8, 2*I_l) int32, ``qzeros`` (H/group, 2*I_l/8) int32,
    ``scales`` (H/group, 2*I_l) fp16, ``g_idx`` (H,) int32 (replicated); the shards are
    column slices of the packed tensors.
    """

    def __init__(self, *, vocab=16, hidden=16, inter=16, group=8, tp_size=1, tp_rank=0,
                 seed=2) -> None:
        super().__init__(seed)
        self.V, self.H, self.I, self.G = vocab, hidden, inter, group
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.Vl, self.Il = vocab // tp_size, inter // tp_size
        emb = self.add("model.embed_tokens.weight", (self.Vl, hidden), torch.float16)
        self.lm_head = nn.Module()
        self.lm_head.register_parameter("weight", emb)  # tied: the same Parameter
        self.add("model.norm.weight", (hidden,), torch.float16)
        m = "model.layers.0.mlp.gate_up_proj"
        self.add(f"{m}.qweight", (hidden // 8, 2 * self.Il), torch.int32)
        self.add(f"{m}.qzeros", (hidden // group, 2 * self.Il // 8), torch.int32)
        self.add(f"{m}.scales", (hidden // group, 2 * self.Il), torch.float16)
        self.add(f"{m}.g_idx", (hidden,), torch.int32)

    def _cols(self, leaf):
        """Columns per rank and per shard of a packed leaf (output dim is dim 1)."""
        return self.Il // 8 if leaf == "qzeros" else self.Il

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded = set()
        for name, w in weights:
            if name == "lm_head.weight":
                continue  # tied: vLLM skips it
            parts = name.split(".")
            if "gate_proj" in parts or "up_proj" in parts:
                shard = 0 if "gate_proj" in parts else 1
                parts[4] = "gate_up_proj"
                mapped = ".".join(parts)
                param = params[mapped]
                if parts[-1] == "g_idx":  # the same for gate and up
                    self.copy(param.data, w)
                else:
                    n = self._cols(parts[-1])
                    self.copy(param.data.narrow(1, shard * n, n),
                              w.narrow(1, self.tp_rank * n, n))
                loaded.add(mapped)
            elif name == "model.embed_tokens.weight":
                self.copy(params[name].data, w.narrow(0, self.tp_rank * self.Vl, self.Vl))
                loaded.add(name)
            else:
                self.copy(params[name].data, w)
                loaded.add(name)
        return loaded

    def ckpt_shapes(self):
        out = {"model.embed_tokens.weight": ((self.V, self.H), torch.float16),
               "model.norm.weight": ((self.H,), torch.float16)}
        for proj in ("gate_proj", "up_proj"):
            p = f"model.layers.0.mlp.{proj}"
            out[f"{p}.qweight"] = ((self.H // 8, self.I), torch.int32)
            out[f"{p}.qzeros"] = ((self.H // self.G, self.I // 8), torch.int32)
            out[f"{p}.scales"] = ((self.H // self.G, self.I), torch.float16)
            out[f"{p}.g_idx"] = ((self.H,), torch.int32)
        return out

    def regions(self, name):
        full = slice(None)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            r = self.tp_rank
            return [("model.embed_tokens.weight", (full, full),
                     (slice(r * self.Vl, (r + 1) * self.Vl), full))]
        parts = name.split(".")
        if "gate_proj" not in parts and "up_proj" not in parts:
            return [(name, (), ())]
        leaf = parts[-1]
        tgt = f"model.layers.0.mlp.gate_up_proj.{leaf}"
        if leaf == "g_idx":
            return [(tgt, (), ())]
        n = self._cols(leaf)
        off = 0 if "gate_proj" in parts else n
        return [(tgt, (full, slice(off, off + n)),
                 (full, slice(self.tp_rank * n, (self.tp_rank + 1) * n)))]

    def returned_name(self, name):
        if name == "lm_head.weight":
            return "model.embed_tokens.weight"
        return name.replace(".gate_proj.", ".gate_up_proj.").replace(".up_proj.",
                                                                      ".gate_up_proj.")


# -- brute force ----------------------------------------------------------------------


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.named_parameters()}


def assert_same_bits(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape
        assert torch.equal(_bits(got[name]), _bits(want[name])), name


def _start_offset(index, shape) -> int:
    starts = [i if isinstance(i, int) else (i.start or 0) for i in index]
    starts += [0] * (len(shape) - len(starts))
    return int(np.ravel_multi_index(starts, shape)) if shape else 0


def _canonical(model, name):
    return "model.embed_tokens.weight" if name == "lm_head.weight" and hasattr(
        model, "lm_head") else name


def expected_load(model, before, patches):
    """Apply ``patches`` to a copy of ``before`` by the independent region map.

    Returns (after, rows, masks): rows are the expected ``writes`` rows in order, masks
    each target's written elements. Tied alias patches in the same call as the canonical
    name are not modelled here: callers that send both check that separately.
    """
    state = {n: t.clone() for n, t in before.items()}
    masks = {n: torch.zeros(t.shape, dtype=torch.bool) for n, t in before.items()}
    rows = []
    for pos, p in enumerate(patches):
        staged = patchkit.stage(p)
        for target, tidx, cidx, *perm in model.regions(_canonical(model, p.name)):
            dst = state[target][tidx]
            src = staged[cidx]
            src = (src.permute(*perm[0]) if perm else src).to(dst.dtype)
            keep = (src.float().isnan() if p.indices is not None
                    else torch.zeros(src.shape, dtype=torch.bool))
            new = torch.where(keep, _bits(dst), _bits(src))
            changed = int((new != _bits(dst)).sum())
            view = _bits(state[target])
            view[tidx] = new
            masks[target][tidx] |= ~keep
            rows.append(dict(position=pos, name=_canonical(model, p.name),  # as sent
                             checkpoint_offset=_start_offset(cidx, tuple(staged.shape)),
                             target=target,
                             target_offset=_start_offset(tidx, tuple(before[target].shape)),
                             shape=tuple(dst.shape), elements=dst.numel(),
                             written=int((~keep).sum()), changed=changed))
    return state, rows, masks


def dense_patches(ckpt, names=None):
    names = list(ckpt) if names is None else names
    return [Patch(n, tuple(ckpt[n].shape), ckpt[n].dtype, ckpt[n].flatten()) for n in names]


def sparse_patches(ckpt, seed, density=0.4, names=None):
    """Random positions of each float tensor, values from ``ckpt``; the values travel as
    float32 (cast to the patch dtype when staged). Cast, then indexed: torch 2.4 has no
    CPU index kernel for float8, and the cast is exact."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in (list(ckpt) if names is None else names):
        t = ckpt[n]
        if not t.dtype.is_floating_point:
            continue
        numel = t.numel()
        idx = torch.nonzero(torch.rand(numel, generator=g) < density).flatten()
        out.append(Patch(n, tuple(t.shape), t.dtype, t.flatten().float()[idx], idx))
    return out


def check_load(model, patches, *, max_chunk_bytes=1 << 20):
    """inspect_load against brute force: the model's new bits, every ``writes`` row, the
    ``deltas`` counts, the returned names. Returns the report."""
    before = snapshot(model)
    want, rows, masks = expected_load(model, before, patches)
    report = patchkit.inspect_load(model, patches, max_chunk_bytes=max_chunk_bytes)
    assert report.error is None
    assert_same_bits(snapshot(model), want)

    w = report.writes
    got = [dict(position=int(r.position), name=r.name,
                checkpoint_offset=int(r.checkpoint_offset), target=r.target,
                target_offset=int(r.target_offset), shape=tuple(r.shape),
                elements=int(r.elements), written=int(r.written), changed=int(r.changed))
           for r in w.itertuples()]
    assert got == rows

    for target, mask in masks.items():
        n_changed = int((_bits(before[target]) != _bits(want[target])).sum())
        if not mask.any():
            assert target not in report.deltas.index
            continue
        assert int(report.deltas.loc[target, "elements"]) == int(mask.sum()), target
        assert int(report.deltas.loc[target, "changed"]) == n_changed, target
        assert torch.equal(report.written(target), mask), target
        assert torch.equal(_bits(report.before(target)), _bits(before[target])), target
        assert torch.equal(_bits(report.after(target)), _bits(want[target])), target

    # the contract's chunk walk (CONTRACT §2), on the names as sent
    chunk, plan, used, seen = 0, [], 0, set()
    for p in patches:
        cost = math.prod(p.shape) * p.dtype.itemsize
        name = _canonical(model, p.name)
        if seen and (used + cost > max_chunk_bytes or name in seen):
            chunk, used, seen = chunk + 1, 0, set()
        plan.append(chunk)
        used += cost
        seen.add(name)
    assert list(report.chunks["chunk"]) == plan
    assert list(report.calls["chunk"]) == sorted(set(plan))

    want_loaded = {model.returned_name(p.name) for p in patches
                   if model.regions(_canonical(model, p.name))}
    assert report.loaded == want_loaded
    calls = report.calls
    assert sum(int(c) for c in calls["writes"]) == len(rows)
    assert set().union(*[set(r) for r in calls["returned"]]) == want_loaded
    return report


# -- the tests -----------------------------------------------------------------------

MOE_SETUPS = [dict(), dict(tp_size=2, tp_rank=1), dict(ep_size=2, ep_rank=1),
              dict(tp_size=3, tp_rank=2, ep_size=4, ep_rank=2),
              dict(fp8=True, tp_size=2, tp_rank=1, ep_size=2, ep_rank=0)]


@pytest.mark.parametrize("setup", MOE_SETUPS, ids=str)
@pytest.mark.parametrize("kind", ["dense", "sparse"])
@pytest.mark.parametrize("max_chunk_bytes", [1, 700, 1 << 20])
def test_moe_loads_match_brute_force(setup, kind, max_chunk_bytes):
    model = MoERuntime(**setup)
    ckpt = model.checkpoint(seed=5)
    patches = dense_patches(ckpt) if kind == "dense" else sparse_patches(ckpt, seed=6)
    check_load(model, patches, max_chunk_bytes=max_chunk_bytes)


@pytest.mark.parametrize("setup", [dict(), dict(tp_size=2, tp_rank=1, ep_size=2, ep_rank=1),
                                   dict(tp_size=3, tp_rank=1, ep_size=4, ep_rank=3)], ids=str)
@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_fused_checkpoint_moe_transposed_sources(setup, kind):
    model = FusedCheckpointMoE(**setup)
    ckpt = model.checkpoint(seed=4)
    for mcb in (1, 1 << 20):
        patches = (dense_patches(ckpt) if kind == "dense"
                   else sparse_patches(model.checkpoint(seed=mcb), seed=mcb))
        check_load(model, patches, max_chunk_bytes=mcb)


def test_moe_expert_slice_offsets_are_the_experts():
    """Spelled out for one expert: expert 3's up_proj lands at local expert 1 of a rank
    holding experts 2 and 3, rows I_l..2*I_l of w13, from this rank's rows of up_proj."""
    model = MoERuntime(tp_size=2, tp_rank=1, ep_size=2, ep_rank=1, hidden=8, inter=6)
    ckpt = model.checkpoint(seed=1)
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    report = check_load(model, dense_patches(ckpt, [name]))
    (row,) = report.writes.itertuples()
    assert row.target == "model.layers.1.mlp.experts.w13_weight"
    # local expert 1 of (2, 6, 8), row 3 (Il = 3): 1*6*8 + 3*8
    assert int(row.target_offset) == 72 and tuple(row.shape) == (3, 8)
    assert int(row.checkpoint_offset) == 3 * 8  # rank 1's rows of (6, 8)
    w13 = model.get_parameter(row.target)
    assert torch.equal(_bits(w13[1, 3:6]), _bits(ckpt[name][3:6].to(torch.bfloat16)))


def test_moe_other_ranks_experts_are_skipped_not_returned():
    model = MoERuntime(ep_size=2, ep_rank=0)
    ckpt = model.checkpoint(seed=2)
    names = [n for n in ckpt if ".experts.3." in n or ".experts.2." in n]
    before = snapshot(model)
    assert load_checkpoint_weight_patches(model, dense_patches(ckpt, names)) == set()
    assert_same_bits(snapshot(model), before)
    # and sparse: a call that owns none of its weights returns an empty set, no error
    assert load_checkpoint_weight_patches(model, sparse_patches(ckpt, 3, names=names)) == set()
    assert_same_bits(snapshot(model), before)


def test_moe_repeated_names_apply_in_order():
    model = MoERuntime(tp_size=2, tp_rank=0)
    a, b = model.checkpoint(seed=7), model.checkpoint(seed=8)
    name = "model.layers.0.mlp.experts.1.down_proj.weight"
    other = "model.layers.0.mlp.experts.1.gate_proj.weight"
    patches = (sparse_patches(a, 1, 0.6, [name, other]) + sparse_patches(b, 2, 0.6, [name])
               + sparse_patches(b, 3, 0.5, [other, name]))
    report = check_load(model, patches)
    # a repeated name closes the call before it: [name, other], [name, other], [name];
    # the later patch of a name wins where both touch a position (check_load's brute force)
    assert list(report.chunks["chunk"]) == [0, 0, 1, 1, 2]


def test_fp8_dense_and_sparse_match_brute_force():
    for setup in (dict(), dict(tp_size=2, tp_rank=1)):
        model = Fp8Runtime(**setup)
        ckpt = model.checkpoint(seed=3)
        check_load(model, dense_patches(ckpt))
        for mcb in (1, 100, 1 << 20):
            check_load(model, sparse_patches(model.checkpoint(seed=mcb), seed=mcb, density=0.5),
                       max_chunk_bytes=mcb)


def test_fp8_per_shard_scales_go_to_their_element():
    model = Fp8Runtime(tp_size=2, tp_rank=0)
    ckpt = model.checkpoint(seed=4)
    names = [f"model.layers.0.self_attn.{p}_proj.weight_scale" for p in "kvq"]
    report = check_load(model, dense_patches(ckpt, names))
    assert list(report.writes["target_offset"]) == [1, 2, 0]
    assert [tuple(s) for s in report.writes["shape"]] == [(), (), ()]
    scale = model.get_parameter("model.layers.0.self_attn.qkv_proj.weight_scale")
    assert torch.equal(scale, torch.stack([ckpt[n] for n in names[2:] + names[:2]]))


def test_fp8_sparse_nan_never_reaches_the_model():
    """A sparse fp8 patch whose positions cover only some of a fused shard: the staged
    fp8 NaN everywhere else must keep the runtime bits (e4m3fn's NaN is 0x7f/0xff)."""
    model = Fp8Runtime()
    ckpt = model.checkpoint(seed=9)
    patches = sparse_patches(ckpt, seed=9, density=0.1)
    check_load(model, patches)
    for name, t in model.named_parameters():
        assert not t.float().isnan().any(), name


def test_tied_and_gptq_dense_match_brute_force():
    for setup in (dict(), dict(tp_size=2, tp_rank=1)):
        model = TiedGptqRuntime(**setup)
        ckpt = model.checkpoint(seed=11)
        names = [n for n in ckpt if n != "model.embed_tokens.weight"]
        ckpt["lm_head.weight"] = ckpt.pop("model.embed_tokens.weight")
        for mcb in (1, 64, 1 << 20):
            check_load(model, dense_patches(ckpt, ["lm_head.weight", *names]),
                       max_chunk_bytes=mcb)
        check_load(model, sparse_patches(model.checkpoint(seed=12), seed=12))


def test_tied_alias_with_canonical_in_one_call_is_written_once():
    model = TiedGptqRuntime()
    ckpt = model.checkpoint(seed=13)
    emb = ckpt["model.embed_tokens.weight"]
    patches = dense_patches({"model.embed_tokens.weight": emb, "lm_head.weight": emb})
    report = patchkit.inspect_load(model, patches)
    assert len(report.writes) == 1
    assert torch.equal(model.lm_head.weight, emb)
    assert report.loaded == {"model.embed_tokens.weight"}


def test_packed_int32_refused_sparse_before_anything():
    model = TiedGptqRuntime()
    before = snapshot(model)
    q = "model.layers.0.mlp.gate_proj.qweight"
    # a sparse patch of an int32 dtype: no NaN to mean "keep", refused by validation
    with pytest.raises(TypeError, match="floating"):
        load_checkpoint_weight_patches(model, [Patch(q, (2, 16), torch.int32,
                                                     torch.ones(1, dtype=torch.int32),
                                                     torch.tensor([3]))])
    # a float sparse patch the loader copies into the int32 param: refused at that copy
    with pytest.raises(NotImplementedError, match="same-shaped floating-point"):
        load_checkpoint_weight_patches(model, [Patch(q, (2, 16), torch.float32,
                                                     torch.ones(1), torch.tensor([3]))])
    # int32 bits sent as float32 and bit-cast back by the loader: its staged NaN would be
    # the word 0x7fc00000, so that copy is refused too
    qweight = model.get_parameter("model.layers.0.mlp.gate_up_proj.qweight")

    def bitcasting_loader(weights):
        for _, w in weights:
            qweight.data.narrow(1, 0, 16).copy_(w.view(torch.int32))
        return {"model.layers.0.mlp.gate_up_proj.qweight"}

    model.load_weights = bitcasting_loader
    with pytest.raises(NotImplementedError, match="same-shaped floating-point"):
        load_checkpoint_weight_patches(model, [Patch(q, (2, 16), torch.float32,
                                                     torch.ones(1), torch.tensor([3]))])
    assert_same_bits(snapshot(model), before)


ROLLBACK_CASES = [
    (lambda: MoERuntime(fp8=True, ep_size=2, ep_rank=1), "dense"),
    (lambda: FusedCheckpointMoE(tp_size=2, tp_rank=1, ep_size=2, ep_rank=0), "sparse"),
    (lambda: MoERuntime(tp_size=2, tp_rank=1, ep_size=2, ep_rank=0), "dense"),
    (lambda: MoERuntime(ep_size=2, ep_rank=1), "sparse"),
    (lambda: Fp8Runtime(tp_size=2, tp_rank=1), "dense"),
    (lambda: Fp8Runtime(), "sparse"),
    (lambda: TiedGptqRuntime(tp_size=2, tp_rank=0), "dense"),
    (lambda: TiedGptqRuntime(), "sparse"),
]


@pytest.mark.parametrize("make,kind", ROLLBACK_CASES)
@pytest.mark.parametrize("inspect", [False, True])
def test_transactional_failure_part_way_restores_every_bit(make, kind, inspect):
    model = make()
    ckpt = model.checkpoint(seed=21)
    patches = dense_patches(ckpt) if kind == "dense" else sparse_patches(ckpt, seed=22)
    # repeat a few names so some regions are written twice before the failure
    patches += patches[:3]
    total = sum(len(model.regions(_canonical(model, p.name))) for p in patches)
    for fail_at in (0, total // 2, total - 1):
        before = snapshot(model)
        model.copies, model.fail_at = 0, fail_at
        if inspect:
            with pytest.raises(InjectedFailure) as exc:
                patchkit.inspect_load(model, patches, max_chunk_bytes=300, transactional=True)
            assert exc.value.report.rolled_back
            assert len(exc.value.report.writes) == fail_at
        else:
            with pytest.raises(InjectedFailure):
                load_checkpoint_weight_patches(model, patches, max_chunk_bytes=300,
                                               transactional=True)
        assert model.copies == fail_at
        assert_same_bits(snapshot(model), before)
    # and without the failure, the same load applies in full
    model.fail_at = None
    want, _, _ = expected_load(model, snapshot(model), patches)
    load_checkpoint_weight_patches(model, patches, max_chunk_bytes=300, transactional=True)
    assert_same_bits(snapshot(model), want)


@pytest.mark.parametrize("inspect", [False, True])
def test_non_transactional_failure_keeps_exactly_the_writes_made(inspect):
    model = MoERuntime(tp_size=2, tp_rank=0, ep_size=2, ep_rank=1)
    ckpt = model.checkpoint(seed=31)
    patches = sparse_patches(ckpt, seed=32)
    before = snapshot(model)
    model.fail_at = 10
    # the first 10 copies: the patches up to the tenth that maps to a region
    mapped = [i for i, p in enumerate(patches) if model.regions(p.name)]
    want, rows, _ = expected_load(model, before, patches[:mapped[9] + 1])
    if inspect:
        with pytest.raises(InjectedFailure) as exc:
            patchkit.inspect_load(model, patches, max_chunk_bytes=250)
        report = exc.value.report
        assert not report.rolled_back
        got = report.writes[["position", "target", "target_offset", "written", "changed"]]
        assert [tuple(r) for r in got.itertuples(index=False)] == [
            (r["position"], r["target"], r["target_offset"], r["written"], r["changed"])
            for r in rows]
        for target in report.deltas.index:
            n = int((_bits(before[target]) != _bits(want[target])).sum())
            assert int(report.deltas.loc[target, "changed"]) == n
    else:
        with pytest.raises(InjectedFailure):
            load_checkpoint_weight_patches(model, patches, max_chunk_bytes=250)
    assert_same_bits(snapshot(model), want)
    assert not any(t.float().isnan().any() for t in model.parameters())


class PackedFp8Experts(nn.Module):
    """fp8 expert weights stored four to an int32 word (E, N, K/4), written through a
    ``.view(float8_e4m3fn)`` of the expert: a sparse fp8 patch merges byte by byte."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.w = nn.Parameter(torch.randint(-2**31, 2**31 - 1, (3, 4, 2), generator=g,
                                            dtype=torch.int64).to(torch.int32),
                              requires_grad=False)

    def load_weights(self, weights):
        for name, t in weights:
            self.w.data[int(name.split(".")[1])].view(FP8).copy_(t)
        return {"w"}


def test_fp8_packed_in_int32_words_merges_bytes():
    model = PackedFp8Experts()
    before = model.w.detach().clone()
    new = (torch.randn(4, 8, generator=torch.Generator().manual_seed(6)) * 3).to(FP8)
    idx = torch.tensor([1, 2, 3, 9, 31])
    report = patchkit.inspect_load(
        model, [Patch("experts.1.w", (4, 8), FP8, new.flatten().float()[idx], idx)])
    want = before.clone()
    want[1].view(torch.uint8).view(-1)[idx] = new.view(torch.uint8).flatten()[idx]
    assert torch.equal(model.w, want)
    (row,) = report.writes.itertuples()
    # in int32 words: expert 1 starts at word 8 and its fp8 view spans 8 words
    assert (row.target, int(row.target_offset), int(row.elements)) == ("w", 8, 8)
    words = int((want != before).sum())  # bytes 1-3 share word 0; 9 and 31 one each
    assert int(row.written) == words == 3
    assert int(report.deltas.loc["w", "changed"]) == words


def test_checkpoint_shapes_are_full_size():
    """The region map's sanity: every name's checkpoint region is this rank's shard of
    the full tensor, and the shards of all ranks tile the checkpoint tensor."""
    for make, n_ranks in ((lambda r: MoERuntime(tp_size=3, tp_rank=r), 3),
                          (lambda r: MoERuntime(fp8=True, ep_size=2, ep_rank=r), 2),
                          (lambda r: FusedCheckpointMoE(tp_size=2, tp_rank=r % 2, ep_size=2,
                                                        ep_rank=r // 2), 4),
                          (lambda r: Fp8Runtime(tp_size=2, tp_rank=r), 2),
                          (lambda r: TiedGptqRuntime(tp_size=2, tp_rank=r), 2)):
        models = [make(r) for r in range(n_ranks)]
        for name, (shape, _) in models[0].ckpt_shapes().items():
            hit = torch.zeros(shape, dtype=torch.int64)
            for m in models:
                for _, _, cidx, *_ in m.regions(_canonical(m, name)):
                    hit[cidx] += 1
            # replicated tensors are read whole by each rank; sharded ones once per rank
            assert hit.min() >= 1 and math.prod(shape) > 0, name


@pytest.mark.parametrize("make", [
    lambda: MoERuntime(fp8=True, tp_size=2, tp_rank=1, ep_size=2, ep_rank=1),
    lambda: FusedCheckpointMoE(tp_size=3, tp_rank=2, ep_size=2, ep_rank=0),
    lambda: Fp8Runtime(tp_size=2, tp_rank=0),
    lambda: TiedGptqRuntime(tp_size=2, tp_rank=1),
], ids=["moe-fp8", "fused-moe", "fp8", "tied-gptq"])
def test_trainer_step_through_a_file_equals_loading_the_new_checkpoint(make, tmp_path):
    """A trainer's step: old and new checkpoints, float weights sent as a bitwise sparse
    diff (split in parts, through a patch file), integer weights dense. The model that
    held the old checkpoint must end bit for bit as a model given the new one whole."""
    old_model, new_model = make(), make()
    old, new = old_model.checkpoint(seed=41), old_model.checkpoint(seed=41)
    g = torch.Generator().manual_seed(42)
    for t in new.values():  # change about a third of each tensor
        if t.dtype.is_floating_point:
            mask = torch.rand(t.shape, generator=g) < 0.3
            # (through the bits: torch 2.4 has no CPU index kernels for float8)
            _bits(t)[mask] = _bits((torch.randn(t.shape, generator=g) * 3).to(t.dtype))[mask]
        else:
            t.view(-1)[::3] += 1
    load_checkpoint_weight_patches(old_model, dense_patches(old))
    load_checkpoint_weight_patches(new_model, dense_patches(new))

    floats = [n for n in new if new[n].dtype.is_floating_point]
    ints = [n for n in new if n not in floats]
    sparse = patchkit.sparse_patches_from_diff({n: old[n] for n in floats},
                                               {n: new[n] for n in floats})
    sparse = [part for p in sparse for part in patchkit.split_patch(p, 2)]
    patchkit.save_patches(tmp_path / "step.safetensors", sparse)
    sparse = patchkit.load_patches(tmp_path / "step.safetensors")
    load_checkpoint_weight_patches(old_model, sparse, max_chunk_bytes=256)
    if ints:
        load_checkpoint_weight_patches(old_model, dense_patches(new, ints))
    assert_same_bits(snapshot(old_model), snapshot(new_model))


def test_training_loop_with_reuse_matches_brute_force_every_step():
    """inspect_load(..., reuse=last_report) step after step, sparse and dense steps in
    turn: each report's written/before/deltas are its own load's."""
    for make in (lambda: MoERuntime(fp8=True, tp_size=2, tp_rank=1, ep_size=2, ep_rank=1),
                 lambda: FusedCheckpointMoE(tp_size=2, tp_rank=1),
                 lambda: Fp8Runtime(tp_size=2, tp_rank=1)):
        model, report = make(), None
        for step in range(4):
            ckpt = model.checkpoint(seed=100 + step)
            patches = (dense_patches(ckpt) if step % 2
                       else sparse_patches(ckpt, seed=step, density=0.3))
            before = snapshot(model)
            want, _, masks = expected_load(model, before, patches)
            report = patchkit.inspect_load(model, patches, reuse=report, max_chunk_bytes=300)
            assert_same_bits(snapshot(model), want)
            for target, mask in masks.items():
                if mask.any():
                    assert torch.equal(report.written(target), mask), (step, target)
                    assert torch.equal(_bits(report.before(target)), _bits(before[target]))
                    n = int((_bits(before[target]) != _bits(want[target])).sum())
                    assert int(report.deltas.loc[target, "changed"]) == n, (step, target)
