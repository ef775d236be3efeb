#!/usr/bin/env bash
# Runs a fuzz target for a bounded time and prints what it covered.
#
#   bash fuzz/run.sh [SECONDS] [TARGET]   (default 300 s, target ops; index: the
#                                          prefix index's events and queries)
#
# Needs cargo-fuzz (`cargo install cargo-fuzz`) and a nightly toolchain; with only
# a stable one it sets RUSTC_BOOTSTRAP=1 for the sanitizer flags. The corpus grows
# in fuzz/corpus/TARGET (kept between runs, not in git); a crash input lands in
# fuzz/artifacts/TARGET and makes this script exit non-zero. Save it under
# fuzz/regressions/TARGET/ (replayed by rust/pagedkv-fuzz-driver/tests/regressions.rs)
# and reduce it to a plain test there.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

SECONDS_TO_RUN=${1:-300}
TARGET=${2:-ops}
if ! cargo fuzz --version >/dev/null 2>&1; then
  echo "cargo-fuzz is missing: cargo install cargo-fuzz" >&2
  exit 2
fi
if cargo +nightly --version >/dev/null 2>&1; then
  FUZZ=(cargo +nightly fuzz)
else
  export RUSTC_BOOTSTRAP=1
  FUZZ=(cargo fuzz)
fi

mkdir -p "corpus/$TARGET" "artifacts/$TARGET"
LOG=$(mktemp)
COV=$(mktemp)
trap 'rm -f "$LOG" "$COV"' EXIT

echo "== build"
"${FUZZ[@]}" build "$TARGET"

echo "== fuzz for ${SECONDS_TO_RUN}s"
start=$(date +%s)
status=0
"${FUZZ[@]}" run "$TARGET" "corpus/$TARGET" -- -max_total_time="$SECONDS_TO_RUN" -max_len=2048 \
  -print_final_stats=1 >"$LOG" 2>&1 || status=$?
end=$(date +%s)

echo "== coverage of the corpus (libFuzzer edge counters, per function of pagedkv-core)"
"${FUZZ[@]}" run "$TARGET" "corpus/$TARGET" -- -runs=0 -print_coverage=1 >"$COV" 2>&1 || true

python3 - "$LOG" "$COV" "$((end - start))" "$status" <<'PY'
import re, sys
log, cov, secs, status = open(sys.argv[1]).read(), open(sys.argv[2]).read(), sys.argv[3], sys.argv[4]
def stat(name):
    m = re.search(rf"stat::{name}:\s+(\d+)", log)
    return int(m.group(1)) if m else None
execs = stat("number_of_executed_units")
last = [l for l in log.splitlines() if re.match(r"#\d+\s", l)]
print(f"wall time:        {secs} s")
print(f"executions:       {execs} ({stat('average_exec_per_sec')} per second)")
print(f"peak RSS:         {stat('peak_rss_mb')} MB")
if last:
    m = re.search(r"cov: (\d+) ft: (\d+) corp: (\d+)/(\S+)", last[-1])
    if m:
        print(f"libFuzzer:        cov {m.group(1)} edges, {m.group(2)} features, "
              f"corpus {m.group(3)} inputs ({m.group(4)})")
pcs = re.search(r"PC tables \((\d+) PCs\)", log)
if pcs:
    print(f"instrumented PCs: {pcs.group(1)} (the whole binary: std, driver and core)")
# COVERED_FUNC: hits: H edges: X/Y name path:line ; UNCOVERED_FUNC: hits: 0 edges: 0/Y ...
files = {}
uncovered = []
for l in cov.splitlines():
    m = re.match(r"\s*(UN)?COVERED_FUNC: hits: \d+ edges: (\d+)/(\d+) (.*) (\S+):\d+$", l)
    if not m or "pagedkv-core/src/" not in m.group(5):
        continue
    f = m.group(5).split("pagedkv-core/src/")[1]
    x, y = int(m.group(2)), int(m.group(3))
    a = files.setdefault(f, [0, 0, 0, 0])
    a[0] += x; a[1] += y; a[2] += x > 0; a[3] += 1
    if x == 0:
        uncovered.append(f"{f}: {m.group(4)[:90]}")
if files:
    print("pagedkv-core edges covered (functions reached):")
    tx = ty = tf = tn = 0
    for f, (x, y, fr, n) in sorted(files.items()):
        print(f"  {f:16} {x:5}/{y:<5} {100 * x / max(y, 1):5.1f}%   ({fr}/{n} functions)")
        tx += x; ty += y; tf += fr; tn += n
    print(f"  {'total':16} {tx:5}/{ty:<5} {100 * tx / max(ty, 1):5.1f}%   ({tf}/{tn} functions)")
    if uncovered:
        print(f"functions never reached ({len(uncovered)}):")
        for u in uncovered[:40]:
            print("  " + u)
crashes = re.findall(r"Test unit written to (\S+)", log)
if crashes or status != "0":
    print("CRASH:", *crashes)
    print("\n".join(log.splitlines()[-60:]))
    sys.exit(1)
print("no crash")
PY
