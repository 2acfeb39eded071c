//! Where a node's rings sit in the ring maps (docs/RING.md
//! "Configuration"): each ring's dense index (`ring_jobs`, `ring_ctrl`,
//! `ring_members`, ...) and its region of `ring_data` / `ring_done` (two
//! buffers of its fragments from `base`), within the memory reserved when
//! the ring object loads: the file's rings at attach and `[node]
//! ring_pool` elements more.
//!
//! [`RingPool`] is a value with no map access: attach places the file's
//! rings in an empty pool (in file order from entry 0, as the rings always
//! sat); a reload, or a run that brings its ring, places the new set of
//! rings ([`RingPool::place`]): a ring that keeps its id and size keeps
//! its place (its base never moves while it lives), the others take the
//! first free region that fits and the lowest free dense index, in file
//! order. What does not fit is refused with the numbers, before anything
//! changes. Clearing a region before a new ring uses it is the writer's
//! (`XdpPlane::set_ring`).

use std::collections::BTreeMap;

use crate::config::RingConfig;
use crate::wire::abi;

use super::RingSizing;

/// One ring's place in the ring maps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingPlace {
    /// Dense index: key of `ring_jobs`, `ring_ctrl`, `ring_stats`,
    /// `ring_nexthop`, and `ring_members` / `AGGBOX_MAX_RANKS`.
    pub dense: u32,
    /// Its first `ring_data` / `ring_done` entry (`RingJob::base`).
    pub base: u32,
    /// Its entries: two buffers of its fragments (`RingJob::entries`).
    pub entries: u32,
}

/// The ring memory of a node and the rings placed in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RingPool {
    /// Elements of a `ring_data` value (one fragment), for every ring.
    frag_elems: u32,
    /// `ring_data` / `ring_done` entries the rings may use.
    entries: u32,
    /// The rings by id.
    rings: BTreeMap<u16, RingPlace>,
}

/// How much of the pool is used, in elements (a fragment counts
/// `frag_elems`, its two buffers once), as `aggbox status` shows it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct RingPoolUsage {
    /// Elements per fragment of every ring of the node.
    pub frag_elems: u32,
    /// Elements reserved at attach (the file's rings and `ring_pool`).
    pub reserved: u64,
    /// Elements of the rings placed now.
    pub used: u64,
    /// Elements not used (`reserved - used`).
    pub free: u64,
    /// Elements of the largest free region: the largest ring that fits.
    pub largest_free: u64,
}

/// Why rings could not be placed (nothing was placed).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RingPoolError {
    /// A ring's fragments are not the node's.
    #[error("ring {id} ({path}) has frag_elems {asked} where this node's ring memory holds fragments of {frag_elems} elements (fixed at attach: restart `aggbox attach` to change it)")]
    FragElems {
        /// The ring.
        id: u16,
        /// Its table in the file (`ring[i]`).
        path: String,
        /// Its `frag_elems`.
        asked: u32,
        /// The node's.
        frag_elems: u32,
    },
    /// No free region holds the ring.
    #[error("ring {id} ({path}) asks {asked} elements ({frags} fragments of {frag_elems}) but the ring pool has {free} free (the largest free region {largest_free}) of {reserved} reserved at attach ([node] ring_pool)")]
    NoRoom {
        /// The ring.
        id: u16,
        /// Its table in the file (`ring[i]`).
        path: String,
        /// Elements it takes (whole fragments).
        asked: u64,
        /// Its fragments.
        frags: u32,
        /// The node's fragment size.
        frag_elems: u32,
        /// Free elements once the rings before it were placed.
        free: u64,
        /// The largest free region then.
        largest_free: u64,
        /// Elements reserved at attach.
        reserved: u64,
    },
    /// Two rings of one id.
    #[error("ring {id} ({path}) is listed twice")]
    Twice {
        /// The ring.
        id: u16,
        /// Its second table.
        path: String,
    },
    /// More rings than `ring_jobs` has entries.
    #[error("ring {id} ({path}): the node serves at most {} rings at once", abi::MAX_RINGS)]
    TooMany {
        /// The ring.
        id: u16,
        /// Its table in the file.
        path: String,
    },
    /// The memory asked at attach does not fit a map's u32 entries.
    #[error("the rings and [node] ring_pool ask {entries} ring_data entries, more than a BPF map holds")]
    TooLarge {
        /// Entries asked.
        entries: u64,
    },
}

impl RingPool {
    /// The memory to reserve at attach for `rings` (the file's) and
    /// `pool_elems` elements more (`[node] ring_pool`, rounded up to whole
    /// fragments), fragments of `frag_elems`, with `rings` placed in file
    /// order from entry 0.
    pub fn reserve(rings: &[RingConfig], frag_elems: u32, pool_elems: u32) -> Result<RingPool, RingPoolError> {
        let frag_elems = frag_elems.max(1);
        let entries = rings.iter().map(|r| u64::from(r.frags()) * 2).sum::<u64>() + u64::from(pool_elems.div_ceil(frag_elems)) * 2;
        let entries = u32::try_from(entries).map_err(|_| RingPoolError::TooLarge { entries })?;
        RingPool { frag_elems, entries, rings: BTreeMap::new() }.place(rings)
    }

    /// A pool of `entries` with rings already placed (read back from a
    /// node's maps, for `aggbox status`).
    pub fn with_places(frag_elems: u32, entries: u32, rings: impl IntoIterator<Item = (u16, RingPlace)>) -> RingPool {
        RingPool { frag_elems: frag_elems.max(1), entries, rings: rings.into_iter().collect() }
    }

    /// How the ring object's maps are sized for this pool.
    pub fn sizing(&self) -> RingSizing {
        RingSizing { frag_elems: self.frag_elems, fragments: self.entries }
    }

    /// Elements per fragment of every ring of the node.
    pub fn frag_elems(&self) -> u32 {
        self.frag_elems
    }

    /// Ring `id`'s place, if placed.
    pub fn place_of(&self, id: u16) -> Option<RingPlace> {
        self.rings.get(&id).copied()
    }

    /// The pool with exactly `rings` placed (the node's rings after a
    /// reload, in file order): a ring placed now with the same id and
    /// entries keeps its place; the others (new, resized, or another
    /// ring's id) take the first free region that holds them, in file
    /// order, and the lowest free dense index; what is not in `rings` is
    /// freed. Refused as a whole when one does not fit.
    pub fn place(&self, rings: &[RingConfig]) -> Result<RingPool, RingPoolError> {
        let path = |i: usize| format!("ring[{i}]");
        let mut placed: BTreeMap<u16, RingPlace> = BTreeMap::new();
        for (i, ring) in rings.iter().enumerate() {
            if rings[..i].iter().any(|r| r.id == ring.id) {
                return Err(RingPoolError::Twice { id: ring.id, path: path(i) });
            }
            if ring.frag_elems != self.frag_elems {
                return Err(RingPoolError::FragElems { id: ring.id, path: path(i), asked: ring.frag_elems, frag_elems: self.frag_elems });
            }
            if let Some(place) = self.place_of(ring.id).filter(|p| u64::from(p.entries) == ring_entries(ring)) {
                placed.insert(ring.id, place);
            }
        }
        for (i, ring) in rings.iter().enumerate() {
            if placed.contains_key(&ring.id) {
                continue;
            }
            let taken = RingPool { frag_elems: self.frag_elems, entries: self.entries, rings: placed.clone() };
            let Some(dense) = (0..abi::MAX_RINGS).find(|d| !placed.values().any(|p| p.dense == *d)) else {
                return Err(RingPoolError::TooMany { id: ring.id, path: path(i) });
            };
            let want = ring_entries(ring);
            let Some(base) = taken.free_regions().into_iter().find(|&(_, len)| u64::from(len) >= want).map(|(base, _)| base) else {
                let usage = taken.usage();
                return Err(RingPoolError::NoRoom {
                    id: ring.id,
                    path: path(i),
                    asked: want / 2 * u64::from(self.frag_elems),
                    frags: ring.frags(),
                    frag_elems: self.frag_elems,
                    free: usage.free,
                    largest_free: usage.largest_free,
                    reserved: usage.reserved,
                });
            };
            // `want` fits a free region of u32 entries.
            placed.insert(ring.id, RingPlace { dense, base, entries: want as u32 });
        }
        Ok(RingPool { frag_elems: self.frag_elems, entries: self.entries, rings: placed })
    }

    /// The free regions (first entry, entries), ascending.
    fn free_regions(&self) -> Vec<(u32, u32)> {
        let mut used: Vec<(u32, u32)> = self.rings.values().map(|p| (p.base, p.entries)).collect();
        used.sort_unstable();
        let mut out = Vec::new();
        let mut next = 0u32;
        for (base, entries) in used {
            if base > next {
                out.push((next, base - next));
            }
            next = next.max(base.saturating_add(entries));
        }
        if self.entries > next {
            out.push((next, self.entries - next));
        }
        out
    }

    /// Reserved, used and free elements.
    pub fn usage(&self) -> RingPoolUsage {
        let elems = |entries: u64| entries / 2 * u64::from(self.frag_elems);
        let reserved = elems(u64::from(self.entries));
        let used = self.rings.values().map(|p| elems(u64::from(p.entries))).sum::<u64>();
        let largest = self.free_regions().iter().map(|&(_, len)| u64::from(len)).max().unwrap_or(0);
        RingPoolUsage {
            frag_elems: self.frag_elems,
            reserved,
            used,
            free: reserved.saturating_sub(used),
            largest_free: elems(largest),
        }
    }
}

/// The entries `ring` takes: two buffers of its fragments.
fn ring_entries(ring: &RingConfig) -> u64 {
    2 * u64::from(ring.frags())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ring(id: u16, vector_len: u32) -> RingConfig {
        RingConfig {
            id,
            port: 7400 + id,
            members: vec!["10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap()],
            weights: vec![1, 1],
            vector_len,
            frag_elems: 10,
        }
    }

    fn place(pool: &RingPool, id: u16) -> (u32, u32, u32) {
        let p = pool.place_of(id).unwrap_or_else(|| panic!("ring {id} placed"));
        (p.dense, p.base, p.entries)
    }

    #[test]
    fn the_files_rings_sit_in_file_order_from_entry_0_and_the_pool_after_them() {
        let pool = RingPool::reserve(&[ring(40, 25), ring(41, 10)], 10, 0).unwrap();
        assert_eq!((place(&pool, 40), place(&pool, 41)), ((0, 0, 6), (1, 6, 2)));
        assert_eq!(pool.sizing(), RingSizing { frag_elems: 10, fragments: 8 });
        assert_eq!(pool.usage(), RingPoolUsage { frag_elems: 10, reserved: 40, used: 40, free: 0, largest_free: 0 });
        // 35 elements more: 4 fragments, rounded up.
        let pool = RingPool::reserve(&[ring(40, 25), ring(41, 10)], 10, 35).unwrap();
        assert_eq!(pool.sizing().fragments, 16);
        assert_eq!(pool.usage(), RingPoolUsage { frag_elems: 10, reserved: 80, used: 40, free: 40, largest_free: 40 });
        assert_eq!(RingPool::reserve(&[], 10, 0).unwrap().usage().reserved, 0);
    }

    #[test]
    fn a_kept_ring_never_moves_and_freed_regions_and_indices_are_reused() {
        let pool = RingPool::reserve(&[ring(40, 20), ring(41, 20)], 10, 60).unwrap();
        assert_eq!((place(&pool, 40), place(&pool, 41)), ((0, 0, 4), (1, 4, 4)));
        // 40 removed, 42 added (needs 6 entries: not in 40's 4), 43 fits 40's.
        let next = pool.place(&[ring(41, 20), ring(42, 30), ring(43, 20)]).unwrap();
        assert_eq!(place(&next, 41), (1, 4, 4), "a kept ring keeps its dense index and base");
        assert_eq!(place(&next, 42), (0, 8, 6), "first fit after 41, the lowest free dense index");
        assert_eq!(place(&next, 43), (2, 0, 4), "first fit: 40's freed region");
        assert_eq!(next.place_of(40), None);
        // 41 resized: a new place; its old region is free for the others.
        let resized = next.place(&[ring(41, 30), ring(42, 30), ring(43, 20)]).unwrap();
        assert_eq!(place(&resized, 41), (1, 14, 6));
        assert_eq!((place(&resized, 42), place(&resized, 43)), (place(&next, 42), place(&next, 43)));
        // The same rings again: nothing moves.
        assert_eq!(resized.place(&[ring(43, 20), ring(42, 30), ring(41, 30)]).unwrap(), resized);
    }

    #[test]
    fn what_does_not_fit_is_refused_with_the_numbers() {
        let pool = RingPool::reserve(&[ring(40, 20)], 10, 40).unwrap();
        let err = pool.place(&[ring(40, 20), ring(44, 50)]).unwrap_err();
        assert_eq!(
            err,
            RingPoolError::NoRoom { id: 44, path: "ring[1]".into(), asked: 50, frags: 5, frag_elems: 10, free: 40, largest_free: 40, reserved: 60 }
        );
        let text = err.to_string();
        assert!(text.contains("ring 44 (ring[1]) asks 50 elements") && text.contains("40 free"), "{text}");
        // Free enough in all, but not in one region: 20 + 20 free, around a ring of 20.
        let pool = RingPool::reserve(&[ring(40, 20), ring(41, 20), ring(42, 20)], 10, 0).unwrap();
        let holes = pool.place(&[ring(41, 20)]).unwrap();
        assert_eq!(holes.usage().free, 40);
        match holes.place(&[ring(41, 20), ring(45, 30)]).unwrap_err() {
            RingPoolError::NoRoom { free, largest_free, .. } => assert_eq!((free, largest_free), (40, 20)),
            other => panic!("{other:?}"),
        }
        assert!(matches!(pool.place(&[ring(41, 20), ring(41, 20)]), Err(RingPoolError::Twice { id: 41, .. })));
        let mut odd = ring(46, 20);
        odd.frag_elems = 12;
        assert!(matches!(pool.place(&[odd]), Err(RingPoolError::FragElems { id: 46, asked: 12, frag_elems: 10, .. })));
    }

    #[test]
    fn dense_indices_run_out_at_max_rings() {
        let rings: Vec<RingConfig> = (0..abi::MAX_RINGS as u16).map(|i| ring(i, 10)).collect();
        let pool = RingPool::reserve(&rings, 10, 10).unwrap();
        let mut more = rings[1..].to_vec();
        more.push(ring(100, 10));
        assert_eq!(place(&pool.place(&more).unwrap(), 100), (0, 0, 2), "ring 0's dense index and region");
        let mut too_many = rings.clone();
        too_many.push(ring(100, 10));
        assert!(matches!(pool.place(&too_many), Err(RingPoolError::TooMany { id: 100, .. })));
    }
}
