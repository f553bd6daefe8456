"""A loopback OTLP/gRPC receiver that keeps the spans it is sent: a stand-in for Jaeger.

``bench.gateway --otlp`` points corral's processes at one (``CORRAL_OTLP_ENDPOINT``) to
measure what tracing costs when it is on; the tests use it to check that spans really
leave a process over OTLP. It speaks the collector's ``TraceService.Export`` and keeps
each span's service, name, trace id and parent (up to ``keep`` spans; it counts them
all). ``python -m testkit.otlp_sink [--listen 127.0.0.1:4317]`` runs one in the
foreground and prints what arrives.
"""

from __future__ import annotations

import argparse
import sys
import threading
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from netplumb.addresses import host_of


@dataclass(frozen=True)
class Received:
    """One span as it arrived."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    start_ns: int
    duration_s: float


class Sink(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps (up to ``keep``) and counts the spans exported to it."""

    def __init__(self, keep: int = 100_000, echo: bool = False) -> None:
        self.keep, self.echo = keep, echo
        self.spans: list[Received] = []
        self.count = 0
        self._lock = threading.Lock()

    def Export(self, request: Any, context: grpc.ServicerContext) -> Any:
        """Take one batch of spans."""
        got = []
        for resource_spans in request.resource_spans:
            service = next(
                (
                    a.value.string_value
                    for a in resource_spans.resource.attributes
                    if a.key == "service.name"
                ),
                "",
            )
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    got.append(
                        Received(
                            service,
                            span.name,
                            span.trace_id.hex(),
                            span.span_id.hex(),
                            span.parent_span_id.hex(),
                            span.start_time_unix_nano,
                            (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9,
                        )
                    )
        with self._lock:
            self.count += len(got)
            self.spans.extend(got[: max(0, self.keep - len(self.spans))])
        if self.echo:
            for span in got:
                print(
                    f"{span.service:16} {span.name:32} {span.duration_s * 1000:9.2f} ms  "
                    f"trace {span.trace_id}",
                    flush=True,
                )
        return trace_service_pb2.ExportTraceServiceResponse()


class RunningSink:
    """A sink served on loopback."""

    def __init__(self, server: grpc.Server, port: int, sink: Sink) -> None:
        self.server, self.port, self.sink = server, port, sink
        self.endpoint = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        """Stop serving."""
        self.server.stop(grace=0)


def serve(listen: str = "127.0.0.1:0", *, keep: int = 100_000, echo: bool = False) -> RunningSink:
    """Start a sink on ``listen`` (loopback); returns once it serves."""
    host = host_of(listen)
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"the sink listens on loopback only, not {host}")
    sink = Sink(keep, echo)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port(listen)
    server.start()
    return RunningSink(server, port, sink)


def main(argv: list[str] | None = None) -> int:
    """Serve a sink in the foreground, printing each span."""
    parser = argparse.ArgumentParser(prog="python -m testkit.otlp_sink", description=__doc__)
    parser.add_argument("--listen", default="127.0.0.1:4317")
    args = parser.parse_args(argv)
    running = serve(args.listen, keep=0, echo=True)
    print(f"OTLP sink on {running.endpoint}", flush=True)
    try:
        running.server.wait_for_termination()
    except KeyboardInterrupt:
        running.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
