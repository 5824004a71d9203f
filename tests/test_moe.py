"""Mixture-of-experts in the tiny Llama: ``TinyLlamaConfig(num_experts=E)``.

vLLM's fused-experts layout: per layer a replicated router ``mlp.gate.weight`` (E, H),
``mlp.experts.w13_weight`` (E, 2 * I/T, H) holding each expert's gate rows then its up
rows of this rank, and ``mlp.experts.w2_weight`` (E, H, I/T) holding its down_proj
columns of this rank; checkpoints name each expert's tensors
``mlp.experts.{e}.{gate,up,down}_proj.weight``. With ``expert_parallel=True`` rank r of
T holds experts [r*E/T, (r+1)*E/T) whole instead, (E/T, 2 * I, H) and (E/T, H, I), and its
loader skips (writes nothing, returns no name for) the other ranks' experts: the last
part checks that skipping in every kind of load and report. Every expected slice below
is cut by the test from the checkpoint tensors themselves.
"""

from __future__ import annotations

import pytest
import torch

import patchkit
from patchkit import CheckpointWeightPatch, load_checkpoint_weight_patches
from patchkit.build import AdamLikeTrainer, dense_patches, sparse_patches_from_diff
from patchkit.inspect import NO_WRITE_NOTE
from patchkit.toymodels import (
    TinyLlamaConfig,
    TinyLlamaRuntime,
    UnknownWeightError,
    gather_checkpoint,
    tiny_llama_checkpoint,
    tiny_llama_shapes,
)

E, H, INTER = 4, 64, 128
MOE = dict(vocab_size=256, hidden_size=H, intermediate_size=INTER, num_layers=2,
           num_heads=4, num_kv_heads=2, num_experts=E)
EXPERT = "model.layers.{i}.mlp.experts.{e}.{w}_proj.weight"
W13 = "model.layers.{i}.mlp.experts.w13_weight"
W2 = "model.layers.{i}.mlp.experts.w2_weight"

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().view(torch.int16)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(bits(a), bits(b))


def ranks_of(config: TinyLlamaConfig, tp: int) -> list[TinyLlamaRuntime]:
    return [TinyLlamaRuntime(config, r, tp) for r in range(tp)]


def gathered_after_loading(rts: list[TinyLlamaRuntime], ckpt) -> dict[str, torch.Tensor]:
    """``gather_checkpoint(rts)`` after a dense load of ``ckpt`` into every rank, checked
    to be ``ckpt`` bit for bit, name for name, in its order."""
    for rt in rts:
        load_checkpoint_weight_patches(rt, dense_patches(ckpt))
    got = gather_checkpoint(rts)
    assert list(got) == list(ckpt)
    for n, t in ckpt.items():
        assert same_bits(got[n], t), n
    return got


def expected_experts(ckpt, layer: int, r: int, tp: int,
                     experts: int = E) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13_weight, w2_weight) of rank ``r`` of ``tp`` for ``layer``, cut from ``ckpt``."""
    size = INTER // tp
    rows = slice(r * size, (r + 1) * size)
    w13 = torch.stack([
        torch.cat([ckpt[EXPERT.format(i=layer, e=e, w="gate")][rows],
                   ckpt[EXPERT.format(i=layer, e=e, w="up")][rows]])
        for e in range(experts)])
    w2 = torch.stack([ckpt[EXPERT.format(i=layer, e=e, w="down")][:, rows]
                      for e in range(experts)])
    return w13, w2


# --------------------------------------------------------------------------------------
# config, names, layout
# --------------------------------------------------------------------------------------


def test_the_mlp_is_dense_unless_num_experts_is_given():
    assert TinyLlamaConfig().num_experts == 0
    dense = tiny_llama_shapes(TinyLlamaConfig())
    assert not any("experts" in n or n.endswith("mlp.gate.weight") for n in dense)
    assert "model.layers.0.mlp.gate_proj.weight" in dense
    rt = TinyLlamaRuntime(TinyLlamaConfig())
    assert "model.layers.0.mlp.gate_up_proj.weight" in dict(rt.named_parameters())


@pytest.mark.parametrize("value", [-1, 2.0, True, "4", None])
def test_a_bad_num_experts_is_refused_naming_the_field_and_value(value):
    with pytest.raises(ValueError, match=rf"num_experts must be an int >= 0.*got {value!r}"):
        TinyLlamaConfig(num_experts=value)


def test_the_checkpoint_names_each_expert_in_order_after_the_router():
    c = TinyLlamaConfig(**MOE)
    shapes = tiny_llama_shapes(c)
    layer = [n for n in shapes if n.startswith("model.layers.1.")]
    want = [f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkvo"]
    want.append("model.layers.1.mlp.gate.weight")
    want += [EXPERT.format(i=1, e=e, w=w) for e in range(E) for w in ("gate", "up", "down")]
    want += ["model.layers.1.input_layernorm.weight",
             "model.layers.1.post_attention_layernorm.weight"]
    assert layer == want
    assert shapes["model.layers.1.mlp.gate.weight"] == (E, H)
    assert shapes[EXPERT.format(i=1, e=3, w="gate")] == (INTER, H)
    assert shapes[EXPERT.format(i=1, e=3, w="up")] == (INTER, H)
    assert shapes[EXPERT.format(i=1, e=3, w="down")] == (H, INTER)
    ckpt = tiny_llama_checkpoint(c, seed=1)
    assert list(ckpt) == list(shapes)
    assert {n: tuple(t.shape) for n, t in ckpt.items()} == shapes


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_every_rank_holds_every_expert_in_fused_parameters(tp):
    c = TinyLlamaConfig(**{**MOE, "num_heads": 4, "num_kv_heads": 4})
    for rt in ranks_of(c, tp):
        params = {n: tuple(p.shape) for n, p in rt.named_parameters()}
        layer0 = {n: s for n, s in params.items() if n.startswith("model.layers.0.mlp.")}
        assert layer0 == {"model.layers.0.mlp.gate.weight": (E, H),
                          W13.format(i=0): (E, 2 * INTER // tp, H),
                          W2.format(i=0): (E, H, INTER // tp)}


# --------------------------------------------------------------------------------------
# loads land in each expert's slice
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [1, 2])
def test_a_dense_load_puts_each_experts_shard_in_its_slice_on_every_rank(tp):
    c = TinyLlamaConfig(**MOE)
    ckpt = tiny_llama_checkpoint(c, seed=3)
    for r, rt in enumerate(ranks_of(c, tp)):
        loaded = load_checkpoint_weight_patches(rt, dense_patches(ckpt), max_chunk_bytes=1 << 16)
        assert {W13.format(i=0), W2.format(i=0), "model.layers.0.mlp.gate.weight"} <= loaded
        assert not any(".experts." in n and "_proj" in n for n in loaded)
        for i in range(c.num_layers):
            w13, w2 = expected_experts(ckpt, i, r, tp)
            assert same_bits(rt.get_parameter(W13.format(i=i)), w13)
            assert same_bits(rt.get_parameter(W2.format(i=i)), w2)
            router = f"model.layers.{i}.mlp.gate.weight"
            assert same_bits(rt.get_parameter(router), ckpt[router])


@pytest.mark.parametrize("tp", [1, 2])
def test_a_sparse_patch_of_one_expert_changes_only_its_elements_on_each_rank(tp):
    c = TinyLlamaConfig(**MOE)
    ckpt = tiny_llama_checkpoint(c, seed=0)
    size = INTER // tp
    # expert 2 of layer 1: up_proj rows 5 and 100 (ranks 0 and 1 of tp 2), down_proj
    # columns 7 and 70
    up_rc = [(5, 0), (100, 63)]
    down_rc = [(0, 7), (63, 70)]
    patches = [
        CheckpointWeightPatch(EXPERT.format(i=1, e=2, w="up"), (INTER, H), torch.bfloat16,
                              torch.tensor([0.5, -0.25]),
                              torch.tensor([row * H + col for row, col in up_rc])),
        CheckpointWeightPatch(EXPERT.format(i=1, e=2, w="down"), (H, INTER), torch.bfloat16,
                              torch.tensor([1.5, -2.0]),
                              torch.tensor([row * INTER + col for row, col in down_rc])),
    ]
    for r, rt in enumerate(ranks_of(c, tp)):
        load_checkpoint_weight_patches(rt, dense_patches(ckpt))
        before = {n: p.detach().clone() for n, p in rt.named_parameters()}
        loaded = load_checkpoint_weight_patches(rt, patches)
        assert loaded == {W13.format(i=1), W2.format(i=1)}
        w13, w2 = before[W13.format(i=1)].clone(), before[W2.format(i=1)].clone()
        for (row, col), v in zip(up_rc, (0.5, -0.25)):
            if r * size <= row < (r + 1) * size:
                w13[2, size + row - r * size, col] = v
        for (row, col), v in zip(down_rc, (1.5, -2.0)):
            if r * size <= col < (r + 1) * size:
                w2[2, row, col - r * size] = v
        assert same_bits(rt.get_parameter(W13.format(i=1)), w13)
        assert same_bits(rt.get_parameter(W2.format(i=1)), w2)
        changed = {n for n, p in rt.named_parameters() if not same_bits(p, before[n])}
        assert changed == {W13.format(i=1), W2.format(i=1)}
        # two of the four elements on each rank of tp 2, all four on tp 1
        diff13 = (bits(rt.get_parameter(W13.format(i=1))) != bits(before[W13.format(i=1)]))
        assert int(diff13.sum()) == 2 // tp
        assert diff13[2].any() and not diff13[[0, 1, 3]].any()


@pytest.mark.parametrize("tp", [1, 2])
def test_gather_puts_the_experts_back_together_bit_exactly(tp):
    c = TinyLlamaConfig(**MOE)
    ckpt = tiny_llama_checkpoint(c, seed=5)
    rts = ranks_of(c, tp)
    got = gathered_after_loading(rts, ckpt)
    # fresh tensors: a write into the result leaves the runtimes as they were
    got[EXPERT.format(i=0, e=1, w="down")].fill_(0)
    assert same_bits(gather_checkpoint(rts)[EXPERT.format(i=0, e=1, w="down")],
                     ckpt[EXPERT.format(i=0, e=1, w="down")])


def test_gather_refuses_a_router_that_differs_between_ranks():
    c = TinyLlamaConfig(**MOE)
    rts = ranks_of(c, 2)
    for rt in rts:
        load_checkpoint_weight_patches(rt, dense_patches(tiny_llama_checkpoint(c)))
    rts[1].model.layers[1].mlp.gate.weight.data[3, 0] += 1
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.mlp\.gate\.weight'.*rank 1"):
        gather_checkpoint(rts)


# --------------------------------------------------------------------------------------
# what a report shows
# --------------------------------------------------------------------------------------


def test_the_writes_table_puts_each_experts_gate_and_up_rows_at_their_offsets():
    c = TinyLlamaConfig(**MOE)
    ckpt = tiny_llama_checkpoint(c, seed=0)
    rt = TinyLlamaRuntime(c, tp_rank=1, tp_size=2)
    size = INTER // 2
    names = [EXPERT.format(i=0, e=e, w=w) for e in range(E) for w in ("gate", "up", "down")]
    report = patchkit.inspect_load(rt, dense_patches({n: ckpt[n] for n in names}))
    w = report.writes.set_index("name")
    for e in range(E):
        gate, up, down = (w.loc[EXPERT.format(i=0, e=e, w=p)] for p in ("gate", "up", "down"))
        for row, start in ((gate, 0), (up, size)):
            assert row["target"] == W13.format(i=0)
            assert row["target_offset"] == (e * 2 * size + start) * H
            assert row["target_region"] == f"[{e}:{e + 1}, {start}:{start + size}, :]"
            assert row["checkpoint_region"] == f"[{size}:{2 * size}, :]"
            assert row["elements"] == size * H
        assert down["target"] == W2.format(i=0)
        assert down["target_offset"] == e * H * size
        assert down["checkpoint_region"] == f"[:, {size}:{2 * size}]"
    assert set(report.deltas.index) == {W13.format(i=0), W2.format(i=0)}
    assert report.deltas.loc[W13.format(i=0), "elements"] == E * 2 * size * H


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tp", [1, 2])
def test_experts_the_batch_never_routed_to_stay_unchanged_and_the_counts_are_exact(tp, device):
    # an Adam-like step with gradients for experts 1 and 6 of 8 only (the others got no
    # tokens: no gradient, so Adam leaves them where they are)
    c = TinyLlamaConfig(**{**MOE, "num_experts": 8, "num_layers": 1})
    ckpt = tiny_llama_checkpoint(c, seed=0)
    routed = {1, 6}
    trained = {n: t for n, t in ckpt.items()
               if ".experts." in n and int(n.split(".")[5]) in routed}
    new = {**ckpt, **AdamLikeTrainer(trained, lr=1e-4, seed=2).step()}
    patches = sparse_patches_from_diff(ckpt, new)
    assert {int(p.name.split(".")[5]) for p in patches} == routed
    on_device = [p._replace(values=p.values.to(device), indices=p.indices.to(device))
                 for p in patches]
    size = INTER // tp
    rts = [TinyLlamaRuntime(c, r, tp, device=device) for r in range(tp)]
    for r, rt in enumerate(rts):
        load_checkpoint_weight_patches(rt, dense_patches(ckpt))
        before13 = rt.get_parameter(W13.format(i=0)).detach().clone()
        before2 = rt.get_parameter(W2.format(i=0)).detach().clone()
        report = patchkit.inspect_load(rt, on_device)
        w13, w2 = expected_experts(new, 0, r, tp, experts=8)
        assert same_bits(rt.get_parameter(W13.format(i=0)), w13)
        assert same_bits(rt.get_parameter(W2.format(i=0)), w2)
        after13 = rt.get_parameter(W13.format(i=0))
        after2 = rt.get_parameter(W2.format(i=0))
        for e in set(range(8)) - routed:
            assert same_bits(after13[e], before13[e]) and same_bits(after2[e], before2[e])
        # changed elements, counted from the checkpoint tensors' own bits in this rank's
        # slice of each routed expert
        rows = slice(r * size, (r + 1) * size)
        per_expert = {}
        for e in sorted(routed):
            n = {w: int((bits(ckpt[EXPERT.format(i=0, e=e, w=w)])
                         != bits(new[EXPERT.format(i=0, e=e, w=w)]))[
                    (rows, slice(None)) if w != "down" else (slice(None), rows)].sum())
                 for w in ("gate", "up", "down")}
            per_expert[e] = n
            assert n["gate"] and n["up"] and n["down"]
        want13 = sum(n["gate"] + n["up"] for n in per_expert.values())
        want2 = sum(n["down"] for n in per_expert.values())
        assert int((bits(after13) != bits(before13)).sum()) == want13
        deltas = report.deltas
        assert set(deltas.index) == {W13.format(i=0), W2.format(i=0)}
        assert deltas.loc[W13.format(i=0), "changed"] == want13
        assert deltas.loc[W13.format(i=0), "elements"] == want13  # sparse: only those
        assert deltas.loc[W2.format(i=0), "changed"] == want2
        by_name = report.writes.groupby("name")["changed"].sum()
        for e, n in per_expert.items():
            for w in ("gate", "up", "down"):
                assert by_name[EXPERT.format(i=0, e=e, w=w)] == n[w]
    assert patchkit.same_state(gather_checkpoint(rts), new)


# --------------------------------------------------------------------------------------
# what the loader refuses
# --------------------------------------------------------------------------------------


def test_the_experts_weight_loader_refuses_before_writing():
    c = TinyLlamaConfig(**MOE)
    rt = TinyLlamaRuntime(c, tp_rank=1, tp_size=2)
    w13, w2 = rt.model.layers[0].mlp.experts.w13_weight, rt.model.layers[0].mlp.experts.w2_weight
    gate, down = torch.ones(INTER, H), torch.ones(H, INTER)
    cases = [
        (w13, gate, "x", 0, "shard_id must be 'w1'.*got 'x'"),
        (w13, gate, None, 0, "shard_id must be 'w1'.*got None"),
        (w13, gate, 1, 0, "shard_id must be 'w1'.*got 1"),
        (w13, gate, "w1", E, rf"expert_id must be an int in \[0, {E}\), got {E}"),
        (w13, gate, "w1", -1, "expert_id.*got -1"),
        (w13, gate, "w1", True, "expert_id.*got True"),
        (w13, gate, "w1", 1.0, "expert_id.*got 1.0"),
        (w13, gate, "w2", 0, "'w2' goes into w2_weight"),
        (w2, down, "w1", 0, "'w1' goes into w13_weight"),
        (w13, torch.ones(INTER // 2, H), "w3", 0, "must have shape"),
        (w2, gate, "w2", 0, "must have shape"),
    ]
    for param, w, shard_id, expert_id, match in cases:
        with pytest.raises(ValueError, match=match):
            param.weight_loader(param, w, "a.name", shard_id=shard_id, expert_id=expert_id)
    assert not w13.any() and not w2.any()
    with pytest.raises(ValueError, match=r"experts \('a\.name'\)"):
        w13.weight_loader(w13, gate, "a.name", shard_id="w9", expert_id=0)
    # the right ones still load, in their slices only
    w13.weight_loader(w13, gate, "a.name", shard_id="w3", expert_id=2)
    assert torch.equal(w13.ne(0).nonzero()[:, :2].unique(dim=0),
                       torch.tensor([[2, r] for r in range(INTER // 2, INTER)]))


@pytest.mark.parametrize("name", [
    EXPERT.format(i=0, e=E, w="gate"),  # one expert too many
    "model.layers.0.mlp.gate_proj.weight",  # the dense MLP's name
    "model.layers.0.mlp.experts.w13_weight",  # a runtime name
])
def test_names_the_moe_checkpoint_lacks_are_unknown_weights(name):
    rt = TinyLlamaRuntime(TinyLlamaConfig(**MOE))
    with pytest.raises(UnknownWeightError, match="unknown checkpoint weight"):
        rt.load_weights([(name, torch.ones(INTER, H))])
    assert not any(p.any() for p in rt.parameters())


# --------------------------------------------------------------------------------------
# expert parallelism: whole experts per rank, the others' weights skipped
# --------------------------------------------------------------------------------------


def ep_ranks(config: TinyLlamaConfig, tp: int) -> list[TinyLlamaRuntime]:
    return [TinyLlamaRuntime(config, r, tp, expert_parallel=True) for r in range(tp)]


def expected_ep_experts(ckpt, layer: int, experts) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13_weight, w2_weight) of a rank holding the global ``experts`` whole, in order."""
    w13 = torch.stack([torch.cat([ckpt[EXPERT.format(i=layer, e=e, w="gate")],
                                  ckpt[EXPERT.format(i=layer, e=e, w="up")]])
                       for e in experts])
    w2 = torch.stack([ckpt[EXPERT.format(i=layer, e=e, w="down")] for e in experts])
    return w13, w2


def expert_patch(layer: int, e: int, w: str, values=(0.5, -0.25), at=(3, 200)):
    shape = (H, INTER) if w == "down" else (INTER, H)
    return CheckpointWeightPatch(EXPERT.format(i=layer, e=e, w=w), shape, torch.bfloat16,
                                 torch.tensor(values), torch.tensor(at))


@pytest.mark.parametrize(("experts", "tp"), [(4, 1), (4, 2), (4, 4), (8, 2)])
def test_with_expert_parallel_each_rank_holds_its_block_of_whole_experts(experts, tp):
    c = TinyLlamaConfig(**{**MOE, "num_experts": experts, "num_kv_heads": 4})
    ckpt = tiny_llama_checkpoint(c, seed=4)
    per_rank = experts // tp
    for r, rt in enumerate(ep_ranks(c, tp)):
        assert (rt.ep_rank, rt.ep_size) == (r, tp)
        assert list(rt.local_experts) == list(range(r * per_rank, (r + 1) * per_rank))
        params = {n: tuple(p.shape) for n, p in rt.named_parameters()}
        assert params[W13.format(i=0)] == (per_rank, 2 * INTER, H)
        assert params[W2.format(i=0)] == (per_rank, H, INTER)
        # attention and the rest stay tensor-parallel, as without expert parallelism
        plain = dict(TinyLlamaRuntime(c, r, tp).named_parameters())
        for n in params:
            if ".experts." not in n:
                assert params[n] == tuple(plain[n].shape), n
        loaded = load_checkpoint_weight_patches(rt, dense_patches(ckpt), max_chunk_bytes=1 << 15)
        assert {W13.format(i=1), W2.format(i=1)} <= loaded
        for i in range(c.num_layers):
            w13, w2 = expected_ep_experts(ckpt, i, range(r * per_rank, (r + 1) * per_rank))
            assert same_bits(rt.get_parameter(W13.format(i=i)), w13)
            assert same_bits(rt.get_parameter(W2.format(i=i)), w2)
        size = c.q_size // tp
        qkv = rt.get_parameter("model.layers.0.self_attn.qkv_proj.weight")
        assert same_bits(qkv[:size], ckpt["model.layers.0.self_attn.q_proj.weight"][
            r * size:(r + 1) * size])


def test_without_expert_parallel_the_attributes_say_one_group_holding_every_expert():
    rt = TinyLlamaRuntime(TinyLlamaConfig(**MOE), 1, 2)
    assert (rt.expert_parallel, rt.ep_rank, rt.ep_size) == (False, 0, 1)
    assert list(rt.local_experts) == list(range(E))
    assert list(TinyLlamaRuntime(TinyLlamaConfig()).local_experts) == []


@pytest.mark.parametrize(("changes", "kwargs", "error", "match"), [
    ({"num_experts": 0}, {}, ValueError, r"needs a mixture of experts.*num_experts=0"),
    ({"num_experts": 6}, {}, ValueError,
     r"with expert_parallel=True, tp_size=4 must divide num_experts=6"),
    ({}, {"expert_parallel": 1}, TypeError, r"expert_parallel must be a bool, got int 1"),
    ({}, {"expert_parallel": "yes"}, TypeError, r"expert_parallel must be a bool"),
])
def test_expert_parallel_is_refused_where_the_experts_cannot_be_split(changes, kwargs, error,
                                                                      match):
    c = TinyLlamaConfig(**{**MOE, **changes})
    with pytest.raises(error, match=match):
        TinyLlamaRuntime(c, 0, 4, **{"expert_parallel": True, **kwargs})


def test_with_expert_parallel_intermediate_size_need_not_divide_by_the_ranks():
    # whole experts: nothing is cut along intermediate_size (without expert parallelism
    # it must divide)
    c = TinyLlamaConfig(**{**MOE, "intermediate_size": 90, "num_kv_heads": 4})
    with pytest.raises(ValueError, match="must divide intermediate_size=90"):
        TinyLlamaRuntime(c, 0, 4)
    rt = TinyLlamaRuntime(c, 3, 4, expert_parallel=True)
    assert tuple(rt.get_parameter(W13.format(i=0)).shape) == (1, 180, H)
    ckpt = tiny_llama_checkpoint(c, seed=1)
    load_checkpoint_weight_patches(rt, dense_patches(ckpt))
    w13, w2 = expected_ep_experts(ckpt, 1, [3])
    assert same_bits(rt.get_parameter(W13.format(i=1)), w13)
    assert same_bits(rt.get_parameter(W2.format(i=1)), w2)


def test_the_experts_loader_skips_another_ranks_expert_after_checking_it():
    c = TinyLlamaConfig(**MOE)
    rt = TinyLlamaRuntime(c, 1, 2, expert_parallel=True)  # experts 2 and 3
    w13, w2 = rt.model.layers[0].mlp.experts.w13_weight, rt.model.layers[0].mlp.experts.w2_weight
    gate, down = torch.ones(INTER, H), torch.ones(H, INTER)
    assert w13.weight_loader(w13, gate, "a", shard_id="w1", expert_id=0) is False
    assert w2.weight_loader(w2, down, "a", shard_id="w2", expert_id=1) is False
    assert not w13.any() and not w2.any()
    # a bad weight fails on every rank alike, whether the rank holds the expert or not
    for expert_id in (0, 3):
        with pytest.raises(ValueError, match="must have shape"):
            w13.weight_loader(w13, torch.ones(INTER // 2, H), "a", shard_id="w3",
                              expert_id=expert_id)
    with pytest.raises(ValueError, match=rf"expert_id must be an int in \[0, {E}\), got {E}"):
        w13.weight_loader(w13, gate, "a", shard_id="w1", expert_id=E)
    assert w13.weight_loader(w13, gate, "a", shard_id="w3", expert_id=3) is True
    assert torch.equal(w13.ne(0).nonzero()[:, :2].unique(dim=0),
                       torch.tensor([[1, r] for r in range(INTER, 2 * INTER)]))
    assert w2.weight_loader(w2, down, "a", shard_id="w2", expert_id=2) is True
    assert bool(w2[0].eq(1).all()) and not w2[1].any()


@pytest.mark.parametrize("tp", [2, 4])
def test_gather_reads_each_expert_whole_from_the_rank_that_holds_it(tp):
    c = TinyLlamaConfig(**{**MOE, "num_experts": 8, "num_kv_heads": 4})
    ckpt = tiny_llama_checkpoint(c, seed=6)
    rts = ep_ranks(c, tp)
    got = gathered_after_loading(rts, ckpt)
    # fresh tensors: a write into the result leaves the runtimes as they were
    for n in got:
        got[n].zero_()
    assert patchkit.same_state(gather_checkpoint(rts), ckpt)
    # one rank's slot of an expert is that expert in the gathered checkpoint
    rts[-1].model.layers[1].mlp.experts.w2_weight.data[-1, 5, 9] = 7.0
    assert gather_checkpoint(rts)[EXPERT.format(i=1, e=7, w="down")][5, 9] == 7.0


def test_gather_refuses_ranks_that_split_the_experts_differently():
    c = TinyLlamaConfig(**MOE)
    rts = [TinyLlamaRuntime(c, 0, 2, expert_parallel=True), TinyLlamaRuntime(c, 1, 2)]
    with pytest.raises(ValueError, match=r"runtimes\[1\] has expert_parallel=False, "
                                         r"runtimes\[0\] has expert_parallel=True"):
        gather_checkpoint(rts)


MODES = ["plain", "transactional", "inspect", "inspect transactional"]


def load_in(mode: str, rt, patches, **kw):
    """The names a load in ``mode`` returned, and its report (``None`` without one)."""
    tx = "transactional" in mode
    if mode.startswith("inspect"):
        report = patchkit.inspect_load(rt, patches, transactional=tx, **kw)
        return report.loaded, report
    return load_checkpoint_weight_patches(rt, patches, transactional=tx, **kw), None


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_a_load_of_only_another_ranks_experts_writes_nothing_returns_nothing(mode, kind):
    c = TinyLlamaConfig(**MOE)
    ckpt = tiny_llama_checkpoint(c, seed=2)
    theirs = [EXPERT.format(i=0, e=e, w=w) for e in (2, 3) for w in ("gate", "up", "down")]
    patches = (dense_patches({n: ckpt[n] for n in theirs}) if kind == "dense"
               else [expert_patch(0, e, w) for e in (2, 3) for w in ("gate", "up", "down")])
    for budget in (1 << 14, 1 << 30):  # a call per patch, and one call for all
        rt = TinyLlamaRuntime(c, 0, 2, expert_parallel=True)  # experts 0 and 1
        loaded, report = load_in(mode, rt, patches, max_chunk_bytes=budget)
        assert loaded == set()  # an empty collection: the loader owns none of them
        assert not any(p.any() for p in rt.parameters())
        if report is not None:
            assert report.error is None and not report.rolled_back
            assert report.calls["returned"].tolist() == [()] * len(report.calls)
            assert report.calls["writes"].tolist() == [0] * len(report.calls)
            assert len(report.writes) == 0 and len(report.deltas) == 0
            s = report.summary()
            assert s["names loaded"] == 0 and s["runtime writes"] == 0
            assert "calls with no write seen" not in s
            assert report.chunks["note"].tolist() == [NO_WRITE_NOTE] * len(patches)


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("budget", [1 << 14, 1 << 30])
def test_a_sparse_load_of_both_ranks_experts_writes_each_ranks_own(mode, budget):
    # experts 1 (rank 0's) and 2 (rank 1's), and the replicated router; with the small
    # budget a call per patch, with the large one a single call holding both ranks'
    c = TinyLlamaConfig(**MOE)
    ckpt = tiny_llama_checkpoint(c, seed=0)
    router = "model.layers.1.mlp.gate.weight"
    patches = [CheckpointWeightPatch(router, (E, H), torch.bfloat16, torch.tensor([2.0]),
                                     torch.tensor([70]))]
    patches += [expert_patch(1, e, w, values=(1.5, -3.0), at=(5, 4000))
                for e in (1, 2) for w in ("gate", "up", "down")]
    for r, rt in enumerate(ep_ranks(c, 2)):
        load_checkpoint_weight_patches(rt, dense_patches(ckpt))
        before = {n: p.detach().clone() for n, p in rt.named_parameters()}
        loaded, report = load_in(mode, rt, patches, max_chunk_bytes=budget)
        assert loaded == {router, W13.format(i=1), W2.format(i=1)}
        mine = 1 if r == 0 else 2
        slot = mine - rt.local_experts.start
        w13, w2 = before[W13.format(i=1)].clone(), before[W2.format(i=1)].clone()
        for k, v in ((5, 1.5), (4000, -3.0)):
            w13[slot].view(-1)[k] = v  # gate rows first
            w13[slot].view(-1)[INTER * H + k] = v  # then up rows
            w2[slot].view(-1)[k] = v
        assert same_bits(rt.get_parameter(W13.format(i=1)), w13)
        assert same_bits(rt.get_parameter(W2.format(i=1)), w2)
        changed = {n for n, p in rt.named_parameters() if not same_bits(p, before[n])}
        assert changed == {router, W13.format(i=1), W2.format(i=1)}
        if report is None:
            continue
        theirs = [k + 1 for k, p in enumerate(patches[1:])
                  if int(p.name.split(".")[5]) != mine]
        assert len(theirs) == 3
        assert set(report.writes["position"]) == set(range(len(patches))) - set(theirs)
        assert set(report.deltas.index) == changed
        assert report.deltas["changed"].sum() == 1 + 3 * 2
        if budget == 1 << 14:  # a call per patch: the other rank's return nothing
            returned = dict(zip(report.calls["chunk"], report.calls["returned"]))
            for k in theirs:
                assert returned[report.chunks["chunk"][k]] == ()
        assert "calls with no write seen" not in report.summary()
        # each patch of the other rank's expert is noted as taken and not written from
        notes = report.chunks["note"].tolist()
        assert [k for k, n in enumerate(notes) if n] == theirs
        assert all(notes[k] == NO_WRITE_NOTE for k in theirs)
        report.plot_placement()  # draws the writes it has, without error
        import matplotlib.pyplot as plt

        plt.close("all")


@pytest.mark.filterwarnings("error")
def test_a_rollback_after_a_call_that_skipped_everything_gives_no_warning():
    # transactional: call 0 holds only rank 1's expert (skipped, empty set), call 1 a
    # local one, call 2 a name the model lacks; the rollback restores call 1's write and
    # has no call to warn of (a call that returned nothing wrote nothing)
    c = TinyLlamaConfig(**MOE)
    rt = TinyLlamaRuntime(c, 0, 2, expert_parallel=True)
    load_checkpoint_weight_patches(rt, dense_patches(tiny_llama_checkpoint(c)))
    before = {n: p.detach().clone() for n, p in rt.named_parameters()}
    bad = CheckpointWeightPatch(EXPERT.format(i=0, e=E, w="up"), (INTER, H), torch.bfloat16,
                                torch.tensor([1.0]), torch.tensor([0]))
    patches = [expert_patch(0, 3, "up"), expert_patch(0, 0, "up"), bad]
    for mode in ("transactional", "inspect transactional"):
        with pytest.raises(UnknownWeightError) as info:
            load_in(mode, rt, patches, max_chunk_bytes=1 << 14)
        assert all(same_bits(p, before[n]) for n, p in rt.named_parameters())
        if mode.startswith("inspect"):
            report = info.value.report
            assert report.rolled_back is True
            assert report.calls["returned"].tolist()[:2] == [(), (W13.format(i=0),)]
            assert "calls with no write seen" not in report.summary()


def test_explore_shows_a_skipped_patch_with_its_note():
    pytest.importorskip("ipywidgets")
    c = TinyLlamaConfig(**MOE)
    rt = TinyLlamaRuntime(c, 1, 2, expert_parallel=True)  # experts 2 and 3
    patches = [expert_patch(0, 0, "gate"), expert_patch(0, 3, "gate")]
    report = patchkit.inspect_load(rt, patches)
    ex = report.explore()
    texts = {}
    for k in range(2):
        ex.dropdown.value = ("patch", k)
        texts[k] = "".join(o.get("text", "") for o in ex.output.outputs)
    assert f"note: {NO_WRITE_NOTE}" in texts[0]
    assert "note:" not in texts[1]
    import matplotlib.pyplot as plt

    plt.close("all")


class _NamesSkippedExperts(TinyLlamaRuntime):
    """An expert-parallel loader that returns the fused name of every expert weight it
    was sent, its own or not (a loader that adds the name whatever the weight loader
    did), where vLLM's MoE loaders leave a skipped expert's name out."""

    def load_weights(self, weights):
        weights = list(weights)
        names = {".".join([*n.split(".")[:5], _FUSED[n.split(".")[6]]])
                 for n, _ in weights if ".experts." in n}
        return super().load_weights(weights) | names


_FUSED = {"gate_proj": "w13_weight", "up_proj": "w13_weight", "down_proj": "w2_weight"}


def test_a_loader_that_returns_skipped_experts_names_is_refused_sparse_and_noted_dense():
    c = TinyLlamaConfig(**MOE)
    ckpt = tiny_llama_checkpoint(c, seed=0)
    rt = _NamesSkippedExperts(c, 0, 2, expert_parallel=True)  # experts 0 and 1
    # sparse: a call that returns names but copied nothing is refused (CONTRACT §4), and
    # the message says what an expert-parallel loader should return instead
    with pytest.raises(patchkit.ContractViolation,
                       match=r"returned \['model\.layers\.0\.mlp\.experts\.w13_weight'\] "
                             r"without copying.*returns an empty collection"):
        load_checkpoint_weight_patches(rt, [expert_patch(0, 3, "up")])
    assert not any(p.any() for p in rt.parameters())
    # dense: the call is one "with no write seen"; the rollback's warning of it says it
    # may have written nothing, not only that its writes stayed in the model
    theirs = dense_patches({EXPERT.format(i=0, e=3, w="up"): ckpt[EXPERT.format(i=0, e=3,
                                                                                w="up")]})
    report = patchkit.inspect_load(rt, theirs)
    assert report.summary()["calls with no write seen"] == [0]
    assert report.loaded == {W13.format(i=0)}
    bad = CheckpointWeightPatch("nope", (1,), torch.bfloat16, torch.ones(1))
    with pytest.warns(UserWarning, match=r"without a write it saw: .* stays in the model; "
                      r"a call that wrote nothing \(a loader that skips weights another "
                      r"rank holds yet returns their names\) left nothing to put back"), \
            pytest.raises(UnknownWeightError):
        load_checkpoint_weight_patches(rt, [*theirs, bad], transactional=True,
                                       max_chunk_bytes=1 << 14)
    assert not any(p.any() for p in rt.parameters())
