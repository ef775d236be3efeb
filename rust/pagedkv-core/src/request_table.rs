//! The request table: a slab of requests with generations, the id index and
//! request handles.
//!
//! A handle packs, from the low bit up: the tag of the manager that issued it
//! (12 bits), the request's slot (32 bits) and the slot's generation (19 bits,
//! bumped when the slot is vacated); the top bit is clear, so handles fit an
//! `int64` array. While a slot is on its first request and below 2^18, the
//! handle is below 2^30: one digit of a Python int, the cheapest to convert. A
//! removed request's handle is refused until its slot was reused 2^19 times; a
//! handle of another manager is refused unless 4,096 managers were built
//! between the two.

use rustc_hash::FxHashMap;

use crate::error::{Error, Result, invalid};
use crate::request::Request;

/// A request's handle: returned by [`crate::KvCacheManager::add_request`],
/// valid until the request is removed. Batch calls take handles to skip the id
/// lookup.
pub type RequestHandle = u64;

/// The requests of a batch call, named by ids or by handles.
#[derive(Clone, Copy, Debug)]
pub enum RequestRefs<'a> {
    /// Request ids.
    Ids(&'a [&'a str]),
    /// Handles from [`crate::KvCacheManager::add_request`].
    Handles(&'a [RequestHandle]),
}

impl RequestRefs<'_> {
    /// Number of requests named.
    #[must_use]
    pub fn len(&self) -> usize {
        match self {
            Self::Ids(v) => v.len(),
            Self::Handles(v) => v.len(),
        }
    }

    /// No request named.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

const TAG_BITS: u32 = 12;
const SLOT_BITS: u32 = 32;
const GEN_BITS: u32 = 19;
const TAG_MASK: u64 = (1 << TAG_BITS) - 1;
const SLOT_SHIFT: u32 = TAG_BITS;
const GEN_SHIFT: u32 = TAG_BITS + SLOT_BITS;
const GEN_MASK: u64 = (1 << GEN_BITS) - 1;
/// A slot's generation word with this bit set holds a request.
const LIVE: u32 = 1 << 31;

/// Requests by slot, with the id index and handle resolution.
#[derive(Debug)]
pub(crate) struct RequestTable {
    /// The requests by slot; a vacant slot holds [`Request::vacant`]. Whether a
    /// slot holds a request is its generation word's [`LIVE`] bit, not an
    /// `Option`: a decode step resolves a hundred handles on cold caches, and
    /// an `Option<Request>`'s discriminant sits in whichever field has the
    /// widest niche (the `LoRA` id's, in the request's fourth cache line),
    /// one more line per request than the step reads.
    reqs: Vec<Request>,
    /// Generation of each slot (the low bits), bumped when the slot is
    /// vacated, so a handle of a removed request never names its successor;
    /// and [`LIVE`] while it holds a request.
    slot_gen: Vec<u32>,
    free_slots: Vec<u32>,
    index: FxHashMap<String, u32>,
    /// Identity of the owning manager, carried by every handle.
    tag: u64,
    next_uid: u64,
}

impl RequestTable {
    /// An empty table for the manager whose unique id is `manager_uid`.
    pub(crate) fn new(manager_uid: u64) -> Self {
        Self {
            reqs: Vec::new(),
            slot_gen: Vec::new(),
            free_slots: Vec::new(),
            index: FxHashMap::default(),
            tag: manager_uid & TAG_MASK,
            next_uid: 1,
        }
    }

    /// Number of known requests.
    pub(crate) fn len(&self) -> usize {
        self.index.len()
    }

    /// Whether a request id is known.
    pub(crate) fn contains(&self, id: &str) -> bool {
        self.index.contains_key(id)
    }

    /// The unique id the next inserted request gets (never reused).
    pub(crate) fn next_uid(&self) -> u64 {
        self.next_uid
    }

    /// The slot of a known request.
    pub(crate) fn slot(&self, id: &str) -> Result<u32> {
        self.index
            .get(id)
            .copied()
            .ok_or_else(|| Error::UnknownRequest(id.to_owned()))
    }

    /// The handle of the request in `slot`.
    pub(crate) fn handle_of(&self, slot: u32) -> RequestHandle {
        ((u64::from(self.slot_gen[slot as usize]) & GEN_MASK) << GEN_SHIFT)
            | (u64::from(slot) << SLOT_SHIFT)
            | self.tag
    }

    /// The slot a handle names, if it names a live request of this table.
    pub(crate) fn slot_of_handle(&self, handle: RequestHandle) -> Result<u32> {
        let slot = (handle >> SLOT_SHIFT) as u32;
        // The tag check also refuses a set top bit (never issued).
        if handle & (TAG_MASK | 1 << 63) == self.tag
            && self
                .slot_gen
                .get(slot as usize)
                .is_some_and(|&g| g & LIVE != 0 && u64::from(g) & GEN_MASK == handle >> GEN_SHIFT)
        {
            return Ok(slot);
        }
        Err(self.refusal(handle))
    }

    /// Why a handle names no live request of this table.
    #[cold]
    fn refusal(&self, handle: RequestHandle) -> Error {
        let why = if handle >> 63 != 0 {
            ", never issued"
        } else if handle & TAG_MASK != self.tag {
            ", issued by another manager"
        } else {
            ""
        };
        Error::UnknownRequest(format!("handle {handle:#x}{why}"))
    }

    /// Resolves request references to slots (into `out`, cleared first).
    pub(crate) fn resolve(&self, refs: RequestRefs<'_>, out: &mut Vec<u32>) -> Result<()> {
        out.clear();
        match refs {
            RequestRefs::Ids(ids) => {
                out.reserve(ids.len());
                for id in ids {
                    out.push(self.slot(id)?);
                }
            }
            RequestRefs::Handles(hs) => {
                out.reserve(hs.len());
                for &h in hs {
                    out.push(self.slot_of_handle(h)?);
                }
            }
        }
        Ok(())
    }

    /// The request in a slot, if it holds one.
    pub(crate) fn live(&self, slot: u32) -> Option<&Request> {
        let live = self
            .slot_gen
            .get(slot as usize)
            .is_some_and(|g| g & LIVE != 0);
        self.reqs.get(slot as usize).filter(|_| live)
    }

    /// The request in an occupied slot (the index maps ids only to occupied
    /// slots, and handles are checked before use).
    pub(crate) fn get(&self, slot: u32) -> &Request {
        debug_assert!(
            self.slot_gen[slot as usize] & LIVE != 0,
            "vacant slot {slot}"
        );
        &self.reqs[slot as usize]
    }

    /// The request in an occupied slot, mutably.
    pub(crate) fn get_mut(&mut self, slot: u32) -> &mut Request {
        debug_assert!(
            self.slot_gen[slot as usize] & LIVE != 0,
            "vacant slot {slot}"
        );
        &mut self.reqs[slot as usize]
    }

    /// Adds a request under `id` (not known yet); returns its slot.
    pub(crate) fn insert(&mut self, id: &str, req: Request) -> Result<u32> {
        let slot = if let Some(s) = self.free_slots.pop() {
            self.reqs[s as usize] = req;
            self.slot_gen[s as usize] |= LIVE;
            s
        } else {
            let s = u32::try_from(self.reqs.len())
                .map_err(|_| invalid("the request table is full (2**32 requests)"))?;
            self.reqs.push(req);
            self.slot_gen.push(LIVE);
            s
        };
        self.next_uid += 1;
        self.index.insert(id.to_owned(), slot);
        Ok(slot)
    }

    /// Forgets the request in `slot` (named `id`); its handle dies with it.
    pub(crate) fn remove(&mut self, id: &str, slot: u32) {
        self.index.remove(id);
        self.reqs[slot as usize] = Request::vacant();
        let g = &mut self.slot_gen[slot as usize];
        *g = (*g & !LIVE).wrapping_add(1) & !LIVE;
        self.free_slots.push(slot);
    }

    /// Every live request with its slot.
    pub(crate) fn iter_slots(&self) -> impl Iterator<Item = (u32, &Request)> {
        self.reqs
            .iter()
            .zip(&self.slot_gen)
            .enumerate()
            .filter(|&(_, (_, &g))| g & LIVE != 0)
            .map(|(s, (r, _))| (s as u32, r))
    }

    /// Every live request.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &Request> {
        self.reqs
            .iter()
            .zip(&self.slot_gen)
            .filter(|&(_, &g)| g & LIVE != 0)
            .map(|(r, _)| r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::RequestSpec;

    fn request(uid: u64) -> Request {
        let spec = RequestSpec {
            prompt_token_ids: vec![1, 2, 3],
            ..RequestSpec::default()
        };
        Request::new(format!("r{uid}"), uid, spec, 1, 16, false).expect("valid request")
    }

    #[test]
    fn another_managers_handle_is_refused_even_for_the_same_slot() {
        let (mut a, mut b) = (RequestTable::new(7), RequestTable::new(8));
        let sa = a.insert("x", request(1)).expect("insert");
        let sb = b.insert("x", request(1)).expect("insert");
        assert_eq!(sa, sb);
        let ha = a.handle_of(sa);
        assert_eq!(a.slot_of_handle(ha), Ok(sa));
        let err = b.slot_of_handle(ha).expect_err("foreign handle");
        assert!(err.to_string().contains("another manager"), "{err}");
    }

    #[test]
    fn handles_keep_the_top_bit_clear_and_stay_small_until_a_slot_is_reused() {
        let mut t = RequestTable::new(u64::MAX);
        let s = t.insert("x", request(1)).expect("insert");
        let h = t.handle_of(s);
        assert_eq!(h >> 63, 0);
        assert!(h < 1 << 30, "{h:#x}: one digit of a Python int");
        assert!(t.slot_of_handle(h | 1 << 63).is_err());
        t.remove("x", s);
        let s2 = t.insert("y", request(2)).expect("insert");
        let h2 = t.handle_of(s2);
        assert_eq!(h2 as u32, h as u32, "same slot, same low word");
        assert_ne!(h2, h);
    }

    /// Whether a slot holds a request is its live bit: a vacated slot is
    /// skipped by `iter`, not `live`, its handle refused; refilled, it is live
    /// again under a new generation.
    #[test]
    fn a_vacated_slot_is_not_live() {
        let mut t = RequestTable::new(3);
        let slots: Vec<u32> = ["a", "b", "c"]
            .iter()
            .enumerate()
            .map(|(i, id)| t.insert(id, request(i as u64 + 1)).expect("insert"))
            .collect();
        let old = t.handle_of(slots[1]);
        t.remove("b", slots[1]);
        assert!(t.live(slots[1]).is_none() && t.live(slots[0]).is_some());
        assert!(t.live(99).is_none());
        let ids: Vec<&str> = t.iter().map(|r| r.id.as_str()).collect();
        assert_eq!(ids, ["r1", "r3"]);
        assert!(t.slot_of_handle(old).is_err());
        let s = t.insert("d", request(4)).expect("insert");
        assert_eq!(s, slots[1], "the slot is reused");
        assert_eq!(t.live(s).map(|r| r.uid), Some(4));
        assert_eq!(t.slot_of_handle(t.handle_of(s)), Ok(s));
        assert!(
            t.slot_of_handle(old).is_err(),
            "the old generation stays refused"
        );
        assert_eq!(t.iter().count(), 3);
    }

    #[test]
    fn a_vacated_slot_gets_a_new_generation() {
        let mut t = RequestTable::new(1);
        let s = t.insert("x", request(1)).expect("insert");
        let old = t.handle_of(s);
        t.remove("x", s);
        assert!(t.slot_of_handle(old).is_err());
        let s2 = t.insert("y", request(2)).expect("insert");
        assert_eq!(s, s2);
        assert_ne!(t.handle_of(s2), old);
        assert!(t.slot_of_handle(old).is_err());
        assert_eq!(t.next_uid(), 3);
    }
}
