//! New data within the send windows: a worker's contribution fragments
//! (encoded, floats quantized, straight from the caller's slice into the
//! window's buffer), broadcast fragments and the results the aggregator
//! forwards, handed to the driver in batches.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Instant;

use super::round::{RoundState, Src};
use super::{Engine, Participant, TxWin};
use crate::wire::abi;
use crate::wire::proto::{self, AggHeader, BcastHeader, RuntimeSubHeader};
use crate::runtime::fragment::fragment_range;
use crate::runtime::outbox::Transmit;
use crate::runtime::quantize;
use crate::runtime::transport::BATCH_MAX;

impl Engine {
    /// Sends new datagrams while the windows allow.
    pub(super) fn pump(&mut self, st: &mut RoundState, now: Instant, tx: &mut impl Transmit) {
        let job = self.cfg.job;
        if let Some(c) = st.contrib.as_mut() {
            let rank = match self.cfg.me {
                Participant::Worker(r) => r,
                Participant::Aggregator => abi::RESULT_RANK,
            };
            let target = self.cfg.contrib_target();
            // An allreduce worker stays within half the aggregator's slots
            // of the first result it lacks. Every fragment below that one
            // is complete, so all workers' fragments in flight fit the
            // slots whatever the scheduler does: the socket aggregator
            // acknowledges on arrival, and a worker favoured by it ran ahead
            // of a slow one until the slots were full, then had its windows
            // dropped and resent after timeouts (docs/RUNTIME.md, "Not done").
            let ahead = st.bin.as_ref().map_or(usize::MAX, |b| {
                b.cov.first_missing() + (self.cfg.slots as usize / 2).max(1)
            });
            while c.next < c.nfrags && c.next < ahead && self.agg_tx.can_send() {
                let r = fragment_range(c.next, c.src.len(), self.per);
                let mut hdr = AggHeader {
                    job,
                    rank,
                    seq: 0,
                    round: st.round,
                    frag_off: r.start as u32,
                    op: c.op,
                    flags: if c.next + 1 == c.nfrags {
                        abi::AGG_F_LAST_FRAGMENT
                    } else {
                        0
                    },
                    count: r.len() as u16,
                };
                let src = &c.src;
                let res = self.agg_tx.send(
                    1,
                    now,
                    |seq, buf| {
                        hdr.seq = seq;
                        match src {
                            Src::I32(v) => proto::encode_agg_into(&hdr, &v[r], buf),
                            Src::RawI32(x) => {
                                // Encoded straight from the caller's slice.
                                // SAFETY: as for F32 below.
                                let xs = unsafe { x.slice() };
                                proto::encode_agg_into(&hdr, &xs[r], buf)
                            }
                            Src::F32 { x, scale } => {
                                // Quantized straight into the datagram buffer.
                                // SAFETY: no reference into x lives while this
                                // one does (results land only in fragments
                                // already sent, and not now).
                                let xs = unsafe { x.slice() };
                                let at = buf.len();
                                proto::write_agg_header(&hdr, buf);
                                if quantize::quantize_be_into(&xs[r], *scale, buf) {
                                    // A clamped value: the aggregator carries
                                    // OVERFLOW into the RESULT, so every
                                    // participant fails (Fixed) or reruns
                                    // (FixedOrAdaptive) instead of returning a
                                    // sum of clamped values.
                                    buf[at + proto::AGG_FLAGS_OFF] |= abi::AGG_F_OVERFLOW;
                                }
                                Ok(())
                            }
                            Src::Len(_) => proto::encode_agg_into(&hdr, &[], buf),
                        }
                    },
                    &mut |_, _| {},
                );
                debug_assert!(res.map_or(true, |s| s == c.seq_base.wrapping_add(c.next as u32)));
                if let Ok(seq) = res {
                    self.txq.push((TxWin::Agg, seq, target));
                }
                c.next += 1;
            }
        }
        if let Some(b) = st.bout.as_mut() {
            let addrs = &self.addrs;
            let tc = self.tc.as_ref();
            let txq = &mut self.txq;
            while self.bc_tx.can_send() {
                let Some(&i) = b.queue.front() else { break };
                let i = i as usize;
                let start = i * self.chunk;
                let end = (start + self.chunk).min(b.len_bytes);
                let sub = RuntimeSubHeader {
                    round: st.round,
                    offset: start as u32,
                    overflow: b.overflow.contains(i),
                };
                let (mut mask, group) = match tc {
                    Some(t) => (t.mask(b.dests), t.id),
                    None => ((b.dests & 0xffff_ffff) as u32, job),
                };
                let hdr = BcastHeader {
                    mask,
                    seq: 0,
                    group,
                    flags: 0,
                    hops: 0,
                };
                let (bytes, ints) = match st.collect.as_ref() {
                    // SAFETY: nothing writes into c.out while this lives.
                    Some(c) => (&[][..], Some(&unsafe { c.out.slice() }[start / 4..end / 4])),
                    None => (&b.bytes[start..end], None),
                };
                let mark = txq.len();
                let res = self.bc_tx.send::<()>(
                    b.dests,
                    now,
                    |seq, buf| {
                        let h = BcastHeader { seq, ..hdr };
                        buf.extend_from_slice(&proto::bcast_header_bytes(&h));
                        sub.encode_into(buf);
                        match ints {
                            Some(v) => proto::write_i32_be(v, buf),
                            None => buf.extend_from_slice(bytes),
                        }
                        Ok(())
                    },
                    &mut |d, _| match tc {
                        // One datagram with the full mask (already in its
                        // header) to the first member: the TC program copies it.
                        Some(t) => {
                            if mask != 0 {
                                txq.push((TxWin::Bcast, 0, t.first));
                                mask = 0;
                            }
                        }
                        None => txq.push((TxWin::Bcast, 0, addrs[d])),
                    },
                );
                match res {
                    Ok(seq) => txq[mark..].iter_mut().for_each(|e| e.1 = seq),
                    Err(()) => txq.truncate(mark),
                }
                b.queue.pop_front();
            }
        }
        self.flush_tx(tx);
    }

    /// Hands the new datagrams [`Engine::pump`] registered to `tx` in
    /// batches (`sendmmsg`), straight from the send windows' buffers; with UDP GSO
    /// ordered by destination first (stable: each destination keeps its
    /// order), so each destination's datagrams form runs.
    fn flush_tx(&mut self, tx: &mut impl Transmit) {
        const NONE: (&[u8], SocketAddr) = (&[], SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0));
        let gso = self.cfg.udp_gso == Some(true);
        if gso {
            self.txq
                .sort_by_key(|&(_, _, to)| (to.ip(), to.port()));
        }
        let mut msgs = [NONE; BATCH_MAX];
        for chunk in self.txq.chunks(BATCH_MAX) {
            let mut n = 0;
            for &(w, seq, to) in chunk {
                let win = match w {
                    TxWin::Agg => &self.agg_tx,
                    TxWin::Bcast => &self.bc_tx,
                };
                if let Some(b) = win.bytes_of(seq) {
                    msgs[n] = (b, to);
                    n += 1;
                }
            }
            if n > 0 {
                tx.send_batch(&msgs[..n], gso);
            }
        }
        self.txq.clear();
    }
}
