"""KV events over ZeroMQ with vLLM's protocol: a publisher and a gap-filling subscriber.

Protocol (vLLM's ``ZmqEventPublisher``):

- a PUB socket sends one three-frame message per batch:
  ``(topic, sequence as 8-byte big-endian, msgpack KVEventBatch)``; sequences
  start at 0 and grow by one per batch;
- an optional ROUTER "replay" socket: a client sends ``(b"", start_seq as 8
  bytes big-endian)`` and receives ``(b"", topic, seq, payload)`` for every
  buffered batch with ``seq >= start_seq``, then ``(b"", b"", -1 as 8 signed
  bytes, b"")`` (vLLM 0.33's framing; the subscriber also takes the older
  three-frame ``(b"", seq, payload)``);
- the PUB endpoint binds when it contains ``*`` or ``::`` or is ``ipc://`` /
  ``inproc://``, and connects otherwise.

The publisher converts, encodes and sends on its own thread: the scheduler
thread only enqueues the events it drained (``publish_from(manager)`` costs one
crossing into the core and a queue put). The queue, the replay buffer and the
socket high-water marks are bounded.

The subscriber checks sequences: a duplicate is dropped, a jump triggers a
replay request from the first missing sequence, and what the publisher no
longer buffers is reported as lost. A new subscriber asks for a replay from 0
on connect, so it starts with everything the publisher still buffers.

Requires the ``events`` extra (``msgspec``, ``pyzmq``).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import zmq

from .wire import HashFormat, KVEventBatch, KVEventEncoder, decode_batch_lenient

__all__ = [
    "DEFAULT_ENDPOINT",
    "END_SEQ",
    "Received",
    "ZmqEventPublisher",
    "ZmqEventSubscriber",
    "offset_endpoint_port",
]

END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: The publisher's default PUB endpoint: bound on loopback only.
DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"


class _EventSource(Protocol):
    def take_events(self) -> list[Any]: ...


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """vLLM's per-rank endpoint: the TCP port plus the rank, ``inproc://x_dp<rank>``."""
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{data_parallel_rank}"
    if "tcp" in endpoint:
        base, sep, port = endpoint.rpartition(":")
        if not sep:
            return endpoint
        return f"{base}:{int(port) + data_parallel_rank}"
    raise ValueError("endpoint must be tcp:// or inproc://")


def _binds(endpoint: str) -> bool:
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


_Item = tuple[float, Any]  # (ts, events or a ready KVEventBatch)


class ZmqEventPublisher:
    """Publishes KV-event batches on a PUB socket, with an optional replay ROUTER.

    Args:
        endpoint: PUB address. The default, ``tcp://127.0.0.1:5557``, binds on
            loopback only (events carry prompt token ids and cache salts);
            ``tcp://*:5557`` binds every interface; any other ``tcp://host:port``
            connects (to a proxy), as in vLLM.
        replay_endpoint: ROUTER address for replay requests (always bound), or None.
        buffer_steps: batches kept for replay.
        hwm: send high-water mark of the PUB socket (messages a slow subscriber
            may queue before the socket drops for it) and of replay streams.
        max_queue_size: batches waiting to be encoded. When it is full,
            ``publish`` waits up to ``publish_timeout`` seconds, then drops the
            batch (``num_dropped``) and skips its sequence number, so subscribers
            see the gap and know events were lost.
        topic: first frame of every message.
        data_parallel_rank: stamped on batches; offsets the endpoint ports.
        hash_format: ``"int"`` (vLLM's default) or ``"bytes"``.
        replay_send_timeout: seconds a replay stream may make no progress (its
            client not reading) before it is abandoned (``num_replay_abandoned``).
            Replay sends never wait: streams advance as their clients read, and
            live publishing goes on meanwhile.
        publish_timeout: the longest ``publish`` waits for room in the queue.

    A batch that cannot be encoded (not a KV event, a raw-digest format over
    integer hashes) is skipped without a sequence number; the error is kept in
    ``error`` and raised (once) by the next ``publish`` or ``flush``.
        bind: bind (True) or connect (False) the PUB socket; None decides as vLLM
            does, from the endpoint.
    """

    SHUTDOWN_TIMEOUT: float = 2.0
    #: Replay streams served at once (the oldest is abandoned past it).
    MAX_REPLAY_STREAMS: int = 64

    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:5557",  # DEFAULT_ENDPOINT
        replay_endpoint: str | None = None,
        *,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        topic: str = "",
        data_parallel_rank: int = 0,
        hash_format: HashFormat = "int",
        replay_send_timeout: float = 5.0,
        publish_timeout: float = 1.0,
        bind: bool | None = None,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        if buffer_steps <= 0 or max_queue_size <= 0 or hwm < 0:
            raise ValueError("buffer_steps and max_queue_size must be positive, hwm >= 0")
        self._encoder = KVEventEncoder(
            hash_format=hash_format, data_parallel_rank=data_parallel_rank
        )
        self._queue: queue.Queue[_Item | None] = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._ctx = context or zmq.Context.instance()
        self._endpoint = offset_endpoint_port(endpoint, data_parallel_rank)
        self._replay_endpoint = offset_endpoint_port(replay_endpoint, data_parallel_rank)
        self._hwm = hwm
        # The default endpoint is bound (on loopback), not connected to.
        self._bind = True if bind is None and endpoint == DEFAULT_ENDPOINT else bind
        self._replay_send_timeout_ms = int(replay_send_timeout * 1000)
        self._topic = topic.encode()
        self._next_seq = 0
        self._lock = threading.Lock()  # guards the counters read by other threads
        self.num_published = 0
        self.num_replay_requests = 0
        self.num_replayed = 0
        self.num_replay_abandoned = 0
        self.num_dropped = 0
        self.num_failed = 0
        self._publish_timeout = publish_timeout
        # Replay streams in progress: client id -> [next sequence, last progress].
        self._streams: dict[bytes, list[Any]] = {}
        self._dropped_pending = 0  # sequence numbers to skip before the next batch
        self.error: BaseException | None = None
        self._error_raised = True
        self.bound_endpoint: str | None = None
        self.bound_replay_endpoint: str | None = None
        # A pipe wakes the thread as soon as something is queued (no polling delay).
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._running = True
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="pagedkv-zmq-pub")
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            self._close_pipe()
            raise self._error

    # -- scheduler side -------------------------------------------------------------

    def publish(self, events: Iterable[Any] | KVEventBatch, ts: float | None = None) -> None:
        """Queues one batch: events in any form :func:`pagedkv.events.wire.to_wire` accepts,
        or a ready ``KVEventBatch``. Conversion and encoding happen on the
        publisher thread. Blocks while the queue is full."""
        if not self._running:
            raise RuntimeError("publisher is closed")
        self._raise_error()
        if not isinstance(events, KVEventBatch):
            events = list(events)
        try:
            self._queue.put(
                (time.time() if ts is None else ts, events), timeout=self._publish_timeout
            )
        except queue.Full:
            with self._lock:
                self.num_dropped += 1
                self._dropped_pending += 1
        self._wake()

    def _raise_error(self) -> None:
        """Raises (once) an encoding error the publisher thread met."""
        with self._lock:
            if self._error_raised or self.error is None:
                return
            self._error_raised = True
            err = self.error
        raise RuntimeError(f"a KV-event batch could not be published: {err}") from err

    def publish_from(self, manager: _EventSource) -> int:
        """Drains a manager's events and queues them as one batch (nothing when
        there are none, as vLLM's scheduler does). Returns the number of events."""
        events = manager.take_events()
        if events:
            self.publish(events)
        return len(events)

    def flush(self, timeout: float = 10.0) -> bool:
        """Waits until every queued batch has been sent; False on timeout."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if time.monotonic() > deadline or not self._thread.is_alive():
                return False
            time.sleep(0.001)
        self._raise_error()
        return True

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch will get."""
        return self._next_seq

    def close(self) -> None:
        """Sends what is queued (up to ``SHUTDOWN_TIMEOUT``), stops the thread, closes
        the sockets."""
        if not self._running:
            return
        self.flush(self.SHUTDOWN_TIMEOUT)
        self._running = False
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(None)
        self._wake()
        self._thread.join(self.SHUTDOWN_TIMEOUT)
        self._close_pipe()

    shutdown = close

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"\0")

    def _close_pipe(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    # -- publisher thread -----------------------------------------------------------

    def _run(self) -> None:
        pub: zmq.Socket[Any] | None = None
        replay: zmq.Socket[Any] | None = None
        try:
            pub = self._ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, self._hwm)
            pub.setsockopt(zmq.LINGER, 0)
            if self._endpoint is not None:
                if self._bind if self._bind is not None else _binds(self._endpoint):
                    pub.bind(self._endpoint)
                    self.bound_endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
                else:
                    pub.connect(self._endpoint)
                    self.bound_endpoint = self._endpoint
            if self._replay_endpoint is not None:
                replay = self._ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.SNDHWM, self._hwm)
                replay.setsockopt(zmq.LINGER, 0)
                # A full client queue is an error (EAGAIN), not a silent drop.
                replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
                replay.bind(self._replay_endpoint)
                self.bound_replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException as e:  # reported to the constructor
            self._error = e
            for s in (pub, replay):
                if s is not None:
                    s.close(0)
            self._started.set()
            return
        self._started.set()
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if replay is not None:
            poller.register(replay, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll(1 if self._streams else 100))
                if self._wake_r in ready:
                    with contextlib.suppress(BlockingIOError, OSError):
                        os.read(self._wake_r, 65536)
                if not self._drain(pub):
                    break
                if replay is not None:
                    if replay in ready:
                        self._service_replay(replay)
                    if self._streams:
                        self._pump_replays(replay)
        finally:
            pub.close(0)
            if replay is not None:
                replay.close(0)

    def _drain(self, pub: zmq.Socket[Any]) -> bool:
        """Sends everything queued; False once the stop sentinel is reached."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return True
            try:
                if item is None:
                    return False
                ts, events = item
                try:
                    if isinstance(events, KVEventBatch):
                        if events.data_parallel_rank is None:
                            events.data_parallel_rank = self._encoder.data_parallel_rank
                        payload = self._encoder.encode(events)
                    else:
                        payload = self._encoder.encode_events(events, ts)
                except Exception as e:  # the caller hears of it on its next call
                    with self._lock:
                        self.num_failed += 1
                        self.error = e
                        self._error_raised = False
                    continue
                with self._lock:
                    # Batches dropped on a full queue leave a gap subscribers see.
                    seq = self._next_seq + self._dropped_pending
                    self._dropped_pending = 0
                pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), copy=False)
                self._buffer.append((seq, payload))
                with self._lock:
                    self._next_seq = seq + 1
                    self.num_published += 1
            except zmq.ZMQError:
                time.sleep(0.01)  # a transient socket error: do not spin
            finally:
                self._queue.task_done()

    def _service_replay(self, replay: zmq.Socket[Any]) -> None:
        """Takes the waiting replay requests: each starts (or restarts) a stream."""
        while True:
            try:
                frames = replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3:
                continue
            client, _, start = frames
            if len(start) != 8:
                continue
            self.num_replay_requests += 1
            self._streams.pop(client, None)
            if len(self._streams) >= self.MAX_REPLAY_STREAMS:
                # The oldest stream goes; its client may ask again.
                self._streams.pop(next(iter(self._streams)))
                self.num_replay_abandoned += 1
            self._streams[client] = [int.from_bytes(start, "big", signed=True), time.monotonic()]

    def _pump_replays(self, replay: zmq.Socket[Any]) -> None:
        """Sends each stream what its client's queue takes now, never waiting: a
        stream that makes no progress for ``replay_send_timeout`` is abandoned,
        and live publishing never waits on a replay client."""
        now = time.monotonic()
        topic = self._topic
        for client, state in list(self._streams.items()):
            cursor, last_progress = state
            buf = self._buffer
            try:
                for i in range(_first_at_or_after(buf, cursor), len(buf)):
                    seq, payload = buf[i]
                    replay.send_multipart(
                        (client, b"", topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK
                    )
                    self.num_replayed += 1
                    state[0] = cursor = seq + 1
                    state[1] = last_progress = now
                replay.send_multipart((client, b"", b"", END_SEQ, b""), zmq.NOBLOCK)
                del self._streams[client]
            except zmq.Again:
                if now - last_progress > self._replay_send_timeout_ms / 1000:
                    del self._streams[client]
                    self.num_replay_abandoned += 1
            except zmq.ZMQError:
                del self._streams[client]  # the client went away
                self.num_replay_abandoned += 1


def _first_at_or_after(buf: deque[tuple[int, bytes]], seq: int) -> int:
    """Index of the first buffered batch with a sequence >= ``seq`` (sequences
    grow along the buffer): a stream resumes there without rescanning."""
    lo, hi = 0, len(buf)
    while lo < hi:
        mid = (lo + hi) // 2
        if buf[mid][0] < seq:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _seq(frame: bytes) -> int | None:
    """A sequence frame: 8 bytes big-endian, below 2**63 (vLLM's signed int64;
    -1 is the replay end marker). None for anything else."""
    if len(frame) != 8:
        return None
    seq = int.from_bytes(frame, "big")
    return seq if seq < 1 << 63 else None


@dataclass(frozen=True)
class Received:
    """One delivered batch.

    ``replayed``: it came from the replay socket. ``lost_before``: batches
    before it that the publisher no longer had (0 normally). ``reset``: the
    publisher restarted before this batch, so everything learnt from it
    earlier is stale.
    """

    seq: int
    batch: KVEventBatch
    replayed: bool = False
    lost_before: int = 0
    reset: bool = False


class ZmqEventSubscriber:
    """Receives KV-event batches in sequence order, filling gaps by replay.

    Replays never block: a request is sent and its answer delivered by the
    polls that follow, live batches arriving meanwhile kept until it ends (at
    most ``MAX_HELD``), and a replay unanswered for ``replay_timeout`` is given
    up (``num_replay_timeouts``; what it did not fill counts as lost). A dead
    publisher therefore costs its subscriber nothing but a request per
    ``resync_interval``.

    Args:
        endpoint: the publisher's PUB address (connected).
        replay_endpoint: its replay ROUTER address, or None (gaps are then only
            counted).
        topic: subscription prefix.
        start_seq: the first sequence wanted. 0 (default) replays everything the
            publisher still buffers on connect; None starts at the first live batch.
        replay_timeout: seconds a replay may go without a message before it is
            given up.
        resync_interval: with no live batch for this long, ``poll`` asks the
            replay socket for anything newer (a tail dropped by a high-water mark
            or published before the subscription took effect). None: never.
        rcvhwm: receive high-water mark of the SUB socket.

    One publisher's live sequences only grow. A live batch whose sequence is not
    above the last live one means a new publisher (a restart), whatever the
    timestamps say: the next batch delivered has ``reset=True``. A live batch
    below the expected sequence but above the last live one is the live copy of a
    batch a replay already delivered: a duplicate. Before any live batch was seen
    (everything so far came by replay), a batch below the expected sequence that
    is newer than the last one delivered is taken as a restart.

    Counters: ``num_received`` (live), ``num_duplicates``, ``num_gaps``,
    ``num_replayed``, ``num_lost``, ``num_restarts``; ``next_seq`` is the next
    sequence expected. Hostile input is refused, never raised: a message that is
    not ``(topic, 8-byte sequence below 2**63, payload)`` is dropped
    (``num_malformed``); a batch that does not decode is refused whole, its
    sequence consumed (``num_rejected``, ``last_error``); events of a type this
    version does not know are skipped (``num_unknown_events``).
    """

    #: Live batches kept while a replay is in progress (past it, the replay is
    #: given up).
    MAX_HELD: int = 100_000

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        start_seq: int | None = 0,
        replay_timeout: float = 5.0,
        resync_interval: float | None = 1.0,
        rcvhwm: int = 1_000_000,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self._ctx = context or zmq.Context.instance()
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.sub = self._ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, rcvhwm)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.connect(endpoint)
        self._replay: zmq.Socket[Any] | None = None
        self._replay_timeout_ms = int(replay_timeout * 1000)
        self._resync_interval = resync_interval
        self._last_activity = time.monotonic()
        self.next_seq: int | None = start_seq
        self._catch_up = start_seq is not None and replay_endpoint is not None
        self._last_live: int | None = None
        self._last_ts: float | None = None
        # A replay in progress: the deadline for its next message, or None.
        self._replay_pending: float | None = None
        # Live batches that arrived during a replay, delivered after it.
        self._held: list[tuple[int, bytes]] = []
        self.num_replay_timeouts = 0
        # When the publisher was last heard from (a live or replayed message).
        self.last_heard = time.monotonic()
        self._pending_lost = 0
        self._pending_reset = False
        self.num_received = 0
        self.num_duplicates = 0
        self.num_gaps = 0
        self.num_replayed = 0
        self.num_lost = 0
        self.num_restarts = 0
        self.num_malformed = 0
        self.num_rejected = 0
        self.num_unknown_events = 0
        self.last_error: str | None = None

    def close(self) -> None:
        self.sub.close(0)
        if self._replay is not None:
            self._replay.close(0)
            self._replay = None

    def __enter__(self) -> ZmqEventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def poll(self, timeout: float = 0.0, max_batches: int = 10_000) -> list[Received]:
        """Batches that arrived, in sequence order, gaps filled by replay where the
        publisher still buffers them. Waits up to ``timeout`` seconds for the
        first live message; never waits on the replay socket (a replay in
        progress advances by what has arrived, and one unanswered past
        ``replay_timeout`` is given up). Reads at most ``max_batches`` messages
        from each socket per call."""
        out: list[Received] = []
        if self._catch_up:
            self._catch_up = False
            self.sync(out)
        self._advance_replay(out, max_batches)
        wait = 0 if self._replay_pending is not None else int(timeout * 1000)
        if not self.sub.poll(wait):
            if (
                self._replay_pending is None
                and self._resync_interval is not None
                and time.monotonic() - self._last_activity > self._resync_interval
            ):
                self.sync(out)
            return out
        self._last_activity = self.last_heard = time.monotonic()
        for _ in range(max_batches):
            try:
                frames = self.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            seq = _seq(frames[1]) if len(frames) == 3 else None
            if seq is None:
                self.num_malformed += 1
                continue
            self._on_live(seq, frames[2], out)
        return out

    def sync(self, out: list[Received] | None = None) -> list[Received]:
        """Asks the replay socket for every batch from ``next_seq`` on (from the
        oldest buffered one when nothing was received yet); what has already
        arrived is delivered now, the rest by the following polls."""
        out = [] if out is None else out
        self._last_activity = time.monotonic()
        if self._replay_pending is None:
            self._request_replay(0 if self.next_seq is None else self.next_seq)
            self._advance_replay(out, 10_000)
        return out

    def _decode(self, payload: bytes) -> KVEventBatch | None:
        """The batch, or None for a payload that is not one (counted)."""
        try:
            batch, unknown = decode_batch_lenient(payload)
        except (msgspec.DecodeError, ValueError, TypeError) as e:
            self.num_rejected += 1
            self.last_error = f"{type(e).__name__}: {e}"
            return None
        self.num_unknown_events += unknown
        return batch

    def _deliver(
        self, seq: int, batch: KVEventBatch | None, out: list[Received], replayed: bool
    ) -> None:
        if batch is None:
            # Refused: the sequence is consumed, nothing is delivered.
            self.next_seq = seq + 1
            return
        out.append(
            Received(
                seq, batch, replayed, lost_before=self._pending_lost, reset=self._pending_reset
            )
        )
        self._pending_lost = 0
        self._pending_reset = False
        self._last_ts = batch.ts
        self.next_seq = seq + 1

    def _lost(self, first: int, end: int) -> None:
        self.num_lost += end - first
        self._pending_lost += end - first
        self.next_seq = end

    def _on_live(self, seq: int, payload: bytes, out: list[Received]) -> None:
        self.num_received += 1
        if self.next_seq is None:
            self.next_seq = seq
        last_live, self._last_live = self._last_live, seq
        batch: KVEventBatch | None = None
        restarted = last_live is not None and seq <= last_live
        if not restarted and seq < self.next_seq:
            # Below what was delivered: the live copy of a replayed batch, or,
            # with no live batch seen yet to compare with, a restarted publisher
            # whose batch is newer than the last one delivered.
            if last_live is None:
                batch = self._decode(payload)
                restarted = (
                    batch is not None and self._last_ts is not None and batch.ts > self._last_ts
                )
            if not restarted:
                self.num_duplicates += 1
                return
        if restarted:
            self.num_restarts += 1
            self._pending_reset = True
            self.next_seq = 0
        if self._replay_pending is not None:
            # A replay is filling what came before: keep this one for after it.
            self._hold(seq, payload, out)
            return
        if seq > self.next_seq:
            self.num_gaps += 1
            if self.replay_endpoint is not None:
                self._request_replay(self.next_seq)
                self._hold(seq, payload, out)
                return
            self._lost(self.next_seq, seq)
        self._deliver(seq, self._decode(payload) if batch is None else batch, out, False)

    def _hold(self, seq: int, payload: bytes, out: list[Received]) -> None:
        """Keeps a live batch until the replay in progress ends (bounded: past
        ``MAX_HELD`` the replay is given up)."""
        self._held.append((seq, payload))
        if len(self._held) > self.MAX_HELD:
            self._end_replay(out)

    def _replay_socket(self) -> zmq.Socket[Any] | None:
        if self.replay_endpoint is None:
            return None
        if self._replay is None:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVHWM, 0)
            s.connect(self.replay_endpoint)
            self._replay = s
        return self._replay

    @property
    def replaying(self) -> bool:
        """A replay is in progress (its answer arrives over the next polls)."""
        return self._replay_pending is not None

    def _request_replay(self, start: int) -> None:
        """Asks for every buffered batch from ``start`` (answered over later polls)."""
        sock = self._replay_socket()
        if sock is None:
            return
        try:
            sock.send_multipart((b"", start.to_bytes(8, "big")), zmq.NOBLOCK)
        except zmq.Again:
            # Requests to an unreachable publisher piled up: start afresh later.
            sock.close(0)
            self._replay = None
            self.num_replay_timeouts += 1
            return
        self._replay_pending = time.monotonic() + self._replay_timeout_ms / 1000

    def _advance_replay(self, out: list[Received], max_batches: int) -> None:
        """Delivers the replayed batches that have arrived; ends the replay at its
        end marker, or gives it up past its deadline."""
        if self._replay_pending is None or self._replay is None:
            return
        sock = self._replay
        for _ in range(max_batches):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self.last_heard = time.monotonic()
            self._replay_pending = self.last_heard + self._replay_timeout_ms / 1000
            if len(frames) == 4:  # vLLM 0.33: (b"", topic, seq, payload)
                _, _, seq_bytes, payload = frames
            elif len(frames) == 3:  # (b"", seq, payload)
                _, seq_bytes, payload = frames
            else:
                self.num_malformed += 1
                continue
            if seq_bytes == END_SEQ:
                self._end_replay(out)
                return
            seq = _seq(seq_bytes)
            if seq is None:
                self.num_malformed += 1
                continue
            if self.next_seq is None:
                self.next_seq = seq
            if seq < self.next_seq:
                continue
            if seq > self.next_seq:
                self._lost(self.next_seq, seq)
            self.num_replayed += 1
            self._deliver(seq, self._decode(payload), out, True)
        if time.monotonic() > self._replay_pending:
            # No answer: drop the socket so a late stream cannot be mistaken for
            # the answer to a later request.
            sock.close(0)
            self._replay = None
            self.num_replay_timeouts += 1
            self._end_replay(out)

    def _end_replay(self, out: list[Received]) -> None:
        """Ends the replay in progress and delivers the live batches kept during
        it, in order: what the replay delivered is a duplicate, what it could not
        fill is lost."""
        self._replay_pending = None
        held, self._held = self._held, []
        for seq, payload in held:
            if self.next_seq is None:
                self.next_seq = seq
            if seq < self.next_seq:
                self.num_duplicates += 1
                continue
            if seq > self.next_seq:
                self._lost(self.next_seq, seq)
            self._deliver(seq, self._decode(payload), out, False)
