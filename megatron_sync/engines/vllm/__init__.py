"""vLLM as a megatron-sync engine: a weight-transfer backend inside vLLM, an HTTP client in the trainer.

- `plugin.register` (entry point `vllm.general_plugins: megatron_sync`) names the
  backend; `worker.MegatronSyncTransferEngine` is what each vLLM worker runs.
- `client.VLLMEngineClient` is the trainer-side `EngineClient` that drives an
  unmodified vLLM server through its own routes.

Importing this package does not import vLLM; only `worker` and `adapter` do,
and they run inside vLLM's processes.
"""
