"""Tests for patchkit.toymodels: the vLLM-style stand-in models and the broken loaders."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import patchkit
from patchkit import CheckpointWeightPatch, ContractViolation, load_checkpoint_weight_patches
from patchkit.toymodels import (
    BROKEN_LOADERS,
    FailingModel,
    OverlappingDestinationsModel,
    PlainModel,
    ReportsWithoutWritingModel,
    ShapeMismatchModel,
    TinyLlamaConfig,
    TinyLlamaRuntime,
    UnknownWeightError,
    WritesThenFillsModel,
    WritesTwiceModel,
    gather_checkpoint,
    tiny_llama_checkpoint,
    tiny_llama_shapes,
)

# Divisible by tp_size 1, 2 and 4 (heads 8, kv heads 4, intermediate 128, vocab 256).
TP4 = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
           num_kv_heads=4)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# (torch 2.8 added float4_e2m1fn_x2: older torch has no such dtype to refuse)
FP4 = getattr(torch, "float4_e2m1fn_x2", None)
needs_fp4 = pytest.mark.skipif(
    FP4 is None, reason="this torch has no float4_e2m1fn_x2 (torch 2.8 has it)")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
        t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a.cpu()), bits(b.cpu()))


def assert_same_checkpoint(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for name in want:
        assert same_bits(got[name], want[name]), name


def dense(ckpt: dict) -> list[CheckpointWeightPatch]:
    return [CheckpointWeightPatch(n, tuple(t.shape), t.dtype, t.flatten()) for n, t in ckpt.items()]


def returned_names(names, tied: bool = False) -> set[str]:
    """What vLLM's Llama loader returns for these checkpoint names: the runtime parameter
    each lands in (q/k/v into qkv_proj, gate/up into gate_up_proj), a tied lm_head not."""
    out = set()
    for n in names:
        if tied and n == "lm_head.weight":
            continue
        for part, packed in (("q_proj", "qkv_proj"), ("k_proj", "qkv_proj"),
                             ("v_proj", "qkv_proj"), ("gate_proj", "gate_up_proj"),
                             ("up_proj", "gate_up_proj")):
            n = n.replace(f".{part}.", f".{packed}.")
        out.add(n)
    return out


def load_ranks(config, tp_size, ckpt, **kw) -> list[TinyLlamaRuntime]:
    ranks = [TinyLlamaRuntime(config, r, tp_size, **kw) for r in range(tp_size)]
    for rt in ranks:
        rt.load_weights(ckpt.items())
    return ranks


# --------------------------------------------------------------------------------------
# config and checkpoint
# --------------------------------------------------------------------------------------


def test_default_config_is_tiny_and_consistent():
    c = TinyLlamaConfig()
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads,
            c.num_kv_heads, c.tie_word_embeddings) == (256, 64, 128, 2, 4, 2, False)
    assert (c.head_dim, c.q_size, c.kv_size) == (16, 64, 32)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(hidden_size=60, num_heads=8), "must divide hidden_size"),
        (dict(num_heads=4, num_kv_heads=3), "must divide num_heads"),
        (dict(vocab_size=0), "vocab_size must be a positive int"),
        (dict(num_layers=-1), "num_layers"),
        (dict(intermediate_size=2.0), "intermediate_size"),
        (dict(num_heads=True), "num_heads"),
        (dict(tie_word_embeddings=1), "tie_word_embeddings"),
    ],
)
def test_bad_config_raises_value_error(kw, match):
    with pytest.raises(ValueError, match=match):
        TinyLlamaConfig(**kw)


@pytest.mark.parametrize("tied", [False, True])
def test_checkpoint_names_shapes_order(tied):
    c = TinyLlamaConfig(num_layers=2, tie_word_embeddings=tied)
    ckpt = tiny_llama_checkpoint(c)
    layer = [
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
    ]
    want = ["model.embed_tokens.weight"]
    want += [f"model.layers.{i}.{n}" for i in range(2) for n in layer]
    want += ["model.norm.weight"] + ([] if tied else ["lm_head.weight"])
    assert list(ckpt) == want
    assert list(tiny_llama_shapes(c)) == want
    h, hd = 64, 16
    expect = {
        "model.embed_tokens.weight": (256, h),
        "model.layers.1.self_attn.q_proj.weight": (4 * hd, h),
        "model.layers.1.self_attn.k_proj.weight": (2 * hd, h),
        "model.layers.1.self_attn.v_proj.weight": (2 * hd, h),
        "model.layers.1.self_attn.o_proj.weight": (h, 4 * hd),
        "model.layers.1.mlp.gate_proj.weight": (128, h),
        "model.layers.1.mlp.up_proj.weight": (128, h),
        "model.layers.1.mlp.down_proj.weight": (h, 128),
        "model.layers.1.input_layernorm.weight": (h,),
        "model.norm.weight": (h,),
    }
    for name, shape in expect.items():
        assert tuple(ckpt[name].shape) == shape, name
    for name, t in ckpt.items():
        assert t.dtype == torch.bfloat16 and t.device.type == "cpu" and t.is_contiguous()
        assert tiny_llama_shapes(c)[name] == tuple(t.shape)
        assert torch.isfinite(t.float()).all()


def test_checkpoint_is_deterministic_per_seed():
    c = TinyLlamaConfig()
    a, b = tiny_llama_checkpoint(c, seed=3), tiny_llama_checkpoint(c, seed=3)
    assert_same_checkpoint(a, b)
    other = tiny_llama_checkpoint(c, seed=4)
    for name in a:
        assert not same_bits(a[name], other[name]), name
    # no two weights of one checkpoint are the same tensor
    assert not same_bits(a["model.layers.0.mlp.gate_proj.weight"],
                         a["model.layers.0.mlp.up_proj.weight"])
    f32 = tiny_llama_checkpoint(c, seed=3, dtype=torch.float32)
    assert all(t.dtype == torch.float32 for t in f32.values())
    assert same_bits(f32["model.norm.weight"].to(torch.bfloat16), a["model.norm.weight"])


# --------------------------------------------------------------------------------------
# the runtime layout
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, tp, match",
    [
        (dict(num_heads=12, num_kv_heads=6, hidden_size=48), 4, "num_kv_heads=6$"),
        (dict(num_heads=6, num_kv_heads=6, hidden_size=48), 4, "num_heads"),
        (dict(intermediate_size=130), 4, "intermediate_size"),
        (dict(vocab_size=250), 4, "vocab_size"),
    ],
)
def test_runtime_rejects_indivisible_tp(kw, tp, match):
    c = TinyLlamaConfig(**{**TP4, **kw})
    with pytest.raises(ValueError, match=match):
        TinyLlamaRuntime(c, 0, tp)


@pytest.mark.parametrize("kw, tp, multiple", [
    # more ranks than kv heads, but not a whole number of ranks for each head (and a
    # tp_size that is a multiple of the kv heads, which the same config takes)
    (dict(num_heads=12, num_kv_heads=4, hidden_size=48, intermediate_size=96,
          vocab_size=384), 6, 12),
    (dict(num_heads=6, num_kv_heads=2, hidden_size=48, intermediate_size=96,
          vocab_size=192), 3, 6),
])
def test_more_ranks_than_kv_heads_must_be_a_multiple_of_them(kw, tp, multiple):
    c = TinyLlamaConfig(**{**TP4, **kw})
    kv = kw["num_kv_heads"]
    want = (f"tp_size={tp} is more than num_kv_heads={kv} and not a multiple of it: each "
            "rank then holds one kv head, and each head is replicated on "
            "tp_size // num_kv_heads ranks (as in vLLM)")
    for rank in range(tp):
        with pytest.raises(ValueError, match=re.escape(want)):
            TinyLlamaRuntime(c, rank, tp)
    # (as many ranks as kv heads, and a multiple of them, are taken)
    assert TinyLlamaRuntime(c, kv - 1, kv).num_kv_head_replicas == 1
    assert TinyLlamaRuntime(c, multiple - 1, multiple).num_kv_head_replicas == multiple // kv


# 8 query heads of head_dim 8 over 2 kv heads: tp 4 and 8 replicate each kv head
GQA = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=8,
           num_kv_heads=2)
HD = 8  # head_dim: 64 // 8


def kv_head_of(rank: int, tp_size: int) -> int:
    """The kv head rank ``rank`` of ``tp_size`` holds, 2 kv heads: the first half of the
    ranks head 0, the second half head 1 (written out, not the model's formula)."""
    return 0 if rank < tp_size // 2 else 1


@pytest.mark.parametrize("tp_size", [4, 8])
def test_more_ranks_than_kv_heads_give_each_rank_one_kv_head(tp_size):
    c = TinyLlamaConfig(**GQA)
    ckpt = tiny_llama_checkpoint(c, seed=11)
    q_rows = 8 * HD // tp_size
    ranks = load_ranks(c, tp_size, ckpt)
    for r, rt in enumerate(ranks):
        assert (rt.num_kv_head_replicas, rt.kv_per_rank) == (tp_size // 2, HD)
        head = kv_head_of(r, tp_size)
        ps = dict(rt.named_parameters())
        for i in range(c.num_layers):
            p = f"model.layers.{i}.self_attn."
            qkv = ps[p + "qkv_proj.weight"]
            assert tuple(qkv.shape) == (q_rows + 2 * HD, 64)
            want = torch.cat([
                ckpt[p + "q_proj.weight"][r * q_rows:(r + 1) * q_rows],
                ckpt[p + "k_proj.weight"][head * HD:(head + 1) * HD],
                ckpt[p + "v_proj.weight"][head * HD:(head + 1) * HD],
            ])
            assert same_bits(qkv.data, want)
            # o_proj stays split over every rank, as the query heads are
            assert same_bits(ps[p + "o_proj.weight"].data,
                             ckpt[p + "o_proj.weight"][:, r * q_rows:(r + 1) * q_rows])
    # the ranks of one group hold the same k and v bits; the two groups differ
    for i in range(c.num_layers):
        name = f"model.layers.{i}.self_attn.qkv_proj.weight"
        kv = [dict(rt.named_parameters())[name].data[q_rows:] for rt in ranks]
        half = tp_size // 2
        assert all(same_bits(kv[r], kv[0]) for r in range(half))
        assert all(same_bits(kv[r], kv[half]) for r in range(half, tp_size))
        assert not same_bits(kv[0], kv[half])
    assert_same_checkpoint(gather_checkpoint(ranks), ckpt)


@pytest.mark.parametrize("tp_size", [4, 8])
def test_a_sparse_kv_patch_lands_in_every_replica_of_its_head(tp_size):
    c = TinyLlamaConfig(**GQA)
    ckpt = tiny_llama_checkpoint(c, seed=12)
    ranks = load_ranks(c, tp_size, ckpt)
    q_rows = 8 * HD // tp_size
    # k: two elements in head 0 (rows 1 and 7), one in head 1 (row 8 + 3); v: head 1 only
    k_idx, v_idx = [1 * 64 + 5, 7 * 64 + 63, 11 * 64 + 0], [9 * 64 + 2, 15 * 64 + 40]
    k_vals, v_vals = [3.0, -2.5, 7.0], [-4.0, 6.5]
    patches = [
        CheckpointWeightPatch("model.layers.1.self_attn.k_proj.weight", (16, 64),
                              torch.bfloat16, torch.tensor(k_vals), torch.tensor(k_idx)),
        CheckpointWeightPatch("model.layers.1.self_attn.v_proj.weight", (16, 64),
                              torch.bfloat16, torch.tensor(v_vals), torch.tensor(v_idx)),
    ]
    k_want = ckpt["model.layers.1.self_attn.k_proj.weight"].clone()
    v_want = ckpt["model.layers.1.self_attn.v_proj.weight"].clone()
    k_want.view(-1)[k_idx] = torch.tensor(k_vals, dtype=torch.bfloat16)
    v_want.view(-1)[v_idx] = torch.tensor(v_vals, dtype=torch.bfloat16)
    for r, rt in enumerate(ranks):
        qkv = rt.model.layers[1].self_attn.qkv_proj.weight
        before = qkv.detach().clone()
        assert load_checkpoint_weight_patches(rt, patches) == {
            "model.layers.1.self_attn.qkv_proj.weight"}
        head = kv_head_of(r, tp_size)
        assert same_bits(qkv.data[q_rows:q_rows + HD], k_want[head * HD:(head + 1) * HD])
        assert same_bits(qkv.data[q_rows + HD:], v_want[head * HD:(head + 1) * HD])
        assert same_bits(qkv.data[:q_rows], before[:q_rows])  # q untouched
        # head 0's ranks got the 2 k elements of head 0, head 1's the other 3
        changed = int((bits(qkv.data) != bits(before)).sum())
        assert changed == (2 if head == 0 else 3)
    assert_same_checkpoint(
        gather_checkpoint(ranks),
        {**ckpt, "model.layers.1.self_attn.k_proj.weight": k_want,
         "model.layers.1.self_attn.v_proj.weight": v_want})


def test_kv_weight_loader_takes_the_full_checkpoint_tensor_where_heads_are_replicated():
    c = TinyLlamaConfig(**GQA)
    rt = TinyLlamaRuntime(c, 3, 4)  # head 1
    qkv = rt.model.layers[0].self_attn.qkv_proj.weight
    with pytest.raises(ValueError, match=r"must have shape \(16, 64\), got \(8, 64\)"):
        qkv.weight_loader(qkv, torch.ones(HD, 64), "k")  # one head is not the checkpoint
    assert int(qkv.count_nonzero()) == 0
    v = torch.arange(16 * 64, dtype=torch.float32).reshape(16, 64)
    qkv.weight_loader(qkv, v, "v")
    assert same_bits(qkv.data[16 + HD:], v[HD:].bfloat16())
    assert int(qkv.data[:16 + HD].count_nonzero()) == 0


def test_gather_refuses_replicas_of_a_kv_head_that_differ():
    c = TinyLlamaConfig(**GQA)
    ranks = load_ranks(c, 4, tiny_llama_checkpoint(c, seed=13))
    ranks[3].model.layers[1].self_attn.qkv_proj.weight.data[24 + 2, 5] += 1  # v of head 1
    with pytest.raises(ValueError, match=re.escape(
            "the replicated kv head in rows [24:32] of "
            "'model.layers.1.self_attn.qkv_proj.weight' differs between rank 2 and rank 3")):
        gather_checkpoint(ranks)


@pytest.mark.parametrize("rank, size", [(2, 2), (-1, 2), (0, 0)])
def test_runtime_rejects_bad_rank(rank, size):
    with pytest.raises(ValueError):
        TinyLlamaRuntime(TinyLlamaConfig(**TP4), rank, size)


def test_runtime_parameter_names_and_shapes():
    c = TinyLlamaConfig(**TP4)
    rt = TinyLlamaRuntime(c, 1, 2, dtype=torch.float16)
    shapes = {n: tuple(p.shape) for n, p in rt.named_parameters(remove_duplicate=False)}
    hd = c.head_dim
    want = {"model.embed_tokens.weight": (128, 64)}
    for i in range(2):
        p = f"model.layers.{i}."
        want[p + "self_attn.qkv_proj.weight"] = ((8 + 2 * 4) * hd // 2, 64)
        want[p + "self_attn.o_proj.weight"] = (64, 8 * hd // 2)
        want[p + "mlp.gate_up_proj.weight"] = (2 * 64, 64)
        want[p + "mlp.down_proj.weight"] = (64, 64)
        want[p + "input_layernorm.weight"] = (64,)
        want[p + "post_attention_layernorm.weight"] = (64,)
    want["model.norm.weight"] = (64,)
    want["lm_head.weight"] = (128, 64)
    assert shapes == want
    assert list(shapes) == list(want)
    for p in rt.parameters():
        assert p.dtype == torch.float16 and not p.requires_grad and callable(p.weight_loader)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
@pytest.mark.parametrize("tied", [False, True])
def test_load_then_gather_is_bit_exact(tp_size, tied):
    c = TinyLlamaConfig(**TP4, tie_word_embeddings=tied)
    ckpt = tiny_llama_checkpoint(c, seed=tp_size)
    ranks = [TinyLlamaRuntime(c, r, tp_size) for r in range(tp_size)]
    for rt in ranks:
        returned = rt.load_weights(iter(ckpt.items()))
        assert returned == returned_names(ckpt, tied)
        # (vLLM's names: every one a parameter of the runtime, 3 per layer fewer)
        assert returned <= dict(rt.named_parameters(remove_duplicate=False)).keys()
        assert len(returned) == len(ckpt) - 3 * c.num_layers
    got = gather_checkpoint(ranks)
    assert_same_checkpoint(got, ckpt)
    # fresh CPU tensors: writing the gathered copy leaves the runtime alone
    got["model.norm.weight"].zero_()
    assert same_bits(ranks[0].model.norm.weight.data, ckpt["model.norm.weight"])


@pytest.mark.parametrize("device", DEVICES)
def test_load_casts_dtype_and_device(device):
    c = TinyLlamaConfig(**TP4)
    ckpt = tiny_llama_checkpoint(c, seed=1, dtype=torch.float32)
    ranks = load_ranks(c, 2, ckpt, dtype=torch.float64, device=device)
    assert all(p.device.type == device for rt in ranks for p in rt.parameters())
    got = gather_checkpoint(ranks)
    assert all(t.device.type == "cpu" and t.dtype == torch.float64 for t in got.values())
    assert_same_checkpoint(got, {n: t.double() for n, t in ckpt.items()})


@pytest.mark.parametrize("tp_size", [2, 4])
def test_packing_and_sharding_on_each_rank(tp_size):
    c = TinyLlamaConfig(**TP4)
    ckpt = tiny_llama_checkpoint(c, seed=7)
    ranks = load_ranks(c, tp_size, ckpt)
    q, kv, inter, voc = c.q_size // tp_size, c.kv_size // tp_size, 128 // tp_size, 256 // tp_size
    for r, rt in enumerate(ranks):
        ps = dict(rt.named_parameters())
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            qkv = ps[p + "self_attn.qkv_proj.weight"]
            want = torch.cat([
                ckpt[p + "self_attn.q_proj.weight"][r * q:(r + 1) * q],
                ckpt[p + "self_attn.k_proj.weight"][r * kv:(r + 1) * kv],
                ckpt[p + "self_attn.v_proj.weight"][r * kv:(r + 1) * kv],
            ])
            assert same_bits(qkv.data, want)
            gate_up = ps[p + "mlp.gate_up_proj.weight"]
            want = torch.cat([
                ckpt[p + "mlp.gate_proj.weight"][r * inter:(r + 1) * inter],
                ckpt[p + "mlp.up_proj.weight"][r * inter:(r + 1) * inter],
            ])
            assert same_bits(gate_up.data, want)
            assert same_bits(ps[p + "self_attn.o_proj.weight"].data,
                             ckpt[p + "self_attn.o_proj.weight"][:, r * q:(r + 1) * q])
            assert same_bits(ps[p + "mlp.down_proj.weight"].data,
                             ckpt[p + "mlp.down_proj.weight"][:, r * inter:(r + 1) * inter])
            assert same_bits(ps[p + "input_layernorm.weight"].data,
                             ckpt[p + "input_layernorm.weight"])
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            assert same_bits(ps[name].data, ckpt[name][r * voc:(r + 1) * voc])
        assert same_bits(ps["model.norm.weight"].data, ckpt["model.norm.weight"])


class _CopySpy(TorchDispatchMode):
    """Records every mutating op: (op, destination storage pointer, source storage pointer)."""

    def __init__(self):
        super().__init__()
        self.writes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments):
            src = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else None
            self.writes.append((
                func._schema.name,
                args[0].untyped_storage().data_ptr(),
                None if src is None else src.untyped_storage().data_ptr(),
            ))
        return func(*args, **(kwargs or {}))


def test_exactly_one_copy_per_checkpoint_tensor_from_a_view_of_it():
    c = TinyLlamaConfig(**TP4)
    ckpt = tiny_llama_checkpoint(c, dtype=torch.float32)
    rt = TinyLlamaRuntime(c, 1, 2)
    runtime = {p.untyped_storage().data_ptr() for p in rt.parameters()}
    with torch.no_grad(), _CopySpy() as spy:
        rt.load_weights(ckpt.items())
    assert [w[0] for w in spy.writes] == ["aten::copy_"] * len(ckpt)
    for (_, dest, src), t in zip(spy.writes, ckpt.values()):
        assert dest in runtime
        assert src == t.untyped_storage().data_ptr()  # a narrow of the checkpoint, no clone


# --------------------------------------------------------------------------------------
# tied embeddings
# --------------------------------------------------------------------------------------


def test_tied_lm_head_is_the_embedding_parameter():
    c = TinyLlamaConfig(**TP4, tie_word_embeddings=True)
    rt = TinyLlamaRuntime(c, 0, 2)
    assert rt.lm_head.weight is rt.model.embed_tokens.weight
    names = [n for n, _ in rt.named_parameters(remove_duplicate=False)]
    assert names[0] == "model.embed_tokens.weight"
    assert names[-1] == "lm_head.weight"
    assert names.count("lm_head.weight") == 1
    assert "lm_head.weight" not in dict(rt.named_parameters())


def test_tied_runtime_skips_lm_head_entry():
    c = TinyLlamaConfig(**TP4, tie_word_embeddings=True)
    ckpt = tiny_llama_checkpoint(c)
    rt = TinyLlamaRuntime(c)
    rt.load_weights(ckpt.items())
    other = torch.randn(256, 64, generator=torch.Generator().manual_seed(9)).bfloat16()
    assert rt.load_weights([("lm_head.weight", other)]) == set()
    assert same_bits(rt.model.embed_tokens.weight.data, ckpt["model.embed_tokens.weight"])


def test_tied_alias_patch_is_renamed_by_patchkit():
    c = TinyLlamaConfig(**TP4, tie_word_embeddings=True)
    rt = TinyLlamaRuntime(c, 1, 2)
    new = torch.randn(256, 64, generator=torch.Generator().manual_seed(5)).bfloat16()
    got = load_checkpoint_weight_patches(
        rt, [CheckpointWeightPatch("lm_head.weight", (256, 64), torch.bfloat16, new.flatten())]
    )
    assert got == {"model.embed_tokens.weight"}
    assert same_bits(rt.lm_head.weight.data, new[128:])


# --------------------------------------------------------------------------------------
# through patchkit's loader
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True])
def test_dense_patches_through_patchkit_equal_direct_load(tied):
    c = TinyLlamaConfig(**TP4, tie_word_embeddings=tied)
    ckpt = tiny_llama_checkpoint(c, seed=11)
    direct = load_ranks(c, 2, ckpt)
    via = [TinyLlamaRuntime(c, r, 2) for r in range(2)]
    for rt in via:
        got = load_checkpoint_weight_patches(rt, dense(ckpt), max_chunk_bytes=40_000)
        assert got == returned_names(ckpt, tied)
    assert len(patchkit.plan_chunks(dense(ckpt), 40_000)) > 3  # really several calls
    assert_same_checkpoint(gather_checkpoint(via), gather_checkpoint(direct))
    assert_same_checkpoint(gather_checkpoint(via), ckpt)


@pytest.mark.parametrize("device", DEVICES)
def test_sparse_patch_changes_only_chosen_elements(device):
    c = TinyLlamaConfig(**TP4)
    ckpt = tiny_llama_checkpoint(c, seed=2)
    ranks = load_ranks(c, 2, ckpt, device=device)
    g = torch.Generator().manual_seed(0)
    chosen = ["model.embed_tokens.weight", "model.layers.0.self_attn.k_proj.weight",
              "model.layers.1.self_attn.o_proj.weight", "model.layers.1.mlp.up_proj.weight",
              "model.layers.0.mlp.down_proj.weight", "model.norm.weight", "lm_head.weight"]
    patches, expected = [], {n: t.clone() for n, t in ckpt.items()}
    for name in chosen:
        n = ckpt[name].numel()
        idx = torch.randperm(n, generator=g)[: max(1, n // 50)]
        vals = (torch.randn(idx.numel(), generator=g) + 5.0).bfloat16()
        patches.append(CheckpointWeightPatch(name, tuple(ckpt[name].shape), torch.bfloat16,
                                             vals.to(device), idx.to(device)))
        expected[name].view(-1)[idx] = vals
    for rt in ranks:
        got = load_checkpoint_weight_patches(rt, patches, max_chunk_bytes=50_000)
        assert got == returned_names(chosen)
    got = gather_checkpoint(ranks)
    assert_same_checkpoint(got, expected)
    changed = sum(int((bits(got[n]) != bits(ckpt[n])).sum()) for n in ckpt)
    assert changed == sum(p.indices.numel() for p in patches)


# --------------------------------------------------------------------------------------
# errors of the runtime loader and of gather_checkpoint
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["model.layers.2.self_attn.q_proj.weight", "model.layers.0.self_attn.qkv_proj.weight",
     "model.embed.weight", "lm_head.scale", "q_proj", "model.layers.0.rotary_emb.theta"],
)
def test_unknown_name_raises_naming_it(name):
    rt = TinyLlamaRuntime(TinyLlamaConfig())
    with pytest.raises(KeyError) as info:
        rt.load_weights([(name, torch.zeros(64, 64))])
    assert isinstance(info.value, UnknownWeightError)
    assert info.value.name == name and repr(name) in str(info.value)


@pytest.mark.parametrize("tied", [False, True])
def test_names_vllm_skips_are_skipped_not_written_nor_returned(tied):
    c = TinyLlamaConfig(tie_word_embeddings=tied)
    rt = TinyLlamaRuntime(c)
    before = {n: t.clone() for n, t in rt.state_dict().items()}
    skipped = ["model.layers.0.self_attn.rotary_emb.inv_freq",
               "model.layers.1.self_attn.rotary_emb.cos_cached",
               "model.layers.1.self_attn.rotary_emb.sin_cached",
               "model.layers.0.self_attn.q_proj.bias", "lm_head.bias"]
    assert rt.load_weights([(n, torch.ones(3)) for n in skipped]) == set()
    assert all(same_bits(t, before[n]) for n, t in rt.state_dict().items())
    # (through the loader: a sparse call of only such names returns the empty set, fine)
    p = CheckpointWeightPatch(skipped[0], (3,), torch.float32, torch.ones(1), torch.tensor([0]))
    assert load_checkpoint_weight_patches(rt, [p]) == set()


def test_weight_loaders_refuse_what_vllm_asserts_against_before_writing():
    rt = TinyLlamaRuntime(TinyLlamaConfig(), tp_rank=1, tp_size=2)
    layer = rt.model.layers[0]
    qkv, gate_up = layer.self_attn.qkv_proj.weight, layer.mlp.gate_up_proj.weight
    o, norm = layer.self_attn.o_proj.weight, layer.input_layernorm.weight
    emb = rt.model.embed_tokens.weight
    h = rt.config.hidden_size
    cases = [
        (norm, torch.ones(1), None, "must have shape"),  # (copy_ would broadcast it)
        (o, torch.ones(1, rt.config.q_size), None, "must have shape"),
        (emb, torch.ones(2 * rt.config.vocab_size, h), None, "must have shape"),
        (emb, torch.ones(rt.config.vocab_size, 1), None, "must have shape"),
        (qkv, torch.ones(rt.config.q_size, h), "x", "shard_id must be 'q', 'k' or 'v'"),
        (qkv, torch.ones(rt.config.q_size, h), None, "fused"),
        (qkv, torch.ones(rt.config.kv_size, h), "q", "must have shape"),
        (gate_up, torch.ones(rt.config.intermediate_size, h), -1, "shard_id must be 0 or 1"),
        (gate_up, torch.ones(rt.config.intermediate_size, h), True, "shard_id must be 0 or 1"),
        (gate_up, torch.ones(rt.config.intermediate_size, h), 1.0, "shard_id must be 0 or 1"),
        (gate_up, torch.ones(rt.config.intermediate_size, h), torch.tensor(1),
         "shard_id must be 0 or 1"),
        (gate_up, torch.ones(rt.config.intermediate_size, h), None, "fused"),
    ]
    before = {n: t.clone() for n, t in rt.state_dict().items()}
    for param, w, shard_id, match in cases:
        with pytest.raises(ValueError, match=match):
            if shard_id is None:
                param.weight_loader(param, w)
            else:
                param.weight_loader(param, w, shard_id)
    assert all(same_bits(t, before[n]) for n, t in rt.state_dict().items())
    # the right shapes and ids still load
    qkv.weight_loader(qkv, torch.ones(rt.config.kv_size, h), "v")
    gate_up.weight_loader(gate_up, torch.ones(rt.config.intermediate_size, h), np.int64(1))
    assert int(qkv.count_nonzero()) == rt.kv_per_rank * h
    assert int(gate_up.count_nonzero()) == rt.intermediate_per_rank * h


def test_unknown_weight_error_pickles():
    import pickle

    e = pickle.loads(pickle.dumps(UnknownWeightError("x.weight", "M", "a hint")))
    assert isinstance(e, KeyError) and e.name == "x.weight"
    assert str(e) == "M.load_weights: unknown checkpoint weight 'x.weight'; a hint"


def test_runtime_dtype_and_device_follow_the_parameters():
    rt = TinyLlamaRuntime(TinyLlamaConfig())
    assert (rt.dtype, rt.device) == (torch.bfloat16, torch.device("cpu"))
    rt.to(torch.float32)
    assert rt.dtype == torch.float32


def test_wrong_shape_raises_before_writing():
    rt = TinyLlamaRuntime(TinyLlamaConfig())
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        rt.load_weights([("model.norm.weight", torch.ones(63))])
    assert not rt.model.norm.weight.data.any()


def test_gather_validates_its_ranks():
    c = TinyLlamaConfig(**TP4)
    r0, r1 = TinyLlamaRuntime(c, 0, 2), TinyLlamaRuntime(c, 1, 2)
    with pytest.raises(ValueError, match="rank order"):
        gather_checkpoint([r1, r0])
    with pytest.raises(ValueError, match="tp_size"):
        gather_checkpoint([r0])
    with pytest.raises(ValueError):
        gather_checkpoint([])
    with pytest.raises(ValueError, match="config"):
        gather_checkpoint([r0, TinyLlamaRuntime(TinyLlamaConfig(**{**TP4, "num_layers": 1}), 1, 2)])
    with pytest.raises(ValueError, match="dtype"):
        gather_checkpoint([r0, TinyLlamaRuntime(c, 1, 2, dtype=torch.float32)])
    r1.model.layers[0].input_layernorm.weight.data.fill_(1.0)
    with pytest.raises(ValueError, match=r"input_layernorm.*rank 1"):
        gather_checkpoint([r0, r1])


# --------------------------------------------------------------------------------------
# the plain model
# --------------------------------------------------------------------------------------

SHAPES = {
    "embed.weight": (6, 4),
    "layers.0.proj.weight": (4, 4),
    "layers.1.proj.weight": (4, 4),
    "norm.weight": (4,),
    "scale": (),
}


def state(seed: int = 0, shapes=SHAPES) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}


def sparse_of(new: dict, nnz: int = 2) -> list[CheckpointWeightPatch]:
    out = []
    for n, t in new.items():
        k = min(nnz, t.numel())
        idx = torch.arange(k, dtype=torch.int64)
        out.append(CheckpointWeightPatch(n, tuple(t.shape), t.dtype, t.flatten()[:k], idx))
    return out


def test_plain_model_names_and_load():
    m = PlainModel(SHAPES, fill=1.5)
    # exact names; a module's own parameters come before its submodules' (nn.Module order)
    got = [(n, tuple(p.shape)) for n, p in m.named_parameters()]
    assert got == [("scale", ())] + [(n, s) for n, s in SHAPES.items() if n != "scale"]
    assert m.get_parameter("layers.0.proj.weight").shape == (4, 4)
    assert all(bool((p == 1.5).all()) and not p.requires_grad for p in m.parameters())
    sd = state(1)
    assert m.load_weights(sd.items()) == set(SHAPES)
    for n, p in m.named_parameters():
        assert same_bits(p.data, sd[n])
    with pytest.raises(KeyError, match="nope"):
        m.load_weights([("nope", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        m.load_weights([("norm.weight", torch.zeros(5))])


def test_plain_model_from_a_llama_checkpoint_keeps_its_order():
    ckpt = tiny_llama_checkpoint(TinyLlamaConfig(num_layers=3))
    m = PlainModel.from_state_dict(ckpt)
    assert [n for n, _ in m.named_parameters()] == list(ckpt)
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())
    assert same_bits(m.get_parameter("model.layers.2.mlp.up_proj.weight").data,
                     ckpt["model.layers.2.mlp.up_proj.weight"])


def test_plain_model_from_state_dict_and_sparse():
    sd = state(2)
    m = PlainModel.from_state_dict(sd)
    assert all(same_bits(p.data, sd[n]) for n, p in m.named_parameters())
    vals = torch.tensor([7.0, -0.0])
    p = CheckpointWeightPatch("layers.1.proj.weight", (4, 4), torch.float32, vals,
                              torch.tensor([5, 15]))
    assert load_checkpoint_weight_patches(m, [p]) == {"layers.1.proj.weight"}
    want = sd["layers.1.proj.weight"].clone()
    want.view(-1)[torch.tensor([5, 15], device="cpu")] = vals.cpu()
    assert same_bits(m.get_parameter("layers.1.proj.weight").data, want)


@pytest.mark.parametrize("shapes", [{"a": (1,), "a.b": (1,)}, {"a.b": (1,), "a": (1,)},
                                    {"a..b": (1,)}, {"training": (1,)}, {"x": (-1,)}])
def test_plain_model_rejects_bad_names(shapes):
    with pytest.raises(ValueError):
        PlainModel(shapes)


# --------------------------------------------------------------------------------------
# loaders that break the sparse contract
# --------------------------------------------------------------------------------------

EXPECTED_REASONS = {
    "writes_twice": (WritesTwiceModel, "overlapping runtime views"),
    "writes_then_fills": (WritesThenFillsModel, "unsupported op"),
    "shape_mismatch": (ShapeMismatchModel, "same-shaped floating-point"),
    "reports_without_writing": (ReportsWithoutWritingModel, "without copying"),
    "overlapping_destinations": (OverlappingDestinationsModel, "overlapping runtime views"),
}


def test_broken_loaders_table():
    assert set(BROKEN_LOADERS) == set(EXPECTED_REASONS)
    for key, cls in BROKEN_LOADERS.items():
        want_cls, want_reason = EXPECTED_REASONS[key]
        assert cls is want_cls
        assert want_reason == cls.REASON
        assert cls.CLAUSE and "NotImplementedError" in cls.CLAUSE
        assert cls.__doc__ and "CONTRACT" in cls.__doc__


def test_broken_loader_clauses_quote_the_contract():
    # each CLAUSE is a sentence of CONTRACT.md §4 as written there (markdown emphasis and
    # code marks aside), its "[patchkit, ...]" marker included where the contract has one
    contract = (Path(__file__).resolve().parents[1] / "docs" / "CONTRACT.md").read_text()
    section = contract.split("### 4.")[1].split("### 5.")[0]
    plain = re.sub(r"\s+", " ", section.replace("*", "").replace("`", ""))
    for key, cls in BROKEN_LOADERS.items():
        assert cls.CLAUSE in plain, key
        start = plain.index(cls.CLAUSE)
        # the marker is not left out: the clause starts where its list item starts
        assert plain[:start].rstrip().endswith("-"), (key, plain[start - 50:start])


@pytest.mark.parametrize("key", list(EXPECTED_REASONS))
def test_broken_loader_rejected_by_sparse_load(key):
    cls, reason = EXPECTED_REASONS[key]
    m = cls(SHAPES)
    with pytest.raises(NotImplementedError) as info:
        load_checkpoint_weight_patches(m, sparse_of(state(3)))
    assert isinstance(info.value, ContractViolation)
    assert info.value.reason == reason


@pytest.mark.parametrize("key", list(EXPECTED_REASONS))
def test_broken_loader_runs_dense(key):
    cls, _ = EXPECTED_REASONS[key]
    m = cls(SHAPES)
    sd = state(4)
    assert load_checkpoint_weight_patches(m, dense(sd)) == set(SHAPES)


def test_broken_loaders_dense_effects():
    sd = state(5)
    twice = WritesTwiceModel(SHAPES)
    twice.load_weights(sd.items())
    assert all(same_bits(p.data, sd[n]) for n, p in twice.named_parameters())

    fills = WritesThenFillsModel(SHAPES, fill=3.0, pad_rows=2)
    assert tuple(fills.embed.weight.shape) == (8, 4)
    assert tuple(fills.scale.shape) == ()
    fills.load_weights(sd.items())
    assert same_bits(fills.embed.weight.data[:6], sd["embed.weight"])
    assert not fills.embed.weight.data[6:].any()

    bcast = ShapeMismatchModel(SHAPES)
    assert tuple(bcast.norm.weight.shape) == (1, 4)
    bcast.load_weights(sd.items())
    assert same_bits(bcast.norm.weight.data[0], sd["norm.weight"])

    stash = ReportsWithoutWritingModel(SHAPES)
    assert stash.load_weights(sd.items()) == set(SHAPES)
    assert not any(p.any() for p in stash.parameters())
    assert stash.apply_pending() == set(SHAPES)
    assert all(same_bits(p.data, sd[n]) for n, p in stash.named_parameters())

    flat = OverlappingDestinationsModel(SHAPES)
    assert [n for n, _ in flat.named_parameters()] == ["flat_weight"]
    assert flat.flat_weight.numel() == sum(t.numel() for t in sd.values()) - 4
    flat.load_weights(sd.items())
    # the last weight wins on the shared element; the others keep all but their last
    assert same_bits(flat.view("scale"), sd["scale"])
    assert same_bits(flat.view("embed.weight").flatten()[:-1], sd["embed.weight"].flatten()[:-1])
    assert same_bits(flat.view("embed.weight").flatten()[-1],
                     sd["layers.0.proj.weight"].flatten()[0])


def test_overlapping_destinations_sparse_single_weight_per_call_passes():
    m = OverlappingDestinationsModel(SHAPES)
    patches = sparse_of(state(6))
    assert load_checkpoint_weight_patches(m, patches, max_chunk_bytes=1) == set(SHAPES)


def test_sparse_rejection_keeps_first_write_and_writes_nothing_after():
    sd = state(7)
    m = WritesThenFillsModel({"w": (3, 2)}, fill=2.0)
    idx = torch.tensor([0, 5])
    p = CheckpointWeightPatch("w", (3, 2), torch.float32, sd["embed.weight"][0, :2], idx)
    with pytest.raises(ContractViolation, match="fill_"):
        load_checkpoint_weight_patches(m, [p])
    w = m.w.data
    assert w.view(-1)[0] == sd["embed.weight"][0, 0] and w.view(-1)[5] == sd["embed.weight"][0, 1]
    assert bool((w.view(-1)[1:5] == 2.0).all()) and bool((w[3] == 2.0).all())  # pad not zeroed


def test_broken_loader_constructor_checks():
    with pytest.raises(ValueError):
        WritesThenFillsModel(SHAPES, pad_rows=0)
    with pytest.raises(ValueError):
        OverlappingDestinationsModel(SHAPES, overlap=0)
    with pytest.raises(ValueError, match="scale"):
        OverlappingDestinationsModel({"scale": (), "big": (4,)}, overlap=2)
    OverlappingDestinationsModel({"big": (4,), "scale": ()}, overlap=2)  # last may be small
    with pytest.raises(KeyError):
        OverlappingDestinationsModel(SHAPES).load_weights([("zzz", torch.zeros(1))])


# --------------------------------------------------------------------------------------
# the failing loader: partial updates and transactional loads
# --------------------------------------------------------------------------------------


def test_failing_model_leaves_partial_update():
    sd = state(8)
    m = FailingModel(SHAPES, fail_on="layers.1.proj.weight")
    with pytest.raises(RuntimeError, match="simulated failure"):
        load_checkpoint_weight_patches(m, dense(sd))
    names = list(SHAPES)
    k = names.index("layers.1.proj.weight")
    params = dict(m.named_parameters())
    assert all(same_bits(params[n].data, sd[n]) for n in names[:k])
    assert all(not params[n].data.any() for n in names[k:])
    with pytest.raises(ValueError):
        FailingModel(SHAPES, fail_on="missing")


@pytest.mark.parametrize("sparse", [False, True])
def test_failing_model_transactional_restores(sparse):
    sd = state(9)
    m = FailingModel(SHAPES, fill=0.25, fail_on="norm.weight")
    patches = sparse_of(sd) if sparse else dense(sd)
    with pytest.raises(RuntimeError):
        load_checkpoint_weight_patches(m, patches, max_chunk_bytes=64, transactional=True)
    assert m.calls > 1
    assert all(bool((p == 0.25).all()) for p in m.parameters())


# --------------------------------------------------------------------------------------
# hygiene
# --------------------------------------------------------------------------------------


def test_module_imports_torch_only():
    import ast
    import pathlib

    import patchkit.toymodels as toymodels

    tree = ast.parse(pathlib.Path(toymodels.__file__).read_text())
    imported, own = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level:
            own.add(node.module)
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported <= {"__future__", "math", "numbers", "operator", "collections",
                        "dataclasses", "typing", "torch"}
    # patchkit's own torch-only modules, which `import patchkit` has loaded already
    assert own <= {"bitwise", "density", "errors", "patch"}
    assert all(hasattr(toymodels, n) for n in toymodels.__all__)


# -- found by review -----------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [100, 250, 257])
def test_a_vocabulary_vllm_would_pad_is_refused_not_laid_out_unpadded(vocab):
    # vLLM pads the vocabulary to a multiple of 64 before splitting it; the toy does not
    # model that, so a vocabulary needing padding would get other shards than vLLM's
    with pytest.raises(ValueError, match=r"vocab_size=\d+ is not a multiple of 64: vLLM would "
                                         r"pad the vocabulary to \d+ rows"):
        TinyLlamaRuntime(TinyLlamaConfig(vocab_size=vocab), 0, 1)
    tiny_llama_checkpoint(TinyLlamaConfig(vocab_size=vocab))  # a checkpoint is fine
    assert TinyLlamaRuntime(TinyLlamaConfig(vocab_size=192), 1, 2).vocab_per_rank == 96


ABSENT = f"cuda:{torch.cuda.device_count()}"  # a GPU this machine does not have


MAKERS = [
    lambda device: PlainModel({"w": (4,)}, device=device),
    lambda device: PlainModel.from_state_dict({"w": torch.ones(4)}, device=device),
    lambda device: FailingModel({"w": (4,)}, device=device, fail_on="w"),
    lambda device: WritesThenFillsModel({"w": (4,)}, device=device),
    lambda device: OverlappingDestinationsModel({"a": (4,), "b": (4,)}, device=device),
    lambda device: TinyLlamaRuntime(device=device),
]
MAKER_IDS = ["plain", "from_state_dict", "failing", "fills", "overlapping", "llama"]


@pytest.mark.parametrize("make", MAKERS, ids=MAKER_IDS)
def test_a_device_this_machine_lacks_is_refused_as_elsewhere_before_anything_is_made(make):
    with pytest.raises(patchkit.PatchValueError, match=rf"device '{ABSENT}' is not available "
                                                       r"here") as info:
        make(ABSENT)
    assert (info.value.reason, info.value.value) == ("device unavailable", ABSENT)
    if not torch.cuda.is_available():  # torch's own "Torch not compiled with CUDA enabled"
        with pytest.raises(patchkit.PatchValueError, match="'cuda' is not available here"):
            make("cuda")
    with pytest.raises(patchkit.PatchValueError, match="'bogus' is not a torch device"):
        make("bogus")
    with pytest.raises(patchkit.PatchTypeError, match=r"device must be a str or torch\.device"):
        make(2.5)
    assert {p.device.type for p in make("meta").parameters()} == {"meta"}  # a model to plan with


@pytest.mark.parametrize("make", MAKERS, ids=MAKER_IDS)
def test_a_model_without_a_device_is_made_on_torchs_default_device(make):
    # as torch's own layers: the README's dry run, ``with torch.device("meta"):``, made a
    # real CPU model that the load then wrote into
    assert {p.device.type for p in make(None).parameters()} == {"cpu"}
    with torch.device("meta"):
        assert {p.device.type for p in make(None).parameters()} == {"meta"}
    assert {p.device.type for p in make("cpu").parameters()} == {"cpu"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without an accelerator")
def test_a_device_index_without_an_accelerator_is_refused():
    # A CPU build of torch has no accelerator to read 0 as an index of; a CUDA build
    # (torch 2.14 from PyPI, say) on a machine without a GPU reads it as cuda:0
    with pytest.raises(patchkit.PatchValueError,
                       match=r"device (0 \(an index of the current accelerator\)|'cuda:0') "
                             r"is not available here") as info:
        PlainModel({"w": (4,)}, device=0)
    assert info.value.reason == "device unavailable"


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: TinyLlamaRuntime(TinyLlamaConfig(), 0, "2"), TypeError, "tp_size must be an int"),
        (lambda: TinyLlamaRuntime(TinyLlamaConfig(), 0.0, 2), TypeError, "tp_rank must be an int"),
        (lambda: TinyLlamaRuntime(dtype=torch.int32), ValueError, "floating-point dtype"),
        (lambda: TinyLlamaRuntime(dtype="float32"), TypeError, "dtype must be a torch.dtype"),
        (lambda: tiny_llama_checkpoint(dtype="float32"), TypeError, "dtype must be a torch.dtype"),
        (lambda: tiny_llama_checkpoint(dtype=torch.int32), ValueError, "floating-point dtype"),
        (lambda: tiny_llama_checkpoint({}), TypeError, "config must be a TinyLlamaConfig"),
        # (torch.full's own TypeError, or none at all for a model of no weights)
        (lambda: PlainModel({"w": (2,)}, dtype="float32"), TypeError,
         "PlainModel: dtype must be a torch.dtype"),
        (lambda: PlainModel({}, dtype="float32"), TypeError,
         "PlainModel: dtype must be a torch.dtype"),
        # (a ValueError, for a wrong type)
        (lambda: gather_checkpoint(["x"]), TypeError, r"runtimes\[0\] is a str, not a Tiny"),
        # (torch wrapped -1 onto 2**32 - 1, and 2**32 onto seed 0: the same checkpoints)
        (lambda: tiny_llama_checkpoint(seed=-1), ValueError, r"seed must be in \[0, 2\*\*32\)"),
        (lambda: tiny_llama_checkpoint(seed=2**32), ValueError, r"seed must be in"),
        (lambda: tiny_llama_checkpoint(seed=1.5), TypeError, "seed must be an int, got float"),
        (lambda: tiny_llama_checkpoint(seed=True), TypeError, "seed must be an int, got bool"),
        # (torch's "copy_kernel not implemented", or a model that no load could fill)
        pytest.param(lambda: tiny_llama_checkpoint(dtype=FP4), ValueError, "holds numbers",
                     marks=needs_fp4),
        pytest.param(lambda: TinyLlamaRuntime(dtype=FP4), ValueError, "holds numbers",
                     marks=needs_fp4),
        # (bare AttributeErrors: 'int' object has no attribute 'split', and so on)
        (lambda: PlainModel({5: (1,)}), TypeError, "a checkpoint name must be a str, got int"),
        (lambda: PlainModel.from_state_dict([("a", torch.ones(1))]), TypeError,
         "state must be a mapping of names to tensors, got list"),
        (lambda: PlainModel.from_state_dict({"a": [1.0]}), TypeError,
         r"state\['a'\] must be a torch.Tensor, got list"),
        (lambda: OverlappingDestinationsModel([("a", (4,))]), TypeError,
         "shapes must be a mapping of names to shapes"),
        (lambda: PlainModel({"b": (2,)}).load_weights([("b", [1.0, 2.0])]), TypeError,
         "checkpoint weight 'b' must be a torch.Tensor, got list"),
        (lambda: OverlappingDestinationsModel({"a": (4,), "b": (4,)}).load_weights(
            [("a", 3)]), TypeError, "checkpoint weight 'a' must be a torch.Tensor, got int"),
        (lambda: TinyLlamaRuntime().load_weights([("model.norm.weight", [1.0] * 64)]),
         TypeError, "checkpoint weight 'model.norm.weight' must be a torch.Tensor, got list"),
        (lambda: TinyLlamaRuntime().load_weights([(5, torch.ones(64))]), TypeError,
         "TinyLlamaRuntime.load_weights: a checkpoint name must be a str, got int 5"),
        # (torch.full truncated the fill: 2 in an int tensor, True in a bool one)
        (lambda: PlainModel({"a": (1,)}, dtype=torch.int32, fill=2.5), ValueError,
         r"fill 2.5 is not a value of torch.int32 \(a whole number in \[-2147483648, "),
        (lambda: PlainModel({"a": (1,)}, dtype=torch.bool, fill=2), ValueError,
         r"fill 2 is not a value of torch.bool \(a whole number in \[0, 1\]\)"),
        (lambda: PlainModel({"a": (1,)}, dtype=torch.uint8, fill=-1), ValueError,  # (255)
         r"fill -1 is not a value of torch.uint8 \(a whole number in \[0, 255\]\)"),
        (lambda: PlainModel({"a": (1,)}, dtype=torch.int64, fill=10**400), ValueError,
         r"is not a value of torch.int64"),  # (float()'s bare OverflowError)
    ],
)
def test_bad_arguments_are_refused_by_name(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_an_unknown_weight_error_pickles_with_the_report_attached_to_it():
    # (a worker's failed load reaches its parent as itself, report included: the error
    # the toy models raise for an unknown name lost the report on the way)
    import pickle

    p = CheckpointWeightPatch("zz", (4,), torch.float32, torch.ones(1), torch.tensor([0]))
    with pytest.raises(UnknownWeightError) as info:
        patchkit.inspect_load(PlainModel({"a": (4,)}), [p])
    again = pickle.loads(pickle.dumps(info.value))
    assert isinstance(again, UnknownWeightError) and again.name == "zz"
    assert again.report.summary() == info.value.report.summary()


def test_a_float8_fill_where_torch_has_no_float8_full_is_checked_as_torch_full_checks(
        monkeypatch):
    # (torch before 2.6 has no float8 fill on the CPU: the fill is cast from float64
    # instead, which made NaN weights of an infinite fill that torch.full refuses)
    import math

    import patchkit.toymodels as toymodels

    real = torch.full

    def no_float8_full(shape, fill, *, dtype=None, device=None):
        if dtype is not None and dtype.itemsize == 1 and dtype.is_floating_point:
            raise RuntimeError('"fill_cpu" not implemented for \'Float8_e4m3fn\'')
        return real(shape, fill, dtype=dtype, device=device)

    cases = [(dt, v) for dt in (torch.float8_e4m3fn, torch.float8_e5m2)
             for v in (2.0, -500.0, 449.0, 1e6, math.inf, math.nan)]
    expected = {}
    for dt, v in cases:  # (what torch.full itself does here)
        try:
            expected[dt, v] = PlainModel({"a": (2,)}, dtype=dt, fill=v).a.float().tolist()
        except ValueError:
            expected[dt, v] = "refused"
    monkeypatch.setattr(toymodels.torch, "full", no_float8_full)
    for dt, v in cases:
        try:
            got = PlainModel({"a": (2,)}, dtype=dt, fill=v).a.float().tolist()
        except ValueError:
            got = "refused"
        assert str(got) == str(expected[dt, v]), (dt, v)
    assert expected[torch.float8_e4m3fn, math.inf] == "refused"


# -- found by mutation testing ---------------------------------------------------------------


def test_checkpoint_draws_follow_the_documented_distributions():
    # Norms 1 + 0.1 N(0, 1), the embedding 0.02 N(0, 1), every other weight N(0, 1) /
    # sqrt(fan_in) (columns: gate_proj's fan-in is 64, down_proj's 128); a wrong scale
    # or fan-in (rows instead of columns) changed no other test
    c = TinyLlamaConfig(**TP4)
    ckpt = tiny_llama_checkpoint(c, seed=0, dtype=torch.float32)

    def of(kind: str) -> torch.Tensor:
        return torch.cat([t.flatten() for n, t in ckpt.items() if n.endswith(kind)])

    def close(x: float, want: float) -> bool:
        return abs(x - want) <= 0.1 * want

    norms = torch.cat([of("layernorm.weight"), of("model.norm.weight")])
    assert close(float(norms.mean()), 1.0) and close(float(norms.std()), 0.1)
    assert close(float(of("embed_tokens.weight").std()), 0.02)
    for kind, fan_in in (("q_proj.weight", 64), ("k_proj.weight", 64), ("v_proj.weight", 64),
                         ("o_proj.weight", c.q_size), ("gate_proj.weight", 64),
                         ("up_proj.weight", 64), ("down_proj.weight", 128),
                         ("lm_head.weight", 64)):
        assert close(float(of(kind).std()), fan_in ** -0.5), kind
        assert abs(float(of(kind).mean())) < 0.1 * fan_in ** -0.5, kind


def test_a_tp_size_below_one_or_a_bool_is_refused_by_name():
    with pytest.raises(ValueError, match="tp_size must be at least 1, got 0"):
        TinyLlamaRuntime(TinyLlamaConfig(), 0, 0)
    with pytest.raises(ValueError, match="tp_size must be at least 1, got -2"):
        TinyLlamaRuntime(TinyLlamaConfig(), 0, -2)
    # (a bool is no rank count: True would have been read as 1)
    with pytest.raises(TypeError, match="tp_size must be an int, got bool True"):
        TinyLlamaRuntime(TinyLlamaConfig(), 0, True)
    with pytest.raises(TypeError, match="tp_rank must be an int, got bool False"):
        TinyLlamaRuntime(TinyLlamaConfig(), False, 1)


def test_overlapping_destinations_start_overlap_elements_before_the_previous_end():
    # weight i starts `overlap` elements before weight i - 1 ends; the flat parameter
    # reaches the furthest end, also when the last weight ends before the one before it
    m = OverlappingDestinationsModel({"a": (4,), "b": (3,), "c": ()}, overlap=2)
    assert m.offsets == {"a": 0, "b": 2, "c": 3}
    assert m.flat_weight.numel() == 5
    m.load_weights([("a", torch.tensor([1.0, 2, 3, 4])), ("b", torch.tensor([5.0, 6, 7])),
                    ("c", torch.tensor(8.0))])
    assert m.flat_weight.data.tolist() == [1.0, 2.0, 5.0, 8.0, 7.0]
    assert m.view("b").tolist() == [5.0, 8.0, 7.0]


def test_apply_pending_empties_the_stash():
    sd = state(10)
    m = ReportsWithoutWritingModel(SHAPES)
    m.load_weights(sd.items())
    assert m.apply_pending() == set(SHAPES)
    assert m.pending == {}
    m.get_parameter("norm.weight").data.zero_()
    assert m.apply_pending() == set()  # nothing stashed is applied twice
    assert not m.get_parameter("norm.weight").data.any()


def test_from_state_dict_takes_the_first_tensors_device():
    # (a meta state, as a dry run has: the model is made on meta too, and loads)
    sd = {n: t.to("meta") for n, t in state(11).items()}
    m = PlainModel.from_state_dict(sd)
    assert {p.device.type for p in m.parameters()} == {"meta"}
    assert {p.dtype for p in m.parameters()} == {torch.float32}


def test_plain_model_unknown_name_error_lists_known_names():
    with pytest.raises(UnknownWeightError, match=r"'nope'; known names: 'embed\.weight', "
                                                 r"'layers\.0\.proj\.weight', "):
        PlainModel(SHAPES).load_weights([("nope", torch.zeros(1))])


@pytest.mark.parametrize("count", [2, 5, 6])
def test_plain_model_unknown_name_error_ends_with_dots_only_where_names_are_left_out(count):
    # (the message ended in ", ..." also where it listed every name the model has)
    names = [f"w{i}" for i in range(count)]
    with pytest.raises(UnknownWeightError) as caught:
        PlainModel({n: (1,) for n in names}).load_weights([("nope", torch.zeros(1))])
    listed = ", ".join(f"'{n}'" for n in names[:5])
    assert str(caught.value).endswith(f"known names: {listed}" + (", ..." if count > 5 else ""))


def test_a_dotted_name_through_a_module_attribute_is_refused():
    # ('training' is an attribute of every nn.Module: torch's add_module raised KeyError)
    with pytest.raises(ValueError, match="'training' is already a parameter or attribute"):
        PlainModel({"training.w": (1,)})


@pytest.mark.parametrize(
    "make, match",
    [
        # (torch's "full(): argument 'size' ... must be tuple of ints", Python's "'<' not
        # supported", "unhashable type: 'list'", or a True taken for 1)
        (lambda: WritesThenFillsModel(SHAPES, pad_rows=2.0), "pad_rows must be an int, got float"),
        (lambda: WritesThenFillsModel(SHAPES, pad_rows="1"), "pad_rows must be an int, got str"),
        (lambda: WritesThenFillsModel(SHAPES, pad_rows=True), "pad_rows must be an int, got bool"),
        (lambda: OverlappingDestinationsModel(SHAPES, overlap=1.5),
         "overlap must be an int, got float 1.5"),
        (lambda: OverlappingDestinationsModel(SHAPES, overlap=True),
         "overlap must be an int, got bool"),
        (lambda: FailingModel(SHAPES, fail_on=["norm.weight"]),
         r"fail_on: a checkpoint name must be a str, got list \['norm.weight'\]"),
    ],
)
def test_the_broken_and_failing_models_name_a_count_or_name_of_the_wrong_type(make, match):
    with pytest.raises(TypeError, match=match):
        make()
    # (a numpy count is an int)
    assert WritesThenFillsModel(SHAPES, pad_rows=np.int64(2)).embed.weight.shape == (8, 4)
    assert OverlappingDestinationsModel(SHAPES, overlap=np.int64(2)).overlap == 2


# -- branches the coverage audit found unpinned ---------------------------------------------


def test_a_fill_for_an_integer_like_dtype_with_no_limits_must_be_whole():
    # torch.iinfo has no limits for bits8: only "whole number" is asked of the fill
    with pytest.raises(ValueError, match=r"fill 2\.5 is not a value of torch\.bits8 "
                                         r"\(not a whole number\)"):
        PlainModel({"w": (2,)}, dtype=torch.bits8, fill=2.5)


def test_a_dtype_torch_cannot_fill_is_named_as_such_not_the_fill():
    # (it said "fill 0.0 is not a value of torch.bits8": 0 is one; torch.full has no
    # kernel for bits8 at all)
    with pytest.raises(ValueError, match=r"PlainModel: torch cannot make a tensor of dtype "
                                         r"torch\.bits8 \(fill 0\.0: .*not implemented"):
        PlainModel({"w": (2,)}, dtype=torch.bits8)
    with pytest.raises(ValueError, match=r"PlainModel: fill 1000\.0 is not a value of "
                                         r"torch\.int8"):  # (a fill the dtype cannot hold)
        PlainModel({"w": (2,)}, dtype=torch.int8, fill=1000.0)


def test_from_state_dict_takes_a_dtype_over_the_first_tensors():
    m = PlainModel.from_state_dict({"w": torch.arange(4, dtype=torch.int32)},
                                   dtype=torch.float64)
    assert m.w.dtype == torch.float64 and m.w.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_overlapping_destinations_refuses_a_weight_of_another_shape():
    m = OverlappingDestinationsModel({"a": (4,), "b": (2,)})
    with pytest.raises(ValueError, match=r"OverlappingDestinationsModel\.load_weights: 'a' "
                                         r"has shape \(3,\), expected \(4,\)"):
        m.load_weights([("a", torch.zeros(3))])


def test_tiny_llama_runtime_refuses_a_config_that_is_no_tiny_llama_config():
    with pytest.raises(TypeError, match="config must be a TinyLlamaConfig, got dict"):
        TinyLlamaRuntime({"hidden_size": 8})


def test_a_weight_loader_refuses_a_loaded_weight_that_is_no_tensor():
    model = TinyLlamaRuntime(TinyLlamaConfig(), tp_rank=0, tp_size=2)
    norm = model.get_parameter("model.norm.weight")
    with pytest.raises(TypeError, match=r"weight_loader: loaded_weight must be a torch\.Tensor, "
                                        "got list"):
        norm.weight_loader(norm, [1.0, 2.0])
