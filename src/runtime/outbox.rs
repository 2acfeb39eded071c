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
//! holds is small (ACKs) or rare (retransmissions).

use std::net::SocketAddrV4;

use crate::wire::proto::{AckKind, AckMessage, SeqBitmap};

/// Where the state machine's datagrams go: the I/O driver's socket
/// ([`crate::runtime::transport::Net`]), or a test's list.
pub trait Transmit {
    /// A first transmission of one datagram (an `AGK1`, or data).
    fn send(&mut self, to: SocketAddrV4, datagram: &[u8]);
    /// A retransmission of a data datagram.
    fn resend(&mut self, to: SocketAddrV4, datagram: &[u8]);
    /// First transmissions of data datagrams, in order, as one batch;
    /// `gso`: runs to one destination may go as UDP GSO super-datagrams.
    fn send_batch(&mut self, datagrams: &[(&[u8], SocketAddrV4)], gso: bool);
}

/// One queued datagram: `bytes[start..start + len]` of the outbox.
#[derive(Debug, Clone, Copy)]
struct Queued {
    to: SocketAddrV4,
    start: usize,
    len: usize,
    resend: bool,
}

/// Datagrams produced between two polls of the state machine, in the order
/// they were produced; their bytes in one reused buffer.
#[derive(Debug, Default)]
pub struct Outbox {
    bytes: Vec<u8>,
    queued: Vec<Queued>,
}

impl Outbox {
    /// An empty outbox.
    pub fn new() -> Outbox {
        Outbox::default()
    }

    /// Queues a first transmission of `datagram` to `to`.
    pub fn send(&mut self, to: SocketAddrV4, datagram: &[u8]) {
        self.push(to, datagram, false);
    }

    /// Queues a retransmission of `datagram` to `to`.
    pub fn resend(&mut self, to: SocketAddrV4, datagram: &[u8]) {
        self.push(to, datagram, true);
    }

    fn push(&mut self, to: SocketAddrV4, datagram: &[u8], resend: bool) {
        let start = self.bytes.len();
        self.bytes.extend_from_slice(datagram);
        self.queued.push(Queued {
            to,
            start,
            len: datagram.len(),
            resend,
        });
    }

    /// Encodes and queues one `AGK1` (`id`: the job or broadcast group,
    /// `rank`: whose datagrams it acknowledges, or the sender's index).
    pub fn ack(&mut self, id: u16, rank: u16, kind: AckKind, bm: &SeqBitmap, to: SocketAddrV4) {
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
                start,
                len: self.bytes.len() - start,
                resend: false,
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
    pub fn datagrams(&self) -> impl Iterator<Item = (SocketAddrV4, &[u8], bool)> + '_ {
        self.queued
            .iter()
            .map(|q| (q.to, &self.bytes[q.start..q.start + q.len], q.resend))
    }

    /// Hands every queued datagram to `tx`, in order, and empties the outbox.
    pub fn flush(&mut self, tx: &mut impl Transmit) {
        for q in &self.queued {
            let b = &self.bytes[q.start..q.start + q.len];
            if q.resend {
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
    }
}
