"""`examples.tiny.models` under its test-support name: the same module object (tests patch and read it alike)."""

import sys

from examples.tiny import models as _module

sys.modules[__name__] = _module
