"""SGLang as a megatron-sync engine, spoken over SGLang's own HTTP weight-update API (SGLang 0.5.23).

- `requests`: the request bodies, one builder per route (the wire format's one home).
- `client.SGLangEngineClient`: the trainer-side `EngineClient` (checks the settings, pause,
  begin/end update session, cache flush, weight version, resume).
- The bytes move through transport "sglang" (`megatron_sync.transports.sglang`): SGLang's update
  group (`sglang_load: distributed`) or colocated shared-memory tensors (`sglang_load: tensor`).

Settings: `transport: sglang`, `engines: ["sglang=http://host:30000"]`.

No SGLang import: the trainer never needs SGLang installed.
"""
