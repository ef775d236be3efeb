//! The host offload tier's cost per call: steady state on a full tier, from
//! 10^3 to 10^6 chunks (`pagedkv_benches::offload`: 7 calls a request); and,
//! given `PAGEDKV_OFFLOAD_OPS=FILE[:FILE...]` (`benches/offload_bench.py
//! --core-ops`), the calls recorded from vLLM's own manager replayed on the core.

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use pagedkv_benches::offload::{CALLS_PER_REQUEST, Workload};
use pagedkv_benches::offload_replay;
use pagedkv_core::offload::PolicyKind;

fn steady_state(c: &mut Criterion) {
    for policy in [PolicyKind::Lru, PolicyKind::Arc] {
        let mut g = c.benchmark_group(format!("offload_{}", policy.name()));
        g.throughput(Throughput::Elements(CALLS_PER_REQUEST));
        for n in [1_000u64, 10_000, 100_000, 1_000_000] {
            let mut w = Workload::new(n, policy);
            g.bench_with_input(BenchmarkId::new("request", n), &n, |b, _| {
                b.iter(|| black_box(w.request()));
            });
        }
        g.finish();
    }
}

fn recorded(c: &mut Criterion) {
    let Ok(paths) = std::env::var("PAGEDKV_OFFLOAD_OPS") else {
        return;
    };
    let mut g = c.benchmark_group("offload_recorded");
    for path in paths.split(':') {
        let text = std::fs::read_to_string(path).expect("PAGEDKV_OFFLOAD_OPS file");
        let calls = offload_replay::parse(&text).expect("a --core-ops file");
        g.throughput(Throughput::Elements(calls.calls.len() as u64));
        let name = std::path::Path::new(path)
            .file_stem()
            .map_or(path.into(), |s| s.to_string_lossy());
        g.bench_function(name.as_ref(), |b| {
            b.iter(|| black_box(offload_replay::run(&calls)));
        });
    }
    g.finish();
}

criterion_group!(benches, steady_state, recorded);
criterion_main!(benches);
