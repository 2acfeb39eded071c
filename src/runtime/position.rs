//! Where a new run of a node-served job starts: a worker asks the node's
//! result service (`AGP1`, docs/PROTOCOL.md "AGP1: the position of a
//! node-served job") for the round and contribution seq of its first call,
//! and builds its communicator with [`crate::runtime::CommunicatorBuilder::resume`], so a
//! second run on a running node is not taken for the first one's old
//! rounds. Every worker of the run must start at the same position: the
//! workers agree on the newest of their answers first (the MPI shim with an
//! `MPI_Allreduce`, docs/MPI.md).
//!
//! The query goes from the worker's own data socket (the node answers only
//! the socket of the worker a query names, as it takes ACKs), so it is made
//! before the communicator binds that socket. Lost queries or replies are
//! sent again, with a growing wait, until the deadline.

use std::io;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::time::{Duration, Instant};

use crate::wire::abi::Round;
use crate::wire::proto::PositionMessage;

/// The node's answer: the position a new run starts at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodePosition {
    /// Round of the new run's first call.
    pub round: Round,
    /// Contribution seq of that call.
    pub agg_seq: u32,
    /// The node has seen no RESULT of the job (the position is 0, 0).
    pub fresh: bool,
}

/// Why the position could not be learnt.
#[derive(Debug, thiserror::Error)]
pub enum PositionQueryError {
    /// The worker's socket could not be bound (another process holds it?).
    #[error("job {job}: binding worker {rank}'s socket {addr} to ask the node for the job's position: {source}")]
    Bind {
        /// Job id.
        job: u16,
        /// The asking worker.
        rank: u16,
        /// Its socket address.
        addr: SocketAddr,
        /// The error.
        source: io::Error,
    },
    /// Sending or receiving failed.
    #[error("job {job}: asking the node at {node} for the job's position: {source}")]
    Io {
        /// Job id.
        job: u16,
        /// The node's result socket.
        node: SocketAddr,
        /// The error.
        source: io::Error,
    },
    /// No reply within the deadline.
    #[error(
        "job {job}: no answer from the node at {node} to worker {rank}'s position query from {from} \
         ({tries} tries in {waited_ms} ms): is `aggbox attach` running there, serving the job \
         (consumer = \"node\") on result_port {port}, with worker {rank} at {from}?",
        port = node.port()
    )]
    NoAnswer {
        /// Job id.
        job: u16,
        /// The asking worker.
        rank: u16,
        /// Its socket.
        from: SocketAddr,
        /// The node's result socket asked.
        node: SocketAddr,
        /// Queries sent.
        tries: u32,
        /// Time spent.
        waited_ms: u128,
    },
    /// The builder is not a worker's.
    #[error("job {0}: only a worker asks the node for the job's position")]
    NotAWorker(u16),
}

/// First wait for a reply; doubled after each unanswered query up to
/// [`MAX_WAIT`].
const FIRST_WAIT: Duration = Duration::from_millis(50);
const MAX_WAIT: Duration = Duration::from_millis(500);

/// Worker `rank` of `job`, from its socket `from`, asks the node's result
/// service at `node` (the node's address and the job's `result_port`) where
/// a new run starts; queries again after 50, 100, 200, 400, 500, 500 ... ms
/// until `deadline` has passed. Only a reply from `node` that carries the
/// query's job, rank and nonce counts.
pub fn query_position(
    job: u16,
    rank: u16,
    from: SocketAddr,
    node: SocketAddr,
    deadline: Duration,
) -> Result<NodePosition, PositionQueryError> {
    let socket = UdpSocket::bind(from).map_err(|source| PositionQueryError::Bind {
        job,
        rank,
        addr: from,
        source,
    })?;
    let io_err = |source| PositionQueryError::Io { job, node, source };
    let start = Instant::now();
    let end = start + deadline;
    let nonce = nonce(from);
    let query = PositionMessage::query(job, rank, nonce).encode();
    let (mut tries, mut wait) = (0u32, FIRST_WAIT);
    let mut buf = [0u8; 64];
    loop {
        let now = Instant::now();
        if tries > 0 && now >= end {
            return Err(PositionQueryError::NoAnswer {
                job,
                rank,
                from,
                node,
                tries,
                waited_ms: now.duration_since(start).as_millis(),
            });
        }
        match socket.send_to(&query, node) {
            Ok(_) => {}
            // A node not up yet (ICMP unreachable from an earlier query)
            // is the same as no answer: try again.
            Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {}
            Err(e) => return Err(io_err(e)),
        }
        tries += 1;
        let resend_at = (Instant::now() + wait).min(end);
        wait = (wait * 2).min(MAX_WAIT);
        loop {
            let left = resend_at.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            socket.set_read_timeout(Some(left)).map_err(io_err)?;
            match socket.recv_from(&mut buf) {
                Ok((n, src)) if src == node => {
                    if let Ok(reply) = PositionMessage::decode(&buf[..n]) {
                        if reply.is_reply()
                            && reply.job == job
                            && reply.rank == rank
                            && reply.nonce == nonce
                        {
                            return Ok(NodePosition {
                                round: reply.round,
                                agg_seq: reply.agg_seq,
                                fresh: reply.is_fresh(),
                            });
                        }
                    }
                }
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock
                            | io::ErrorKind::TimedOut
                            | io::ErrorKind::Interrupted
                            | io::ErrorKind::ConnectionRefused
                    ) => {}
                Err(e) => return Err(io_err(e)),
            }
        }
    }
}

/// A query's nonce: differs between processes and runs (the clock, the
/// process, the socket), so a late reply to an earlier run's query is not
/// taken for this one's.
fn nonce(from: SocketAddr) -> u32 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let x = t
        ^ (u64::from(std::process::id()) << 32)
        ^ match from.ip() {
            IpAddr::V4(a) => u64::from(u32::from(a)),
            IpAddr::V6(a) => { let b = a.to_bits(); (b ^ (b >> 64)) as u64 }
        }
        ^ (u64::from(from.port()) << 16);
    // splitmix64's finaliser: every input bit reaches every output bit.
    let x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    let x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    (x ^ (x >> 31)) as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::IpAddr;

    const LO: IpAddr = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);

    fn bound() -> (UdpSocket, SocketAddr) {
        let s = UdpSocket::bind((LO, 0)).unwrap();
        let a = s.local_addr().unwrap();
        (s, a)
    }

    /// A free port on lo (bound and released).
    fn free() -> SocketAddr {
        bound().1
    }

    #[test]
    fn the_first_matching_reply_of_the_node_is_the_position_after_lost_queries() {
        let (node, node_addr) = bound();
        let me = free();
        let server = std::thread::spawn(move || {
            let mut buf = [0u8; 64];
            // The first query is "lost"; a wrong nonce, another rank and a
            // stranger's reply come first, then the real one.
            let (n, _) = node.recv_from(&mut buf).unwrap();
            let q = PositionMessage::decode(&buf[..n]).unwrap();
            let (n, from) = node.recv_from(&mut buf).unwrap();
            let q2 = PositionMessage::decode(&buf[..n]).unwrap();
            assert_eq!((q.job, q.rank, q.nonce), (q2.job, q2.rank, q2.nonce));
            let wrong_nonce = PositionMessage {
                nonce: q.nonce ^ 1,
                ..q
            };
            let other_rank = PositionMessage {
                rank: q.rank + 1,
                ..q
            };
            for m in [wrong_nonce, other_rank] {
                node.send_to(
                    &PositionMessage::reply(&m, Round(99), 99, false).encode(),
                    from,
                )
                .unwrap();
            }
            let (stranger, _) = bound();
            stranger
                .send_to(
                    &PositionMessage::reply(&q, Round(98), 98, false).encode(),
                    from,
                )
                .unwrap();
            node.send_to(
                &PositionMessage::reply(&q, Round(7), 42, false).encode(),
                from,
            )
            .unwrap();
        });
        let p = query_position(11, 2, me, node_addr, Duration::from_secs(5)).expect("answered");
        assert_eq!(
            p,
            NodePosition {
                round: Round(7),
                agg_seq: 42,
                fresh: false
            }
        );
        server.join().unwrap();
    }

    #[test]
    fn no_answer_fails_at_the_deadline_naming_the_node() {
        let (_silent, node) = bound();
        let me = free();
        let t0 = Instant::now();
        let err = query_position(11, 2, me, node, Duration::from_millis(300))
            .expect_err("nobody answers");
        let waited = t0.elapsed();
        assert!(
            waited >= Duration::from_millis(300) && waited < Duration::from_secs(2),
            "{waited:?}"
        );
        let msg = err.to_string();
        assert!(
            msg.contains(&node.to_string()) && msg.contains("no answer") && msg.contains("job 11"),
            "{msg}"
        );
        assert!(
            matches!(err, PositionQueryError::NoAnswer { tries, .. } if tries >= 3),
            "{err:?}"
        );
    }
}
