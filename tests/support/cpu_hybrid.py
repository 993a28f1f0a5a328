"""`examples.tiny.cpu_hybrid` under its test-support name: the same module object (tests patch and read it alike)."""

import sys

from examples.tiny import cpu_hybrid as _module

sys.modules[__name__] = _module
