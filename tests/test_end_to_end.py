"""The property that matters: trainer weights reach every rank bit for bit, through patches."""

from __future__ import annotations

import pytest

import patchkit
from patchkit import AdamLikeTrainer, dense_patches, same_state, sparse_patches_from_diff
from patchkit.toymodels import (
    TinyLlamaConfig,
    TinyLlamaRuntime,
    gather_checkpoint,
    tiny_llama_checkpoint,
)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("tp_size", [1, 2, 4])
@pytest.mark.parametrize("budget", [4 << 10, 512 << 20])
def test_sparse_sync_from_a_bit_level_diff_reaches_every_rank_bit_for_bit(
    tp_size, tied, budget
):
    config = TinyLlamaConfig(num_heads=4, num_kv_heads=4, tie_word_embeddings=tied)
    ckpt = tiny_llama_checkpoint(config, seed=3)
    ranks = [TinyLlamaRuntime(config, tp_rank=r, tp_size=tp_size) for r in range(tp_size)]
    for rank in ranks:
        patchkit.load_checkpoint_weight_patches(rank, dense_patches(ckpt), max_chunk_bytes=budget)
    assert same_state(gather_checkpoint(ranks), ckpt)

    trainer = AdamLikeTrainer(ckpt, lr=1e-5, seed=tp_size)
    for _ in range(2):
        before = trainer.state_dict()
        after = trainer.step()
        patches = sparse_patches_from_diff(before, after)
        assert patches, "the step changed nothing: the test would prove nothing"
        calls = patchkit.plan_chunks(patches, budget)
        if budget < 512 << 20:
            assert len(calls) > len(patches) // 2  # a budget that splits the load
        for rank in ranks:
            patchkit.load_checkpoint_weight_patches(rank, patches, max_chunk_bytes=budget)
        assert same_state(gather_checkpoint(ranks), after)


def test_a_sync_through_a_patch_file_is_the_same_as_in_memory(tmp_path):
    config = TinyLlamaConfig()
    ckpt = tiny_llama_checkpoint(config, seed=4)
    trainer = AdamLikeTrainer(ckpt, lr=1e-5, seed=0)
    after = trainer.step()
    patches = sparse_patches_from_diff(ckpt, after)
    patchkit.save_patches(tmp_path / "step1.safetensors", patches, metadata={"step": "1"})
    loaded = patchkit.load_patches(tmp_path / "step1.safetensors")
    ranks = [TinyLlamaRuntime(config, tp_rank=r, tp_size=2) for r in range(2)]
    for rank in ranks:
        patchkit.load_checkpoint_weight_patches(rank, dense_patches(ckpt))
        patchkit.load_checkpoint_weight_patches(rank, loaded, max_chunk_bytes=8 << 10)
    assert same_state(gather_checkpoint(ranks), after)
    assert patchkit.read_patch_metadata(tmp_path / "step1.safetensors") == {"step": "1"}
