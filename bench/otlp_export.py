#!/usr/bin/env python3
"""OTLP export throughput: a report of N stalls (3 evidence spans each) sent to a real in-process receiver.

    .venv/bin/python bench/otlp_export.py [--stalls 5000] [--protocol grpc|http]
"""

from __future__ import annotations

import argparse
import http.server
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any, cast

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from gputrace.capture import CaptureReader, CaptureWriter, host_header
from gputrace.documents import Report
from gputrace.exporters.otlp import OtlpExporter

RECEIVED = [0]


def _count(req: trace_service_pb2.ExportTraceServiceRequest) -> None:
    RECEIVED[0] += sum(len(ss.spans) for rs in req.resource_spans for ss in rs.scope_spans)


class _Grpc(trace_service_pb2_grpc.TraceServiceServicer):
    def Export(self, request: Any, context: Any) -> Any:  # noqa: N802
        _count(request)
        return trace_service_pb2.ExportTraceServiceResponse()


class _Http(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802
        req = trace_service_pb2.ExportTraceServiceRequest()
        req.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
        _count(req)
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def _report(n: int) -> Report:
    def stall(i: int) -> dict[str, Any]:
        t = i * 10_000_000
        ev = {"pid": 2, "tid": 2, "kind": "syscall", "what": "pread64", "start_ns": t, "end_ns": t + 4_000_000}
        return {"device": 0, "start_ns": t, "end_ns": t + 5_000_000, "duration_ns": 5_000_000, "cause": "storage",
                "via": ["wait:pid 2"], "culprit": {"pid": 2, "object": f"/data/{i}.bin"}, "evidence": [ev] * 3}

    # a report's shape with only what the exporter reads of it (the spans it sends): cast, not built in full
    return cast(Report, {"capture": {"start_ns": 0, "end_ns": n * 10_000_000, "pids": [1], "host": "bench"},
                         "devices": [], "summary": {}, "stalls": [stall(i) for i in range(n)]})


def _serve(protocol: str) -> tuple[str, Any]:
    if protocol == "grpc":
        server = grpc.server(futures.ThreadPoolExecutor(2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Grpc(), server)  # type: ignore[no-untyped-call]
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        return f"127.0.0.1:{port}", lambda: server.stop(None)
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Http)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{httpd.server_address[1]}", httpd.shutdown


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stalls", type=int, default=5000)
    ap.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    args = ap.parse_args()
    endpoint, stop = _serve(args.protocol)
    with tempfile.TemporaryDirectory() as tmp:
        path = CaptureWriter(Path(tmp) / "b.gputrace", host_header([])).close({})
        with CaptureReader(path) as reader:
            t0 = time.perf_counter()
            res = OtlpExporter(endpoint, args.protocol, report=_report(args.stalls)).write(reader)
            dt = time.perf_counter() - t0
    stop()
    print(f"{args.protocol}: {res.items:,} spans in {dt:.2f} s = {res.items / dt:,.0f} spans/s, "
          f"dropped {res.dropped}, received {RECEIVED[0]:,}")


if __name__ == "__main__":
    main()
