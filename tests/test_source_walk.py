"""Source walk on hand-built modules: global layer and expert indices in both expert namings."""

from types import SimpleNamespace

import torch
from torch import nn

from megatron_sync.core.grid import ParallelLayout
from megatron_sync.trainer.source import walk_model_chunks


def _param(*shape, tp=False, dim=0, stride=1):
    p = nn.Parameter(torch.zeros(*shape))
    if tp:
        p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, stride
    return p


def _layer(layer_number: int, grouped: bool, num_local: int) -> nn.Module:
    layer = nn.Module()
    layer.layer_number = layer_number
    layer.mlp = nn.Module()
    layer.mlp.router = nn.Module()
    layer.mlp.router.weight = _param(4, 8)
    layer.mlp.router.register_buffer("expert_bias", torch.zeros(4))
    layer.mlp.experts = nn.Module()
    if grouped:  # TEGroupedMLP: linear_fc1.weight{j}
        for fc, shape in (("linear_fc1", (6, 8)), ("linear_fc2", (8, 3))):
            module = nn.Module()
            for j in range(num_local):
                module.register_parameter(f"weight{j}", _param(*shape, tp=True, dim=0 if fc == "linear_fc1" else 1))
            setattr(layer.mlp.experts, fc, module)
    else:  # SequentialMLP: local_experts.{j}.linear_fc1.weight
        layer.mlp.experts.local_experts = nn.ModuleList()
        for _ in range(num_local):
            expert = nn.Module()
            expert.linear_fc1 = nn.Module()
            expert.linear_fc1.weight = _param(6, 8, tp=True, dim=0, stride=2)
            layer.mlp.experts.local_experts.append(expert)
    return layer


def _chunk(first_layer_number: int, grouped: bool) -> nn.Module:
    chunk = nn.Module()
    chunk.config = SimpleNamespace(num_moe_experts=4)
    chunk.decoder = nn.Module()
    chunk.decoder.layers = nn.ModuleList([_layer(first_layer_number, grouped, num_local=2)])
    return chunk


def test_grouped_experts_get_global_layer_and_expert_indices():
    layout = ParallelLayout(ep=2, ep_rank=1, dp=2, dp_rank=1)
    tensors = walk_model_chunks([_chunk(3, grouped=True)], layout, is_buffer=lambda n: n.endswith("expert_bias"))
    names = {t.name: t for t in tensors}
    assert set(names) == {
        "decoder.layers.2.mlp.router.weight",
        "decoder.layers.2.mlp.router.expert_bias",
        "decoder.layers.2.mlp.experts.linear_fc1.weight2",
        "decoder.layers.2.mlp.experts.linear_fc1.weight3",
        "decoder.layers.2.mlp.experts.linear_fc2.weight2",
        "decoder.layers.2.mlp.experts.linear_fc2.weight3",
    }
    fc2 = names["decoder.layers.2.mlp.experts.linear_fc2.weight3"]
    assert (fc2.sharding.axis, fc2.sharding.dim) == ("etp", 1)
    assert fc2.expert.template == "decoder.layers.2.mlp.experts.linear_fc2.weight{expert}"
    assert names["decoder.layers.2.mlp.router.weight"].sharding.axis is None


def test_sequential_experts_keep_stride_and_buffers_are_opt_in():
    layout = ParallelLayout(ep=2, ep_rank=0, dp=2, dp_rank=0)
    tensors = walk_model_chunks([_chunk(1, grouped=False)], layout)
    names = {t.name: t for t in tensors}
    assert "decoder.layers.0.mlp.router.expert_bias" not in names  # the converter did not ask for it
    fc1 = names["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"]
    assert (fc1.sharding.axis, fc1.sharding.dim, fc1.sharding.stride) == ("etp", 0, 2)
    assert fc1.expert.local_index == 1


def test_layer_eleven_is_not_layer_one():
    layout = ParallelLayout()
    [chunk] = [_chunk(12, grouped=False)]
    names = [t.name for t in walk_model_chunks([chunk], layout)]
    assert all(n.startswith("decoder.layers.11.") for n in names)


class DotProductAttention(nn.Module):  # named like megatron-core's: the walk reads the class name
    def __init__(self, heads_per_rank):
        super().__init__()
        self.softmax_offset = nn.Parameter(torch.zeros(heads_per_rank))  # no TP attributes, as in 0.16.1


class GatedDeltaNet(nn.Module):
    def __init__(self, tp):
        super().__init__()
        self.qk_dim, self.v_dim, self.num_value_heads = 8, 16, 4
        self.in_proj = nn.Module()
        self.in_proj.weight = _param((2 * 8 + 2 * 16 + 2 * 4) // tp, 6, tp=True, dim=0)
        self.conv1d = nn.Conv1d((2 * 8 + 16) // tp, (2 * 8 + 16) // tp, 4, groups=(2 * 8 + 16) // tp, bias=False)
        self.conv1d.weight.tensor_model_parallel = True  # set without partition_dim, as in 0.16.1
        self.A_log = nn.Parameter(torch.zeros(4 // tp))
        self.A_log.tensor_model_parallel = True


def test_module_declared_splits_name_their_pieces():
    chunk = nn.Module()
    chunk.decoder = nn.Module()
    layer = nn.Module()
    layer.layer_number = 1
    layer.self_attention = GatedDeltaNet(tp=2)
    other = nn.Module()
    other.layer_number = 2
    other.self_attention = nn.Module()
    other.self_attention.core_attention = DotProductAttention(heads_per_rank=2)
    chunk.decoder.layers = nn.ModuleList([layer, other])
    names = {t.name: t.sharding for t in walk_model_chunks([chunk], ParallelLayout(tp=2, tp_rank=1))}
    assert names["decoder.layers.0.self_attention.in_proj.weight"].stride == (8, 8, 16, 16, 4, 4)
    assert names["decoder.layers.0.self_attention.conv1d.weight"].stride == (8, 8, 16)
    assert (names["decoder.layers.0.self_attention.A_log"].axis, names["decoder.layers.0.self_attention.A_log"].dim) \
        == ("tp", 0)
    sinks = names["decoder.layers.1.self_attention.core_attention.softmax_offset"]
    assert (sinks.axis, sinks.dim, sinks.stride) == ("tp", 0, 1)


def _mtp_chunk(pre_process: bool) -> nn.Module:
    """A last-stage chunk: decoder layer 4 of 4, the MTP block's depth 0 (an MoE layer), and the embedding
    (the stage's own when it is also the first stage, else Megatron's copy for the MTP block)."""
    chunk = _chunk(4, grouped=False)
    chunk.config.num_layers = 4
    chunk.pre_process, chunk.mtp_process = pre_process, True
    chunk.embedding = nn.Module()
    chunk.embedding.word_embeddings = nn.Module()
    chunk.embedding.word_embeddings.weight = _param(8, 8, tp=True)
    depth = nn.Module()
    depth.layer_number = 1
    depth.enorm = nn.Module()
    depth.enorm.weight = _param(8)
    depth.transformer_layer = _layer(5, grouped=False, num_local=2)  # Megatron numbers it past the decoder
    chunk.mtp = nn.Module()
    chunk.mtp.layers = nn.ModuleList([depth])
    return chunk


def test_mtp_layers_get_their_depth_and_global_experts_and_the_stage_embedding_copy_a_name_apart():
    layout = ParallelLayout(ep=2, ep_rank=1, dp=2, dp_rank=1)
    tensors = walk_model_chunks([_mtp_chunk(pre_process=False)], layout, is_buffer=lambda n: n.endswith("expert_bias"))
    names = {t.name: t for t in tensors}
    assert set(n for n in names if n.startswith("mtp.")) == {
        "mtp.embedding.word_embeddings.weight",
        "mtp.layers.0.enorm.weight",
        "mtp.layers.0.transformer_layer.mlp.router.weight",
        "mtp.layers.0.transformer_layer.mlp.router.expert_bias",
        "mtp.layers.0.transformer_layer.mlp.experts.local_experts.2.linear_fc1.weight",
        "mtp.layers.0.transformer_layer.mlp.experts.local_experts.3.linear_fc1.weight",
    }
    fc1 = names["mtp.layers.0.transformer_layer.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert fc1.expert.template == "mtp.layers.0.transformer_layer.mlp.experts.local_experts.{expert}.linear_fc1.weight"
    # the depth's experts are gathered as a layer of their own, apart from decoder layer 3's
    assert fc1.expert.layer == 4
    assert names["decoder.layers.3.mlp.experts.local_experts.3.linear_fc1.weight"].expert.layer == 3
    assert "embedding.word_embeddings.weight" not in names
    # On a single stage the embedding is the model's own.
    single = {t.name for t in walk_model_chunks([_mtp_chunk(pre_process=True)], ParallelLayout())}
    assert "embedding.word_embeddings.weight" in single and "mtp.embedding.word_embeddings.weight" not in single
