"""Overlay mounts read from mountinfo, and the rules that keep overlay naming from guessing."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gputrace.probes.ebpf import overlay

pytestmark = pytest.mark.kernel  # root and the host's kernel (see tests/conftest.py)

MOUNTINFO = "\n".join([
    "22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw",
    "47 27 0:39 / /tmp/ov/merged rw,relatime - overlay overlay rw,lowerdir=lower,upperdir=upper,workdir=work",
    "48 22 0:40 / /var/lib/docker/overlay2/abc/merged rw,relatime shared:5 master:2 - overlay overlay "
    r"rw,lowerdir=/l/one:/l/two\072x::/data,upperdir=/u\040dir,workdir=/w",
    "49 22 0:41 /sub /mnt/bind rw - overlay overlay rw,lowerdir+=/a,lowerdir+=/b,datadir+=/d,upperdir=/u2,workdir=/w2",
    "50 22 0:42 / /broken",
])


def test_mountinfo_overlays() -> None:
    mounts = overlay.parse_mountinfo(MOUNTINFO)
    assert set(mounts) == {"0:39", "0:40", "0:41"}  # ext4 and the cut line are left out
    assert mounts["0:39"] == overlay.Overlay("/tmp/ov/merged", "/", ("lower", "upper"))
    # upper first is not required by the format: the order is the options'; escapes decoded, empty
    # entries of a data-only "::" separator dropped
    assert mounts["0:40"].layers == ("/l/one", "/l/two:x", "/data", "/u dir")
    assert mounts["0:41"] == overlay.Overlay("/mnt/bind", "/sub", ("/a", "/b", "/d", "/u2"))


def _mount(tmp_path: Path, layers: tuple[str, ...]) -> overlay.Overlay:
    return overlay.Overlay("/merged", "/", layers)


def test_a_layer_file_names_the_path_only_on_device_and_inode(tmp_path: Path) -> None:
    layer = tmp_path / "layer"
    (layer / "data").mkdir(parents=True)
    f = layer / "data" / "x.bin"
    f.write_bytes(b"x")
    st = f.stat()
    dev = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    mount = _mount(tmp_path, (str(layer),))
    assert overlay._in_layer(mount, "/merged/data/x.bin", dev, st.st_ino)
    assert not overlay._in_layer(mount, "/merged/data/x.bin", dev, st.st_ino + 1)  # same path, other file
    assert not overlay._in_layer(mount, "/merged/data/x.bin", "999:0", st.st_ino)  # same number, other device
    assert not overlay._in_layer(mount, "/elsewhere/data/x.bin", dev, st.st_ino)  # not under the mount
    assert not overlay._in_layer(mount, "/merged/data/x.bin (deleted)", dev, st.st_ino)
    relative = _mount(tmp_path, (os.path.relpath(layer),))
    assert not overlay._in_layer(relative, "/merged/data/x.bin", dev, st.st_ino)  # relative layer: unknown


def test_a_symlink_in_a_layer_is_not_followed(tmp_path: Path) -> None:
    layer = tmp_path / "layer"
    layer.mkdir()
    target = tmp_path / "secret.bin"
    target.write_bytes(b"s")
    (layer / "link.bin").symlink_to(target)
    st = target.stat()
    mount = _mount(tmp_path, (str(layer),))
    assert not overlay._in_layer(mount, "/merged/link.bin", f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}",
                                 st.st_ino)


def test_relative_paths_cannot_leave_the_layer(tmp_path: Path) -> None:
    mount = overlay.Overlay("/merged", "/sub", ("/layer",))
    assert overlay._relative(mount, "/merged/a/b") == "sub/a/b"
    assert overlay._relative(overlay.Overlay("/", "/", ()), "/a") == "a"
    assert overlay._relative(overlay.Overlay("/merged", "/", ()), "/merged/../../etc/passwd") is None
    assert overlay._relative(mount, "/mergedx/a") is None


def test_no_overlay_no_name() -> None:
    assert overlay.resolve(os.getpid(), "254:0", 1, {}) == ""
