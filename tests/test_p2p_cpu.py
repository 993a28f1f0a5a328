"""bench/p2p_cpu.py's reading of `perf script` lines: which part of a sync each sample is, and which span."""

from __future__ import annotations

import pytest

from bench.p2p_cpu import SAMPLE, Spans, part

VENV = "/work/main/.venv/lib/python3.11/site-packages"
LINES = [  # from `perf script -F comm,pid,tid,time,ip,sym,dso` on this machine; the C++ symbol shortened
    (f"          python 32106/32106 1796601868.549033:      7fd283c2f2a4 XXHL64_seed_avx512 "
     f"({VENV}/xxhash/_xxhash.cpython-311-x86_64-linux-gnu.so)", "checksums"),
    ("          python 32097/32097 1796601859.796152:  ffffffff81ba4f70 _copy_to_iter ([kernel.kallsyms])",
     "kernel copies"),
    ("         swapper     0/0     1796601859.775137:  ffffffff8224379b pv_native_safe_halt ([kernel.kallsyms])",
     "idle"),
    (f"          python 32108/32108 1796601866.153388:      7fd2966ba719 c10::function_ref<void (char**, long "
     f"const*, long, long)>::callback_fn<at::native::AVX2::direct_copy_kernel(at::TensorIteratorBase&)> "
     f"({VENV}/torch/lib/libtorch_cpu.so)", "tensor copies"),
    ("          python 32097/32097 1796601859.779056:      7f0c4048e730 _PyPreConfig_InitCompatConfig "
     "(/root/.pyenv/versions/3.11.7/lib/libpython3.11.so.1.0)", "interpreter"),
    (f"          python 32107/32107 1796601868.439966:      7fd258f7a2da uct_tcp_netif_caps "
     f"({VENV}/nixl_cu12.libs/libuct-1141f529.so.0.0.0)", "ucx"),
    (" pt_gloo_runloop 32107/32263 1796601868.508004:  ffffffff82065fa6 tcp_sendmsg_locked ([kernel.kallsyms])",
     "kernel other"),
    ("          python 32097/32097 1796601860.092293:      7f0c28cac990 [unknown] "
     "(/usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.30)", "other"),
]


@pytest.mark.parametrize("line,kind", LINES, ids=[k for _, k in LINES])
def test_each_sample_is_read_and_put_in_its_part(line, kind):
    match = SAMPLE.match(line)
    assert match is not None, line
    _, pid, _, at, symbol, dso = match.groups()
    assert part(pid, symbol, dso) == kind
    assert float(at) > 1.7e9  # wall-clock seconds (perf record -k CLOCK_REALTIME), comparable with the spans


def test_a_sample_counts_only_inside_a_span():
    spans = Spans([[30.0, 40.0], [10.0, 20.0]])
    inside = [t in spans for t in (9.9, 10.0, 15.0, 20.0, 25.0, 30.5, 40.1)]
    assert inside == [False, True, True, True, False, True, False]
    assert spans.seconds == 20.0
