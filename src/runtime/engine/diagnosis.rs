//! Why a round did not complete by its deadline ([`crate::runtime::TimeoutInfo`]).

use super::round::RoundState;
use super::{index_peer, Engine};
use crate::runtime::fragment::{fragment_range, fragments};
use crate::runtime::error::{CommError, Partial, Peer, TimeoutInfo};

impl Engine {
    /// The error of a round past its deadline: who did not answer (the
    /// root, receivers that did not acknowledge, the aggregator, ranks
    /// whose contributions are missing), how far it got, and, when asked
    /// for, the partial result.
    pub(super) fn timeout_error(&mut self, st: &mut RoundState) -> CommError {
        let opts = st.opts;
        let workers = self.cfg.workers();
        let mut missing: Vec<Peer> = Vec::new();
        let mut missing_known = true;
        let (mut arrived, mut expected) = (0usize, 0usize);
        let mut partial = None;
        let mut what = String::new();
        if let Some(c) = &st.contrib {
            if st.bin.is_none() && (c.next < c.nfrags || !self.agg_tx.is_idle()) {
                missing.push(Peer::Aggregator);
                arrived = c.nfrags - self.agg_tx.in_flight().min(c.nfrags) - (c.nfrags - c.next);
                expected = c.nfrags;
                what = "contribution fragments acknowledged".into();
            }
        }
        if let Some(b) = &st.bin {
            if !b.cov.is_complete() {
                missing.push(index_peer(b.root, workers));
                arrived = b.cov.have();
                expected = b.cov.total();
                what = "fragments received".into();
            }
        }
        if let Some(c) = &st.collect {
            if !c.cov.is_complete() {
                arrived = c.cov.have();
                expected = c.cov.total();
                what = "fragments reduced".into();
                let mut seen_missing = vec![false; workers as usize];
                let mut contributors = vec![workers; c.cov.total()];
                let mut values = if opts.partial {
                    // SAFETY: no `&mut` into c.out lives now.
                    Some(unsafe { c.out.slice() }.to_vec())
                } else {
                    None
                };
                if let Some(be) = self.backend.as_ref() {
                    for i in c.cov.missing() {
                        let off = (i * self.per) as u32;
                        let fs = be.fragment_state(st.round, off);
                        match &fs.contributors {
                            Some(ranks) => {
                                contributors[i] = ranks.len() as u16;
                                for r in 0..workers {
                                    if !ranks.contains(&r) {
                                        seen_missing[r as usize] = true;
                                    }
                                }
                            }
                            None => {
                                missing_known = false;
                                contributors[i] = 0;
                            }
                        }
                        if let Some(v) = values.as_mut() {
                            let range = fragment_range(i, v.len(), self.per);
                            match &fs.partial {
                                Some(p) if p.len() == range.len() => v[range].copy_from_slice(p),
                                _ => v[range].fill(0),
                            }
                        }
                    }
                }
                missing.extend(
                    (0..workers)
                        .filter(|&r| seen_missing[r as usize])
                        .map(Peer::Rank),
                );
                if let Some(values) = values {
                    partial = Some(Partial {
                        values,
                        contributors,
                        per_fragment: self.per,
                    });
                }
            }
        }
        if st.rout && st.collect.as_ref().is_some_and(|c| c.cov.is_complete()) {
            let pend = self.res_tx.unacked_dests();
            missing.extend(
                (0..workers)
                    .filter(|&r| pend & (1 << r) != 0)
                    .map(Peer::Rank),
            );
            let total = st.collect.as_ref().map_or(0, |c| c.cov.total());
            expected = total;
            arrived = total - self.res_tx.in_flight().min(total);
            what = "result fragments acknowledged by every worker".into();
        }
        if let Some(_b) = &st.bout {
            let pend = self.bc_tx.unacked_dests();
            if pend != 0 || st.collect.as_ref().is_some_and(|c| c.cov.is_complete()) {
                for i in 0..self.cfg.participants() {
                    if pend & (1 << i) != 0 {
                        let p = index_peer(i, workers);
                        if !missing.contains(&p) {
                            missing.push(p);
                        }
                    }
                }
                if what.is_empty() {
                    what = "broadcast fragments acknowledged by everyone".into();
                    let total = fragments(st.bout.as_ref().map_or(0, |b| b.len_bytes), self.chunk);
                    expected = total;
                    arrived = total
                        - self.bc_tx.in_flight().min(total)
                        - st.bout.as_ref().map_or(0, |b| b.queue.len()).min(total);
                }
            }
        }
        CommError::Timeout(Box::new(TimeoutInfo {
            op: st.name,
            round: st.round,
            missing,
            missing_known,
            arrived,
            expected,
            what,
            partial,
        }))
    }
}
