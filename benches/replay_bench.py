"""Replays an operation dump recorded from vLLM's manager through pagedkv and prints
the time inside each manager API (µs per call), the manager time per scheduler step,
and — given vLLM's own replay figures for the same dump (``replay_ops.py`` JSON
output) — the ratio. Each round also measures the harness floor
(``harness_floor``: the same replay with every call replaced by one that does
next to nothing), and with vLLM's figures the ratio no implementation could
exceed in this harness.

    python benches/replay_bench.py tests/vectors/ops_small.jsonl.gz [--vllm-json vllm.json]
    python benches/replay_bench.py DUMP --vllm-python ORACLE_VENV/bin/python \
        --oracle-dir ../shared/tools/vllm_oracle --rounds 3
        # vLLM's replay and pagedkv's, alternating, in the same invocation
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time

from pagedkv._oracle.replay import harness_floor, replay_dump

VLLM_API = {  # pagedkv API -> vLLM replay_ops.py key (it reports these totals only)
    "get_computed_blocks": "get_computed_blocks",
    "allocate_slots(all)": "allocate_slots",
    "free+remove_request": "free",
    "new_step_starts": "new_step",
}


def _vllm_replay(args: argparse.Namespace) -> dict:
    out = subprocess.run(
        [
            args.vllm_python,
            # Absolute: the script runs from the oracle's directory.
            os.path.join(os.path.abspath(args.oracle_dir), "replay_ops.py"),
            os.path.abspath(args.dump),
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=args.oracle_dir,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


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
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds; with --vllm-python each runs both replays, in alternating order",
    )
    args = ap.parse_args()
    ours: list[tuple[object, float]] = []
    floors = []
    theirs: list[dict] = []
    for r in range(args.rounds):
        sides = ["vllm", "pagedkv"] if r % 2 == 0 else ["pagedkv", "vllm"]
        for side in sides:
            if side == "vllm":
                if args.vllm_python:
                    theirs.append(_vllm_replay(args))
                continue
            t0 = time.perf_counter()
            rep = replay_dump(args.dump)
            wall = time.perf_counter() - t0
            assert rep.ok, rep.first_mismatches
            ours.append((rep, wall))
            floors.append(harness_floor(args.dump))
    if not theirs and args.vllm_json:
        with open(args.vllm_json) as f:
            theirs.append(json.loads(f.read().strip().splitlines()[-1]))
    rep, wall = min(ours, key=lambda x: x[0].manager_seconds)
    floor = min(floors, key=lambda f: f.manager_seconds)
    steps = rep.per_api.get("new_step_starts", [1, 0])[0]
    vllm = min(theirs, key=lambda v: sum(v["manager_ms"].values())) if theirs else None

    print(
        f"dump: {args.dump}  ops: {rep.ops}  mismatches: {rep.mismatches}  "
        f"python {platform.python_version()} on {platform.machine()}  "
        f"best of {len(ours)} pagedkv / {len(theirs)} vLLM replays"
    )
    print(f"{'API':<26}{'calls':>9}{'pagedkv µs/call':>17}{'floor':>8}", end="")
    print(f"{'vLLM µs/call':>14}{'ratio':>8}" if vllm else "")
    rows, floor_rows = _with_sums(rep.per_api), _with_sums(floor.per_api)
    for api, (calls, ns) in sorted(rows.items()):
        if not calls:
            continue
        us = ns / calls / 1e3
        f_calls, f_ns = floor_rows.get(api, [0, 0])
        f_us = f_ns / f_calls / 1e3 if f_calls else float("nan")
        line = f"{api:<26}{calls:>9}{us:>17.3f}{f_us:>8.3f}"
        if vllm and api in VLLM_API:
            v = vllm["us_per_call"][VLLM_API[api]]
            line += f"{v:>14.2f}{v / us:>8.0f}x"
        print(line)
    ms = sorted(r.manager_seconds * 1e3 for r, _ in ours)
    fms = sorted(f.manager_seconds * 1e3 for f in floors)
    print(
        f"pagedkv manager time per step: {ms[0] * 1e3 / steps:.2f} / "
        f"{statistics.median(ms) * 1e3 / steps:.2f} µs (min / median) over {steps} steps "
        f"(replay wall {wall:.2f} s)"
    )
    print(
        f"harness floor per step: {fms[0] * 1e3 / steps:.2f} / "
        f"{statistics.median(fms) * 1e3 / steps:.2f} µs (every call replaced by one "
        "that does next to nothing)"
    )
    if theirs:
        vms = sorted(sum(v["manager_ms"].values()) for v in theirs)
        print(
            f"vLLM manager time per step: {vms[0] * 1e3 / steps:.1f} / "
            f"{statistics.median(vms) * 1e3 / steps:.1f} µs; ratio {vms[0] / ms[0]:.0f}x (min), "
            f"{statistics.median(vms) / statistics.median(ms):.0f}x (median)"
        )
        print(
            f"vLLM / harness floor: {vms[0] / fms[0]:.0f}x (min), "
            f"{statistics.median(vms) / statistics.median(fms):.0f}x (median): "
            "the most any implementation could show in this replay"
        )


def _with_sums(per_api: dict[str, list[int]]) -> dict[str, list[int]]:
    """The per-API rows plus the sums compared with vLLM's totals."""
    rows = dict(per_api)
    adm = rows.get("allocate_slots(admit)", [0, 0])
    run = rows.get("allocate_slots(running)", [0, 0])
    rows["allocate_slots(all)"] = [adm[0] + run[0], adm[1] + run[1]]
    frees = [rows.get(k, [0, 0]) for k in ("free", "remove_request")]
    rows["free+remove_request"] = [frees[0][0] + frees[1][0], frees[0][1] + frees[1][1]]
    return rows


if __name__ == "__main__":
    main()
