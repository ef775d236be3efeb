//! `kv_cache_metrics`: the pool logs what vLLM's pool reports to its metrics
//! collector (blocks popped for a request, hits taken, evictions, resets) and
//! counts it; without the option it records nothing.
use pagedkv_core::pool::{BlockActivity, BlockActivityKind, BlockPoolStats};
use pagedkv_core::{AllocateArgs, KvCacheManager, Lora, ManagerConfig, NULL_BLOCK, RequestSpec};

fn mgr(metrics: bool) -> KvCacheManager {
    let mut cfg = ManagerConfig::full_attention(16, 4, 1024);
    cfg.kv_cache_metrics = metrics;
    KvCacheManager::new(cfg).expect("config")
}

fn spec(tokens: std::ops::Range<u32>) -> RequestSpec {
    RequestSpec {
        prompt_token_ids: tokens.collect(),
        ..Default::default()
    }
}

fn kinds(log: &[BlockActivity], kind: BlockActivityKind) -> Vec<u32> {
    log.iter()
        .filter(|a| a.kind == kind)
        .map(|a| a.block)
        .collect()
}

#[test]
fn without_the_option_nothing_is_recorded() {
    let mut m = mgr(false);
    m.add_request("a", spec(0..10)).expect("add");
    let args = AllocateArgs::step(10, 0);
    assert!(m.allocate_slots("a", &args, None).expect("alloc").is_some());
    assert!(m.take_block_activity().is_empty());
    assert_eq!(m.pool().stats(), None);
}

#[test]
fn the_log_follows_vllms_collector_calls_through_a_request_life() {
    let mut m = mgr(true);
    m.add_request("a", spec(0..9)).expect("add");
    let hit = m.get_computed_blocks("a").expect("lookup");
    let new = m
        .allocate_slots("a", &AllocateArgs::step(9, 0), Some(&hit))
        .expect("alloc")
        .expect("fits")[0]
        .clone();
    let log = m.take_block_activity();
    // Each popped block: evicted (caching is on), then allocated.
    assert_eq!(kinds(&log, BlockActivityKind::Allocated), new);
    assert_eq!(kinds(&log, BlockActivityKind::Evicted), new);
    assert_eq!(log[0].kind, BlockActivityKind::Evicted);
    m.remove_request("a").expect("remove");

    // A second request hits the two full blocks: they are accessed, and only the
    // tail block is popped.
    m.add_request("b", spec(0..9)).expect("add");
    let hit = m.get_computed_blocks("b").expect("lookup");
    assert_eq!(hit.num_computed_tokens, 8);
    let args = AllocateArgs {
        num_new_computed_tokens: 8,
        ..AllocateArgs::step(1, 0)
    };
    assert!(
        m.allocate_slots("b", &args, Some(&hit))
            .expect("alloc")
            .is_some()
    );
    let log = m.take_block_activity();
    assert_eq!(kinds(&log, BlockActivityKind::Accessed), hit.block_ids[0]);
    assert_eq!(kinds(&log, BlockActivityKind::Allocated).len(), 1);
    m.remove_request("b").expect("remove");

    m.evict_blocks(&[new[0], 0]).expect("evict");
    let log = m.take_block_activity();
    assert_eq!(
        kinds(&log, BlockActivityKind::Evicted),
        vec![new[0], NULL_BLOCK]
    );
    assert!(m.reset_prefix_cache());
    assert_eq!(
        m.take_block_activity(),
        vec![BlockActivity {
            kind: BlockActivityKind::Reset,
            block: NULL_BLOCK
        }]
    );
    assert_eq!(
        m.pool().stats(),
        Some(BlockPoolStats {
            blocks_allocated: 4,
            blocks_accessed: 2,
            blocks_evicted: 1,
            cache_resets: 1,
        })
    );
}

#[test]
fn blocks_for_connector_tokens_are_logged_though_not_returned() {
    let mut m = mgr(true);
    m.add_request("r", spec(0..20)).expect("add");
    let args = AllocateArgs {
        num_external_computed_tokens: 16,
        ..AllocateArgs::step(4, 0)
    };
    let returned = m
        .allocate_slots("r", &args, None)
        .expect("alloc")
        .expect("fits")[0]
        .clone();
    let held = m.block_ids("r").expect("blocks")[0].to_vec();
    assert!(returned.len() < held.len());
    let mut allocated = kinds(&m.take_block_activity(), BlockActivityKind::Allocated);
    allocated.sort_unstable();
    let mut held_sorted = held;
    held_sorted.sort_unstable();
    assert_eq!(allocated, held_sorted);
}

#[test]
fn a_lora_path_or_id_needs_a_name() {
    assert_eq!(Lora::from_parts(None, None, None), Ok(None));
    assert!(Lora::from_parts(None, Some("/p".into()), None).is_err());
    assert!(Lora::from_parts(None, None, Some(3)).is_err());
    let lora = Lora::from_parts(Some("l".into()), Some("/p".into()), Some(3)).expect("lora");
    assert_eq!(
        lora.map(|l| (l.name, l.id)),
        Some(("l".to_owned(), Some(3)))
    );
}

#[test]
fn num_new_computed_tokens_defaults_to_the_hit() {
    let mut m = mgr(false);
    m.add_request("a", spec(0..9)).expect("add");
    let hit = m.get_computed_blocks("a").expect("lookup");
    assert_eq!(AllocateArgs::num_new_computed_tokens_or_hit(None, None), 0);
    assert_eq!(
        AllocateArgs::num_new_computed_tokens_or_hit(None, Some(&hit)),
        hit.num_computed_tokens
    );
    assert_eq!(
        AllocateArgs::num_new_computed_tokens_or_hit(Some(3), Some(&hit)),
        3
    );
}

#[test]
fn truncation_outside_one_to_thirty_two_bytes_is_a_bad_config() {
    for n in [0u8, 33, 255] {
        let mut cfg = ManagerConfig::full_attention(16, 4, 1024);
        cfg.hash_truncate_bytes = Some(n);
        assert!(matches!(
            KvCacheManager::new(cfg),
            Err(pagedkv_core::Error::InvalidConfig(_))
        ));
    }
}
