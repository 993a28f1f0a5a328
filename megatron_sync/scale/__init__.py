"""The scale model: a sync planned at full size with the project's own planners on metadata, its time
predicted per transport on a named hardware profile, checked against measurements, and `transport: auto`.

    layouts.py   the trainer's and the engines' layouts, where the engines run   models.py  bundled HF configs
    megatron_side.py  the Megatron side from a family's rules     plans.py / p2p_plan.py  the adapters to the planners
    summary.py   per-sender / per-receiver totals of a plan       hardware.py  profiles, every number sourced
    phases.py    phases, predictions, shared link rates           timing*.py  the time model per transport
    variants.py  other systems' methods   published*.py  their published syncs (calibration rows and checks)
    auto.py      transport: auto          cli.py / sweep.py / __main__.py  python -m megatron_sync.scale
"""
