//! What the communicator's state machine (`runtime::engine`) sends,
//! and the seam between it and the I/O driver.
//!
//! The state machine never touches a socket: datagrams it produces while it
//! handles an arriving datagram (`AGK1` acknowledgements, retransmissions an
//! ACK's holes call for, the backends' contribution ACKs) are queued in an
//! [`Outbox`]; the driver hands them, with the new data the send windows
//! allow and what the timers fire, to a [`Transmit`] when it polls. New
//! data is handed as borrowed slices of the send windows' buffers, so the
//! batched send path (`sendmmsg`, UDP GSO) copies nothing; what the outbox
//! holds is small (ACKs) or rare (retransmissions). A retransmission is
//! copied into a buffer of its own, kept for the next one, so that a burst
//! of them costs at most one datagram-sized allocation each, once, and
//! never regrows (and copies) one buffer holding them all.

use std::net::SocketAddr;

use crate::wire::proto::{AckKind, AckMessage, SeqBitmap};

/// Where the state machine's datagrams go: the I/O driver's socket
/// ([`crate::runtime::transport::Net`]), or a test's list.
pub trait Transmit {
    /// A first transmission of one datagram (an `AGK1`, or data).
    fn send(&mut self, to: SocketAddr, datagram: &[u8]);
    /// A retransmission of a data datagram.
    fn resend(&mut self, to: SocketAddr, datagram: &[u8]);
    /// First transmissions of data datagrams, in order, as one batch;
    /// `gso`: runs to one destination may go as UDP GSO super-datagrams.
    fn send_batch(&mut self, datagrams: &[(&[u8], SocketAddr)], gso: bool);
}

/// Where a queued datagram's bytes are.
#[derive(Debug, Clone, Copy)]
enum Bytes {
    /// `bytes[start..start + len]` of the outbox.
    Shared { start: usize, len: usize },
    /// `resends[k]` of the outbox (a retransmission).
    Own(usize),
}

/// One queued datagram.
#[derive(Debug, Clone, Copy)]
struct Queued {
    to: SocketAddr,
    bytes: Bytes,
}

/// Datagrams produced between two polls of the state machine, in the order
/// they were produced: first transmissions' bytes in one reused buffer,
/// each retransmission in a reused buffer of its own.
#[derive(Debug, Default)]
pub struct Outbox {
    bytes: Vec<u8>,
    resends: Vec<Vec<u8>>,
    spare: Vec<Vec<u8>>,
    queued: Vec<Queued>,
}

impl Outbox {
    /// An empty outbox.
    pub fn new() -> Outbox {
        Outbox::default()
    }

    /// Queues a first transmission of `datagram` to `to`.
    pub fn send(&mut self, to: SocketAddr, datagram: &[u8]) {
        let start = self.bytes.len();
        self.bytes.extend_from_slice(datagram);
        self.queued.push(Queued {
            to,
            bytes: Bytes::Shared { start, len: datagram.len() },
        });
    }

    /// Queues a retransmission of `datagram` to `to`.
    pub fn resend(&mut self, to: SocketAddr, datagram: &[u8]) {
        let mut b = self.spare.pop().unwrap_or_default();
        b.clear();
        b.extend_from_slice(datagram);
        self.resends.push(b);
        self.queued.push(Queued {
            to,
            bytes: Bytes::Own(self.resends.len() - 1),
        });
    }

    /// Encodes and queues one `AGK1` (`id`: the job or broadcast group,
    /// `rank`: whose datagrams it acknowledges, or the sender's index).
    pub fn ack(&mut self, id: u16, rank: u16, kind: AckKind, bm: &SeqBitmap, to: SocketAddr) {
        let msg = AckMessage {
            id,
            rank,
            kind,
            flags: 0,
            bitmap: *bm,
        };
        let start = self.bytes.len();
        if msg.encode_into(&mut self.bytes).is_ok() {
            self.queued.push(Queued {
                to,
                bytes: Bytes::Shared {
                    start,
                    len: self.bytes.len() - start,
                },
            });
        } else {
            self.bytes.truncate(start);
        }
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.queued.is_empty()
    }

    /// The queued datagrams: (destination, bytes, whether a retransmission).
    pub fn datagrams(&self) -> impl Iterator<Item = (SocketAddr, &[u8], bool)> + '_ {
        self.queued.iter().map(|q| {
            let (b, resend) = self.bytes_of(q);
            (q.to, b, resend)
        })
    }

    /// A queued datagram's bytes and whether it is a retransmission.
    fn bytes_of(&self, q: &Queued) -> (&[u8], bool) {
        match q.bytes {
            Bytes::Shared { start, len } => (&self.bytes[start..start + len], false),
            Bytes::Own(k) => (&self.resends[k], true),
        }
    }

    /// Hands every queued datagram to `tx`, in order, and empties the outbox.
    pub fn flush(&mut self, tx: &mut impl Transmit) {
        for q in &self.queued {
            let (b, resend) = self.bytes_of(q);
            if resend {
                tx.resend(q.to, b);
            } else {
                tx.send(q.to, b);
            }
        }
        self.clear();
    }

    /// Drops everything queued.
    pub fn clear(&mut self) {
        self.queued.clear();
        self.bytes.clear();
        self.spare.append(&mut self.resends);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn to(port: u16) -> SocketAddr {
        SocketAddr::new([127, 0, 0, 1].into(), port)
    }

    #[test]
    fn datagrams_keep_their_order_and_kind() {
        let mut out = Outbox::new();
        out.send(to(1), b"first");
        out.resend(to(2), b"again");
        out.ack(7, 0, AckKind::Aggregation, &SeqBitmap::for_group(0, 1), to(3));
        out.resend(to(4), b"and again");
        let got: Vec<_> = out.datagrams().map(|(a, b, r)| (a.port(), b.to_vec(), r)).collect();
        assert_eq!(got[0], (1, b"first".to_vec(), false));
        assert_eq!(got[1], (2, b"again".to_vec(), true));
        assert_eq!((got[2].0, got[2].2), (3, false));
        assert_eq!(got[3], (4, b"and again".to_vec(), true));
        assert_eq!(got.len(), 4);
    }

    #[test]
    fn a_retransmission_reuses_an_earlier_ones_buffer() {
        let mut out = Outbox::new();
        let big = vec![9u8; 65_000];
        out.resend(to(1), &big);
        out.resend(to(1), &big);
        let firsts: Vec<*const u8> = out.resends.iter().map(|b| b.as_ptr()).collect();
        out.clear();
        assert!(out.is_empty());
        out.resend(to(2), &big[..100]);
        out.resend(to(2), &big);
        let again: Vec<*const u8> = out.resends.iter().map(|b| b.as_ptr()).collect();
        for p in &again {
            assert!(firsts.contains(p), "a new buffer for a retransmission after clear");
        }
        let got: Vec<_> = out.datagrams().map(|(_, b, _)| b.len()).collect();
        assert_eq!(got, vec![100, 65_000]);
    }
}
