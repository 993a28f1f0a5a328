"""Named hardware profiles: what a node's links move per second, and what the sync's own work costs.

Every value carries its source: a vendor specification, a published measurement, a measurement on
this project's machine (`bench/bench_scale_rates.py`, stored in `rates_local.json` with the machine
it ran on), or an assumption, said as such. Rates are per direction, in bytes per second.

`local` is this machine (2 CPU cores, no GPU): everything, the loopback "wire" included, is CPU work
on shared cores, so its profile is measured per byte and per item and the time model adds a
shared-cores bound. The GPU profiles are node types; a job declares one by name
(`weight_sync.hardware_profile`), and an unknown name is refused with the list.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any

GB = 1e9
RATES_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rates_local.json")


@dataclass(frozen=True)
class Value:
    """One number and where it comes from."""

    value: float
    source: str


def _v(value: float, source: str) -> Value:
    return Value(float(value), source)


# Sources, cited once.
DGX_H100 = "NVIDIA DGX H100 datasheet: 8x H100 SXM5, 8x ConnectX-7 400 Gb/s (compute fabric), NVLink4 900 GB/s per GPU"
DGX_H200 = "NVIDIA DGX H200 datasheet: 8x H200 SXM, 4.8 TB/s HBM3e, 8x ConnectX-7 400 Gb/s, NVLink4 900 GB/s per GPU"
GB200 = ("NVIDIA GB200 NVL72 datasheet: 72 Blackwell GPUs in one NVLink domain, NVLink5 1.8 TB/s per GPU, "
         "8 TB/s HBM3e; compute tray of 4 GPUs with 4x ConnectX-7 400 Gb/s")
H800 = "H800 SXM: NVLink 400 GB/s per GPU (export variant of H100), 8x 400 Gb/s NICs as in the checkpoint-engine setup"
H20 = "NVIDIA H20: NVLink 900 GB/s per GPU, 4.0 TB/s HBM3; 8x 400 Gb/s RoCE per node (nccl-tests issue #367 setup)"
AWS_P5 = "AWS p5.48xlarge: 8x H100, 3200 Gbps EFA per node (32 x 100 Gb/s), https://aws.amazon.com/ec2/instance-types/p5/"
NIC_ACHIEVED = ("NCCL maintainers: 46-48 GB/s per NDR 400 Gb/s NIC in nccl-tests "
                "(https://github.com/NVIDIA/nccl-tests/issues/290)")
EFA_ACHIEVED = ("~36 GB/s per GPU over EFA in an RL weight transfer (https://le.qun.ch/en/blog/2025/09/07/"
                "rl-weight-transfer): 0.72 of 400 Gb/s")
SINGLE_SOURCE_BCAST = ("a broadcast whose root is the only group member on its node drives one NIC "
                       "(https://github.com/verl-project/verl/issues/7167: ~25 GB/s of 4 NICs on GH200)")
PCIE5 = "PCIe Gen5 x16: 64 GB/s per direction raw, ~50 GB/s achieved by host<->device copies (assumed 0.8)"
HBM_COPY = "a device copy reads and writes every byte: half the HBM bandwidth (assumed; no GPU measured here)"
ASSUMED_APPLY = ("assumed: an engine's load_weights per HF tensor (Python loader, a few kernel launches); "
                 "not measured (no GPU in this project's sessions)")
ASSUMED_ROUND = ("assumed: one agreement round (an all-gather of a small JSON over the transport group + store) "
                 "at hundreds of ranks; measured only on loopback")
ASSUMED_MSG = "assumed: latency of one collective or RDMA operation between nodes (a few microseconds + software)"
STORAGE = "assumed: a parallel file system client per node (e.g. 2 x 200 Gb/s storage ports on DGX H100)"
STORE = ("measured on this machine: bench/bench_store.py, 8 clients, the TCPStore server's CPU per P2P report "
         "posted and per round's reports taken in one request (bench/RESULTS.md); the trainer node's host core "
         "assumed no faster")


@dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    """One node type and the rates of the work a sync does on it (see the module docstring)."""

    name: str
    description: str
    gpus_per_node: Value
    nics_per_node: Value
    nic_gbps: Value  # line rate per NIC, Gb/s
    nic_efficiency: Value  # achieved / line rate for large transfers
    nvlink: Value  # bytes/s per GPU per direction
    nvlink_domain: Value  # GPUs that reach each other over NVLink (a node, or a rack)
    pcie: Value  # host <-> device bytes/s per GPU per direction, achieved
    hbm: Value  # device memory bytes/s
    storage: Value  # shared storage read or write bytes/s per node
    host_copy: Value  # one host thread's memcpy bytes/s
    host_xxh3: Value  # one host thread's xxh3 bytes/s
    delta_encode: Value  # one thread's delta encoding bytes/s (raw bytes in)
    delta_decode: Value  # one thread's decode + patch bytes/s (raw bytes out)
    round_s: Value  # one agreement round
    message_s: Value  # per collective / message latency
    apply_tensor_s: Value  # engine load per HF tensor
    pause_resume_s: Value  # engine pause + resume around a sync
    switch_s: Value  # an engine's switch to its other staging set (`SyncOptions.engine_switch`: no copy)
    store_post_s: Value = field(default_factory=lambda: _v(6.2e-6, STORE))  # the store's work per report posted
    store_take_s: Value = field(default_factory=lambda: _v(20.7e-6, STORE))  # per take of a round's reports
    cpu_bound: bool = False  # True: every phase, the wire included, is work on `cores` shared CPU cores
    cores: Value = field(default_factory=lambda: _v(0, "n/a"))
    cpu: dict[str, Value] = field(default_factory=dict)  # cpu_bound profiles: seconds per byte / per item

    @property
    def nic_per_gpu(self) -> float:
        """Achieved NIC bytes/s one GPU reaches (its share of the node's NICs)."""
        return self.node_nic / self.gpus_per_node.value

    @property
    def node_nic(self) -> float:
        return self.nics_per_node.value * self.nic_gbps.value / 8 * GB * self.nic_efficiency.value

    @property
    def device_copy(self) -> float:
        return self.hbm.value / 2

    def table(self) -> list[tuple[str, str, str]]:
        """Return (field, value, source) rows for every number of the profile."""
        rows = []
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Value):
                rows.append((f.name, f"{value.value:g}", value.source))
        for key, value in sorted(self.cpu.items()):
            rows.append((f"cpu.{key}", f"{value.value:.4g}", value.source))
        return rows


def _measured_host() -> dict[str, Value]:
    """Return the host-side rates the sync's own code sets (one thread's copy and xxh3), as measured on this
    machine by bench/bench_scale_rates.py, when its rates file exists."""
    if not os.path.isfile(RATES_FILE):
        return {}
    with open(RATES_FILE) as f:
        measured = json.load(f)
    where = (f"measured on this machine, one thread ({measured['machine']}, {measured['date']}; "
             "bench/bench_scale_rates.py)")
    return {"host_copy": _v(1 / measured["rates"]["copy_byte"], where),
            "host_xxh3": _v(1 / measured["rates"]["xxh3_byte"], where)}


def _gpu_node(name: str, description: str, *, gpus: int, nics: int, nic_gbps: float, nvlink: float, hbm: float,
              source: str, nvlink_domain: int | None = None, efficiency: Value | None = None) -> HardwareProfile:
    host = _measured_host()
    return HardwareProfile(
        name=name, description=description,
        gpus_per_node=_v(gpus, source), nics_per_node=_v(nics, source), nic_gbps=_v(nic_gbps, source),
        nic_efficiency=efficiency or _v(0.93, NIC_ACHIEVED), nvlink=_v(nvlink, source),
        nvlink_domain=_v(nvlink_domain or gpus, source), pcie=_v(50 * GB, PCIE5), hbm=_v(hbm, source),
        storage=_v(50 * GB, STORAGE),
        host_copy=host.get("host_copy", _v(8 * GB, "assumed: one server core's memcpy of large buffers")),
        host_xxh3=host.get("host_xxh3", _v(15 * GB, "assumed: XXH3 on one core with cold caches")),
        delta_encode=_v(1.5 * GB, "measured here, bench/RESULTS.md (disk-delta): sparse XOR 1.2-1.9 GB/s per thread"),
        delta_decode=_v(3.0 * GB, "measured here, bench/RESULTS.md (disk-delta): decode 2.6-3.7 GB/s per thread"),
        round_s=_v(0.005, ASSUMED_ROUND), message_s=_v(20e-6, ASSUMED_MSG),
        apply_tensor_s=_v(30e-6, ASSUMED_APPLY),
        pause_resume_s=_v(0.05, "assumed: vLLM /pause + /resume with few requests in flight"),
        switch_s=_v(0.001, "assumed: repointing an engine's params at its other staging set (no copy)"))


PROFILES: dict[str, HardwareProfile] = {p.name: p for p in (
    _gpu_node("h100", "DGX/HGX H100 node", gpus=8, nics=8, nic_gbps=400, nvlink=450 * GB, hbm=3350 * GB,
              source=DGX_H100),
    _gpu_node("h200", "DGX/HGX H200 node", gpus=8, nics=8, nic_gbps=400, nvlink=450 * GB, hbm=4800 * GB,
              source=DGX_H200),
    _gpu_node("gb200", "GB200 NVL72 compute tray (4 GPUs; the NVLink domain is the 72-GPU rack)", gpus=4, nics=4,
              nic_gbps=400, nvlink=900 * GB, hbm=8000 * GB, source=GB200, nvlink_domain=72),
    _gpu_node("h800", "H800 node (checkpoint-engine's published setup)", gpus=8, nics=8, nic_gbps=400,
              nvlink=200 * GB, hbm=3350 * GB, source=H800),
    _gpu_node("h20", "H20 node (checkpoint-engine's published setup)", gpus=8, nics=8, nic_gbps=400,
              nvlink=450 * GB, hbm=4000 * GB, source=H20),
    _gpu_node("p5-efa", "AWS p5 (H100, EFA 3200 Gbps per node)", gpus=8, nics=32, nic_gbps=100, nvlink=450 * GB,
              hbm=3350 * GB, source=AWS_P5, efficiency=_v(0.72, EFA_ACHIEVED)),
)}
"""The GPU node types a job may declare (`weight_sync.hardware_profile`); `local` is read from its rates file."""


def local_profile(path: str = RATES_FILE) -> HardwareProfile:
    """Return this machine's profile from the rates `bench/bench_scale_rates.py` measured (and stored with
    the machine they ran on); FileNotFoundError says how to measure them."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing: measure this machine's rates with "
                                "`PYTHONPATH=. .venv/bin/python bench/bench_scale_rates.py`")
    with open(path) as f:
        measured = json.load(f)
    where = f"measured on this machine ({measured['machine']}, {measured['date']}; bench/bench_scale_rates.py)"
    rates = {k: _v(v, where) for k, v in measured["rates"].items()}
    base = PROFILES["h100"]
    return replace(base, name="local", description=f"this machine: {measured['machine']}",
                   gpus_per_node=_v(measured["cores"], where), nics_per_node=_v(0, "no NIC: loopback"),
                   cpu_bound=True, cores=_v(measured["cores"], where), cpu=rates,
                   round_s=rates["round_s"], message_s=rates["message_s"])


def profile_names() -> list[str]:
    """Return the hardware profiles a job may declare."""
    return sorted(PROFILES) + ["local"]


def profile_named(name: str) -> HardwareProfile:
    """Return the profile `name` ("local" or one of PROFILES); ValueError names the known ones and the fix."""
    if name == "local":
        return local_profile()
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown hardware profile {name!r}: use one of {profile_names()} "
                         "(or add a row to megatron_sync.scale.hardware.PROFILES with the sources of its numbers)"
                         ) from None


def describe(profile: HardwareProfile) -> dict[str, Any]:
    """Return the profile as JSON-able rows (for the report)."""
    return {"name": profile.name, "description": profile.description,
            "values": [{"field": f, "value": v, "source": s} for f, v, s in profile.table()]}
