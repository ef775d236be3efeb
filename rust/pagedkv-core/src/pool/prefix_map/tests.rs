use super::*;

/// Keys sharing their first 8 bytes collide on bucket and tag: only the
/// full-key comparison tells them apart.
fn colliding(i: u8) -> CacheKey {
    let mut b = [7u8; 32];
    b[31] = i;
    CacheKey {
        hash: BlockHash::from_slice(&b).unwrap_or_default(),
        group: 0,
    }
}

#[test]
fn colliding_keys_overflow_into_later_buckets_and_come_back_out() {
    let mut m = PrefixMap::with_capacity(1, 0);
    for i in 0..40u8 {
        m.insert(colliding(i), u32::from(i) + 1, 16, 0);
    }
    assert!(m.num_buckets > 1);
    assert!(m.check().is_ok());
    for i in 0..40u8 {
        assert_eq!(
            m.head(&colliding(i)).map(|e| m.entry(e).block),
            Some(u32::from(i) + 1)
        );
    }
    for i in (0..40u8).step_by(3) {
        assert!(m.remove(&colliding(i), u32::from(i) + 1));
        assert!(!m.remove(&colliding(i), u32::from(i) + 1));
    }
    assert!(m.check().is_ok());
    for i in 0..40u8 {
        let present = m.head(&colliding(i)).is_some();
        assert_eq!(present, i % 3 != 0);
    }
}

#[test]
fn three_hundred_keys_with_one_home_probe_past_it_and_come_back_out() {
    // 300 keys with one home: 8 live there, the other 292 further on.
    let key = |i: u16| {
        let mut b = [7u8; 32];
        b[30..].copy_from_slice(&i.to_le_bytes());
        CacheKey {
            hash: BlockHash::from_slice(&b).unwrap_or_default(),
            group: 0,
        }
    };
    let mut m = PrefixMap::with_capacity(4096, 0);
    for i in 0..300u16 {
        m.insert(key(i), u32::from(i), 16, 0);
    }
    let home = m.home(mix(&key(0)));
    assert_eq!(overflow(m.bucket(home)), 292);
    assert!(m.check().is_ok());
    for i in (0..300u16).rev() {
        assert_eq!(
            m.head(&key(i)).map(|e| m.entry(e).block),
            Some(u32::from(i))
        );
        assert!(m.remove(&key(i), u32::from(i)));
        assert!(m.head(&key(i)).is_none());
    }
    assert_eq!(m.len(), 0);
    assert!(m.check().is_ok());
    assert_eq!(overflow(m.bucket(home)), 0);
    m.insert(key(5), 9, 16, 0);
    assert_eq!(m.head(&key(5)).map(|e| m.entry(e).block), Some(9));
    assert!(m.check().is_ok());
}

#[test]
fn a_table_larger_than_the_address_space_is_refused_not_aborted() {
    // 2^45 buckets: 2 PiB, past any x86-64 or AArch64 user address space.
    assert!(!table_fits(1 << 45));
    assert!(!table_fits(usize::MAX / 4));
    assert!(table_fits(1 << 10));
}

#[test]
fn one_key_chains_its_blocks_in_insertion_order() {
    let mut m = PrefixMap::with_capacity(8, 8);
    let k = colliding(0);
    for b in [5, 3, 9] {
        m.insert(k, b, 16, 0);
    }
    let blocks = |m: &PrefixMap| m.chain(&k).map(|e| m.entry(e).block).collect::<Vec<_>>();
    assert_eq!(blocks(&m), vec![5, 3, 9]);
    assert!(m.remove(&k, 3));
    assert_eq!(blocks(&m), vec![5, 9]);
    assert!(m.remove(&k, 5));
    assert_eq!(blocks(&m), vec![9]);
    assert_eq!(m.len(), 1);
    assert!(m.remove(&k, 9));
    assert_eq!(m.len(), 0);
    assert!(m.head(&k).is_none());
    assert!(m.check().is_ok());
}

/// Half the keys collide with each other; the rest spread over buckets.
fn key_of(k: u8) -> CacheKey {
    let mut key = colliding(k);
    if k >= 12 {
        let mut b = [k; 32];
        b[0] = k.wrapping_mul(37);
        key.hash = BlockHash::from_slice(&b).unwrap_or_default();
    }
    key
}

#[derive(Clone, Debug)]
enum Op {
    Insert(u8, u32),
    Remove(u8, u32),
}

fn op() -> impl proptest::strategy::Strategy<Value = Op> {
    use proptest::prelude::*;
    prop_oneof![
        (0..24u8, 0..6u32).prop_map(|(k, b)| Op::Insert(k, b)),
        (0..24u8, 0..6u32).prop_map(|(k, b)| Op::Remove(k, b)),
    ]
}

proptest::proptest! {
    /// Against a plain map of key -> blocks in insertion order: keys that
    /// collide on bucket and tag, chains, overflow across buckets, growth
    /// from one bucket.
    #[test]
    fn the_map_answers_as_a_list_of_blocks_per_key(ops in proptest::collection::vec(op(), 1..300)) {
        let mut m = PrefixMap::with_capacity(1, 0);
        let mut model: std::collections::HashMap<u8, Vec<u32>> = std::collections::HashMap::new();
        for op in ops {
            match op {
                Op::Insert(k, b) => {
                    m.insert(key_of(k), b, 0, 0);
                    model.entry(k).or_default().push(b);
                }
                Op::Remove(k, b) => {
                    let list = model.entry(k).or_default();
                    let expected = list.iter().position(|&x| x == b).map(|i| list.remove(i));
                    proptest::prop_assert_eq!(m.remove(&key_of(k), b), expected.is_some());
                }
            }
            proptest::prop_assert!(m.check().is_ok());
        }
        for k in 0..24u8 {
            let got: Vec<u32> = m.chain(&key_of(k)).map(|e| m.entry(e).block).collect();
            proptest::prop_assert_eq!(got, model.get(&k).cloned().unwrap_or_default());
        }
        proptest::prop_assert_eq!(m.len(), model.values().filter(|v| !v.is_empty()).count());
    }
}

/// Distinct keys (distinct hashes) whose home in `m` is bucket `home`.
fn keys_homed_at(m: &PrefixMap, home: usize, n: usize) -> Vec<CacheKey> {
    (0u32..)
        .map(|i| {
            let mut b = [0u8; 32];
            b[..4].copy_from_slice(&i.to_le_bytes());
            b[4..8].copy_from_slice(&i.wrapping_mul(0x9e37_79b9).to_le_bytes());
            CacheKey {
                hash: BlockHash::from_slice(&b).unwrap_or_default(),
                group: 0,
            }
        })
        .filter(|k| m.home(mix(k)) == home)
        .take(n)
        .collect()
}

#[test]
fn a_removed_key_stays_as_a_ghost_that_its_return_takes_and_its_record_forgets() {
    let mut m = PrefixMap::with_capacity(4096, 0);
    let keys = keys_homed_at(&m, 3, 6);
    for (i, k) in keys.iter().enumerate() {
        m.insert(*k, i as u32, 16, 0);
    }
    // A key with a second block keeps its lane: no ghost.
    m.insert(keys[5], 50, 16, 0);
    assert_eq!(
        m.remove_leaving_ghost(&keys[5], 5, Some((0, 0))),
        (true, None)
    );
    let mut records = Vec::new();
    for (i, k) in keys.iter().enumerate().take(4) {
        let (removed, record) = m.remove_leaving_ghost(k, i as u32, Some((i % 2, i)));
        assert!(removed);
        records.push(record.expect("a ghost in the key's home bucket"));
    }
    assert_eq!(m.ghost_lens(), [2, 2]);
    assert_eq!(m.len(), 2);
    assert!(keys[..4].iter().all(|k| m.head(k).is_none()));
    assert!(
        keys[..4]
            .iter()
            .all(|k| m.first_block(&k.hash, 0).is_none())
    );
    assert_eq!(m.iter().count(), 2);
    assert!(m.check().is_ok());
    // Key 1 comes back: its ghost (B2) is taken, its lane reused.
    assert_eq!(m.insert_taking_ghost(keys[1], 9, 16, 0).1, Some(true));
    assert_eq!(m.head(&keys[1]).map(|e| m.entry(e).block), Some(9));
    assert_eq!(m.ghost_lens(), [2, 1]);
    // Its record forgets nothing now; key 0's forgets key 0's ghost (B1).
    assert_eq!(m.forget_ghost(records[1]), None);
    assert_eq!(m.forget_ghost(records[0]), Some(0));
    assert_eq!(m.forget_ghost(records[0]), None);
    assert_eq!(m.insert_taking_ghost(keys[0], 8, 16, 0).1, None);
    assert_eq!(m.ghost_lens(), [1, 1]);
    // A key never seen takes no ghost.
    let stranger = keys_homed_at(&m, 3, 7)[6];
    assert_eq!(m.insert_taking_ghost(stranger, 7, 16, 0).1, None);
    assert!(m.check().is_ok());
    // Growing the table drops the ghosts.
    for (i, k) in keys_homed_at(&m, 0, 4000).iter().enumerate() {
        m.insert(*k, 100 + i as u32, 16, 0);
    }
    assert_eq!(m.ghost_lens(), [0, 0]);
    assert!(m.check().is_ok());
    assert_eq!(m.insert_taking_ghost(keys[2], 1, 16, 0).1, None);
}

#[test]
fn ghosts_give_their_lanes_to_keys_and_never_make_a_key_overflow() {
    let mut m = PrefixMap::with_capacity(64, 0);
    let keys = keys_homed_at(&m, 1, 12);
    for (i, k) in keys.iter().enumerate().take(8) {
        m.insert(*k, i as u32, 16, 0);
    }
    assert_eq!(overflow(m.bucket(1)), 0);
    for (i, k) in keys.iter().enumerate().take(3) {
        assert!(
            m.remove_leaving_ghost(k, i as u32, Some((0, i)))
                .1
                .is_some()
        );
    }
    assert_eq!(m.ghost_lens(), [3, 0]);
    // Three more keys take the three ghosts' lanes; a fourth overflows.
    for (i, k) in keys.iter().enumerate().skip(8) {
        assert_eq!(m.insert_taking_ghost(*k, i as u32, 16, 0).1, None);
    }
    assert_eq!(m.ghost_lens(), [0, 0]);
    assert_eq!(overflow(m.bucket(1)), 1);
    assert!(m.check().is_ok());
    // The key that overflowed leaves no ghost: its home has no lane free.
    assert_eq!(
        m.remove_leaving_ghost(&keys[11], 11, Some((1, 0))),
        (true, None)
    );
    assert_eq!(overflow(m.bucket(1)), 0);
    // With a lane free at home, it does: its ghost moves home.
    m.insert(keys[11], 11, 16, 0);
    assert_eq!(overflow(m.bucket(1)), 1);
    assert!(m.remove(&keys[3], 3));
    assert!(
        m.remove_leaving_ghost(&keys[11], 11, Some((1, 0)))
            .1
            .is_some()
    );
    assert_eq!(overflow(m.bucket(1)), 0);
    assert_eq!(m.ghost_lens(), [0, 1]);
    assert!(m.check().is_ok());
    assert_eq!(m.insert_taking_ghost(keys[11], 11, 16, 0).1, Some(true));
    assert!(m.check().is_ok());
    for (i, k) in keys.iter().enumerate().skip(4) {
        assert_eq!(
            m.head(k).map(|e| m.entry(e).block),
            Some(i as u32),
            "key {i}"
        );
    }
}

#[derive(Clone, Debug)]
enum GhostOp {
    Insert(u8, u32),
    Remove(u8, u32, Option<bool>),
    Forget(usize),
}

fn ghost_op() -> impl proptest::strategy::Strategy<Value = GhostOp> {
    use proptest::prelude::*;
    prop_oneof![
        (0..24u8, 0..6u32).prop_map(|(k, b)| GhostOp::Insert(k, b)),
        (0..24u8, 0..6u32, proptest::option::of(any::<bool>()))
            .prop_map(|(k, b, g)| GhostOp::Remove(k, b, g)),
        (0..64usize).prop_map(GhostOp::Forget),
    ]
}

proptest::proptest! {
    /// Ghosts beside the keys, against a model of the keys and of the ghosts
    /// left: the keys answer exactly as the model's whatever the ghosts
    /// (colliding keys, overflow, growth from one bucket); a ghost hit or
    /// forgetting names a ghost the model left in that list (keys with equal
    /// hashes are one ghost), and the map holds no more ghosts than it.
    #[test]
    fn ghosts_never_change_what_the_keys_answer(ops in proptest::collection::vec(ghost_op(), 1..300)) {
        let mut m = PrefixMap::with_capacity(1, 0);
        let mut model: std::collections::HashMap<u8, Vec<u32>> = std::collections::HashMap::new();
        // (key hash, B2) of each ghost left; records with theirs.
        let mut ghosts: Vec<(u64, bool)> = Vec::new();
        let mut records: Vec<(GhostRecord, u64, bool)> = Vec::new();
        for (step, op) in ops.into_iter().enumerate() {
            match op {
                GhostOp::Insert(k, b) => {
                    let h = mix(&key_of(k));
                    let fresh = model.get(&k).is_none_or(Vec::is_empty);
                    let (_, hit) = m.insert_taking_ghost(key_of(k), b, 0, 0);
                    if let Some(second) = hit {
                        proptest::prop_assert!(fresh);
                        let at = ghosts.iter().position(|&g| g == (h, second));
                        proptest::prop_assert!(at.is_some(), "a hit on no ghost left");
                        ghosts.remove(at.unwrap_or_default());
                    } else if fresh {
                        // Dropped before (a full bucket, growth) if listed.
                        ghosts.retain(|g| g.0 != h);
                    }
                    model.entry(k).or_default().push(b);
                }
                GhostOp::Remove(k, b, ghost) => {
                    let list = model.entry(k).or_default();
                    let expected = list.iter().position(|&x| x == b).map(|i| list.remove(i));
                    let gone = list.is_empty();
                    let ghost = ghost.map(|second| (usize::from(second), step));
                    let (removed, record) = m.remove_leaving_ghost(&key_of(k), b, ghost);
                    proptest::prop_assert_eq!(removed, expected.is_some());
                    if let Some(r) = record {
                        proptest::prop_assert!(gone && expected.is_some());
                        let second = ghost.is_some_and(|g| g.0 == 1);
                        ghosts.push((mix(&key_of(k)), second));
                        records.push((r, mix(&key_of(k)), second));
                    }
                }
                GhostOp::Forget(i) => {
                    if !records.is_empty() {
                        let (r, h, second) = records.remove(i % records.len());
                        if let Some(list) = m.forget_ghost(r) {
                            proptest::prop_assert_eq!(list, usize::from(second));
                            let at = ghosts.iter().position(|&g| g == (h, second));
                            proptest::prop_assert!(at.is_some(), "forgot no ghost left");
                            ghosts.remove(at.unwrap_or_default());
                        }
                    }
                }
            }
            proptest::prop_assert!(m.check().is_ok(), "{:?}", m.check());
            let lens = m.ghost_lens();
            for second in [false, true] {
                let listed = ghosts.iter().filter(|g| g.1 == second).count();
                proptest::prop_assert!(lens[usize::from(second)] as usize <= listed);
            }
        }
        for k in 0..24u8 {
            let got: Vec<u32> = m.chain(&key_of(k)).map(|e| m.entry(e).block).collect();
            proptest::prop_assert_eq!(got, model.get(&k).cloned().unwrap_or_default());
        }
        proptest::prop_assert_eq!(m.len(), model.values().filter(|v| !v.is_empty()).count());
    }
}
