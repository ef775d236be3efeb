//! The host offload tier's cost per call, steady state on a full tier, from
//! 10^3 to 10^6 chunks (`pagedkv_benches::offload`: 7 calls a request).

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use pagedkv_benches::offload::{CALLS_PER_REQUEST, Workload};
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

criterion_group!(benches, steady_state);
criterion_main!(benches);
