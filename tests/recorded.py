"""The captures recorded on a real GPU host (tests/data/captures/README.md), packed as NAME.gputrace.xz or .gz."""

from __future__ import annotations

import gzip
import lzma
import shutil
from pathlib import Path

DATA = Path(__file__).parent / "data" / "captures"
PACKED = {".gputrace.xz": lzma.open, ".gputrace.gz": gzip.open}
CAPTURES = sorted(p.name.removesuffix(end) for end in PACKED for p in DATA.glob(f"*{end}"))


def unpacked(name: str, tmp: Path) -> Path:
    """Recorded capture ``name`` unpacked into ``tmp``: its path."""
    out = tmp / f"{name}.gputrace"
    [(end, opener)] = [(end, opener) for end, opener in PACKED.items() if (DATA / f"{name}{end}").exists()]
    with opener(DATA / f"{name}{end}", "rb") as src, out.open("wb") as dst:
        shutil.copyfileobj(src, dst)
    return out
