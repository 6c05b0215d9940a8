#!/usr/bin/env bash
# Sets up gputrace on a Debian/Ubuntu host, idempotently:
#   1. distribution packages: bcc (python3-bpfcc), kernel headers for the running kernel
#      (or the distribution's nearest headers, linked under /lib/modules/$(uname -r)),
#   2. tracefs/debugfs mounted,
#   3. a virtual environment in .venv made from the system Python with system site packages
#      (so `import bcc` works), with gputrace installed into it,
#   4. with --test, what only the tests need: a Python 3.14 in build/python3.14 to attach to with
#      sys.remote_exec (the distribution's is older), from Debian's python3.14 packages (see below),
#      and PyTorch (its CPU build where the machine has one) in .venv, for a scenario that runs
#      PyTorch's own DataLoader, and Chromium, to render the HTML report headless.
# Every step says what it did. Run as root.
set -euo pipefail
cd "$(dirname "$0")"
say() { printf 'setup: %s\n' "$*"; }
die() { printf 'setup: error: %s\n' "$*" >&2; exit 1; }

with_test=0
for arg in "$@"; do
    case "$arg" in
        --test) with_test=1 ;;
        -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; echo "usage: ./setup.sh [--test]"; exit 0 ;;
        *) die "unknown argument $arg (usage: ./setup.sh [--test])" ;;
    esac
done

[ "$(id -u)" = 0 ] || die "run as root (installs packages, links kernel headers, mounts tracefs)"
command -v apt-get >/dev/null || die "needs a Debian/Ubuntu host with apt-get"
export DEBIAN_FRONTEND=noninteractive
krel=$(uname -r)
apt_updated=0
apt_install() {
    if [ "$apt_updated" = 0 ]; then apt-get update -qq; apt_updated=1; fi
    apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# bcc and the venv; then what the tests use for real workloads: FUSE (libfuse2 for fusepy), loop devices
# and ext4 (util-linux, e2fsprogs), privilege drops (setpriv), network namespaces (iproute2),
# systemd-analyze for the unit; strace and perf for the side-by-side benchmark.
missing=()
for pkg in python3-bpfcc python3-venv python3-dev libfuse2 e2fsprogs util-linux iproute2 systemd strace linux-perf; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
    say "installing ${missing[*]}"
    apt_install "${missing[@]}"
else
    say "distribution packages already installed (python3-bpfcc, libfuse2, ...)"
fi

if [ -e "/lib/modules/$krel/build/include/linux/kconfig.h" ] || [ -e "/lib/modules/$krel/source/include/linux/kconfig.h" ]; then
    say "kernel headers for $krel present at /lib/modules/$krel/build"
elif apt-get install -y -qq --no-install-recommends "linux-headers-$krel" >/dev/null 2>&1; then
    say "installed linux-headers-$krel"
else
    [ "$apt_updated" = 1 ] || { apt-get update -qq; apt_updated=1; }
    arch=$(dpkg --print-architecture)
    nearest=$(apt-cache search --names-only "^linux-headers-[0-9.]+-[0-9]+-$arch\$" | awk '{print $1}' | sort -V | tail -n 1)
    [ -n "$nearest" ] || die "no kernel headers for $krel and none in the distribution; install headers by hand"
    apt_install "$nearest"
    common=${nearest%-"$arch"}-common
    mkdir -p "/lib/modules/$krel"
    ln -sfn "/usr/src/$nearest" "/lib/modules/$krel/build"
    ln -sfn "/usr/src/$common" "/lib/modules/$krel/source"
    say "no headers packaged for $krel: installed $nearest and linked /lib/modules/$krel/{build,source}"
    say "(tracepoint programs do not depend on struct layouts, so nearby headers are safe for them)"
fi

if ! mountpoint -q /sys/kernel/tracing; then
    mount -t tracefs tracefs /sys/kernel/tracing && say "mounted tracefs at /sys/kernel/tracing"
fi
if ! mountpoint -q /sys/kernel/debug; then
    mount -t debugfs debugfs /sys/kernel/debug && say "mounted debugfs at /sys/kernel/debug"
fi

if [ ! -x .venv/bin/python ]; then
    /usr/bin/python3 -m venv --system-site-packages .venv
    say "created .venv from /usr/bin/python3 with system site packages"
fi
stamp=.venv/.gputrace-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -c constraints.txt -e '.[dev]'
    touch "$stamp"
    say "installed gputrace and its dependencies into .venv (the versions in constraints.txt)"
else
    say "gputrace already installed in .venv"
fi
.venv/bin/python -c 'import bcc' 2>/dev/null || die ".venv cannot import bcc (python3-bpfcc)"

# The tests attach the agent to a running Python 3.14 with sys.remote_exec, which needs a 3.14 interpreter.
# Debian stable has none, so apt fetches Debian unstable's python3.14 binary packages (signatures checked
# against the system's Debian archive keyring, in a private apt state under build/, so the system's own
# sources are untouched), they are unpacked into build/python3.14 with the C library they were built
# against, and the interpreter is pointed at that library (patchelf). Nothing is installed system-wide.
if [ "$with_test" = 1 ]; then
    py314=$PWD/build/python3.14
    if "$py314/usr/bin/python3.14" -c 'import sys; sys.remote_exec' 2>/dev/null; then
        say "test interpreter $py314/usr/bin/python3.14 already present"
    else
        command -v patchelf >/dev/null || apt_install patchelf
        st=$PWD/build/apt-unstable
        rm -rf "$st" "$py314"
        mkdir -p "$st/lists/partial" "$st/archives/partial" "$py314"
        echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian unstable main" \
            >"$st/sources.list"
        touch "$st/status"
        aopt=(-o "Dir::Etc::SourceList=$st/sources.list" -o Dir::Etc::SourceParts=/dev/null
              -o "Dir::State::Lists=$st/lists" -o "Dir::State::status=$st/status" -o "Dir::Cache=$st"
              -o "Dir::Cache::archives=$st/archives" -o APT::Sandbox::User=root)
        apt-get "${aopt[@]}" update -qq || die "cannot read Debian unstable's package lists (needed by --test)"
        debs=(python3.14-minimal libpython3.14-minimal libpython3.14-stdlib libc6 libexpat1 zlib1g)
        (cd "$st/archives" && apt-get "${aopt[@]}" download -qq "${debs[@]}") \
            || die "cannot download ${debs[*]} from Debian unstable (needed by --test)"
        for deb in "$st"/archives/*.deb; do dpkg-deb -x "$deb" "$py314"; done
        loader=$(ls "$py314"/usr/lib/*-linux-gnu/ld-linux*.so.* | head -n 1)
        libdir=$(dirname "$loader")
        patchelf --set-interpreter "$loader" --force-rpath --set-rpath "$libdir" \
            "$py314/usr/bin/python3.14"
        "$py314/usr/bin/python3.14" -c 'import sys; sys.remote_exec' \
            || die "the unpacked Python 3.14 does not run (needed by --test)"
        rm -rf "$st"
        say "unpacked Debian's python3.14 $("$py314/usr/bin/python3.14" -c 'import platform; print(platform.python_version())') into $py314 for the tests (patchelf: its own libc)"
    fi
    # PyTorch's DataLoader, for the scenario that checks its worker processes are named. pip takes the CPU
    # build where one lies in its find-links (as on our CI machines); elsewhere PyPI's build.
    torch_version() { .venv/bin/python -c 'import torch; print(torch.__version__)' 2>/dev/null; }
    if v=$(torch_version); then
        say "PyTorch $v already in .venv"
    else
        .venv/bin/python -m pip install -q 'torch==2.13.0' || die "cannot install PyTorch 2.13.0 into .venv (needed by --test)"
        say "installed PyTorch $(torch_version) into .venv for the tests"
    fi
    # Chromium renders the HTML report headless (tests/test_html_render.py): a screenshot and the DOM after its
    # script ran. Debian packages it as chromium; without it that test would skip, so its absence stops --test.
    if command -v chromium >/dev/null; then
        say "chromium already installed ($(chromium --version 2>/dev/null | head -n 1))"
    else
        [ "$apt_updated" = 1 ] || { apt-get update -qq; apt_updated=1; }
        policy=$(apt-cache policy chromium 2>/dev/null)  # whole: grep -q closing the pipe early fails pipefail
        if grep -q 'Candidate: [0-9]' <<<"$policy"; then
            apt-get install -y -qq --no-install-recommends chromium >/dev/null
            say "installed chromium ($(chromium --version 2>/dev/null | head -n 1)) for the HTML rendering test"
        else
            die "no chromium package in this host's apt sources (needed by --test for the HTML rendering test)"
        fi
    fi
fi
say "ready: .venv/bin/gputrace doctor   # checks this host"
