"""Query latency of an index process whose replicas are all dead.

    python benches/index_dead_replicas_bench.py [--replicas 3] [--seconds 12]

Starts ``python -m pagedkv.index`` with replicas nothing listens for (every
replay, on connect and at each resync, goes unanswered until its timeout), sends
``longest_prefix`` queries back to back for ``--seconds`` and prints the
median, p99 and worst latency.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import msgspec
import zmq


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--seconds", type=float, default=12.0)
    args = p.parse_args()
    cmd = [sys.executable, "-m", "pagedkv.index", "--query", "tcp://127.0.0.1:*", "--allow-stop"]
    for i in range(args.replicas):
        cmd += ["--replica", f"dead{i}=tcp://127.0.0.1:{9 + 2 * i},tcp://127.0.0.1:{10 + 2 * i}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    endpoint = json.loads(proc.stdout.readline())["query_endpoint"]
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    query = msgspec.msgpack.encode({"op": "longest_prefix", "block_hashes": [1, 2, 3]})
    latencies = []
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        sock.send(query)
        sock.recv()
        latencies.append((time.perf_counter() - t0) * 1000.0)
    sock.send(msgspec.msgpack.encode({"op": "stop"}))
    sock.recv()
    sock.close(0)
    proc.wait(10)
    latencies.sort()
    p99 = latencies[int(len(latencies) * 0.99)]
    print(
        f"{len(latencies)} queries over {args.seconds:g} s with {args.replicas} dead replicas: "
        f"median {statistics.median(latencies):.2f} ms, p99 {p99:.2f} ms, "
        f"max {latencies[-1]:.2f} ms"
    )


if __name__ == "__main__":
    main()
