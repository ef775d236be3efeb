"""Replays an operation dump recorded from vLLM's manager through pagedkv and prints
the time inside each manager API (µs per call), the manager time per scheduler step,
and — given vLLM's own replay figures for the same dump (``replay_ops.py`` JSON
output) — the ratio.

    python benches/replay_bench.py tests/vectors/ops_small.jsonl.gz [--vllm-json vllm.json]
    python benches/replay_bench.py DUMP --vllm-python ORACLE_VENV/bin/python \
        --oracle-dir ../shared/tools/vllm_oracle       # runs vLLM's replay in the same invocation
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time

from pagedkv._oracle.replay import replay_dump

VLLM_API = {  # pagedkv API -> vLLM replay_ops.py key (it reports these totals only)
    "get_computed_blocks": "get_computed_blocks",
    "allocate_slots(all)": "allocate_slots",
    "free+remove_request": "free",
    "new_step_starts": "new_step",
}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("dump")
    ap.add_argument("--vllm-json", help="replay_ops.py output (one JSON line) for the same dump")
    ap.add_argument("--vllm-python", help="python of a venv with vLLM (the oracle's .venv)")
    ap.add_argument(
        "--oracle-dir",
        default=os.path.join(
            os.path.dirname(__file__), "..", "..", "shared", "tools", "vllm_oracle"
        ),
    )
    ap.add_argument("--repeat", type=int, default=3, help="replays; the fastest is reported")
    args = ap.parse_args()
    vllm_line = None
    if args.vllm_python:
        # vLLM's own manager replays the same dump first, in this same invocation.
        out = subprocess.run(
            [
                args.vllm_python,
                os.path.join(args.oracle_dir, "replay_ops.py"),
                os.path.abspath(args.dump),
            ],
            capture_output=True,
            text=True,
            check=True,
            cwd=args.oracle_dir,
        )
        vllm_line = out.stdout.strip().splitlines()[-1]

    best = None
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        rep = replay_dump(args.dump)
        wall = time.perf_counter() - t0
        assert rep.ok, rep.first_mismatches
        if best is None or rep.manager_seconds < best[0].manager_seconds:
            best = (rep, wall)
    assert best is not None
    rep, wall = best
    steps = rep.per_api.get("new_step_starts", [1, 0])[0]
    vllm = None
    if vllm_line:
        vllm = json.loads(vllm_line)
    elif args.vllm_json:
        with open(args.vllm_json) as f:
            vllm = json.loads(f.read().strip().splitlines()[-1])

    print(
        f"dump: {args.dump}  ops: {rep.ops}  mismatches: {rep.mismatches}  "
        f"python {platform.python_version()} on {platform.machine()}"
    )
    print(f"{'API':<26}{'calls':>9}{'pagedkv µs/call':>17}", end="")
    print(f"{'vLLM µs/call':>14}{'ratio':>8}" if vllm else "")
    rows = dict(rep.per_api)
    adm = rows.get("allocate_slots(admit)", [0, 0])
    run = rows.get("allocate_slots(running)", [0, 0])
    rows["allocate_slots(all)"] = [adm[0] + run[0], adm[1] + run[1]]
    frees = [rows.get(k, [0, 0]) for k in ("free", "remove_request")]
    rows["free+remove_request"] = [frees[0][0] + frees[1][0], frees[0][1] + frees[1][1]]
    for api, (calls, ns) in sorted(rows.items()):
        if not calls:
            continue
        us = ns / calls / 1e3
        line = f"{api:<26}{calls:>9}{us:>17.3f}"
        if vllm and api in VLLM_API:
            v = vllm["us_per_call"][VLLM_API[api]]
            line += f"{v:>14.2f}{v / us:>8.0f}x"
        print(line)
    total_us = rep.manager_seconds * 1e6
    print(
        f"manager time: {rep.manager_seconds * 1e3:.1f} ms = {total_us / steps:.1f} µs/step "
        f"over {steps} steps (replay wall {wall:.2f} s)"
    )
    if vllm:
        v_ms = sum(vllm["manager_ms"].values())
        print(
            f"vLLM manager time: {v_ms:.0f} ms = {v_ms * 1e3 / steps:.1f} µs/step; "
            f"ratio {v_ms / (rep.manager_seconds * 1e3):.0f}x"
        )


if __name__ == "__main__":
    main()
