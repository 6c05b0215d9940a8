"""`gputrace capture` as a user runs it: real processes, real eBPF, the files it leaves, its errors."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from waiting import wait_for

from gputrace.capture import CaptureReader, CaptureWriter, host_header
from gputrace.probes import procfs
from gputrace.records import FdInfo, ProcFork, ProcInfo, SourceStatus, Syscall

pytestmark = pytest.mark.kernel  # root and the host's kernel (see tests/conftest.py)

GPUTRACE = [sys.executable, "-m", "gputrace"]


def gputrace(*args: str, cwd: Path, user: int | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    prefix = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups"] if user is not None else []
    return subprocess.run(prefix + GPUTRACE + list(args), cwd=cwd, capture_output=True, text=True, timeout=timeout)


def test_command_is_traced_and_its_exit_code_returned(tmp_path: Path) -> None:
    data = tmp_path / "input.bin"
    data.write_bytes(os.urandom(1 << 20))
    script = (
        "import os, sys, time\n"
        f"fd = os.open({str(data)!r}, os.O_RDONLY)\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    time.sleep(0.3)\n"  # a sleep longer than the threshold, in a child forked during the capture
        "    os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "n = len(os.pread(fd, 1 << 20, 0))\n"
        "print('read', n)\n"
        "sys.exit(7)\n"
    )
    r = gputrace("capture", "-o", "run.gputrace", "--syscall-threshold-us", "0", "--", sys.executable, "-c", script,
                 cwd=tmp_path)
    assert r.returncode == 7, r.stderr
    assert "read 1048576" in r.stdout
    assert "Wrote run.gputrace" in r.stderr and "Wrote run.pftrace" in r.stderr
    assert "gputrace report run.gputrace" in r.stderr
    with CaptureReader(tmp_path / "run.gputrace") as reader:
        recs = list(reader.records())
        assert reader.complete, reader.problem or reader.drops
    reads = [x for x in recs if isinstance(x, Syscall) and x.name == "pread64" and x.obj == str(data)]
    assert reads and reads[0].nbytes == 1 << 20
    forks = [x for x in recs if isinstance(x, ProcFork) and not x.is_thread]
    assert forks, "the child forked during the capture was not followed"
    sleeps = [x for x in recs if isinstance(x, Syscall) and x.pid == forks[0].child_pid and "sleep" in x.name]
    assert sleeps and sleeps[0].end_ns - sleeps[0].start_ns >= 250_000_000


def capture_until_exit(tmp_path: Path, target: subprocess.Popen[str], pid: int) -> list[str]:
    """`capture -p PID -o t.gputrace` of `target`, which waits for a line on stdin and then exits: the
    lines gputrace printed before `tracing ...` (the handshake), once the capture ended by itself."""
    try:
        cap = subprocess.Popen(GPUTRACE + ["capture", "-p", str(pid), "-o", "t.gputrace"], cwd=tmp_path,
                               stderr=subprocess.PIPE, text=True)
        assert cap.stderr is not None and target.stdin is not None
        before = []
        while not (line := cap.stderr.readline()).startswith("gputrace: tracing"):
            assert line, "gputrace ended before tracing"
            before.append(line.rstrip("\n"))
        target.stdin.write("go\n")
        target.stdin.flush()
        _, err = cap.communicate(timeout=60)
        assert cap.returncode == 0, err
    finally:
        target.kill()
    return before


def test_pid_capture_ends_when_target_exits(tmp_path: Path) -> None:
    target = subprocess.Popen([sys.executable, "-c", "import sys,time; sys.stdin.readline(); time.sleep(0.5)"],
                              stdin=subprocess.PIPE, text=True)
    assert capture_until_exit(tmp_path, target, target.pid) == []
    with CaptureReader(tmp_path / "t.gputrace") as reader:
        list(reader.records())
        assert reader.complete
        assert reader.trailer is not None and reader.trailer["stop_reason"] == "targets exited"
        skipped = reader.trailer["skipped"]  # programs the kernel skipped: source.program -> count, never 0
        assert all(k.startswith(("ebpf.", "sampler.")) and type(v) is int and v > 0 for k, v in skipped.items())


def test_dead_pid_is_refused(tmp_path: Path) -> None:
    p = subprocess.Popen(["true"])
    p.wait()
    r = gputrace("capture", "-p", str(p.pid), "-d", "1", cwd=tmp_path)
    assert r.returncode != 0 and f"no process with pid {p.pid}" in r.stderr
    assert "Traceback" not in r.stderr and not list(tmp_path.iterdir())


def test_existing_output_is_not_overwritten(tmp_path: Path) -> None:
    (tmp_path / "x.gputrace").write_text("keep")
    r = gputrace("capture", "-o", "x.gputrace", "--", "true", cwd=tmp_path)
    assert r.returncode != 0 and "--force" in r.stderr
    assert (tmp_path / "x.gputrace").read_text() == "keep"


def test_unwritable_directory(tmp_path: Path) -> None:
    r = gputrace("capture", "-o", str(tmp_path / "missing" / "x.gputrace"), "--", "true", cwd=tmp_path)
    assert r.returncode != 0 and "does not exist" in r.stderr


def test_not_root_names_the_capability(tmp_path: Path) -> None:
    os.chmod(tmp_path, 0o777)
    r = gputrace("capture", "-d", "1", "--", "true", cwd=tmp_path, user=65534)
    assert r.returncode != 0
    assert "CAP_BPF" in r.stderr and "CAP_PERFMON" in r.stderr and "Traceback" not in r.stderr


def test_command_not_found(tmp_path: Path) -> None:
    r = gputrace("capture", "--", "no-such-command-xyz", cwd=tmp_path)
    assert r.returncode != 0 and "command not found" in r.stderr
    assert not list(tmp_path.glob("*.gputrace")) and not list(tmp_path.glob(".*partial"))


def test_full_disk_keeps_the_capture_up_to_the_cut_and_the_command_runs_on(tmp_path: Path) -> None:
    """The disk fills mid-capture: one clear error, the file keeps what was written (readable, incomplete), the
    command is left to finish and its exit code is gputrace's."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    assert os.system(f"mount -t tmpfs -o size=256k tmpfs {mnt}") == 0
    try:
        script = ("import os, sys, time\nt = time.monotonic() + 3\nwhile time.monotonic() < t: os.stat('/')\n"
                  "print('finished', flush=True)\nsys.exit(7)\n")
        r = gputrace("capture", "--syscall-threshold-us", "0", "-o", str(mnt / "x.gputrace"), "--",
                     sys.executable, "-c", script, cwd=tmp_path)
        assert r.returncode == 7, r.stderr
        assert "finished" in r.stdout
        assert "No space left" in r.stderr and "cut off" in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert [p.name for p in mnt.iterdir()] == ["x.gputrace"]
        with CaptureReader(mnt / "x.gputrace") as reader:
            recs = list(reader.records())
            assert not reader.complete and reader.trailer is None and "cut off" in reader.problem
        assert any(isinstance(x, Syscall) for x in recs)
        report = subprocess.run(GPUTRACE + ["report", str(mnt / "x.gputrace")], capture_output=True, text=True)
        assert report.returncode == 0 and "INCOMPLETE" in report.stdout, report.stderr
    finally:
        os.system(f"umount {mnt}")


def test_duration_ends_capture_and_statuses_recorded(tmp_path: Path) -> None:
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        t0 = time.monotonic()
        r = gputrace("capture", "-p", str(sleeper.pid), "-d", "1", "-o", "d.gputrace", cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert time.monotonic() - t0 < 30
    finally:
        sleeper.kill()
    with CaptureReader(tmp_path / "d.gputrace") as reader:
        recs = list(reader.records())
    assert reader.trailer is not None and reader.trailer["stop_reason"] == "duration"
    assert any(isinstance(x, SourceStatus) for x in recs)
    # -d 1 holds a second of tracing, not the seconds the sampler and the other sources took to start too.
    traced_s = (reader.trailer["end_ns"] - reader.trailer["tracing_ns"]) / 1e9
    assert 0.9 <= traced_s < 1.5 or "longer than -d 1" in r.stderr, (traced_s, r.stderr)


@pytest.mark.parametrize("bad", [["-d", "0", "--", "true"], ["-p", "1", "--", "true"], []])
def test_bad_arguments(tmp_path: Path, bad: list[str]) -> None:
    r = gputrace("capture", *bad, cwd=tmp_path)
    assert r.returncode != 0 and "error" in r.stderr and "Traceback" not in r.stderr


def test_a_command_that_cannot_run_says_why(tmp_path: Path) -> None:
    plain = tmp_path / "train.py"
    plain.write_text("print('hi')\n")
    for cmd, why in ((str(plain), "not executable"), (str(tmp_path), "it is a directory"),
                     ("no-such-command-here", "command not found")):
        r = gputrace("capture", "-o", "x.gputrace", "--", cmd, cwd=tmp_path)
        assert r.returncode == 2 and why in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not list(tmp_path.glob("*.gputrace"))


def test_a_script_whose_interpreter_is_missing_names_the_interpreter(tmp_path: Path) -> None:
    script = tmp_path / "job.sh"
    script.write_text("#!/nonexistent/interp -x\necho hi\n")
    script.chmod(0o755)
    r = gputrace("capture", "-o", "x.gputrace", "--", str(script), cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"cannot run {script}: its interpreter /nonexistent/interp (from its #! line) was not found" in r.stderr


def test_the_command_gets_default_signal_dispositions(tmp_path: Path) -> None:
    """Python ignores SIGPIPE and SIGXFSZ; a command run under gputrace must not inherit that (`yes | head`
    would print "Broken pipe", a pipeline's exit codes would change). Stop signals gputrace was itself
    started with ignored stay ignored for the command, as a shell leaves them (nohup, a background job)."""
    stops = 1 << signal.SIGINT - 1 | 1 << signal.SIGQUIT - 1 | 1 << signal.SIGHUP - 1 | 1 << signal.SIGTERM - 1
    for ignored in ((), (signal.SIGHUP, signal.SIGINT)):
        r = subprocess.run(GPUTRACE + ["capture", "-o", "x.gputrace", "-f", "--", "sh", "-c",
                                       "grep SigIgn /proc/self/status; yes | head -c 10 >/dev/null"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120,
                           preexec_fn=lambda sigs=ignored: [signal.signal(n, signal.SIG_IGN) for n in sigs],
                           )  # fmt: skip
        assert r.returncode == 0, r.stderr
        here = int(Path("/proc/self/status").read_text().split("SigIgn:")[1].split()[0], 16)  # SIGQUIT, say
        want = (here & stops) | sum(1 << s - 1 for s in ignored)
        assert f"SigIgn:\t{want:016x}" in r.stdout and "Broken pipe" not in r.stderr, (r.stdout, ignored)


def test_sigterm_to_gputrace_reaches_the_command_and_the_capture_is_written(tmp_path: Path) -> None:
    """A supervisor stopping `gputrace capture -- CMD` stops the job: the command gets the SIGTERM too."""
    cap = subprocess.Popen(GPUTRACE + ["capture", "-o", "t.gputrace", "--", "sleep", "60"], cwd=tmp_path,
                           stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert cap.stderr is not None
    while not (line := cap.stderr.readline()).startswith("gputrace: tracing"):
        assert line, "gputrace ended before tracing"
    [sleep] = procfs.descendants(cap.pid)
    cap.send_signal(signal.SIGTERM)
    # the command gets it at once (long before its 60 s are up); the capture then ends and is written, in
    # however long a loaded host takes for that
    wait_for(lambda: not _waiting(sleep), 30, "the command to end")
    _, err = cap.communicate(timeout=300)
    assert cap.returncode == 128 + signal.SIGTERM, err  # sleep's own status
    assert "waiting for pid" not in err and "Wrote t.gputrace" in err
    with CaptureReader(tmp_path / "t.gputrace") as reader:
        list(reader.records())
        assert reader.trailer is not None and reader.trailer["stop_reason"] == "stopped"


def test_a_held_command_ends_when_gputrace_is_killed_before_releasing_it(tmp_path: Path) -> None:
    """The command waits on a pipe until tracing is attached; if gputrace dies first (SIGKILL while the
    probes load), the command must not wait forever as an orphan."""
    p = subprocess.Popen([sys.executable, "-m", "gputrace", "capture", "-o", "x.gputrace", "--", "sleep", "60"],
                         cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    children = wait_for(lambda: procfs.descendants(p.pid), 10, "the held child")
    p.kill()
    p.wait()
    held = children[0]
    wait_for(lambda: not _waiting(held), 10, "the held command to stop waiting")


def _waiting(pid: int) -> bool:
    """Alive and not a zombie (an ended child waits as one until its new parent reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


ODD_NAMES = """
import ctypes, os, sys, time
ctypes.CDLL(None).prctl(15, b"odd\\xff\\xe9", 0, 0, 0)  # PR_SET_NAME: a comm that is not UTF-8
fd = os.open(os.fsencode(sys.argv[1]), os.O_RDONLY)
sys.stdin.readline()
for _ in range(20):
    os.pread(fd, 4096, 0)
    time.sleep(0.01)
"""


def test_names_that_are_not_utf8_are_captured_with_escapes(tmp_path: Path) -> None:
    """A process's comm, executable path and open files, and the host's mount points, are bytes, not text:
    undecodable ones (a dataset with latin-1 file names) are recorded with backslash escapes (\\xe9), so two
    names differing only there stay apart, and neither stop the capture nor its report."""
    odd = tmp_path / os.fsdecode(b"dir\xe9")
    odd.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(odd)], check=True)
    try:
        exe, data = odd / os.fsdecode(b"py\xff"), odd / os.fsdecode(b"data\xe9.bin")
        shutil.copy(Path(sys.executable).resolve(), exe)
        data.write_bytes(b"x" * 8192)
        target = subprocess.Popen([str(exe), "-c", ODD_NAMES, str(data)], stdin=subprocess.PIPE, text=True)
        capture_until_exit(tmp_path, target, target.pid)
        target.wait()
    finally:
        subprocess.run(["umount", str(odd)], check=False)
    with CaptureReader(tmp_path / "t.gputrace") as reader:
        records = list(reader.records())
        assert reader.complete
    info = next(r for r in records if isinstance(r, ProcInfo) and r.pid == target.pid)
    assert info.exe == f"{tmp_path}/dir\\xe9/py\\xff" and info.comm == "odd\\xff\\xe9"
    assert any(isinstance(r, FdInfo) and r.obj == f"{tmp_path}/dir\\xe9/data\\xe9.bin" for r in records)
    assert [f"{tmp_path}/dir\\xe9", "tmpfs"] in [m[:2] for m in reader.header["mounts"]]
    report = gputrace("report", "t.gputrace", "--json", cwd=tmp_path)
    assert report.returncode == 0 and json.loads(report.stdout)["capture"]["pids"] == [target.pid], report.stderr


def test_a_capture_writer_takes_strings_python_decoded_with_surrogate_escapes(tmp_path: Path) -> None:
    """An argument or a path Python holds as surrogate escapes (os.fsdecode of undecodable bytes)."""
    writer = CaptureWriter(tmp_path / "s.gputrace", host_header(["run", os.fsdecode(b"a\xffb"), "\ud800"]))
    writer.write([FdInfo(1, 2, 3, "file", os.fsdecode(b"/data/x\xe9.bin")),
                  FdInfo(1, 2, 4, "file", os.fsdecode(b"/data/x\xff.bin"))])  # two files, kept apart
    writer.close({})
    with CaptureReader(tmp_path / "s.gputrace") as reader:
        assert reader.header["argv"] == ["run", "a\\xffb", "?"]
        assert [r.obj for r in reader.records()] == ["/data/x\\xe9.bin", "/data/x\\xff.bin"]


FORKS_AND_EXITS = """
import os
from gputrace.agent import arming
from gputrace.sim import Device
s = Device(0).stream()
for _ in range(24):
    pid = os.fork()
    if pid == 0:  # each child connects its own agent, then leaves by os._exit: no goodbye
        s.launch("child", duration_ms=1.0)
        agent = arming.current()
        assert agent is not None and agent.answered.wait(30)  # taken by the session, however busy the machine
        os._exit(0)
    os.waitpid(pid, 0)
s.launch("parent", duration_ms=1.0)
s.synchronize()
"""


def test_many_children_ending_without_goodbye_are_summed_up_not_listed(tmp_path: Path) -> None:
    r = gputrace("capture", "-o", "f.gputrace", "--no-perfetto", "--", sys.executable, "-c", FORKS_AND_EXITS,
                 cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr
    one_by_one = [line for line in r.stderr.splitlines()
                  if line.startswith("gputrace: agent pid ") and "without saying bye" in line]  # fmt: skip
    with CaptureReader(tmp_path / "f.gputrace") as reader:
        ended = [s for s in reader.records() if isinstance(s, SourceStatus) and s.status == "ended_early"]
    assert len(ended) > 5, r.stderr  # the capture keeps each one
    assert len(one_by_one) == 5, r.stderr
    assert f"gputrace: agent: {len(ended)} peers ended without saying bye in all" in r.stderr


def test_a_script_without_a_shebang_is_run_by_sh_as_a_shell_would(tmp_path: Path) -> None:
    script = tmp_path / "job"
    script.write_text('echo "ran with $1"\nexit 3\n')
    script.chmod(0o755)
    r = gputrace("capture", "-o", "s.gputrace", "--no-perfetto", "--", str(script), "arg", cwd=tmp_path)
    assert r.returncode == 3, r.stderr
    assert "ran with arg" in r.stdout


def test_a_capture_killed_outright_is_pointed_out_by_the_next_one(tmp_path: Path) -> None:
    """SIGKILL leaves the hidden temporary file; the next capture to that name says where it is and that
    `report` reads it."""
    marker = str(tmp_path / "sleeper")  # names the command, which outlives the killed capture
    cap = subprocess.Popen(GPUTRACE + ["capture", "-o", "k.gputrace", "--", sys.executable, "-c",
                                       "import time; time.sleep(30)", marker], cwd=tmp_path,
                           stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert cap.stderr is not None
    while not cap.stderr.readline().startswith("gputrace: tracing"):
        assert cap.poll() is None, "gputrace ended before tracing"
    cap.kill()
    cap.wait()
    subprocess.run(["pkill", "-f", marker], check=False)
    [left] = tmp_path.glob(".k.gputrace.*.partial")
    r = gputrace("capture", "-o", "k.gputrace", "--no-perfetto", "--", "true", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"gputrace: note: {left.name} is what a capture to this name wrote before it was cut off" in r.stderr
    report = gputrace("report", str(left), cwd=tmp_path)
    assert report.returncode == 0 and "INCOMPLETE" in report.stdout + report.stderr, report.stdout + report.stderr


def test_a_command_whose_arguments_are_not_utf8_is_captured(tmp_path: Path) -> None:
    """gputrace capture -- CMD with an argument that is not UTF-8 (a latin-1 file name, a newline in it): the
    command runs with its bytes and its exit code is gputrace's; the header records the argument with a
    backslash escape, and nothing but the capture and its trace is left behind."""
    r = subprocess.run([*map(os.fsencode, GPUTRACE), b"capture", b"-d", b"30", b"-o", b"a.gputrace", b"--",
                        b"sh", b"-c", b'test "$1" = "$(printf "caf\\351\\nline two")" && exit 6', b"x",
                        b"caf\xe9\nline two"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 6, r.stderr
    assert "Traceback" not in r.stderr
    with CaptureReader(tmp_path / "a.gputrace") as reader:
        list(reader.records())
        assert reader.trailer is not None and reader.trailer["stop_reason"] == "command exited"
        assert reader.header["argv"][-1] == reader.header["command"][-1] == "caf\\xe9\nline two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gputrace", "a.pftrace"]
    report = gputrace("report", "a.gputrace", cwd=tmp_path)
    assert report.returncode == 0 and "Traceback" not in report.stderr, report.stderr
