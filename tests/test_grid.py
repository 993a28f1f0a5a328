"""The one parallel grid: `Grid` holds and validates the sizes; a live rank's `ParallelLayout` is a `Grid`
with its coordinates and groups; the scale model's `TrainerLayout` is a `Grid` on nodes."""

from __future__ import annotations

import pytest

from megatron_sync.core.grid import AXES, Grid, ParallelLayout
from megatron_sync.scale.auto import trainer_layout_of
from megatron_sync.scale.layouts import TrainerLayout


def test_a_layout_is_its_grid_and_the_grid_computes_the_expert_data_parallel_size():
    layout = ParallelLayout(tp=2, dp=4, ep=2, etp=1, tp_rank=1, dp_rank=3, ep_rank=1, edp_rank=3)
    assert isinstance(layout, Grid) and layout.grid == Grid(tp=2, dp=4, ep=2, etp=1)
    assert (layout.world, layout.stage_ranks, layout.edp) == (8, 8, 4)
    assert trainer_layout_of(layout, 8) == TrainerLayout(tp=2, dp=4, ep=2, etp=1, gpus_per_node=8)


@pytest.mark.parametrize("kwargs,match", [
    ({"ep": 2}, r"trainer: ep\*etp=2 must divide tp\*cp\*dp=1"),  # the grid's rule, checked once, there
    ({"tp": 0}, r"trainer.tp must be an integer >= 1, got 0"),
    ({"tp": 2, "tp_rank": 2}, r"parallel layout: tp rank 2 is outside size 2"),
    ({"dp": 2, "ep": 2, "edp_rank": 1}, r"parallel layout: edp rank 1 is outside size 1"),
])
def test_a_layout_outside_its_grid_is_refused_naming_the_axis(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelLayout(**kwargs)


def test_every_rank_of_a_grid_is_a_valid_place_in_it_and_keeps_its_sizes():
    grid = TrainerLayout(tp=2, cp=2, dp=2, pp=2, ep=4, etp=2, first_layers=3, gpus_per_node=8)
    for rank in grid.ranks():
        layout = ParallelLayout.at(grid, **{f"{axis}_rank": getattr(rank, axis) for axis in AXES})
        assert layout.grid == Grid(**Grid.sizes(grid)) and layout.first_layers == 3
        assert layout.is_stage_source == (grid.stage_source(rank.pp) == rank.rank)
