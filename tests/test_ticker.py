"""Watch mode's sessions have their periodic checks run by one thread (daemon/ticker.py): checks run there until
they are done, one that raises does not stop the others, a check being removed is not running once removal
returns, and a session on a ticker ends when its targets exit and when it is stopped."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
from waiting import wait_for

from gputrace.daemon.session import CaptureOptions, CaptureResult, run_capture
from gputrace.daemon.ticker import Ticker
from gputrace.probes.ebpf.shared import SharedEbpf


def test_checks_run_in_the_ticker_thread_until_done() -> None:
    ticker = Ticker(0.005, name="gputraced-test-tick")
    threads: set[int] = set()
    runs = {"done after 2": 0, "raises": 0, "goes on": 0}
    three = threading.Event()

    def done_after_two() -> bool:
        threads.add(threading.get_ident())
        runs["done after 2"] += 1
        return runs["done after 2"] < 2

    def raises() -> bool:
        threads.add(threading.get_ident())
        runs["raises"] += 1
        raise ValueError("a broken check")

    def goes_on() -> bool:
        threads.add(threading.get_ident())
        runs["goes on"] += 1
        if runs["goes on"] >= 3:
            three.set()
        return True

    try:
        for check in (done_after_two, raises, goes_on):
            ticker.add(check)
        assert three.wait(30), "the checks were not run"
        ticker.remove(goes_on)
        assert runs["done after 2"] == 2 and runs["raises"] == 1 and runs["goes on"] >= 3, runs
        assert len(threads) == 1 and threading.get_ident() not in threads  # one thread, not the caller's
        assert len(ticker) == 0 and ticker.rounds >= 3
    finally:
        ticker.close()
    with pytest.raises(RuntimeError):
        ticker.add(goes_on)


def test_a_check_being_removed_is_not_running_once_removal_returns() -> None:
    ticker = Ticker(0.005, name="gputraced-test-tick")
    entered, gate, calling = threading.Event(), threading.Event(), threading.Event()
    order: list[str] = []

    def slow() -> bool:
        entered.set()
        gate.wait(30)
        order.append("check ended")
        return True

    def remove() -> None:
        calling.set()
        ticker.remove(slow)
        order.append("removed")

    try:
        ticker.add(slow)
        assert entered.wait(30), "the check was not run"
        remover = threading.Thread(target=remove)
        remover.start()
        assert calling.wait(30)
        remover.join(0.2)
        assert remover.is_alive(), "remove() returned while the check was running"
        gate.set()
        remover.join(30)
        assert order == ["check ended", "removed"]
        assert len(ticker) == 0
    finally:
        gate.set()
        ticker.close()


# A target that runs until its stdin closes
WAITER = "import sys; sys.stdin.read()"


@pytest.mark.kernel
def test_a_session_on_a_ticker_ends_with_its_targets_and_when_stopped(tmp_path: Path) -> None:
    ticker, shared = Ticker(0.05, name="gputraced-test-tick"), SharedEbpf()
    procs = [subprocess.Popen([sys.executable, "-c", WAITER], stdin=subprocess.PIPE) for _ in range(2)]
    stops = [threading.Event(), threading.Event()]
    tracing = [threading.Event(), threading.Event()]
    results: list[CaptureResult | BaseException | None] = [None, None]

    def run(i: int) -> None:
        opts = CaptureOptions(output=tmp_path / f"{i}.gputrace", pids=[procs[i].pid], perfetto=False, progress=False,
                              analyse=False, sample_hz=0, off=frozenset({"sampler"}), on_tracing=tracing[i].set,
                              make_ebpf=shared.view, ticker=ticker)
        try:
            results[i] = run_capture(opts, stop=stops[i], log=lambda _msg: None)
        except BaseException as e:  # noqa: BLE001 - asserted below
            results[i] = e
            tracing[i].set()

    sessions = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(2)]
    try:
        for t in sessions:
            t.start()
        for i in range(2):
            assert tracing[i].wait(120) and not isinstance(results[i], BaseException), results[i]
        # each session's checks go to the ticker as its wait begins, just after tracing has
        wait_for(lambda: len(ticker) == 2, 60, "both sessions' checks on the ticker")
        assert procs[0].stdin is not None
        procs[0].stdin.close()  # the first job's target exits: the ticker finds it gone
        sessions[0].join(60)
        stops[1].set()  # the second is stopped, as the service stops its jobs
        sessions[1].join(60)
    finally:
        for p in procs:
            p.kill()
            p.wait()
        ticker.close()
    first, second = results
    assert isinstance(first, CaptureResult) and first.stop_reason == "targets exited", first
    assert isinstance(second, CaptureResult) and second.stop_reason == "stopped", second
    assert len(ticker) == 0
