"""Pure gather pieces: strided shard merge/split and the unit order, without processes."""

import pytest
import torch

from megatron_sync.trainer.gather import merge_strided_shards, plan_gather_units, split_strided_shard
from megatron_sync.core.grid import ParallelLayout
from megatron_sync.trainer.source import ExpertSlot, Split, SourceTensor


@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.parametrize("dim,stride", [(0, 1), (1, 1), (0, 2)])
def test_split_then_merge_is_identity(size, dim, stride):
    full = torch.arange(8 * 8).reshape(8, 8)
    shards = [split_strided_shard(full, dim, stride, size, r) for r in range(size)]
    assert torch.equal(merge_strided_shards(shards, dim, stride), full)


def test_gated_fc1_shards_hold_gate_then_up_halves():
    # Full TP=1 layout: rows 0..3 are gate, rows 4..7 are up.
    full = torch.arange(8)[:, None]
    shard0 = split_strided_shard(full, 0, 2, 2, 0)
    shard1 = split_strided_shard(full, 0, 2, 2, 1)
    assert shard0.flatten().tolist() == [0, 1, 4, 5]  # [gate_0; up_0]
    assert shard1.flatten().tolist() == [2, 3, 6, 7]  # [gate_1; up_1]


@pytest.mark.parametrize("size", [1, 2, 4])
def test_unequal_pieces_split_then_merge_is_identity(size):
    full = torch.arange(24 * 3).reshape(24, 3)
    pieces = (8, 8, 4, 4)  # a gated-delta-net in_proj: q, k, v, z of different widths
    shards = [split_strided_shard(full, 0, pieces, size, r) for r in range(size)]
    assert torch.equal(merge_strided_shards(shards, 0, pieces), full)


def test_unequal_pieces_shard_holds_its_part_of_every_piece():
    # Full TP=1 layout [q0 q1 q2 q3 | k0 k1 k2 k3 | v0 v1]: each TP=2 rank holds [q_r; k_r; v_r].
    full = torch.arange(10)[:, None]
    assert split_strided_shard(full, 0, (4, 4, 2), 2, 0).flatten().tolist() == [0, 1, 4, 5, 8]
    assert split_strided_shard(full, 0, (4, 4, 2), 2, 1).flatten().tolist() == [2, 3, 6, 7, 9]
    shards = [torch.tensor([[0], [1], [4], [5], [8]]), torch.tensor([[2], [3], [6], [7], [9]])]
    assert merge_strided_shards(shards, 0, (4, 4, 2)).flatten().tolist() == list(range(10))


def _expert(layer, j, kind, num_local=2):
    template = f"decoder.layers.{layer}.mlp.experts.local_experts.{{expert}}.{kind}.weight"
    slot = ExpertSlot(layer=layer, template=template, local_index=j, num_local=num_local)
    return SourceTensor(template.format(expert=j), torch.zeros(2, 2), Split(), slot)


def test_units_list_every_global_expert_in_order_on_every_ep_rank():
    tensors = [
        SourceTensor("decoder.layers.0.mlp.router.weight", torch.zeros(4, 2), Split()),
        _expert(0, 0, "linear_fc1"), _expert(0, 0, "linear_fc2"),
        _expert(0, 1, "linear_fc1"), _expert(0, 1, "linear_fc2"),
        SourceTensor("decoder.final_layernorm.weight", torch.zeros(2), Split()),
    ]
    for ep_rank in range(2):
        layout = ParallelLayout(ep=2, ep_rank=ep_rank, dp=2, dp_rank=ep_rank)
        units = plan_gather_units(tensors, layout)
        names = [u.name for u in units]
        assert names == [
            "decoder.layers.0.mlp.router.weight",
            *[f"decoder.layers.0.mlp.experts.local_experts.{e}.{k}.weight"
              for e in range(4) for k in ("linear_fc1", "linear_fc2")],
            "decoder.final_layernorm.weight",
        ]
        owned = [u.name for u in units if u.local is not None and u.owner_ep is not None]
        assert len(owned) == 4 and all(int(n.split(".")[6]) // 2 == ep_rank for n in owned)
