"""The HTML report's pictures (timeline, stall budget chart, waterfalls) and the terminal's timeline strip:
what they name, that text from the capture stays text, the size bound at 100,000 stalls, and the page as
headless Chromium draws it after its script ran."""

from __future__ import annotations

import copy
import html
import io
import re
import shutil
import struct
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

from rich.console import Console

from gputrace.analysis import analyze
from gputrace.capture import open_capture
from gputrace.testing.synth import Builder
from gputrace.viewer import html as html_report
from gputrace.viewer import terminal, timeline

TRAINER, WORKER = 100, 200
HOSTILE_COMM = "<script>alert(1)</script>"  # a worker's comm: a traced process names itself
SHARD = "/data/<b>shard</b>-7.bin"
PEER = "10.0.0.7:29500"


def mixed_report(tmp_path: Path) -> dict[str, Any]:
    """Four stalls on one device: storage (through the hostile worker), network, sleep, cpu."""
    b = Builder().proc(TRAINER, "python").proc(WORKER, HOSTILE_COMM, TRAINER)
    b.device(TRAINER, name="NVIDIA H100 80GB HBM3")
    b.op(TRAINER, TRAINER, 0, 0, 10, "fwd")
    b.syscall(TRAINER, TRAINER, "read", 9, 39.9, "pipe").offcpu(TRAINER, TRAINER, 9, 39.9, "S", 39.8,
                                                                (WORKER, WORKER, HOSTILE_COMM))
    b.syscall(WORKER, WORKER, "pread64", 11, 39, SHARD, 4 << 20).block(WORKER, WORKER, 11.1, 38.9, 4 << 20)
    b.op(TRAINER, TRAINER, 39.95, 40, 50, "bwd")
    b.syscall(TRAINER, TRAINER, "recvfrom", 50.5, 70, PEER, 100, fd=9)
    b.op(TRAINER, TRAINER, 70.05, 70.1, 80, "k2")
    b.syscall(TRAINER, TRAINER, "clock_nanosleep", 80.5, 95)
    b.op(TRAINER, TRAINER, 95.05, 95.1, 100, "k3")
    b.op(TRAINER, TRAINER, 112, 112.1, 130, "k4")
    with open_capture(b.write(tmp_path / "mixed.gputrace")) as reader:
        report = analyze(reader)
    assert [s["cause"] for s in report["stalls"]] == ["storage", "network", "sleep", "cpu"]
    return report


def many_stalls(report: dict[str, Any], n: int) -> dict[str, Any]:
    """``report`` with its stalls repeated ``n`` times over, spread over a window ``n`` times as long: the
    shape of a long capture, without analysing one."""
    big = copy.deepcopy(report)
    [dev] = big["devices"]
    period = dev["last_ns"] - dev["first_ns"]
    base = report["stalls"]
    big["stalls"] = []
    for i in range(n // len(base)):
        for s in base:
            shifted = dict(s, start_ns=s["start_ns"] + i * period, end_ns=s["end_ns"] + i * period)
            big["stalls"].append(shifted)
    reps = n // len(base)
    dev["last_ns"] = dev["first_ns"] + reps * period
    dev["window_ns"], dev["busy_ns"], dev["stall_ns"] = reps * period, reps * dev["busy_ns"], reps * dev["stall_ns"]
    dev["stalls"] = len(big["stalls"])
    big["capture"]["end_ns"] = dev["last_ns"]
    return big


class Dom(HTMLParser):
    """Elements as (tag, attributes) and the text under each element with a class, for assertions on the DOM."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.elements: list[tuple[str, dict[str, str]]] = []
        self.text: list[str] = []
        self._open: list[str] = []
        self.by_class: dict[str, list[str]] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        self.elements.append((tag, a))
        if tag not in ("br", "img", "meta", "rect", "i", "input"):
            self._open.append(a.get("class", ""))

    def handle_endtag(self, tag: str) -> None:
        if tag not in ("br", "img", "meta", "rect", "i", "input") and self._open:
            self._open.pop()

    def handle_data(self, data: str) -> None:
        self.text.append(data)
        for cls in self._open:
            for c in cls.split():
                self.by_class.setdefault(c, []).append(data)

    def all(self, tag: str, **attrs: str) -> list[dict[str, str]]:
        return [a for t, a in self.elements if t == tag and all(a.get(k) == v for k, v in attrs.items())]


def parse(page: str) -> Dom:
    dom = Dom()
    dom.feed(page)
    return dom


def test_timeline_budget_and_waterfalls_name_each_stall(tmp_path: Path) -> None:
    report = mixed_report(tmp_path)
    page = html_report.page(report, "mixed.gputrace")
    dom = parse(page)
    [section] = dom.all("section")
    assert section["class"] == "dev"
    marks = [a for a in dom.all("rect") if "data-cause" in a]
    assert [m["data-cause"] for m in marks] == ["storage", "network", "sleep", "cpu"]
    storage = marks[0]
    assert storage["data-via"] == "wait:pid 200" and "data-first" in storage, "the longest stall is shown first"
    assert f"pid {WORKER} ({HOSTILE_COMM}) pread64 {SHARD}" in storage["data-culprit"]
    assert f"pid {TRAINER} (python) recvfrom {PEER}" in marks[1]["data-culprit"]
    assert {m["fill"] for m in marks} == {html_report.COLOURS[c] for c in ("storage", "network", "sleep", "cpu")}
    # the budget chart: a bar and a label per cause, the longest first
    budget = [t for t in dom.all("svg") if t.get("class") == "budget"]
    assert len(budget) == 1
    assert "storage30.0 ms · 23.1% of the window" in "".join(dom.text).replace("\n", "")
    # a waterfall per stall, the chain from the stalled thread to the root cause, then the evidence rows
    chains = ["".join(t) for t in [dom.by_class["chain"]]][0]
    assert f"pid {TRAINER} tid {TRAINER} → wait:pid {WORKER} → storage: pid {WORKER} ({HOSTILE_COMM})" in chains
    labels = dom.by_class["lbl"]
    assert f"pid {WORKER} tid {WORKER} syscall: pread64({SHARD}) 4194304 B" in labels
    assert f"pid {TRAINER} tid {TRAINER} wakeup: woken by pid {WORKER} tid {WORKER} ({HOSTILE_COMM})" in labels
    assert len(dom.all("div", **{"class": "wf"})) == 4


def test_capture_text_is_never_markup(tmp_path: Path) -> None:
    page = html_report.page(mixed_report(tmp_path), "<img src=x onerror=alert(2)>.gputrace")
    assert HOSTILE_COMM not in page and "<b>shard" not in page and "<img" not in page
    assert html.escape(HOSTILE_COMM) in page and html.escape(SHARD) in page
    dom = parse(page)
    # the page's own script is the only one; the hostile comm is text (in titles, labels, attributes)
    assert len(dom.all("script")) == 1 and not dom.all("b", **{"class": "shard"})
    assert {t for t, _ in dom.elements} <= {"html", "head", "meta", "title", "style", "body", "h1", "h2", "h3", "h4",
                                            "p", "table", "tr", "th", "td", "span", "section", "svg", "rect",
                                            "text", "div", "b", "i", "script"}
    # nothing to fetch: no element with a URL, none in the style or the script, no font but the system's
    assert not [a for _, a in dom.elements if {"src", "href", "srcset", "xlink:href"} & a.keys()]
    assert not re.search(r"url\(|@import|@font-face|https?://", html_report.STYLE + html_report.SCRIPT)
    # the script writes what it shows as text only
    assert "innerHTML" not in html_report.SCRIPT and "textContent" in html_report.SCRIPT


def test_hostile_cause_and_host_do_not_reach_class_or_style(tmp_path: Path) -> None:
    """A report from another tool or version could hold any cause string: colours and classes are looked up."""
    report = mixed_report(tmp_path)
    report["stalls"][1]["cause"] = "x' onmouseover='alert(3)"
    report["devices"][0]["host"] = "<h1>host</h1>"
    for s in report["stalls"]:
        s["host"] = "<h1>host</h1>"
    page = html_report.page(report, "r")
    assert "onmouseover='alert" not in page and "<h1>host" not in page
    assert html_report.OTHER_COLOUR in page


def test_a_hundred_thousand_stalls_stay_a_light_page(tmp_path: Path) -> None:
    big = many_stalls(mixed_report(tmp_path), 100_000)
    assert len(big["stalls"]) == 100_000
    page = html_report.page(big, "big")
    dom = parse(page)
    slices = [a for a in dom.all("rect") if "data-cause" in a]
    assert 0 < len(slices) <= html_report.TIMELINE_SLICES
    assert len(dom.all("div", **{"class": "wf"})) == html_report.WATERFALLS
    assert len(dom.all("tr")) <= html_report.TABLE_STALLS + 30  # the stall table and the small ones
    assert "The 500 longest of 100,000 stalls" in page and "100,000 stalls, drawn as 1000 slices" in page
    # the slices keep the culprit: the hostile worker's read is in the longest stall of most slices
    assert any(HOSTILE_COMM in a["data-culprit"] for a in slices)
    assert len(page.encode()) < 1_500_000, len(page.encode())


def test_slices_add_up_to_the_stall_time(tmp_path: Path) -> None:
    report = mixed_report(tmp_path)
    [dev] = report["devices"]
    for n in (7, 100, 1000):
        cells = timeline.slices(report, dev, report["stalls"], n)
        assert sum(c.stalled_ns for c in cells) == sum(s["duration_ns"] for s in report["stalls"])
        assert sum(c.window_ns for c in cells) == dev["window_ns"]


def test_terminal_strip_fits_the_console_and_marks_each_cause(tmp_path: Path) -> None:
    report = mixed_report(tmp_path)
    for width in (60, 100, 200):
        out = io.StringIO()
        terminal.render(report, Console(file=out, width=width, color_system=None), "mixed")
        lines = out.getvalue().splitlines()
        i = next(i for i, line in enumerate(lines) if line.startswith("Timeline ("))
        strip, legend = lines[i + 1], lines[i + 2]
        assert len(strip) <= width and strip.startswith("dev 0") and strip.endswith("|")
        cells = strip[strip.index("|") + 1:-1]
        assert len(cells) == width - terminal.STRIP_LABEL - 2
        # the stalls in time order: storage, network, sleep, cpu, with busy time between them
        runs = [ch for j, ch in enumerate(cells) if j == 0 or cells[j - 1] != ch]
        assert runs == ["=", "s", "=", "n", "=", "z", "=", "c", "="], strip
        assert legend == "= busy  . no GPU work  c cpu  n network  z sleep  s storage"


def test_terminal_strip_marks_time_without_gpu_work(tmp_path: Path) -> None:
    report = mixed_report(tmp_path)
    report["capture"]["end_ns"] += report["devices"][0]["window_ns"]  # as long again after the last kernel
    line = timeline.strip(report, report["devices"][0], 40)
    assert line.endswith("." * 19) and line[0] == "="


# ------------------------------------------------------------------------------------- headless Chromium ---

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _chromium(*args: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM
    # --no-sandbox: the tests run as root, where Chromium's sandbox refuses to start; the page is our own
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
           f"--user-data-dir={tmp / 'profile'}", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", "not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_chromium_draws_the_page_and_runs_its_script(tmp_path: Path) -> None:
    assert CHROMIUM is not None, "no chromium binary: ./setup.sh --test installs it"
    page = tmp_path / "mixed.html"
    html_report.write(mixed_report(tmp_path), page, title="mixed.gputrace")
    shot = tmp_path / "mixed.png"
    _chromium(f"--screenshot={shot}", "--window-size=1200,1400", page.as_uri(), tmp=tmp_path)
    assert shot.stat().st_size > 10_000 and _png_size(shot) == (1200, 1400)
    dom = parse(_chromium("--dump-dom", page.as_uri(), tmp=tmp_path).stdout)
    # the timeline's elements, as drawn
    marks = [a for a in dom.all("rect") if "data-cause" in a]
    assert [m["data-cause"] for m in marks] == ["storage", "network", "sleep", "cpu"]
    assert "sel" in marks[0]["class"].split(), "the script marked the longest stall"
    # the script filled the detail panel with the longest stall (the DOM after it ran, not the file's text)
    detail = "".join(dom.by_class["detail"])
    assert detail.startswith("at: 0.010 s, 30.0 ms")
    assert f"culprit: pid {WORKER} ({HOSTILE_COMM}) pread64 {SHARD}" in detail and "via: wait:pid 200" in detail
    text = "".join(dom.text)
    assert f"recvfrom {PEER}" in text and "clock_nanosleep" in text
    assert len(dom.all("script")) == 1, "the hostile comm became no element"
