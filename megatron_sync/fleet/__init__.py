"""An elastic fleet of engines: who is in it (`roster`), and who brings a version to whom (`waves`).

Pure planning; the trainer's driver (`megatron_sync.drivers.sync`) walks these plans over its per-engine links.
"""
