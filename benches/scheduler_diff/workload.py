"""The inputs both sides share: the requests of a run and the fake model's outputs.

Every draw is a function of the seed, the request id and the token position,
never of Python's hash seed, so both sides (and every process) see the same.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .cases import Case

#: Tokens the fake model samples from (opt-125m's vocabulary is 50272).
VOCAB = 1000
EOS_TOKEN_ID = 2
STOP_TOKEN_ID = 3


def mix(*parts: object) -> int:
    """A stable 32-bit hash of ``parts`` (the same in every process)."""
    return zlib.crc32("/".join(map(str, parts)).encode())


class Rng:
    """A small seeded generator whose draws do not depend on Python's hash seed."""

    def __init__(self, *seed: object) -> None:
        import random

        self._r = random.Random(mix(*seed))

    def randint(self, a: int, b: int) -> int:
        return self._r.randint(a, b)

    def random(self) -> float:
        return self._r.random()

    def choice(self, seq: list[Any]) -> Any:
        return self._r.choice(seq)


@dataclass
class ReqSpec:
    """One request of the workload (or one chunk of a streaming session)."""

    rid: str
    arrival: int
    prompt: list[int]
    max_tokens: int
    priority: int = 0
    lora: int | None = None
    salt: str | None = None
    resumable: bool = False
    #: Streaming sessions: the later chunks, each (step, prompt, max_tokens);
    #: a chunk with prompt None ends the session.
    chunks: list[tuple[int, list[int] | None, int]] = field(default_factory=list)
    abort_at: int | None = None
    #: Extra stop tokens (scripted workloads).
    stop: tuple[int, ...] = ()


def make_workload(case: Case, seed: int) -> list[ReqSpec]:
    if case.script is not None:
        return SCRIPTS[case.script](case)
    rng = Rng("workload", case.name, seed)
    bs = case.block_size
    systems = [
        [rng.randint(10, VOCAB - 1) for _ in range(rng.randint(1, 5) * bs + rng.randint(0, bs - 1))]
        for _ in range(3)
    ]
    out: list[ReqSpec] = []
    prompts: list[list[int]] = []
    for i in range(case.num_requests):
        r = rng.random()
        if prompts and r < 0.15:
            prompt = list(rng.choice(prompts))  # an exact repeat: a full hit
        else:
            head = rng.choice(systems) if r < 0.7 else []
            tail = [rng.randint(10, VOCAB - 1) for _ in range(rng.randint(1, 3 * bs + 3))]
            prompt = head + tail
        prompts.append(prompt)
        spec = ReqSpec(
            rid=f"r{i}",
            arrival=rng.randint(0, 6 if case.pressure is not None else 24),
            prompt=prompt,
            max_tokens=rng.randint(1, 3 * bs),
        )
        if case.priority:
            spec.priority = rng.randint(0, 3)
        if case.lora and rng.random() < 0.6:
            spec.lora = rng.randint(1, 3)
        if case.salts and rng.random() < 0.5:
            spec.salt = rng.choice(["s1", "s2"])
        if case.streaming and rng.random() < 0.6:
            spec.resumable = True
            spec.max_tokens = rng.randint(1, bs)
            step = spec.arrival
            for _ in range(rng.randint(1, 3)):
                step += rng.randint(0, 12)
                chunk = [rng.randint(10, VOCAB - 1) for _ in range(rng.randint(1, 2 * bs))]
                spec.chunks.append((step, chunk, rng.randint(1, bs)))
            step += rng.randint(0, 12)
            spec.chunks.append((step, None, 1))
        if case.aborts and rng.random() < 0.25:
            spec.abort_at = spec.arrival + rng.randint(0, 20)
        out.append(spec)
    out.sort(key=lambda s: (s.arrival, int(s.rid[1:])))
    return out


def _stream_minimal(case: Case) -> list[ReqSpec]:
    # Prompt 1..6 samples 100, then 101, a stop token: the session stops with
    # a step in flight (async scheduling) that computes 101. The chunk 7..11
    # replaces 101 (vLLM drops a session's last sampled token), so the cache
    # must hold 1..6, 100, 7..11 and not the block that ended in 101: one
    # probe carries the real content, one the discarded token.
    session = ReqSpec("s", 0, [1, 2, 3, 4, 5, 6], 8, resumable=True, stop=(101,))
    session.chunks = [(1, [7, 8, 9, 10, 11], 1), (12, None, 1)]
    return [session]


SCRIPTS: dict[str, Callable[[Case], list[ReqSpec]]] = {"stream-minimal": _stream_minimal}

#: Scripted model outputs: (request id, output position) -> token.
SCRIPTED_TOKENS: dict[str, dict[tuple[str, int], int]] = {
    "stream-minimal": {("s", 6): 100, ("s", 7): 101},
}
#: Scripted follow-up requests: (step, request id, prompt); the probes read
#: what the cache holds after the session's rewrite.
SCRIPTED_PROBES: dict[str, list[tuple[int, str, list[int]]]] = {
    "stream-minimal": [
        (14, "probe-real", [1, 2, 3, 4, 5, 6, 100, 7, 8, 9, 10, 11, 12]),
        (14, "probe-discarded", [1, 2, 3, 4, 5, 6, 100, 101, 7, 8, 9, 10, 11]),
    ],
}


class FakeModel:
    """Sampled tokens, drafts, acceptance and connector loads, by seed, id and position."""

    def __init__(self, case: Case, seed: int) -> None:
        self.case = case
        self.seed = seed
        self.scripted = SCRIPTED_TOKENS.get(case.script or "", {})

    def token(self, rid: str, pos: int) -> int:
        t = self.scripted.get((rid, pos))
        if t is not None:
            return t
        if self.case.script is not None:
            return 200 + pos
        h = mix("tok", self.seed, rid, pos)
        if h % 29 == 0:
            return EOS_TOKEN_ID
        if h % 31 == 0:
            return STOP_TOKEN_ID
        return 10 + h % (VOCAB - 10)

    def accepted(self, rid: str, pos: int, num_drafts: int) -> int:
        return mix("acc", self.seed, rid, pos) % (num_drafts + 1)

    def drafts(self, rid: str, pos: int, n: int) -> list[int]:
        return [10 + mix("draft", self.seed, rid, pos, i) % (VOCAB - 10) for i in range(n)]

    def external_tokens(self, rid: str, num_prompt: int, num_computed: int) -> int:
        """Tokens the connector offers beyond ``num_computed`` (block-aligned)."""
        bs = self.case.block_size
        blocks = mix("ext", self.seed, rid) % 5
        n = blocks * bs
        room = (num_prompt - 1 - num_computed) // bs * bs
        return max(0, min(n, room))

    def load_fails(self, rid: str) -> bool:
        return self.case.connector_fail and mix("fail", self.seed, rid) % 2 == 0

    def load_delay(self, rid: str) -> int:
        return 1 + mix("delay", self.seed, rid) % 3
