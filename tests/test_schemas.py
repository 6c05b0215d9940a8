"""The JSON Schemas in docs/ are the ones the document types give, and they reject what is not a valid report."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from gputrace.analysis import analyze
from gputrace.analysis.compare import compare
from gputrace.capture import open_capture
from gputrace.cli.doctor import document
from gputrace.hostcheck import FAIL, OK, Check
from gputrace.testing import schemas
from gputrace.testing.schemas import validate
from gputrace.testing.synth import Builder

DOCS = Path(__file__).resolve().parent.parent / "docs"
TRAINER, WORKER = 100, 200


def _report(tmp_path: Path) -> Any:
    """A report with a storage stall reached through a wait (culprit, evidence, block requests, breakdown)."""
    b = Builder().proc(TRAINER, "python").proc(WORKER, "worker", TRAINER)
    b.device(TRAINER, simulated=True)
    b.op(TRAINER, TRAINER, 0, 0, 10, "fwd")
    b.op(TRAINER, TRAINER, 39.95, 40, 50, "bwd")
    b.syscall(TRAINER, TRAINER, "read", 9, 39.9, "pipe").offcpu(TRAINER, TRAINER, 9, 39.9, "S", 39.8,
                                                                (WORKER, WORKER, "worker"))
    b.syscall(WORKER, WORKER, "pread64", 11, 39, "/data/shard-7.bin", 4 << 20).block(WORKER, WORKER, 11.1, 38.9,
                                                                                     4 << 20)
    with open_capture(b.write(tmp_path / "a.gputrace")) as reader:
        return analyze(reader)  # validated on the way out (tests/conftest.py)


@pytest.mark.parametrize("name", sorted(schemas.DOCUMENTS))
def test_the_committed_schemas_are_what_the_types_give(name: str) -> None:
    assert (DOCS / name).read_text() == schemas.rendered(schemas.DOCUMENTS[name]), (
        f"docs/{name} is out of date: run python -m gputrace.testing.schemas")
    jsonschema.Draft202012Validator.check_schema(json.loads((DOCS / name).read_text()))


def test_check_mode_says_which_schema_is_stale(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert schemas.main(["--out", str(tmp_path)]) == 0
    assert schemas.main(["--check", "--out", str(tmp_path)]) == 0
    (tmp_path / "report.schema.json").write_text("{}\n")
    assert schemas.main(["--check", "--out", str(tmp_path)]) == 1
    assert "report.schema.json" in capsys.readouterr().err


def test_a_real_report_is_valid_and_broken_ones_are_rejected(tmp_path: Path) -> None:
    report = _report(tmp_path)
    stall = report["stalls"][0]
    assert stall["cause"] == "storage" and stall["culprit"]["block_requests"] == 1  # the keys under test are there
    validate(report)
    breakages = {
        "a wrong type": lambda r: r["stalls"][0].update(duration_ns="40 ms"),
        "a bool for an int": lambda r: r["stalls"][0]["culprit"].update(pid=True),
        "a missing required key": lambda r: r["stalls"][0]["culprit"].pop("pid"),
        "a missing top-level key": lambda r: r.pop("summary"),
        "a key the types do not know": lambda r: r["capture"].update(hostname="x"),
        "a cause outside the contract": lambda r: r["stalls"][0].update(cause="disk"),
        "a wrong schema name": lambda r: r.update(schema="gputrace.report/2"),
        "an evidence kind nobody writes": lambda r: r["stalls"][0]["evidence"][0].update(kind="guess"),
        "a null for a string": lambda r: r["devices"][0].update(name=None),
    }
    for what, damage in breakages.items():
        broken = copy.deepcopy(report)
        damage(broken)
        with pytest.raises(jsonschema.ValidationError):
            validate(broken)
            pytest.fail(f"{what} passed validation")


def test_compare_and_doctor_documents_are_valid_and_checked(tmp_path: Path) -> None:
    report = _report(tmp_path)
    doc = compare(report, report)
    validate(doc)
    broken = copy.deepcopy(doc)
    broken["by_cause"][0]["change_points"] = "same"
    with pytest.raises(jsonschema.ValidationError):
        validate(broken)
    doctor = document([Check("bpf() syscall", OK, "works"), Check("tracefs", FAIL, "missing", "mount it", True)])
    validate(doctor)
    assert doctor["ok"] is False
    doctor["checks"][0]["status"] = "MAYBE"
    with pytest.raises(jsonschema.ValidationError):
        validate(doctor)
