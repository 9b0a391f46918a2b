//! Counters per limit that leased and synced counting keep (leases, units leased,
//! expired, given back and synced, sync calls), by limit id: one rule's limit, whatever
//! its key.

/// Counters of one limit (by its id: one rule's limit, whatever its key).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LimitStats {
    /// Leases granted.
    pub leases: u64,
    /// Lease calls refused for want of room.
    pub leases_refused: u64,
    /// Units granted by leases.
    pub units_leased: u64,
    /// Leased units that expired unspent.
    pub units_expired: u64,
    /// Unspent leased units given back to the shared store.
    pub units_returned: u64,
    /// Units pushed by sync calls.
    pub units_synced: u64,
    /// Units of a global limit's exact charges sent back to the global store because a
    /// regional limit rejected their request (or its store failed).
    pub units_refunded: u64,
    /// Sync calls that carried this limit's keys (a call carrying several limits' keys
    /// counts once for each).
    pub sync_calls: u64,
    /// Of those, the calls that failed (their units are pushed again).
    pub sync_failures: u64,
}

/// The most limits [`PerLimit`] counts apart; past it, further ones are not counted per
/// limit (the totals still are).
const MAX_LIMITS_COUNTED: usize = 10_000;

/// [`LimitStats`] per limit id.
#[derive(Debug, Default)]
pub(crate) struct PerLimit(parking_lot::Mutex<std::collections::HashMap<u64, LimitStats>>);

impl PerLimit {
    /// Adds to limit `id`'s counters (rare events: leases and syncs, not decisions).
    pub(crate) fn add(&self, id: u64, f: impl FnOnce(&mut LimitStats)) {
        let mut map = self.0.lock();
        if map.len() >= MAX_LIMITS_COUNTED && !map.contains_key(&id) {
            return;
        }
        f(map.entry(id).or_default());
    }

    pub(crate) fn snapshot(&self) -> Vec<(u64, LimitStats)> {
        self.0.lock().iter().map(|(&id, &s)| (id, s)).collect()
    }
}
