"""Mixture-of-experts in the tiny Llama: ``TinyLlamaConfig(num_experts=E)``.

vLLM's fused-experts layout: per layer a replicated router ``mlp.gate.weight`` (E, H),
``mlp.experts.w13_weight`` (E, 2 * I/T, H) holding each expert's gate rows then its up
rows of this rank, and ``mlp.experts.w2_weight`` (E, H, I/T) holding its down_proj
columns of this rank; checkpoints name each expert's tensors
``mlp.experts.{e}.{gate,up,down}_proj.weight``. Every expected slice below is cut by
the test from the checkpoint tensors themselves.
"""

from __future__ import annotations

import pytest
import torch

import patchkit
from patchkit import CheckpointWeightPatch, load_checkpoint_weight_patches
from patchkit.build import AdamLikeTrainer, dense_patches, sparse_patches_from_diff
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
    for rt in rts:
        load_checkpoint_weight_patches(rt, dense_patches(ckpt))
    got = gather_checkpoint(rts)
    assert list(got) == list(ckpt)
    for n, t in ckpt.items():
        assert same_bits(got[n], t), n
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
