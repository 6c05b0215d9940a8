"""Traced processes that attack the session through the agent channel: each attack costs the session a
bounded amount of memory, is counted, and leaves the listener serving the next agent."""

from __future__ import annotations

import os
from pathlib import Path

from agent_harness import Harness, RawPeer
from waiting import wait_for

from gputrace.daemon.agents.server import AgentLimits

MiB = 1 << 20

# A traced process that opens many connections, says hello on each (so frames may be 4 MiB) and leaves a
# 4 MiB frame unfinished on every one; with FORKS children doing the same. Prints "done" when all is sent.
FLOOD = r"""
import os, socket, struct, sys, msgpack
path, conns, forks = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def hello(s):
    body = msgpack.packb({"type": "hello", "pid": os.getpid(), "tid": 1, "interpreter": "x", "backends": []})
    s.sendall(struct.pack(">I", len(body)) + body)
kids = []
for _ in range(forks):
    pid = os.fork()
    if pid == 0:
        break
    kids.append(pid)
held = []
for _ in range(conns):
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        s.settimeout(10)
        hello(s)
        s.sendall(struct.pack(">I", 4 << 20) + b"\0" * ((4 << 20) - 1))
    except OSError:
        pass  # refused or cut off: the session's limits at work
    held.append(s)
for k in kids:
    os.waitpid(k, 0)
if kids or not forks:
    print("done", flush=True)
    sys.stdin.read()
"""

# A traced process sending kernel records with 64 KiB names as fast as it can for ``secs`` seconds.
BLAST = r"""
import os, socket, struct, sys, time, msgpack
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); secs = float(sys.argv[2])
def send(m):
    body = msgpack.packb(m, use_bin_type=True); s.sendall(struct.pack(">I", len(body)) + body)
send({"type": "hello", "pid": os.getpid(), "tid": 1, "interpreter": "x", "backends": ["sim"]})
name = "k" * 65536
rows = [[os.getpid(), 0, 1, 7, i, i + 1, i, name, [1, 1, 1], [1, 1, 1]] for i in range(50)]
sent = 0
end = time.monotonic() + secs
while time.monotonic() < end:
    send({"type": "batch", "records": [["GpuKernel", rows]]}); sent += len(rows)
send({"type": "bye"})
print(sent, flush=True)
s.recv(1)
"""


def rss_peak_reset() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to the current RSS


def rss_peak_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _listener_serves(h: Harness) -> None:
    h.allowed.add(os.getpid())
    peer = RawPeer(h.server.sock_path)
    assert peer.hello()["type"] == "start"
    peer.close()


def test_many_connections_with_unfinished_frames_stay_within_the_bound(tmp_path: Path) -> None:
    limits = AgentLimits()
    h = Harness(tmp_path, authorize=lambda pid: True)
    base = rss_mib()
    rss_peak_reset()
    flood = h.spawn(FLOOD, str(h.server.sock_path), "30", "8", stdin=True)  # 9 processes x 30 connections
    assert flood.stdout is not None and flood.stdout.readline().strip() == "done"
    wait_for(lambda: h.server.stats["accepted"] + h.server.shed.get("connections_refused", 0) >= 9 * 30,
             what="every connection accepted or refused")
    grown = rss_peak_mib() - base
    _listener_serves(h)
    # What the flood sent: 9 x 30 x 4 MiB = 1,080 MiB. What it may hold: the unfinished-frame limit.
    assert h.server._pending <= limits.pending_bytes
    assert grown < limits.pending_bytes / MiB + 48, f"the session grew by {grown:.0f} MiB"
    flood.communicate("")
    h.finish()
    assert h.reader is not None
    drops = h.server.drops()
    # which of the two bounds a connection meets depends on timing (a process's earlier connections may be
    # cut off before its later ones arrive); that the flood met them, and was counted, does not
    assert drops.get("cut_off_unfinished", 0) > 0, drops
    assert drops.get("connections_refused", 0) + drops["cut_off_unfinished"] >= 9 * 30 - 4 * 9, drops
    print(f"flood: peak growth {grown:.0f} MiB, drops {drops}")


def test_a_frame_of_millions_of_empty_arrays_is_refused_before_it_is_built(tmp_path: Path) -> None:
    import msgpack

    h = Harness(tmp_path)
    h.allowed.add(os.getpid())
    peer = RawPeer(h.server.sock_path)
    assert peer.hello()["type"] == "start"
    body = msgpack.packb({"type": "batch", "records": [["GpuKernel", [[]] * ((4 << 20) - 64)]]})
    rss_peak_reset()
    base = rss_mib()
    peer.raw(len(body).to_bytes(4, "big") + body)
    assert peer.closed_by_server()
    grown = rss_peak_mib() - base
    assert grown < 64, f"decoding took {grown:.0f} MiB"
    assert any("items" in r for r in h.server.rejections), h.server.rejections
    _listener_serves(h)
    h.finish()
    print(f"empty arrays: peak growth {grown:.0f} MiB")


def test_an_agent_over_its_budget_is_dropped_counted_and_the_capture_incomplete(tmp_path: Path) -> None:
    limits = AgentLimits(records_per_s=2_000, bytes_per_s=8 * MiB)
    h = Harness(tmp_path, limits=limits)
    blast = h.spawn(BLAST, str(h.server.sock_path), "2.0", stdin=True)
    assert blast.stdout is not None
    sent = int(blast.stdout.readline())
    wait_for(lambda: blast.pid in {p.pid for p in h.server._gone}, what="the blaster's bye")
    recs = h.finish()
    kept = sum(type(r).__name__ == "GpuKernel" for r in recs)
    over = h.server.drops()[f"pid{blast.pid}.over_budget"]
    assert kept + over == sent, "every record sent is either kept or counted"
    # 2 s of sending, plus a second's burst: at most 3 s of the byte budget (64 KiB a record)
    assert kept * 65536 <= 3 * limits.bytes_per_s + 50 * 65600
    # in the trailer's drops, which is what makes the session call the capture incomplete
    assert h.reader is not None and h.reader.drops[f"agent.pid{blast.pid}.over_budget"] == over > 0
    assert any(s.status == "degraded" and "over its budget" in s.detail
               for s in recs if type(s).__name__ == "SourceStatus")
    print(f"blast: sent {sent} records ({sent * 64 / 1024:.0f} MiB of names), kept {kept}, dropped {over}")


def test_running_out_of_descriptors_sheds_connections_and_keeps_the_listener(tmp_path: Path) -> None:
    import resource
    import socket

    h = Harness(tmp_path)
    h.allowed.add(os.getpid())
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    clients: list[socket.socket] = []
    try:
        # Client sockets made first (they count against the same limit), the limit lowered to what is open,
        # then connected: connecting takes the client no descriptor, and each connection then waits for an
        # accept that has none to give it
        clients = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(8)]
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")), hard))
        for c in clients:
            c.connect(str(h.server.sock_path))
        wait_for(lambda: h.server.shed.get("connections_shed", 0) > 0, what="a connection shed for want of fds")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    for c in clients:
        c.close()
    _listener_serves(h)  # the listener lived through it
    assert h.server.sock_path.is_socket()
    h.finish()
    assert h.server.drops()["connections_shed"] > 0 and h.server.stats["accept_failed"] > 0
