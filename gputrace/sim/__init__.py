"""A simulated GPU for machines without one: tests, CI and the bundled example.

    from gputrace.sim import Device
    dev = Device(0)
    s = dev.stream()
    s.launch("matmul", duration_ms=5)      # returns at once, runs 5 ms on the stream's thread
    s.memcpy(1 << 20, duration_ms=1, kind="h2d")
    s.synchronize()                        # really blocks until the stream is idle

Under a gputrace session it emits the records the real agent emits (devices marked simulated);
without one it runs the same and emits nothing.
"""

from gputrace.sim.collective import ProcessGroup
from gputrace.sim.device import Device, Stream

__all__ = ["Device", "ProcessGroup", "Stream"]
