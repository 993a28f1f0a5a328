"""An import-only stand-in for `sgl_kernel` (test support; PyPI has CUDA builds of it only).

With SGLANG_USE_CPU_ENGINE=1, SGLang imports CPU kernels from `sgl_kernel` when
its modules load. On a CPU without AMX, with `--attention-backend torch_native`
and a dense model, its layers take torch-native paths and call none of them.
Every name resolves to a function that says it was called (the tests fail on
that line in a server log, `tests.support.sglang_server.STUB_CALLED`) and raises.
"""

import sys

__version__ = "0.0.0+megatron-sync-stub"


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def called(*args, **kwargs):
        sys.stderr.write(f"[sgl_kernel stub] CALLED {name}\n")
        sys.stderr.flush()
        raise NotImplementedError(f"sgl_kernel stub: {name} has no CPU implementation here")

    called.__name__ = name
    return called
