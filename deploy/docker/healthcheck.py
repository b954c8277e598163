"""Container health check: one grpc.health.v1 Check; exit 0 on SERVING, 1 otherwise.

    python healthcheck.py [--target HOST:PORT] [--service NAME] [--timeout SECONDS]

Docker reads exit 0 as healthy and 1 as unhealthy (2 is reserved), so every failure,
an RPC error included, exits 1. The default target is loopback on the port of
$RETRIEVAL_LISTEN (the address the server binds), so changing the listen port in the
environment does not silently break the check. Needs only the stdlib and the grpcio +
grpcio-health-checking packages the service already depends on.
"""

from __future__ import annotations

import argparse
import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def default_target() -> str:
    listen = os.environ.get("RETRIEVAL_LISTEN", "") or "127.0.0.1:50051"
    port = listen.rsplit(":", 1)[-1]
    return f"127.0.0.1:{port}"


def check(target: str, service: str, timeout: float) -> int:
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            res = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError as err:
            print(f"unhealthy: {target} {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(res.status)
    if res.status == health_pb2.HealthCheckResponse.SERVING:
        print(f"healthy: {target} {status}")
        return 0
    print(f"unhealthy: {target} {status}", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=default_target(), help="HOST:PORT (default: loopback, $RETRIEVAL_LISTEN's port)")
    p.add_argument("--service", default="", help='service name to check ("" = the whole server)')
    p.add_argument("--timeout", type=float, default=3.0, help="RPC deadline in seconds")
    args = p.parse_args(argv)
    return check(args.target, args.service, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
