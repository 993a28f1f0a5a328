"""What the demo's tiny Megatron job needs on a CPU: models built from configs with seeded weights (`models`),
training steps (`train`), Megatron's parallel state (`megatron`), and the documented test-only shims that
let megatron-core 0.16.1 run on CPU (`cpu_shim`, `cpu_hybrid`; see DESIGN.md: the library never patches
Megatron). The test suite uses the same modules (its support package re-exports them)."""
