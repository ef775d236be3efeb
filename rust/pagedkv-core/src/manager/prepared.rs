//! Requests built and hashed away from their manager: an engine's input thread
//! (vLLM builds its `Request`s, block hashes included, in its input thread)
//! prepares each arriving request with a [`RequestPreparer`], which needs no
//! access to the manager; the scheduler's thread then only registers it
//! ([`KvCacheManager::add_prepared`]): no token copy, no hashing and no
//! allocation of the request's vectors on the scheduler's step.

use super::KvCacheManager;
use crate::error::{Error, Result, invalid};
use crate::hash::BlockHasher;
use crate::request::{Request, RequestSpec};
use crate::request_table::RequestHandle;

/// What building and hashing a request for one manager needs, taken from the
/// manager once ([`KvCacheManager::request_preparer`]); it may be cloned and
/// sent to other threads.
#[derive(Clone, Debug)]
pub struct RequestPreparer {
    manager_uid: u64,
    hasher: BlockHasher,
    hash_block_size: usize,
    num_groups: usize,
    max_model_len: u64,
    verify: bool,
    hashing: bool,
}

/// A request built and hashed by a [`RequestPreparer`], for its manager's
/// [`KvCacheManager::add_prepared`].
#[derive(Debug)]
pub struct PreparedRequest {
    manager_uid: u64,
    req: Box<Request>,
}

impl PreparedRequest {
    /// The request's id.
    #[must_use]
    pub fn id(&self) -> &str {
        &self.req.id
    }

    /// The prompt's length in tokens.
    #[must_use]
    pub fn num_tokens(&self) -> usize {
        self.req.num_tokens()
    }

    /// How many block hashes the preparation computed (every full block of the
    /// prompt when the manager hashes; none when it does not).
    #[must_use]
    pub fn num_block_hashes(&self) -> usize {
        self.req.hashes().len()
    }
}

impl RequestPreparer {
    /// The longest prompt its manager takes.
    #[must_use]
    pub fn max_model_len(&self) -> u64 {
        self.max_model_len
    }

    /// The most token ids one prompt may carry ([`crate::ManagerConfig::token_limit`]).
    #[must_use]
    pub fn token_limit(&self) -> usize {
        crate::spec::fields::token_limit(self.max_model_len)
    }

    /// Builds the request `id` and hashes its full prompt blocks, as
    /// [`KvCacheManager::add_request`] would, without the manager.
    ///
    /// # Errors
    /// As [`KvCacheManager::add_request`], except a duplicate id (found when the
    /// request is added).
    pub fn prepare(&self, id: &str, spec: RequestSpec) -> Result<PreparedRequest> {
        check_prompt(&spec, self.max_model_len)?;
        let mut req = Request::new(
            id.to_owned(),
            0,
            spec,
            self.num_groups,
            self.hash_block_size,
            self.verify,
        )?;
        if self.hashing {
            req.update_hashes(&mut self.hasher.same_kind(), self.hash_block_size);
        }
        Ok(PreparedRequest {
            manager_uid: self.manager_uid,
            req: Box::new(req),
        })
    }
}

/// Refuses an empty prompt and one longer than `max_model_len`.
pub(super) fn check_prompt(spec: &RequestSpec, max_model_len: u64) -> Result<()> {
    if spec.prompt_token_ids.is_empty() {
        return Err(invalid("prompt_token_ids must not be empty"));
    }
    if spec.prompt_token_ids.len() as u64 > max_model_len {
        return Err(invalid(format!(
            "prompt of {} tokens is longer than max_model_len {max_model_len}",
            spec.prompt_token_ids.len(),
        )));
    }
    Ok(())
}

impl KvCacheManager {
    /// A preparer of this manager's requests (see [`RequestPreparer`]).
    ///
    /// # Errors
    /// A manager built with `external_block_hashes` (its engine registers
    /// requests by their length and hashes: there is nothing to prepare).
    pub fn request_preparer(&self) -> Result<RequestPreparer> {
        if self.cfg.external_block_hashes {
            return Err(invalid(
                "a manager built with external_block_hashes takes its requests from the \
                 engine (add_request and sync_request): it has no request preparer",
            ));
        }
        Ok(RequestPreparer {
            manager_uid: self.uid,
            hasher: self.hasher.same_kind(),
            hash_block_size: self.hash_block_size,
            num_groups: self.num_groups(),
            max_model_len: self.cfg.max_model_len,
            verify: self.cfg.verify_cached_tokens && self.cfg.enable_caching,
            hashing: self.hashing(),
        })
    }

    /// Whether [`Self::add_prepared`] would take `p`: prepared by this manager's
    /// preparer, its id not known.
    ///
    /// # Errors
    /// A request prepared for another manager; a duplicate id.
    pub fn check_prepared(&self, p: &PreparedRequest) -> Result<()> {
        if p.manager_uid != self.uid {
            return Err(invalid(format!(
                "request {:?} was prepared by another manager's request preparer",
                p.req.id
            )));
        }
        if self.table.contains(&p.req.id) {
            return Err(Error::DuplicateRequest(p.req.id.clone()));
        }
        Ok(())
    }

    /// Registers a prepared request: what [`Self::add_request`] does, the
    /// request already built and hashed (whether a manager hashes is fixed
    /// when it is built, so its preparer hashed what it would).
    ///
    /// # Errors
    /// As [`Self::check_prepared`] (nothing changes then); the request table
    /// full (2**32 requests).
    pub fn add_prepared(&mut self, p: PreparedRequest) -> Result<RequestHandle> {
        self.check_prepared(&p)?;
        let mut req = *p.req;
        req.uid = self.table.next_uid();
        // The table keys its own copy of the id; the request keeps this one.
        let id = std::mem::take(&mut req.id);
        let slot = self.table.insert(&id, req)?;
        self.table.get_mut(slot).id = id;
        Ok(self.table.handle_of(slot))
    }
}

#[cfg(test)]
mod tests {
    use crate::{AllocateArgs, Error, KvCacheManager, ManagerConfig, RequestSpec};

    fn manager(events: bool) -> KvCacheManager {
        let mut cfg = ManagerConfig::full_attention(64, 16, 4096);
        cfg.enable_kv_cache_events = events;
        KvCacheManager::new(cfg).unwrap_or_else(|e| panic!("{e}"))
    }

    fn spec(tokens: impl IntoIterator<Item = u32>) -> RequestSpec {
        RequestSpec {
            prompt_token_ids: tokens.into_iter().collect(),
            cache_salt: Some("salt".into()),
            ..RequestSpec::default()
        }
    }

    /// Two requests sharing three blocks, registered through a preparer on one
    /// manager and by `add_request` on another: the same hashes, hits, block ids
    /// and events.
    #[test]
    fn a_prepared_request_behaves_as_an_added_one() {
        let (mut added, mut via_preparer) = (manager(true), manager(true));
        let preparer = via_preparer
            .request_preparer()
            .unwrap_or_else(|e| panic!("{e}"));
        let prompts = [
            (0..60).collect::<Vec<u32>>(),
            (0..48).chain(900..910).collect(),
        ];
        for (i, prompt) in prompts.iter().enumerate() {
            let id = format!("r{i}");
            added
                .add_request(&id, spec(prompt.clone()))
                .unwrap_or_else(|e| panic!("{e}"));
            let p = preparer
                .prepare(&id, spec(prompt.clone()))
                .unwrap_or_else(|e| panic!("{e}"));
            assert_eq!((p.id(), p.num_tokens()), (id.as_str(), prompt.len()));
            assert_eq!(p.num_block_hashes(), prompt.len() / 16);
            let h = via_preparer
                .add_prepared(p)
                .unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(via_preparer.request_handle(&id).ok(), Some(h));
            assert_eq!(
                added.block_hashes(&id).ok(),
                via_preparer.block_hashes(&id).ok()
            );
            for m in [&mut added, &mut via_preparer] {
                let hit = m.get_computed_blocks(&id).unwrap_or_else(|e| panic!("{e}"));
                let n = prompt.len() as u64 - hit.num_computed_tokens;
                let args = AllocateArgs {
                    num_new_computed_tokens: hit.num_computed_tokens,
                    ..AllocateArgs::step(n, 0)
                };
                m.allocate_slots(&id, &args, Some(&hit))
                    .unwrap_or_else(|e| panic!("{e}"));
            }
            assert_eq!(
                added.block_ids(&id).ok(),
                via_preparer.block_ids(&id).ok(),
                "{id}"
            );
        }
        assert_eq!(added.take_events(), via_preparer.take_events());
        via_preparer
            .check_invariants()
            .unwrap_or_else(|e| panic!("{e}"));
    }

    /// A preparer is sent to another thread; what it prepares there is added
    /// here.
    #[test]
    fn requests_are_prepared_on_another_thread() {
        let mut m = manager(false);
        let preparer = m.request_preparer().unwrap_or_else(|e| panic!("{e}"));
        let done = std::thread::spawn(move || {
            (0..4)
                .map(|i| preparer.prepare(&format!("t{i}"), spec(i * 100..i * 100 + 40)))
                .collect::<Vec<_>>()
        })
        .join()
        .unwrap_or_else(|_| panic!("the preparing thread panicked"));
        let mut reference = manager(false);
        for (i, p) in done.into_iter().enumerate() {
            let p = p.unwrap_or_else(|e| panic!("{e}"));
            let id = p.id().to_owned();
            m.add_prepared(p).unwrap_or_else(|e| panic!("{e}"));
            let start = i as u32 * 100;
            reference
                .add_request(&id, spec(start..start + 40))
                .unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(m.block_hashes(&id).ok(), reference.block_hashes(&id).ok());
        }
    }

    /// Refused: a request prepared for another manager, a known id, a prompt
    /// too long or empty; nothing changes.
    #[test]
    fn bad_prepared_requests_are_refused_and_change_nothing() {
        let (mut a, b) = (manager(false), manager(false));
        let pa = a.request_preparer().unwrap_or_else(|e| panic!("{e}"));
        let pb = b.request_preparer().unwrap_or_else(|e| panic!("{e}"));
        let other = pb
            .prepare("x", spec(0..20))
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(matches!(
            a.check_prepared(&other),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            a.add_prepared(other),
            Err(Error::InvalidArgument(_))
        ));
        a.add_request("x", spec(0..20))
            .unwrap_or_else(|e| panic!("{e}"));
        let dup = pa
            .prepare("x", spec(0..20))
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(matches!(
            a.add_prepared(dup),
            Err(Error::DuplicateRequest(_))
        ));
        assert!(pa.prepare("long", spec(0..4097)).is_err());
        assert!(pa.prepare("empty", spec([])).is_err());
        assert_eq!(a.num_requests(), 1);
        a.check_invariants().unwrap_or_else(|e| panic!("{e}"));
    }

    /// A manager that takes its hashes from the engine has nothing to prepare.
    #[test]
    fn an_engine_hashed_manager_has_no_preparer() {
        let mut cfg = ManagerConfig::full_attention(64, 16, 4096);
        cfg.external_block_hashes = true;
        let m = KvCacheManager::new(cfg).unwrap_or_else(|e| panic!("{e}"));
        assert!(m.request_preparer().is_err());
    }
}
