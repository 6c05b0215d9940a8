"""Shared test set-up."""

from __future__ import annotations

# ---- Every document the tests produce is valid under its JSON Schema (docs/*.schema.json) ----
# The functions that make reports, comparisons and doctor documents are wrapped before any test module imports
# them, so each document made in the test process (directly, or by an in-process `gputrace report`) is checked
# against the schema generated from gputrace/documents.py. A test that runs gputrace in a subprocess validates
# the JSON it reads itself (gputrace.testing.schemas.validate).
import functools
from collections.abc import Callable
from typing import Any

import gputrace.analysis
import gputrace.analysis.compare
import gputrace.analysis.join
import gputrace.cli.doctor
from gputrace.testing.schemas import validate


def _validated(make: Callable[..., Any], documents: Callable[[Any], list[Any]]) -> Callable[..., Any]:
    @functools.wraps(make)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        out = make(*args, **kwargs)
        for doc in documents(out):
            validate(doc)
        return out

    return wrapper


gputrace.analysis.analyze = _validated(gputrace.analysis.analyze, lambda r: [r])
gputrace.analysis.join.join = _validated(gputrace.analysis.join.join, lambda j: [j.report, *j.parts])
gputrace.analysis.compare.compare = _validated(gputrace.analysis.compare.compare, lambda c: [c])
gputrace.cli.doctor.document = _validated(gputrace.cli.doctor.document, lambda d: [d])
# ---- end of the schema section ----
