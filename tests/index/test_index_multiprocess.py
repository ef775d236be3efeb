"""Several real processes on loopback: replicas publishing KV events over ZMQ and a
prefix-index process answering queries; the index process is killed and restarted
and replay restores its view with nothing lost."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")

EVENTS_PER_REPLICA = 50_000

# One serving replica: a manager under a prefix-sharing workload with a small pool
# (so blocks are evicted all the time), publishing one batch per step.
REPLICA = r"""
import json, random, sys
import pagedkv as pk
from pagedkv.index import request_block_hashes
from pagedkv.events.zmq import ZmqEventPublisher

name, target, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
spec = pk.FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float32")
cfg = pk.KVCacheConfig(num_blocks=96, kv_cache_groups=[pk.KVCacheGroupSpec(["l"], spec)])
mgr = pk.KVCacheManager(cfg, max_model_len=4096, enable_kv_cache_events=True)
rng = random.Random(name)
shared = random.Random(1)
prefixes = [[shared.randrange(60_000) for _ in range(40)] for _ in range(6)]
pub = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=100_000)
print(json.dumps({"pub": pub.bound_endpoint, "replay": pub.bound_replay_endpoint}), flush=True)

def run(events_goal):
    n = 0
    step = 0
    while n < events_goal:
        for _ in range(4):
            rid = f"{name}-{run.k}"
            run.k += 1
            p = rng.choice(prefixes)[: rng.randrange(4, 41)]
            prompt = p + [rng.randrange(60_000) for _ in range(rng.randrange(1, 40))]
            mgr.add_request(rid, prompt)
            hit = mgr.get_computed_blocks(rid)
            c = hit.num_computed_tokens
            mgr.allocate_slots(rid, len(prompt) - c, num_computed_tokens=0,
                               num_new_computed_tokens=c, new_computed_blocks=hit)
            mgr.remove_request(rid)
        if step % 97 == 96:
            assert mgr.reset_prefix_cache()
        n += pub.publish_from(mgr)
        step += 1
    return n
run.k = 0

assert sys.stdin.readline().strip() == "go"
total = run(target // 2)
print("HALF", flush=True)
assert sys.stdin.readline().strip() == "continue"
total += run(target - total)
assert pub.flush()
counts = {}
for bid in range(mgr.num_blocks):
    key = mgr.cached_block_hash(bid)
    if key is not None:
        k = (int.from_bytes(key[0][-8:], "big"), key[1])
        counts[k] = counts.get(k, 0) + 1
probes = []
for p in prefixes:
    mgr.add_request("probe", p + [1])
    probes.append(mgr.get_computed_blocks("probe").num_computed_tokens // 4)
    mgr.remove_request("probe")
json.dump({"entries": sorted([h, g, n] for (h, g), n in counts.items()), "events": total,
           "next_seq": pub.next_seq, "probes": probes,
           "probe_hashes": [[int.from_bytes(h[-8:], "big") for h in
                             request_block_hashes(p + [1], 4)] for p in prefixes]},
          open(out, "w"))
print("DONE", flush=True)
sys.stdin.readline()
pub.close()
"""


def _spawn(args: list[str]) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [sys.executable, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )


def _expect(proc: subprocess.Popen[str], want: str | None = None) -> str:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line, f"process {proc.args} exited with {proc.poll()}"
    if want is not None:
        assert line.strip() == want
    return line


def _send(proc: subprocess.Popen[str], text: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(text + "\n")
    proc.stdin.flush()


class IndexClient:
    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.REQ)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def ask(self, **req: Any) -> Any:
        self.sock.send(msgspec.msgpack.encode(req))
        assert self.sock.poll(20_000), "index process did not answer"
        return msgspec.msgpack.decode(self.sock.recv())

    def close(self) -> None:
        self.sock.close(0)


def _start_index(replicas: dict[str, dict[str, str]]) -> tuple[subprocess.Popen[str], IndexClient]:
    args = ["-m", "pagedkv.index", "--query", "tcp://127.0.0.1:*", "--allow-stop"]
    for name, ep in replicas.items():
        args += ["--replica", f"{name}={ep['pub']},{ep['replay']}"]
    proc = _spawn(args)
    return proc, IndexClient(json.loads(_expect(proc))["query_endpoint"])


def test_replicas_publish_and_a_restarted_index_replays_everything(tmp_path: Path) -> None:
    names = ["replica-a", "replica-b"]
    outs = {n: tmp_path / f"{n}.json" for n in names}
    replicas = {n: _spawn(["-c", REPLICA, n, str(EVENTS_PER_REPLICA), str(outs[n])]) for n in names}
    procs = list(replicas.values())
    try:
        endpoints = {n: json.loads(_expect(p)) for n, p in replicas.items()}
        index, client = _start_index(endpoints)
        procs.append(index)
        for p in replicas.values():
            _send(p, "go")
        for p in replicas.values():
            _expect(p, "HALF")
        # The index is following; kill it without warning mid-stream.
        deadline = time.monotonic() + 30
        while client.ask(op="status")["events"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        index.send_signal(signal.SIGKILL)
        index.wait()
        client.close()
        # The replicas publish the second half while no index is listening.
        for p in replicas.values():
            _send(p, "continue")
        for p in replicas.values():
            _expect(p, "DONE")
        truth = {n: json.loads(outs[n].read_text()) for n in names}
        total = sum(t["events"] for t in truth.values())
        assert total >= 2 * EVENTS_PER_REPLICA

        index, client = _start_index(endpoints)
        procs.append(index)
        deadline = time.monotonic() + 60
        while True:
            status = client.ask(op="status")
            if all(status["replicas"][n]["next_seq"] == truth[n]["next_seq"] for n in names):
                break
            assert time.monotonic() < deadline, status
            time.sleep(0.05)
        # Replayed from sequence 0: every event applied once, nothing lost.
        assert status["events"] == total
        for n in names:
            st = status["replicas"][n]
            assert st["lost"] == 0 and st["replayed"] == truth[n]["next_seq"]
            got = client.ask(op="entries", replica=n)
            assert [list(e) for e in got] == truth[n]["entries"]
        assert status["stats"]["unknown_removals"] == 0
        # Queries agree with each replica's own prefix-cache lookups.
        for i, hashes in enumerate(truth[names[0]]["probe_hashes"]):
            reply = client.ask(op="longest_prefix", block_hashes=hashes)
            lengths = {n: truth[n]["probes"][i] for n in names}
            assert reply["lengths"] == lengths
            best = max(lengths.values())
            assert reply["num_blocks"] == best
            assert reply["replica"] == (
                None if best == 0 else next(n for n in names if lengths[n] == best)
            )
        assert client.ask(op="stop") == {"ok": True}
        index.wait(10)
        client.close()
    finally:
        for p in procs:
            if p.poll() is None:
                if p.stdin is not None:
                    p.stdin.close()
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            # Every pipe is closed here, not left to the garbage collector.
            for stream in (p.stdin, p.stdout):
                if stream is not None:
                    with contextlib.suppress(BrokenPipeError):
                        stream.close()


# A replica that publishes one small batch every 20 ms on the endpoints it is
# given (tcp://127.0.0.1:* the first time), until killed.
TICKER = r"""
import json, sys, time
import pagedkv as pk
from pagedkv.events.zmq import ZmqEventPublisher

pub_ep, replay_ep, first_hash = sys.argv[1], sys.argv[2], int(sys.argv[3])
deadline = time.monotonic() + 10
while True:  # a restarted replica rebinds the ports its predecessor held
    try:
        pub = ZmqEventPublisher(pub_ep, replay_ep, bind=True)
        break
    except Exception:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
print(json.dumps({"pub": pub.bound_endpoint, "replay": pub.bound_replay_endpoint}), flush=True)
# Subscribers (re)connect before the first batch: a restart first seen after the
# new sequence has passed the old one cannot be told from a gap (vLLM's
# protocol carries no publisher identity).
time.sleep(1.0)
h = first_hash
while True:
    pub.publish([pk.BlockStored([h], None, [1, 2], 2, None, group_idx=0)])
    h += 1
    time.sleep(0.02)
"""


def _ticker(pub: str, replay: str, first_hash: int) -> subprocess.Popen[str]:
    return _spawn(["-c", TICKER, pub, replay, str(first_hash)])


def test_a_killed_replica_goes_stale_and_its_restart_is_detected() -> None:
    live = _ticker("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", 1_000)
    dead = _ticker("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", 2_000)
    procs = [live, dead]
    try:
        endpoints = {"live": json.loads(_expect(live)), "dead": json.loads(_expect(dead))}
        args = ["-m", "pagedkv.index", "--query", "tcp://127.0.0.1:*", "--allow-stop"]
        args += ["--stale-after", "1"]
        for name, ep in endpoints.items():
            args += ["--replica", f"{name}={ep['pub']},{ep['replay']}"]
        index = _spawn(args)
        procs.append(index)
        client = IndexClient(json.loads(_expect(index))["query_endpoint"])
        deadline = time.monotonic() + 30
        while not all(client.ask(op="status")["replicas"][n]["blocks"] for n in endpoints):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        dead.send_signal(signal.SIGKILL)
        dead.wait()
        # Queries keep answering fast while the dead replica's resyncs go unanswered.
        worst = 0.0
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            t0 = time.monotonic()
            reply = client.ask(op="longest_prefix", block_hashes=[1_000])
            worst = max(worst, time.monotonic() - t0)
        # Blocking on the dead replica's replays took >= 5 s per query; the
        # figure (under 100 ms) is in docs/reliability.md. Loose here: CI is loaded.
        assert worst < 1.0
        assert reply["stale"] == ["dead"] and reply["replica"] == "live"
        held = client.ask(op="status")["replicas"]["dead"]["blocks"]
        assert held > 0  # kept, flagged stale
        # The replica comes back on the same endpoints, its sequence from 0 again.
        back = _ticker(endpoints["dead"]["pub"], endpoints["dead"]["replay"], 5_000)
        procs.append(back)
        _expect(back)
        deadline = time.monotonic() + 30
        while True:
            st = client.ask(op="status")["replicas"]["dead"]
            new_blocks = [e for e in client.ask(op="entries", replica="dead") if e[0] >= 5_000]
            if st["restarts"] == 1 and not st["stale"] and new_blocks:
                break
            assert time.monotonic() < deadline, st
            time.sleep(0.05)
        # The restart cleared what the old process held before the new one's
        # blocks were applied.
        assert not client.ask(op="longest_prefix", block_hashes=[2_000])["lengths"]["dead"]
        assert client.ask(op="stop") == {"ok": True}
        index.wait(10)
        client.close()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=10)
