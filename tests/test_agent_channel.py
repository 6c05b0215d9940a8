"""The agent channel under trouble: killed agents, hostile peers, strangers, silent peers, full queues."""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import time
from pathlib import Path

import msgpack
from agent_harness import PYTHON, Harness, RawPeer, of
from waiting import wait_for

from gputrace.records import GpuKernel

FOREVER = """
import sys
from gputrace.sim import Device
s = Device(0).stream()
s.launch("warmup", duration_ms=1)
s.synchronize()
print("ready", flush=True)
while True:
    s.launch("step", duration_ms=5)
    s.synchronize()
"""


def test_agent_killed_mid_capture_ends_early_and_the_capture_completes(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    p = h.spawn(FOREVER)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    wait_for(lambda: h.server.stats["records"] > 5, what="records from the agent")
    p.send_signal(signal.SIGKILL)
    p.wait(5)
    wait_for(lambda: h.server.stats["ended_early"] == 1, what="the server noticing the dead agent")
    recs = h.finish()
    [status] = [s for s in of(recs, "SourceStatus") if s.status == "ended_early"]
    assert status.source == "agent" and f"pid {p.pid}" in status.detail
    assert of(recs, "GpuKernel"), "what the agent sent before it died is kept"
    assert h.reader is not None and h.reader.complete


def test_stop_asks_a_live_agent_to_flush_and_leaves_it_running(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    p = h.spawn(FOREVER)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    wait_for(lambda: h.server.stats["records"] > 5, what="records")
    t0 = time.monotonic()
    h.server.stop()
    assert time.monotonic() - t0 < 1.5
    assert p.poll() is None, "ending the capture must not end the target"
    recs = h.finish()
    assert h.server.stats["ended_early"] == 0 and not h.server.rejections
    assert h.reader is not None
    [peer] = h.reader.meta["agent"]["peers"]
    assert peer["pid"] == p.pid and peer["end"] == "bye" and peer["backends"] == ["sim"]
    assert "cupti" in peer["unavailable"], "the agent says why CUPTI is not used"
    # All it sent is in the capture, plus the AgentInfo the session makes from hello when the sim was
    # registered before the agent said hello (otherwise the agent announces it in-band).
    kept = len([r for r in recs if type(r).__name__ != "SourceStatus"])
    assert peer["records"] <= kept <= peer["records"] + 1
    # the agent names its I/O thread, whose time in the target is the tracing's
    [own] = of(recs, "AgentThread")
    assert (own.pid, own.role) == (p.pid, "io") and own.tid not in (0, p.pid), own


def test_garbage_is_cut_off_while_a_good_agent_keeps_being_served(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    h.allowed.add(os.getpid())
    good = h.spawn(FOREVER)
    assert good.stdout is not None and good.stdout.readline().strip() == "ready"

    garbage = RawPeer(h.server.sock_path)
    garbage.raw(struct.pack(">I", 12) + b"\xc1" * 12)  # 0xc1 is never valid msgpack
    assert garbage.closed_by_server()

    oversized = RawPeer(h.server.sock_path)
    oversized.raw(struct.pack(">I", 64 << 20))
    assert oversized.closed_by_server()

    wrong_first = RawPeer(h.server.sock_path)
    wrong_first.send({"type": "batch", "records": []})
    assert wrong_first.closed_by_server()

    not_a_map = RawPeer(h.server.sock_path)
    not_a_map.send([1, 2, 3])
    assert not_a_map.closed_by_server()

    before = h.server.stats["records"]
    wait_for(lambda: h.server.stats["records"] > before + 5, what="the good agent still being served")
    recs = h.finish()
    reasons = " | ".join(h.server.rejections)
    assert "undecodable frame" in reasons and "oversized frame" in reasons
    assert "not hello" in reasons and "not a message map" in reasons
    assert h.server.stats["cut_off"] == 4
    degraded = [s for s in of(recs, "SourceStatus") if s.status == "degraded"]
    assert len(degraded) == 4 and all(f"pid {os.getpid()}" in s.detail for s in degraded)
    assert {k.pid for k in of(recs, "GpuKernel")} == {good.pid}


def test_records_for_another_pid_are_rejected_and_counted(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    me = os.getpid()
    h.allowed.add(me)
    peer = RawPeer(h.server.sock_path)
    assert peer.hello()["type"] == "start"
    good = list(GpuKernel(me, 0, 1, 1, 10, 20, 1, "mine", (1, 1, 1), (1, 1, 1)))
    peer.send({"type": "batch", "records": [["GpuKernel", [good]]]})
    forged = [list(GpuKernel(me + 1, 0, 1, 1, 10, 20, n, "forged", (1, 1, 1), (1, 1, 1))) for n in range(3)]
    peer.send({"type": "batch", "records": [["GpuKernel", forged]]})
    assert peer.closed_by_server()

    liar = RawPeer(h.server.sock_path)
    liar.send({"type": "hello", "pid": me + 1, "tid": 1, "interpreter": "", "cuda_version": "",
               "driver_version": "", "backends": [], "unavailable": {}})
    assert liar.closed_by_server()

    future = RawPeer(h.server.sock_path)
    future.send({"type": "hello", "protocol": 99, "pid": me, "tid": 1, "interpreter": "", "cuda_version": "",
                 "driver_version": "", "backends": [], "unavailable": {}})
    assert future.closed_by_server()

    kernel_side = RawPeer(h.server.sock_path)
    kernel_side.hello()
    kernel_side.send({"type": "batch", "records": [["Syscall", [[me, me, "read", 1, 2, 0, 3, "", 0, 0]]]]})
    assert kernel_side.closed_by_server()

    bad_type = RawPeer(h.server.sock_path)
    bad_type.hello()
    bad_type.send({"type": "batch", "records": [["GpuKernel", [[me, 0, 1, 1, "10", 20, 1, "k", [1, 1, 1],
                                                                [1, 1, 1]]]]]})
    assert bad_type.closed_by_server()

    recs = h.finish()
    assert [k.name for k in of(recs, "GpuKernel")] == ["mine"]
    assert h.server.drops()["rejected"] == 3 + 1 + 1
    reasons = " | ".join(h.server.rejections)
    assert f"claims pid {me + 1}, peer is pid {me}" in reasons
    assert "hello claims pid" in reasons
    assert "agent speaks protocol 99, this session 1" in reasons
    assert "'Syscall' is not accepted" in reasons
    assert "field start_ns has a bad value" in reasons


def test_an_unauthorised_pid_is_refused(tmp_path: Path) -> None:
    h = Harness(tmp_path, authorize_grace_s=0.2)
    stranger = RawPeer(h.server.sock_path)
    stranger.send({"type": "hello", "pid": os.getpid(), "tid": 1, "interpreter": "", "cuda_version": "",
                   "driver_version": "", "backends": [], "unavailable": {}})
    assert stranger.closed_by_server()
    recs = h.finish()
    assert h.server.stats["refused"] == 1 and not of(recs, "AgentInfo")
    assert h.server.rejections == [f"pid {os.getpid()}: not a traced process; refused"]


CONNECT_AND_HAND_OVER = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
socket.send_fds(socket.socket(fileno=int(sys.argv[2])), [b"x"], [s.fileno()])
"""


def test_a_peer_that_exits_before_it_is_authorised_stays_refused_when_its_pid_turns_traced(tmp_path: Path) -> None:
    """A stranger connects, hands its connection to another process and exits. Its pid then becomes
    "traced" (as if reused by a target): the connection must still be refused, not served as that target."""
    h = Harness(tmp_path, authorize_grace_s=30.0)
    here, there = socket.socketpair()
    try:
        stranger = subprocess.Popen([PYTHON, "-c", CONNECT_AND_HAND_OVER, str(h.server.sock_path),
                                     str(there.fileno())], pass_fds=[there.fileno()])
        _, fds, _, _ = socket.recv_fds(here, 1, 1)
        assert stranger.wait(10) == 0
    finally:
        here.close()
        there.close()
    h.allowed.add(stranger.pid)
    with socket.socket(fileno=fds[0]) as held:
        held.settimeout(5.0)
        hello = msgpack.packb({"type": "hello", "pid": stranger.pid, "tid": stranger.pid, "interpreter": "",
                               "cuda_version": "", "driver_version": "", "backends": ["sim"], "unavailable": {}})
        held.sendall(struct.pack(">I", len(hello)) + hello)
        try:
            answer = held.recv(4096)
        except ConnectionResetError:
            answer = b""  # closed with our hello unread
        assert answer == b"", "the server answered instead of closing"
    recs = h.finish()
    assert h.server.rejections == [f"pid {stranger.pid}: exited before it was authorised; refused"]
    assert h.server.stats["refused"] == 1 and h.server.stats["accepted"] == 0 and not of(recs, "AgentInfo")


def test_a_silent_peer_never_blocks_the_session(tmp_path: Path) -> None:
    h = Harness(tmp_path, stop_timeout_s=0.5)
    h.allowed.add(os.getpid())
    silent = RawPeer(h.server.sock_path)
    silent.hello()  # then never reads, never writes, never says bye
    half = RawPeer(h.server.sock_path)
    half.hello()
    half.raw(struct.pack(">I", 1000) + b"\x80" * 10)  # a frame that never completes
    t0 = time.monotonic()
    h.finish()
    assert time.monotonic() - t0 < 2.0
    assert silent.closed_by_server(1.0) and half.closed_by_server(1.0)


def test_agent_drop_counts_and_a_full_session_queue_are_reported(tmp_path: Path) -> None:
    h = Harness(tmp_path, queue_records=4)
    me = os.getpid()
    h.allowed.add(me)
    peer = RawPeer(h.server.sock_path)
    peer.hello()
    rows = [list(GpuKernel(me, 0, 1, 1, 10, 20, n, "k", (1, 1, 1), (1, 1, 1))) for n in range(10)]
    peer.send({"type": "batch", "records": [["GpuKernel", rows]]})  # more than the queue holds
    peer.send({"type": "drops", "counts": {"queue": 7, "cupti": 2}})
    peer.send({"type": "bye"})
    assert peer.closed_by_server()
    h.finish()
    drops = h.server.drops()
    assert drops["queue"] == 10 and drops[f"pid{me}.queue"] == 7 and drops[f"pid{me}.cupti"] == 2
    assert h.reader is not None and h.reader.drops["agent.queue"] == 10


def test_an_agents_own_queue_overflow_is_counted_and_reported(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    p = h.spawn("""
import os
from gputrace.agent import arming
from gputrace.records import GpuKernel
agent = arming.current()
agent.queue.limit = 10          # a tiny queue, so this burst overflows it before the I/O thread drains it
pid = os.getpid()
agent.submit([GpuKernel(pid, 0, 1, 1, i, i + 1, i, "k", (1, 1, 1), (1, 1, 1)) for i in range(100)])
print("submitted", flush=True)
""")
    assert p.wait(20) == 0
    recs = h.finish()
    assert len(of(recs, "GpuKernel")) == 10
    assert h.server.drops()[f"pid{p.pid}.queue"] == 90
    assert h.reader is not None and h.reader.drops[f"agent.pid{p.pid}.queue"] == 90
