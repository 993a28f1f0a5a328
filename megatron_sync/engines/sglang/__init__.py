"""SGLang as a megatron-sync engine, spoken over SGLang's own HTTP weight-update API (SGLang 0.5.21+).

- `requests`: the request bodies, one builder per route (the wire format's one home).
- `client.SGLangEngineClient`: the trainer-side `EngineClient` (join the update
  group, pause, begin/end update session, cache flush, weight version, resume).
- `transport.SGLangTransport`: registered as transport "sglang", the trainer's
  end of SGLang's update group, which the bucket `WeightSender` sends plan
  buckets through (`update_weights_from_distributed`, `load_format: flattened_bucket`).

Settings: `transport: sglang`, `engines: ["sglang=http://host:30000"]`.

No SGLang import: the trainer never needs SGLang installed.
"""
