"""Which GPU each process's CUDA device id names: one timeline per physical GPU, joined to NVML's counters.

CUDA numbers devices per process: CUDA_VISIBLE_DEVICES renumbers them from 0 (a scheduler giving each rank
one GPU makes every rank's GPU "device 0"), and CUDA_DEVICE_ORDER may reorder them. NVML numbers them for the
host. The GPU's UUID, in CUPTI's device record and in NVML's device list, is what both agree on:

- a real device whose UUID NVML listed is keyed by NVML's index: processes seeing it under different CUDA ids
  share one timeline, and its NVML counters are its own;
- a real device whose UUID NVML did not list (no NVML source) is keyed by its CUDA id, unless a device with
  another UUID took that id first: then it stays its process's own;
- a real device with no UUID (cupti-python 13.0 reads none) is keyed by its CUDA id, how CUDA numbers
  devices when nothing renumbers them;
- a simulated device belongs to its process.

A key is (pid, id): pid -1 for a real device, which any process may share.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gputrace.documents import Report
from gputrace.records import GpuDevice

DeviceKey = tuple[int, int]  # (owning pid, or -1 for a real device, device id)
SHARED = -1


def nvml_uuids(meta: Any) -> dict[str, int]:
    """UUID -> NVML index from the NVML source's metadata; anything malformed (hostile input) is ignored."""
    devices = meta.get("devices") if isinstance(meta, dict) else None
    out: dict[str, int] = {}
    for d in devices if isinstance(devices, list) else []:
        if isinstance(d, dict) and isinstance(d.get("uuid"), str) and d["uuid"] and type(d.get("index")) is int:
            out.setdefault(d["uuid"], d["index"])
    return out


class DeviceMap:
    """(pid, CUDA device id) -> DeviceKey, from the capture's GpuDevice records and NVML's device list."""

    def __init__(self, devices: Iterable[GpuDevice], nvml: dict[str, int] | None = None) -> None:
        nvml = nvml or {}
        self._keys: dict[tuple[int, int], DeviceKey] = {}
        self.by_key: dict[DeviceKey, GpuDevice] = {}
        self.uuids: dict[DeviceKey, str] = {}
        self._real_ids: set[int] = set()
        owner: dict[int, str] = {}  # CUDA id keyed as shared -> the UUID that took it ("" when none)
        for d in sorted(devices, key=lambda d: (d.pid, d.id)):  # the same keys whatever the record order
            if d.simulated:
                key: DeviceKey = (d.pid, d.id)
            elif d.uuid and d.uuid in nvml:
                key = (SHARED, nvml[d.uuid])
            else:
                self._real_ids.add(d.id)
                took = owner.setdefault(d.id, d.uuid)
                key = (SHARED, d.id) if not d.uuid or not took or took == d.uuid else (d.pid, d.id)
            self._keys[(d.pid, d.id)] = key
            if key not in self.by_key or (d.name and not self.by_key[key].name):
                self.by_key[key] = d
            if d.uuid and not d.simulated:
                self.uuids[key] = d.uuid
        self.cuda_ids: dict[DeviceKey, list[tuple[int, int]]] = {}  # for each device, the (pid, CUDA id)s naming it
        for pair, key in sorted(self._keys.items()):
            self.cuda_ids.setdefault(key, []).append(pair)

    def key(self, pid: int, dev: int) -> DeviceKey:
        """The device a process's CUDA id ``dev`` names. A process whose device record never arrived: a real
        device with that id if one was seen (the common case: its record was dropped), else its own."""
        known = self._keys.get((pid, dev))
        if known is not None:
            return known
        return (SHARED, dev) if dev in self._real_ids else (pid, dev)


class ReportDevices:
    """The report's devices for an exporter that streams the records: which device each (pid, CUDA id) names,
    and its name. Without a report, a simulated device is its process's own and a real one is keyed by its
    CUDA id. The report is ours, but it may come from a file: malformed entries are skipped."""

    def __init__(self, report: Report | None) -> None:
        self._keys: dict[tuple[int, int], DeviceKey] = {}
        self.info: dict[DeviceKey, tuple[str, bool]] = {}
        self.uuids: dict[DeviceKey, str] = {}
        devices = report.get("devices") if report else None
        for d in devices if isinstance(devices, list) else []:
            if not isinstance(d, dict) or type(d.get("id")) is not int:
                continue
            pid = d.get("pid")
            key = (pid if type(pid) is int and pid >= 0 else SHARED, d["id"])
            self.info.setdefault(key, (str(d.get("name", "")), bool(d.get("simulated"))))
            if isinstance(d.get("uuid"), str) and d["uuid"]:
                self.uuids[key] = d["uuid"]
            named = d.get("cuda_ids")
            for n in named if isinstance(named, list) else []:
                if isinstance(n, dict) and type(n.get("pid")) is int and type(n.get("id")) is int:
                    self._keys.setdefault((n["pid"], n["id"]), key)

    def key(self, pid: int, dev: int) -> DeviceKey:
        known = self._keys.get((pid, dev))
        if known is not None:
            return known
        return (pid, dev) if self.info.get((pid, dev), ("", False))[1] else (SHARED, dev)

    def seen(self, r: GpuDevice) -> DeviceKey | None:
        """Record a device record's name; the key whose name changed, if one did."""
        key = self._keys.get((r.pid, r.id))
        if key is None:
            key = (r.pid, r.id) if r.simulated else (SHARED, r.id)
            self._keys[(r.pid, r.id)] = key
        old = self.info.get(key)
        new = (r.name or (old[0] if old else ""), bool(r.simulated) or bool(old and old[1]))
        self.info[key] = new
        return key if new != old else None

    def label(self, key: DeviceKey) -> str:
        """"GPU 0: NVIDIA H100 80GB HBM3"; a process's own device says whose when another has the same id."""
        name, simulated = self.info.get(key, ("", False))
        label = f"GPU {key[1]}: {name}" if name else f"GPU {key[1]}"
        if simulated:
            label += " (simulated)"
        if key[0] >= 0 and any(k[1] == key[1] and k != key for k in self.info):
            label += f", pid {key[0]}"
        return label
