"""The simulator's pieces: workload generators, the trace format, the simulation
clock, and cache salts / LoRA reaching the manager's hashing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pagedkv.sim import (
    WORKLOADS,
    EngineUnavailableError,
    Request,
    SimConfig,
    TraceFormatError,
    Workload,
    WorkloadOptions,
    drive,
    generate,
    policy,
    read_trace,
    run_pagedkv,
    run_vllm,
    runner,
    vllm_engine,
    write_trace,
)

SMALL = SimConfig(memory_gib=1.0, max_model_len=4096)


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_workloads_are_deterministic_from_the_seed(name: str) -> None:
    a = generate(name, WorkloadOptions(seed=3, num_requests=40))
    b = generate(name, WorkloadOptions(seed=3, num_requests=40))
    c = generate(name, WorkloadOptions(seed=4, num_requests=40))
    assert len(a.requests) == len(b.requests) == 40
    for x, y in zip(a.requests, b.requests, strict=True):
        assert x.request_id == y.request_id and x.arrival_step == y.arrival_step
        assert np.array_equal(x.prompt, y.prompt) and x.output == y.output
    assert any(
        not np.array_equal(x.prompt, y.prompt) for x, y in zip(a.requests, c.requests, strict=False)
    )


@pytest.mark.parametrize("name", ["chat", "agentic"])
def test_session_turns_resend_the_whole_history(name: str) -> None:
    w = generate(name, WorkloadOptions(num_requests=60, max_context=8192))
    last: dict[str, Request] = {}
    turns = 0
    for r in w.requests:
        assert r.session is not None and r.max_num_tokens <= 8192
        prev = last.get(r.session)
        if prev is not None:
            head = np.concatenate([prev.prompt, np.asarray(prev.output)])
            assert np.array_equal(r.prompt[: len(head)], head)
            assert len(r.prompt) > len(head) and r.pause > 0 and r.arrival_step == 0
            turns += 1
        last[r.session] = r
    assert turns > 20


def test_agentic_pauses_are_long_and_chat_pauses_short() -> None:
    agent = [
        r.pause for r in generate("agentic", WorkloadOptions(num_requests=80)).requests if r.pause
    ]
    chat = [r.pause for r in generate("chat", WorkloadOptions(num_requests=80)).requests if r.pause]
    assert min(agent) >= 100 > max(chat)


@pytest.mark.parametrize("arrival", ["poisson", "bursty", "at-once"])
def test_arrival_modes(arrival: str) -> None:
    w = generate("tenants", WorkloadOptions(num_requests=400, rate=0.5, arrival=arrival))
    steps = [r.arrival_step for r in w.requests]
    assert steps == sorted(steps)
    distinct = len(set(steps))
    if arrival == "at-once":
        assert set(steps) == {0}
    elif arrival == "poisson":
        assert 400 / 0.5 * 0.7 < steps[-1] < 400 / 0.5 * 1.3 and distinct > 250
    else:  # same mean rate, but requests come in groups
        assert steps[-1] > 400 / 0.5 * 0.4 and distinct < 100


def test_tenant_salts_and_loras() -> None:
    w = generate("tenants", WorkloadOptions(num_requests=50, num_tenants=4, num_loras=2))
    assert all(r.cache_salt is None for r in w.requests)
    assert {r.lora_name for r in w.requests} == {"adapter-0", "adapter-1"}
    salted = generate("tenants-salted", WorkloadOptions(num_requests=50, num_tenants=4))
    assert {r.cache_salt for r in salted.requests} == {f"tenant-{t}" for t in range(4)}
    assert salted.params["cache_salt"] is True and w.params["cache_salt"] is False


def _twice(**keys: Any) -> Workload:
    """The same 64-token prompt twice, the second after the first finished."""
    prompt = np.arange(64, dtype=np.int32)
    second = {k: v[1] for k, v in keys.items()}
    return Workload(
        "twice",
        [
            Request("a", prompt, [1, 2], session="s", **{k: v[0] for k, v in keys.items()}),
            Request("b", prompt.copy(), [3], session="s", pause=1, **second),
        ],
    )


@pytest.mark.parametrize(
    ("keys", "hit"),
    [
        ({}, 48),
        ({"cache_salt": ["x", "x"]}, 48),
        ({"cache_salt": ["x", "y"]}, 0),
        ({"cache_salt": [None, "y"]}, 0),
        ({"lora_name": ["l1", "l1"], "lora_path": ["/p", "/p"]}, 48),
        ({"lora_name": ["l1", "l2"], "lora_path": ["/p", "/p"]}, 0),
    ],
)
def test_cache_salt_and_lora_reach_the_block_hashes(keys: dict[str, Any], hit: int) -> None:
    r = run_pagedkv(_twice(**keys), SMALL)
    assert r.finished == 2
    assert r.hit_tokens == hit  # 3 full blocks of the 4 (the last token is recomputed)


def test_caching_off_never_hits() -> None:
    r = run_pagedkv(_twice(), SimConfig(memory_gib=1.0, max_model_len=4096, enable_caching=False))
    assert r.hit_tokens == 0 and r.finished == 2


class _FakeScheduler:
    """Every request takes ``length[id]`` steps."""

    def __init__(self, length: dict[str, int]) -> None:
        self.length = length
        self.active: dict[str, int] = {}

    @property
    def has_unfinished(self) -> bool:
        return bool(self.active)

    def add_request(self, req: Request) -> None:
        self.active[req.request_id] = self.length[req.request_id]

    def step(self) -> list[Request]:
        done = []
        for rid in list(self.active):
            self.active[rid] -= 1
            if self.active[rid] == 0:
                del self.active[rid]
                done.append(Request(rid, np.zeros(1), [0]))
        return done


def test_clock_starts_next_turns_after_the_pause_and_skips_idle_time() -> None:
    p = np.zeros(1, dtype=np.int32)
    items = [
        Request("s0", p, [0], arrival_step=0, session="s"),
        Request("x", p, [0], arrival_step=2),
        Request("s1", p, [0], arrival_step=0, session="s", pause=10),
        Request("s2", p, [0], arrival_step=100, session="s", pause=1),
    ]
    sched = _FakeScheduler({"s0": 5, "x": 1, "s1": 2, "s2": 1})
    added: list[tuple[str, int]] = []
    pending: list[str] = []
    steps: list[int] = []

    def make(i: int) -> Request:
        pending.append(items[i].request_id)
        return items[i]

    def on_step(clock: int, finished: int) -> None:
        steps.append(clock)
        added.extend((rid, clock) for rid in pending)
        pending.clear()

    end = drive(sched, items, make, on_step)
    # s0 runs steps 0-4 and finishes at 4: s1 is ready at 4 + 1 + 10 = 15 (idle steps
    # 5-14 skipped); s1 finishes at 16; s2 waits for its arrival at step 100.
    assert added == [("s0", 0), ("x", 2), ("s1", 15), ("s2", 100)]
    assert steps == [0, 1, 2, 3, 4, 15, 16, 100]
    assert end == 101


def test_trace_round_trip_gives_the_same_simulation(tmp_path: Path) -> None:
    w = generate("chat", WorkloadOptions(num_requests=40, num_loras=2, cache_salt=True))
    path = tmp_path / "chat.jsonl"
    write_trace(w, path)
    back = read_trace(path)
    assert len(back.requests) == 40
    for x, y in zip(w.requests, back.requests, strict=True):
        assert (x.request_id, x.arrival_step, x.session, x.pause, x.cache_salt, x.lora_name) == (
            y.request_id,
            y.arrival_step,
            y.session,
            y.pause,
            y.cache_salt,
            y.lora_name,
        )
        assert np.array_equal(x.prompt, y.prompt) and x.output == y.output
    # later turns are written as history + new tokens, not resent
    lines = [json.loads(ln) for ln in path.read_text().splitlines()[1:]]
    assert sum(1 for ln in lines if ln.get("history")) > 20
    a, b = run_pagedkv(w, SMALL), run_pagedkv(back, SMALL)
    assert (a.alloc_checksum, a.steps, a.hit_tokens) == (b.alloc_checksum, b.steps, b.hit_tokens)


def test_trace_fields(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        "\n".join(
            [
                '{"type": "header", "format": "pagedkv-trace", "version": 1, "seed": 7}',
                "# a comment",
                '{"type": "prefix", "id": "sys", "len": 40}',
                '{"type": "prefix", "id": "doc", "tokens": [5, 6, 7]}',
                '{"id": "q1", "arrival": 0.26, "prefix": ["sys", "doc"], "prompt_len": 10, '
                '"output_len": 4, "session": "u", "salt": "t1", "lora": "ad"}',
                '{"arrival_step": 3, "prefix": "sys", "prompt": [1, 2], "output": [9, 9]}',
                '{"session": "u", "history": true, "prompt_len": 5, "output_len": 2, "pause": 1}',
            ]
        )
        + "\n"
    )
    w = read_trace(path, step_ms=100)
    a, b, c = w.requests
    assert (a.request_id, a.arrival_step, len(a.prompt), len(a.output)) == ("q1", 2, 53, 4)
    assert a.prompt[40:43].tolist() == [5, 6, 7]
    assert (a.cache_salt, a.lora_name, a.lora_path) == ("t1", "ad", "/adapters/ad")
    assert (b.request_id, b.arrival_step, b.output) == ("r1", 3, [9, 9])
    assert np.array_equal(b.prompt[:40], a.prompt[:40]) and b.prompt[40:].tolist() == [1, 2]
    head = np.concatenate([a.prompt, a.output])
    assert np.array_equal(c.prompt[:57], head) and len(c.prompt) == 62 and c.pause == 10
    again = read_trace(path, step_ms=100)
    assert all(
        np.array_equal(x.prompt, y.prompt) and x.output == y.output
        for x, y in zip(w.requests, again.requests, strict=True)
    )


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt_len": 4}', "missing field 'output_len'"),
        ('{"prompt": [1, -2], "output_len": 1}', "token ids"),
        ('{"prefix": "nope", "output_len": 1}', "unknown prefix"),
        ('{"prompt_len": 3, "output_len": 0}', "output_len must be"),
        ('{"prompt_len": 3, "output_len": 1, "colour": 1}', "unknown field(s) colour"),
        ('{"history": true, "prompt_len": 3, "output_len": 1}', "history needs"),
        ('{"output_len": 2}', "empty prompt"),
        ("[1, 2]", "JSON object"),
        ('{"prompt_len": 3, "output_len": 1, "arrival": -1}', "arrival must be"),
    ],
)
def test_trace_errors_name_the_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt_len": 3, "output_len": 1}\n' + line + "\n")
    with pytest.raises(TraceFormatError, match=r"bad\.jsonl:2: ") as e:
        read_trace(path)
    assert message in str(e.value)


def test_duplicate_ids_and_empty_traces_are_rejected(tmp_path: Path) -> None:
    path = tmp_path / "dup.jsonl"
    path.write_text('{"id": "a", "prompt_len": 3, "output_len": 1}\n' * 2)
    with pytest.raises(TraceFormatError, match="duplicate request id 'a'"):
        read_trace(path)
    path.write_text("\n# nothing\n")
    with pytest.raises(TraceFormatError, match="no request"):
        read_trace(path)


def test_requests_longer_than_the_model_length_fail_the_run_on_request() -> None:
    w = generate("agentic", WorkloadOptions(num_requests=20))
    with pytest.raises(ValueError, match="longer than --max-model-len 2048"):
        run_pagedkv(w, SimConfig(max_model_len=2048, on_overlong="fail"))


def test_vllm_engine_unavailable_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_engine, "vllm_available", lambda: False)
    w = generate("tenants", WorkloadOptions(num_requests=5))
    with pytest.raises(EngineUnavailableError, match="vLLM is not importable in this Python"):
        run_vllm(w, SMALL)
    with pytest.raises(EngineUnavailableError, match="not an executable file"):
        run_vllm(w, SMALL, vllm_python="/nonexistent/python")


def test_vllm_engine_refuses_what_vllm_cannot_run() -> None:
    w = generate("tenants", WorkloadOptions(num_requests=5))
    with pytest.raises(EngineUnavailableError, match="no 'xxh3_native' hash"):
        runner.vllm_payload(w, SimConfig(hash_algo="xxh3_native"))
    short = Workload("short", [Request("a", list(range(100)), [1, 2])])
    with pytest.raises(EngineUnavailableError, match="CrossAttentionSpec"):
        runner.vllm_payload(short, SimConfig(model="whisper-large-v3", memory_gib=8.0))
    payload = runner.vllm_payload(w, SimConfig(model="gemma-3-27b", memory_gib=8.0))
    kinds = {g["kind"] for g in payload["manager"]["groups"]}
    assert kinds == {"full_attention", "sliding_window"}
    json.dumps(payload)  # what the subprocess reads


def test_vllm_engine_script_runs_its_scheduler_loop_without_pagedkv() -> None:
    # The script drives vLLM's manager through the one scheduler policy; it must
    # find the policy outside the package (checked against vLLM by hand, see
    # docs/simulate.md); here only that the module imports standalone, its policy
    # from the same files under a private name.
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("standalone_vllm_engine", vllm_engine.__file__)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["standalone_vllm_engine"] = mod
    try:
        spec.loader.exec_module(mod)
        assert mod.policy.__name__ == "_pagedkv_src.sim.policy"
        assert mod.policy.__file__ == policy.__file__
        assert issubclass(mod.VllmBackend, mod.policy.Backend)
    finally:
        for name in [n for n in sys.modules if n.startswith("_pagedkv_src")]:
            del sys.modules[name]
        del sys.modules["standalone_vllm_engine"]


def test_vllm_engine_script_needs_no_pagedkv() -> None:
    # Without site-packages (so without pagedkv, its compiled core and NumPy) the
    # script still loads; with no payload it prints its usage.
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-S", vllm_engine.__file__], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 2, proc.stderr
    assert "usage: vllm_engine.py PAYLOAD.json" in proc.stderr
