"""The service's threads are named for the OS as for Python (``top -H``, ``ps -T``)."""

from __future__ import annotations

import threading
from pathlib import Path

from gputrace.daemon.writer import QueueSink
from gputrace.threads import Thread, os_name


def test_names_lose_the_prefix_and_fit_the_kernels_sixteen_bytes() -> None:
    assert os_name("gputrace-writer") == "gt-writer"
    assert os_name("gputraced-watch-123456") == "gt-watch-123456"
    assert os_name("gputraced-watch-analysis") == "gt-watch-analys"  # 15 bytes, the kernel's limit
    assert os_name("other-thread-name-of-length") == "other-thread-na"
    assert os_name("gputrace-é" * 3) == "gt-é" + "gputrace-"[:15 - 5]  # never half a character


def test_a_started_thread_carries_its_name_in_proc() -> None:
    seen: list[str] = []

    def read() -> None:
        seen.append(Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip())

    t = Thread(target=read, name="gputrace-nvml")
    t.start()
    t.join()
    assert seen == ["gt-nvml"]


def test_the_writer_thread_of_a_session_is_named(tmp_path: Path) -> None:
    from typing import Any

    from gputrace.capture import CaptureWriter, host_header

    class Noting(CaptureWriter):
        def write_meta(self, source: str, meta: dict[str, Any]) -> None:
            super().write_meta(source, meta)
            wrote.set()

    wrote = threading.Event()
    writer = Noting(tmp_path / "t.gputrace", host_header(["test"]))
    sink = QueueSink(writer)
    try:
        sink.emit_meta("x", {})
        assert wrote.wait(60)  # the writer thread named itself before it took anything
        comm = Path(f"/proc/self/task/{sink._thread.native_id}/comm").read_text().strip()
    finally:
        sink.close()
        writer.close({"complete": True})
    assert comm == "gt-writer"
