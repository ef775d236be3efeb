"""Workloads for the simulator: built-in generators, all deterministic from a seed.

A :class:`Workload` is a list of :class:`~pagedkv.sim.policy.Request`: prompt token ids, the
output tokens the request will "sample" one per decode step, the step at which
it arrives, and optionally a session (turns of a session run one after the
other, each ``pause`` steps after the previous one finished), a cache salt and
a LoRA adapter (both reach the manager's block hashing).

Built-in generators (:data:`WORKLOADS`):

``chat``
    multi-turn conversations; each turn's prompt is the whole history (previous
    prompt and answer) plus a new user message, after a short think pause.
``tenants`` / ``tenants-salted``
    single-turn requests of many tenants behind one long shared system prompt
    (plus per-tenant instructions); ``-salted`` gives every tenant its own
    cache salt, so tenants no longer share cached blocks.
``rag``
    retrieval-augmented generation: a system prompt, a few documents drawn from
    a pool with Zipf popularity (most relevant first), then a question.
``agentic``
    agent sessions: a long tool-definition prompt, then turns that append tool
    results, each after a long tool-call pause during which the session's cached
    blocks may be evicted.

Arrivals (``arrival``): ``poisson`` (exponential gaps of mean ``1 / rate`` steps),
``bursty`` (the same mean rate in bursts of ~16 requests arriving together) or
``at-once`` (everything at step 0). For session workloads they apply to first
turns; later turns follow their pauses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

import numpy as np

from .policy import Request

__all__ = [
    "ARRIVALS",
    "WORKLOADS",
    "Workload",
    "WorkloadOptions",
    "generate",
]

ARRIVALS = ("poisson", "bursty", "at-once")
_BURST_MEAN = 16


@dataclass
class Workload:
    """A named list of requests (``params`` says how it was made)."""

    name: str
    requests: list[Request]
    params: dict[str, object] = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(len(r.output) for r in self.requests)

    @property
    def max_request_tokens(self) -> int:
        return max((r.max_num_tokens for r in self.requests), default=0)

    def summary(self, tick_s: float = 0.05) -> dict[str, object]:
        """Counts and sizes; ``tick_s``: seconds per arrival tick of requests
        timed in steps (for ``last_arrival_s``)."""
        n = len(self.requests)
        return {
            "name": self.name,
            "requests": n,
            "sessions": len({r.session for r in self.requests if r.session is not None}),
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "mean_prompt_tokens": round(self.prompt_tokens / n, 1) if n else 0.0,
            "max_request_tokens": self.max_request_tokens,
            "last_arrival_step": max((r.arrival_step for r in self.requests), default=0),
            "last_arrival_s": round(
                max(
                    (
                        r.arrival_s if r.arrival_s is not None else r.arrival_step * tick_s
                        for r in self.requests
                    ),
                    default=0.0,
                ),
                3,
            ),
            "params": dict(self.params),
        }


@dataclass(frozen=True)
class WorkloadOptions:
    """Knobs shared by every generator (``None``: the generator's default)."""

    seed: int = 0
    #: requests to generate (sessions are added until this many turns exist)
    num_requests: int | None = None
    #: mean request (or session) starts per step
    rate: float | None = None
    arrival: str = "poisson"
    num_tenants: int = 8
    #: a cache salt per tenant (tenants then share no cached blocks)
    cache_salt: bool = False
    #: LoRA adapters: tenant t uses adapter t % num_loras (0: none)
    num_loras: int = 0
    #: longest request (prompt + output) a generator makes
    max_context: int = 16384
    vocab_size: int = 32000


@dataclass(frozen=True)
class _Keys:
    """A tenant's extra hash keys."""

    cache_salt: str | None
    lora_name: str | None
    lora_path: str | None

    def on(self, req: Request) -> Request:
        req.cache_salt, req.lora_name, req.lora_path = (
            self.cache_salt,
            self.lora_name,
            self.lora_path,
        )
        return req


class _Gen:
    """Random draws of one generator run."""

    def __init__(self, opts: WorkloadOptions, default_rate: float) -> None:
        self.opts = opts
        self.rng = np.random.Generator(np.random.PCG64(opts.seed))
        self.rate = opts.rate if opts.rate is not None else default_rate
        if self.rate <= 0:
            raise ValueError(f"rate must be positive, got {self.rate}")
        if opts.arrival not in ARRIVALS:
            raise ValueError(f"arrival must be one of {', '.join(ARRIVALS)}, got {opts.arrival!r}")
        self._t = 0.0
        self._burst_left = 0

    def tokens(self, n: int) -> np.ndarray:
        return self.rng.integers(0, self.opts.vocab_size, n, dtype=np.int32)

    def between(self, lo: int, hi: int) -> int:
        return int(self.rng.integers(lo, hi + 1))

    def next_arrival(self) -> int:
        mode = self.opts.arrival
        if mode == "at-once":
            return 0
        if mode == "poisson":
            self._t += float(self.rng.exponential(1.0 / self.rate))
        elif self._burst_left == 0:  # bursty: a new burst
            self._burst_left = int(self.rng.geometric(1.0 / _BURST_MEAN))
            self._t += float(self.rng.exponential(_BURST_MEAN / self.rate))
        if mode == "bursty":
            self._burst_left -= 1
        return int(self._t)

    def tenant_keys(self, tenant: int) -> _Keys:
        o = self.opts
        salt = f"tenant-{tenant}" if o.cache_salt else None
        if o.num_loras <= 0:
            return _Keys(salt, None, None)
        name = f"adapter-{tenant % o.num_loras}"
        return _Keys(salt, name, f"/adapters/{name}")


def _fit(prompt: np.ndarray, out: list[int], max_context: int) -> np.ndarray:
    """The prompt, cut so that prompt + output fit in ``max_context`` tokens."""
    keep = max_context - len(out)
    if keep < 1:
        raise ValueError(f"max_context {max_context} cannot hold a request")
    return prompt[:keep]


def _sessions(
    g: _Gen,
    n_requests: int,
    shared: np.ndarray,
    first_tokens: Callable[[], int],
    turn_tokens: Callable[[], int],
    output_tokens: Callable[[], int],
    turns: Callable[[], int],
    pause: Callable[[], int],
    prefix: str,
) -> Iterator[Request]:
    """Sessions whose turns extend the history: prompt(k) = prompt(k-1) +
    output(k-1) + new tokens. A session ends when the next turn would not fit in
    ``max_context``."""
    made = 0
    s = 0
    while made < n_requests:
        tenant = s % g.opts.num_tenants
        keys = g.tenant_keys(tenant)
        start = g.next_arrival()
        history = np.concatenate([shared, g.tokens(first_tokens())])
        n_turns = turns()
        for k in range(n_turns):
            if made >= n_requests:
                break
            if k > 0:
                history = np.concatenate([history, g.tokens(turn_tokens())])
            out = g.tokens(output_tokens()).tolist()
            if len(history) + len(out) > g.opts.max_context:
                if k == 0:
                    raise ValueError(
                        f"max_context {g.opts.max_context} (--max-model-len) is too short for "
                        f"a first turn of {len(history) + len(out)} tokens"
                    )
                break
            yield keys.on(
                Request(
                    f"{prefix}{s}-t{k}",
                    history,
                    out,
                    arrival_step=start if k == 0 else 0,
                    session=f"{prefix}{s}",
                    pause=0 if k == 0 else pause(),
                )
            )
            history = np.concatenate([history, np.asarray(out, dtype=np.int32)])
            made += 1
        s += 1


def chat(opts: WorkloadOptions) -> Workload:
    """Multi-turn chat with growing histories."""
    g = _Gen(opts, default_rate=0.05)
    n = opts.num_requests or 1000
    system = g.tokens(g.between(200, 600))
    reqs = list(
        _sessions(
            g,
            n,
            system,
            first_tokens=lambda: g.between(20, 400),
            turn_tokens=lambda: g.between(20, 300),
            output_tokens=lambda: g.between(30, 300),
            turns=lambda: g.between(2, 8),
            pause=lambda: g.between(5, 60),
            prefix="chat",
        )
    )
    return Workload("chat", reqs)


def agentic(opts: WorkloadOptions) -> Workload:
    """Agent sessions with long tool-call pauses between turns."""
    g = _Gen(opts, default_rate=0.1)
    n = opts.num_requests or 500
    tools = g.tokens(3000)
    reqs = list(
        _sessions(
            g,
            n,
            tools,
            first_tokens=lambda: g.between(50, 400),
            turn_tokens=lambda: g.between(100, 1500),
            output_tokens=lambda: g.between(20, 160),
            turns=lambda: g.between(4, 12),
            pause=lambda: g.between(100, 600),
            prefix="agent",
        )
    )
    return Workload("agentic", reqs)


def tenants(opts: WorkloadOptions) -> Workload:
    """A shared system prompt across tenants (per-tenant instructions after it)."""
    g = _Gen(opts, default_rate=0.5)
    n = opts.num_requests or 800
    system = g.tokens(2000)
    instructions = [g.tokens(g.between(100, 400)) for _ in range(opts.num_tenants)]
    reqs = []
    for i in range(n):
        tenant = g.between(0, opts.num_tenants - 1)
        prompt = np.concatenate([system, instructions[tenant], g.tokens(g.between(30, 500))])
        out = g.tokens(g.between(20, 250)).tolist()
        prompt = _fit(prompt, out, opts.max_context)
        req = Request(f"req{i}", prompt, out, arrival_step=g.next_arrival())
        reqs.append(g.tenant_keys(tenant).on(req))
    return Workload("tenants", reqs)


def tenants_salted(opts: WorkloadOptions) -> Workload:
    """:func:`tenants` with a cache salt per tenant."""
    w = tenants(replace(opts, cache_salt=True))
    w.name = "tenants-salted"
    return w


def rag(opts: WorkloadOptions) -> Workload:
    """RAG over a document pool with Zipf popularity."""
    g = _Gen(opts, default_rate=0.15)
    n = opts.num_requests or 700
    system = g.tokens(400)
    num_docs = 200
    docs = [g.tokens(g.between(200, 800)) for _ in range(num_docs)]
    weights = 1.0 / np.arange(1, num_docs + 1) ** 1.1
    weights /= weights.sum()
    reqs = []
    for i in range(n):
        k = g.between(3, 5)
        picked = [docs[int(d)] for d in g.rng.choice(num_docs, size=k, replace=False, p=weights)]
        question = g.tokens(g.between(20, 120))
        out = g.tokens(g.between(50, 250)).tolist()
        # fewer documents when the context would overflow
        while len(picked) > 1 and (
            len(system) + sum(map(len, picked)) + len(question) + len(out) > opts.max_context
        ):
            picked.pop()
        prompt = _fit(np.concatenate([system, *picked, question]), out, opts.max_context)
        tenant = i % opts.num_tenants
        req = Request(f"rag{i}", prompt, out, arrival_step=g.next_arrival())
        reqs.append(g.tenant_keys(tenant).on(req))
    return Workload("rag", reqs)


#: name -> (generator, one-line description)
WORKLOADS: dict[str, tuple[Callable[[WorkloadOptions], Workload], str]] = {
    "chat": (chat, "multi-turn chat, each turn resends the growing history"),
    "tenants": (tenants, "one long system prompt shared by many tenants"),
    "tenants-salted": (tenants_salted, "the same, with a cache salt per tenant"),
    "rag": (rag, "a few documents from a Zipf-popular pool, then a question"),
    "agentic": (agentic, "agent sessions with long tool-call pauses between turns"),
}


def generate(name: str, opts: WorkloadOptions | None = None) -> Workload:
    """The built-in workload ``name`` (see :data:`WORKLOADS`)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; built-in: {', '.join(WORKLOADS)}")
    opts = opts or WorkloadOptions()
    w = WORKLOADS[name][0](opts)
    w.params = {
        "seed": opts.seed,
        "arrival": opts.arrival,
        "rate": opts.rate,
        "num_tenants": opts.num_tenants,
        "cache_salt": any(r.cache_salt is not None for r in w.requests),
        "num_loras": opts.num_loras,
        "max_context": opts.max_context,
    }
    if not w.requests:
        raise ValueError(
            f"workload {name!r} made no request (max_context {opts.max_context} too small?)"
        )
    return w
