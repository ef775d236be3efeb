//! Releasing a request's blocks through the coordinator: freeing them,
//! popping them for an engine that frees them later, the Mamba boundary-state
//! offloads and partial tails a request leaves, and pending copy-on-write pairs.

use super::Coordinator;
use crate::pool::BlockId;
use crate::request::Request;
use crate::single_type::GroupManager;

impl Coordinator {
    /// Releases every block of the request, tail first.
    pub(crate) fn free(&mut self, req: &mut Request) {
        self.free_groups(req, self.groups.len());
    }

    /// Frees the request's blocks in the groups before `until` (all of them
    /// with `until` = the group count), in group order, each group's blocks
    /// tail first. A HiSparse resident row returns its engine-held references
    /// (those the engine still holds: a page it unpinned is skipped).
    pub(crate) fn free_groups(&mut self, req: &mut Request, until: usize) {
        let (id, groups) = req.id_and_groups_mut();
        for (gm, gb) in self.groups.iter_mut().zip(groups).take(until) {
            gm.drop_boundary_offloads(id);
            if gm.is_hisparse_resident() {
                let mut row = GroupManager::resident_release(gb);
                row.reverse();
                row.retain(|&b| self.pool.engine_release_one(b));
                self.pool.free_blocks(row);
            } else {
                GroupManager::free(&mut self.pool, gb);
            }
        }
    }

    /// Detaches every block of the request without freeing any: group by
    /// group, allocation order, leading null blocks dropped. The engine holds
    /// one reference per block listed.
    pub(crate) fn pop_blocks(&mut self, req: &mut Request) -> Vec<BlockId> {
        self.pop_groups(req, self.groups.len())
    }

    /// [`Self::pop_blocks`] of the groups before `until`.
    pub(crate) fn pop_groups(&mut self, req: &mut Request, until: usize) -> Vec<BlockId> {
        let mut out = Vec::new();
        let (id, groups) = req.id_and_groups_mut();
        for (gm, gb) in self.groups.iter_mut().zip(groups).take(until) {
            gm.drop_boundary_offloads(id);
            if gm.is_hisparse_resident() {
                // Already engine-held.
                out.extend(GroupManager::resident_release(gb));
            } else {
                let start = out.len();
                GroupManager::pop_blocks(gb, &mut out);
                for &b in &out[start..] {
                    self.pool.engine_hold(b);
                }
            }
        }
        out
    }

    /// Drains every group's boundary-state offers, `(request id, group, block,
    /// tokens)`.
    pub(crate) fn take_boundary_offloads(&mut self) -> Vec<(String, u32, BlockId, u64)> {
        let mut out = Vec::new();
        for gm in &mut self.groups {
            gm.take_boundary_offloads(&mut out);
        }
        out
    }

    /// The producer partial tails a finishing request leaves as valid sources,
    /// `(group, block, tokens)`.
    pub(crate) fn finalize_partial_tails(
        &self,
        req: &mut Request,
        num_computed: u64,
        num_in_flight: u64,
    ) -> Vec<(u32, BlockId, u64)> {
        let mut out = Vec::new();
        for (g, gm) in self.groups.iter().enumerate() {
            if let Some((b, t)) =
                gm.finalize_partial_tail(&mut req.groups_mut()[g], num_computed, num_in_flight)
            {
                out.push((g as u32, b, t));
            }
        }
        out
    }

    /// Drains every group's copy-on-write pairs `(source, copy)`; each endpoint
    /// holds one reference the caller now owns.
    pub(crate) fn take_pending_cow(&mut self) -> Vec<(BlockId, BlockId)> {
        let mut out = Vec::new();
        for gm in &mut self.groups {
            gm.take_pending_cow(&mut out);
        }
        out
    }

    /// Block references held for copies not yet handed out.
    pub(crate) fn pending_cow_refs(&self) -> impl Iterator<Item = BlockId> + '_ {
        self.groups
            .iter()
            .flat_map(|gm| gm.pending_cow().iter().flat_map(|&(a, b)| [a, b]))
    }
}
