"""JSON Schemas of the documents gputrace writes, generated from their types (gputrace/documents.py).

    python -m gputrace.testing.schemas            writes docs/report.schema.json, compare and doctor
    python -m gputrace.testing.schemas --check    exits 1 when a committed schema differs from the types

Each TypedDict becomes an object schema under ``$defs``: its keys as ``properties``, the keys it always has as
``required``, and no other keys (``additionalProperties: false``), so a report with a key of the wrong type, a
key missing or a key the types do not know fails validation. The tests validate every document they produce.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import types
from pathlib import Path
from typing import Annotated, Any, NotRequired, Required, Union, get_args, get_origin, get_type_hints, is_typeddict

from gputrace import documents
from gputrace.documents import OneOf

DRAFT = "https://json-schema.org/draft/2020-12/schema"
DOCS = Path(__file__).resolve().parent.parent.parent / "docs"
# file name in docs/ -> the document's type
DOCUMENTS: dict[str, Any] = {
    "report.schema.json": documents.Report,
    "compare.schema.json": documents.Comparison,
    "doctor.schema.json": documents.Doctor,
}
_SCALARS = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}


class _Builder:
    """Walks a TypedDict and the TypedDicts it holds, collecting each as one ``$defs`` entry."""

    def __init__(self) -> None:
        self.defs: dict[str, dict[str, Any]] = {}

    def typed_dict(self, tp: Any) -> dict[str, Any]:
        name = tp.__name__
        if name not in self.defs:
            self.defs[name] = {}  # placed first: a type that holds itself refers to it
            hints = get_type_hints(tp, include_extras=True)
            props = {key: self.of(_strip(hint)) for key, hint in hints.items()}
            out: dict[str, Any] = {"type": "object"}
            if tp.__doc__ and not tp.__doc__.startswith(f"{name}("):  # not the generated one
                out["description"] = " ".join(tp.__doc__.split()).replace("``", "`")
            out["properties"] = props
            out["required"] = [k for k in hints if k in tp.__required_keys__]
            out["additionalProperties"] = False
            self.defs[name] = out
        return {"$ref": f"#/$defs/{name}"}

    def of(self, tp: Any) -> dict[str, Any]:
        """The schema of one type: a scalar, list, str-keyed dict, union, TypedDict or ``Annotated[str, OneOf]``."""
        origin, args = get_origin(tp), get_args(tp)
        if origin is Annotated:
            base = self.of(args[0])
            for meta in tp.__metadata__:
                if isinstance(meta, OneOf):
                    base = {**base, "enum": list(meta.values)} if len(meta.values) > 1 else {
                        **base, "const": meta.values[0]}
            return base
        if is_typeddict(tp):
            return self.typed_dict(tp)
        if tp in _SCALARS:
            return {"type": _SCALARS[tp]}
        if origin is list:
            return {"type": "array", "items": self.of(args[0])}
        if origin is dict:
            if args[0] is not str:
                raise TypeError(f"a JSON object's keys are strings, not {args[0]}")
            return {"type": "object", "additionalProperties": self.of(args[1])}
        if origin in (Union, types.UnionType):
            return {"anyOf": [self.of(a) for a in args]}
        raise TypeError(f"no JSON Schema for {tp!r}")


def _strip(hint: Any) -> Any:
    """The type under ``NotRequired[...]`` / ``Required[...]`` (what they say is in ``__required_keys__``)."""
    while get_origin(hint) in (NotRequired, Required):
        hint = get_args(hint)[0]
    return hint


def schema(tp: Any) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of one document type."""
    b = _Builder()
    top = b.typed_dict(tp)
    root = b.defs[tp.__name__]
    title = root["properties"]["schema"].get("const", tp.__name__)
    return {"$schema": DRAFT, "title": title, "description": root.get("description", ""), **top,
            "$defs": dict(sorted(b.defs.items()))}


def rendered(tp: Any) -> str:
    """The schema as written to docs/: stable key order, two-space indent, a final newline."""
    return json.dumps(schema(tp), indent=2, ensure_ascii=False) + "\n"


@functools.cache
def _validators() -> dict[str, Any]:
    """A validator per document, by its ``schema`` name ("gputrace.report/1", ...)."""
    import jsonschema

    out = {}
    for tp in DOCUMENTS.values():
        s = schema(tp)
        jsonschema.Draft202012Validator.check_schema(s)
        out[s["title"]] = jsonschema.Draft202012Validator(s)
    return out


def validate(doc: Any) -> None:
    """Raise ``jsonschema.ValidationError`` unless ``doc`` (a report, comparison or doctor document, told apart by
    its ``schema`` key) is valid under its schema as the types give it now. Needs the ``jsonschema`` package (the
    dev extra): for tests."""
    import jsonschema

    validators = _validators()
    name = doc.get("schema") if isinstance(doc, dict) else None
    if name not in validators:
        raise jsonschema.ValidationError(f"not a gputrace document: schema {name!r} is none of {sorted(validators)}")
    error = jsonschema.exceptions.best_match(validators[name].iter_errors(doc))
    if error is not None:
        raise error


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gputrace.testing.schemas", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare with the files in docs/ instead of writing them")
    p.add_argument("--out", type=Path, default=DOCS, help="the folder to write into (default: the repository's docs/)")
    args = p.parse_args(argv)
    stale = []
    for name, tp in DOCUMENTS.items():
        path = args.out / name
        text = rendered(tp)
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(str(path))
            continue
        tmp = path.with_name(f".{name}.tmp")
        tmp.write_text(text)
        tmp.replace(path)
        print(f"Wrote {path}")
    if stale:
        print(f"out of date (run: python -m gputrace.testing.schemas): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
