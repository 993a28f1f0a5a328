"""The scale model: a sync planned at full size with the project's own planners on metadata, its time
predicted per transport on a named hardware profile, checked against measurements, and `transport: auto`.

    layouts.py   the trainer's and the engines' layouts as data      models.py    bundled HF configs
    megatron_side.py  the Megatron side from a family's rules        plans.py     the one adapter to the planners
    summary.py   per-sender / per-receiver totals of a plan          hardware.py  profiles, every number sourced
    timing.py    the time model per transport                        published.py other systems' syncs
    auto.py      transport: auto                                      __main__.py  python -m megatron_sync.scale
"""
