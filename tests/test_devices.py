"""One timeline per physical GPU: CUDA's per-process device ids joined through the GPU's UUID to NVML's.

Two ranks each given one GPU by CUDA_VISIBLE_DEVICES both call it "device 0"; two processes may see one GPU
under different ids. Captures are built from typed records, analysed and exported as a user's would be.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gputrace.analysis import analyze
from gputrace.analysis.devices import DeviceMap, ReportDevices, nvml_uuids
from gputrace.capture import CaptureReader
from gputrace.exporters.perfetto.export import PerfettoExporter
from gputrace.records import GpuDevice
from gputrace.testing.perfetto_check import check_trace
from gputrace.testing.synth import Builder, ns

RANK0, RANK1 = 100, 200
GPU_A = "GPU-5e0c1a7e-2b1f-4a8e-9d3c-7f1e2a3b4c5d"
GPU_B = "GPU-9a8b7c6d-1111-4222-8333-444455556666"
H100 = "NVIDIA H100 80GB HBM3"


def _two_ranks(tmp: Path, *, uuids: tuple[str, str], ids: tuple[int, int] = (0, 0),
               nvml: tuple[str, ...] = ()) -> dict[str, Any]:
    """Rank 0 runs 0-10 ms and 40-50 ms, rank 1 runs 10-40 ms: on one GPU no gap, on two a 30 ms gap on
    rank 0's. NVML (when listed) reads 90 % on its device 0 and 20 % on its device 1."""
    b = Builder().proc(RANK0, "rank0").proc(RANK1, "rank1")
    if nvml:
        b.nvml_devices(*nvml)
        b.nvml(0, 25, 90.0).nvml(1, 25, 20.0)
    b.device(RANK0, ids[0], simulated=False, name=H100, uuid=uuids[0])
    b.device(RANK1, ids[1], simulated=False, name=H100, uuid=uuids[1])
    b.op(RANK0, RANK0, 0, 0, 10, "fwd0", dev=ids[0])
    b.op(RANK1, RANK1, 9.9, 10, 40, "fwd1", dev=ids[1])
    b.op(RANK0, RANK0, 39.9, 40, 50, "bwd0", dev=ids[0])
    with CaptureReader(b.write(tmp / "two.gputrace")) as reader:
        return analyze(reader)


def test_two_ranks_both_on_device_0_of_their_own_are_two_gpus_joined_to_nvml_by_uuid(tmp_path: Path) -> None:
    # CUDA_VISIBLE_DEVICES=1 for rank 0 and =0 for rank 1: NVML's device 1 is rank 0's GPU.
    report = _two_ranks(tmp_path, uuids=(GPU_A, GPU_B), nvml=(GPU_B, GPU_A))
    devs = {d["id"]: d for d in report["devices"]}
    assert set(devs) == {0, 1}
    assert (devs[1]["uuid"], devs[1]["cuda_ids"], devs[1]["nvml_util_pct"]) == (GPU_A, [{"pid": RANK0, "id": 0}], 20.0)
    assert (devs[0]["uuid"], devs[0]["cuda_ids"], devs[0]["nvml_util_pct"]) == (GPU_B, [{"pid": RANK1, "id": 0}], 90.0)
    assert devs[1]["busy_ns"] == ns(20) - ns(0) and devs[0]["busy_ns"] == ns(30) - ns(0)
    [stall] = report["stalls"]  # rank 0's GPU idled while rank 1's ran: merged by CUDA id, it would not show
    assert (stall["device"], stall["start_ns"], stall["end_ns"]) == (1, ns(10), ns(40))
    assert "device_pid" not in stall


def test_one_gpu_under_two_cuda_ids_is_one_timeline(tmp_path: Path) -> None:
    # Rank 1 sees the same GPU as its device 2 (a different CUDA_VISIBLE_DEVICES order): busy throughout.
    report = _two_ranks(tmp_path, uuids=(GPU_A, GPU_A), ids=(0, 2), nvml=(GPU_B, GPU_A))
    [dev] = report["devices"]
    assert dev["id"] == 1 and dev["cuda_ids"] == [{"pid": RANK0, "id": 0}, {"pid": RANK1, "id": 2}]
    assert dev["busy_ns"] == ns(50) - ns(0) and report["stalls"] == []


def test_without_nvml_a_second_uuid_under_a_taken_id_stays_its_process_own(tmp_path: Path) -> None:
    report = _two_ranks(tmp_path, uuids=(GPU_A, GPU_B))
    devs = sorted(report["devices"], key=lambda d: d.get("pid", -1))
    assert [(d["id"], d.get("pid"), d["uuid"]) for d in devs] == [(0, None, GPU_A), (0, RANK1, GPU_B)]
    assert all("nvml_util_pct" not in d for d in devs)
    [stall] = report["stalls"]
    assert (stall["device"], stall["start_ns"], "device_pid" in stall) == (0, ns(10), False)


def test_devices_without_uuid_are_keyed_by_cuda_id(tmp_path: Path) -> None:
    # cupti-python 13.0 reads no UUID: the same CUDA id is taken to be the same GPU, as when nothing renumbers.
    report = _two_ranks(tmp_path, uuids=("", ""), nvml=(GPU_A, GPU_B))
    [dev] = report["devices"]
    assert (dev["id"], dev["nvml_util_pct"], "uuid" in dev) == (0, 90.0, False)
    assert dev["busy_ns"] == ns(50) - ns(0)


def test_simulated_devices_are_their_process_own_and_get_no_nvml() -> None:
    dmap = DeviceMap([GpuDevice(0, "sim", True, "uuid-100-0", RANK0), GpuDevice(0, "sim", True, "uuid-200-0", RANK1)],
                     {"uuid-100-0": 3})  # fmt: skip
    assert (dmap.key(RANK0, 0), dmap.key(RANK1, 0)) == ((RANK0, 0), (RANK1, 0))
    assert dmap.key(300, 0) == (300, 0)  # a process with no device record: no real GPU to share


def test_malformed_nvml_metadata_is_ignored() -> None:
    meta = {"devices": [{"index": "0", "uuid": GPU_A}, {"index": 1, "uuid": 7}, "x", {"index": 2, "uuid": GPU_B},
                        {"index": 3, "uuid": GPU_B}]}  # fmt: skip
    assert nvml_uuids(meta) == {GPU_B: 2}
    assert nvml_uuids([1, 2]) == {} and nvml_uuids({"devices": "x"}) == {}


def test_perfetto_puts_each_rank_on_its_gpu_with_its_counters_and_stalls(tmp_path: Path) -> None:
    b = Builder().proc(RANK0, "rank0").proc(RANK1, "rank1").nvml_devices(GPU_B, GPU_A)
    b.nvml(0, 25, 20.0).nvml(1, 25, 90.0)
    b.device(RANK0, 0, simulated=False, name=H100, uuid=GPU_A).device(RANK1, 0, simulated=False, name=H100, uuid=GPU_B)
    b.op(RANK0, RANK0, 0, 0, 10, "fwd0")
    b.op(RANK1, RANK1, 9.9, 10, 40, "fwd1")
    b.op(RANK0, RANK0, 39.9, 40, 50, "bwd0")
    b.sync(RANK1, RANK1, 40, 41)
    cap = b.write(tmp_path / "two.gputrace")
    with CaptureReader(cap) as reader:
        report = analyze(reader)
    with CaptureReader(cap) as reader:
        PerfettoExporter(tmp_path / "two.pftrace", report=report).write(reader)
    check = check_trace(tmp_path / "two.pftrace")
    assert check.problems == []
    gpu1, gpu0 = check.track(f"GPU 1: {H100}"), check.track(f"GPU 0: {H100}")
    assert {s.name for s in check.slices_on(gpu1, deep=True)} >= {"fwd0", "bwd0", "resume"}
    assert "fwd1" not in {s.name for s in check.slices_on(gpu1, deep=True)}
    assert {s.name for s in check.slices_on(gpu0, deep=True)} >= {"fwd1", "sync context"}
    assert check.counters[check.track("gpu_util_pct", parent=f"GPU 1: {H100}").uuid] == [(ns(25), 90.0)]
    stalls = [s for s in check.slices_on(check.track("stalls", parent=f"GPU 1: {H100}")) if s.depth == 0]
    assert [(s.ts, s.dur) for s in stalls] == [(ns(10), ns(40) - ns(10))]
    assert check.tracks_named("stalls", parent=f"GPU 0: {H100}") == []


def test_report_devices_place_records_and_name_a_process_own_device() -> None:
    report = {"devices": [{"id": 0, "name": "sim", "simulated": True, "pid": RANK0,
                           "cuda_ids": [{"pid": RANK0, "id": 0}]},
                          {"id": 0, "name": H100, "simulated": False, "uuid": GPU_A,
                           "cuda_ids": [{"pid": RANK1, "id": 3}]},
                          {"id": "x"}, "junk"]}  # fmt: skip
    devs = ReportDevices(report)
    assert devs.key(RANK0, 0) == (RANK0, 0) and devs.key(RANK1, 3) == (-1, 0) and devs.key(RANK1, 5) == (-1, 5)
    assert devs.label((RANK0, 0)) == f"GPU 0: sim (simulated), pid {RANK0}" and devs.label((-1, 0)) == f"GPU 0: {H100}"
    assert devs.uuids == {(-1, 0): GPU_A}
