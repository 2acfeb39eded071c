//! AGC1, the control endpoint's messages (docs/PROTOCOL.md, "Control"):
//! what a run sends `aggbox attach` to create, renew and end its job, and
//! what the node answers. Both the node (`node::control`) and the clients
//! use this module; an outside client can be written from the docs alone.
//!
//! Transport: TCP. Each message is a frame: a 4-byte big-endian length,
//! then that many bytes of UTF-8 JSON (at most [`MAX_FRAME`]). A request
//! frame is an [`Envelope`]: the credential's name, a nonce, the sender's
//! clock, the request itself as a JSON *string* (so the bytes the MAC
//! covers are exactly the bytes sent, with no canonical form to agree on)
//! and the MAC. A reply frame is a [`Reply`].

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr};

use hmac::{Hmac, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;

use crate::wire::proto::AckMode;

/// Largest frame either side sends or accepts, in bytes: a join of the
/// largest run (64 workers' addresses) is a few KiB.
pub const MAX_FRAME: usize = 64 * 1024;

/// The magic that starts the bytes a MAC covers (a MAC of another
/// protocol's message with the same key cannot pass for one of these).
pub const MAC_DOMAIN: &str = "AGC1";

/// A request's nonce, in bytes (hex in the envelope).
pub const NONCE_BYTES: usize = 16;

/// A request as sent: who signs it and the request, MACed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Envelope {
    /// The credential's name (a tenant of the node's key file).
    pub tenant: String,
    /// [`NONCE_BYTES`] random bytes, hex: a request is accepted once.
    pub nonce: String,
    /// The sender's clock, milliseconds since the Unix epoch: the node
    /// refuses a request outside its freshness window.
    pub time_ms: u64,
    /// The [`Request`] as JSON text.
    pub request: String,
    /// HMAC-SHA256 of [`mac_input`] under the tenant's key, hex.
    pub mac: String,
}

/// What a run asks of the node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// One rank of a run joins it. The node creates the run's job once all
    /// `world` ranks have joined with the same `run` key and answers every
    /// rank's join then with [`Reply::Joined`].
    Join {
        /// The run's key: the same for every rank of one run, chosen by its
        /// launcher (a run id, a job name); a later run with the same key
        /// gets a new incarnation.
        run: String,
        /// Ranks in the run.
        world: u16,
        /// This rank.
        rank: u16,
        /// This rank's data socket: where its RESULTs go, and whose address
        /// its contributions come from (IPv4 or IPv6; JSON `"A.B.C.D:PORT"`
        /// or `"[IPv6]:PORT"`).
        data: SocketAddr,
        /// Longest vector the run reduces, in elements (bounds the job's
        /// slot memory), or none.
        #[serde(default)]
        vector_len: Option<u32>,
        /// Rounds the node keeps open at once (the job's `window`,
        /// 1..=2^31-1), or the node's default.
        #[serde(default)]
        window: Option<u32>,
        /// Elements per fragment the ranks send (the job's `frag_elems`,
        /// 1..=MAX_ELEMS; (MTU - 52) / 4 fills a datagram of the run's
        /// MTU), or the node's interface MTU's.
        #[serde(default)]
        frag_elems: Option<u32>,
        /// This node is a leaf of a tree of nodes: the run's ranks that
        /// join here are this leaf's workers, and the node joins the
        /// tree's root on their behalf ([`TreeParent`]). None: a job of
        /// this node alone.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        parent: Option<TreeParent>,
        /// The control endpoint of the node on this rank's own host: the
        /// run asks for a ring of its ranks' nodes besides the job (every
        /// rank names its own, or none does). The node this join reaches
        /// installs the ring at each of them ([`Request::RingInstall`]) and
        /// grants it with the job ([`JobGrant::ring`]).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ring: Option<SocketAddr>,
    },
    /// Keeps the job alive for another lease.
    Renew {
        /// The job's id and incarnation as [`Reply::Joined`] gave them.
        job: u16,
        incarnation: u64,
    },
    /// This rank is done: the job is removed at once when every rank of
    /// the run has ended (a rank still waiting for its last RESULT keeps
    /// it), or when its lease runs out.
    End { job: u16, incarnation: u64, rank: u16 },
    /// A node that serves a run with a ring asks each member's node to
    /// serve its part of the ring (docs/INTERFACE.md, "Rings on demand"):
    /// the ring's id and port are the asking node's proposal, refused with
    /// `conflict` where this node uses them. Answered
    /// [`Reply::RingInstalled`] once this node serves it; asked again with
    /// the same ring it renews it. A run's ring replaces the run's
    /// earlier one on this node.
    RingInstall {
        /// The run's key (the ring belongs to the tenant's run).
        run: String,
        /// The AGR1 ring id and the ring's UDP port on every member.
        ring: u16,
        port: u16,
        /// The members' addresses in ring order (one of them this node's).
        members: Vec<Ipv4Addr>,
        /// Elements of the ring's vector (its memory).
        vector_len: u32,
    },
    /// Keeps ring `ring` of the run alive for another lease.
    RingRenew { run: String, ring: u16 },
    /// Removes ring `ring` of the run at once.
    RingEnd { run: String, ring: u16 },
}

/// The node's answer to one request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Reply {
    /// The run's job exists: what every rank needs to build its
    /// communicator.
    Joined(JobGrant),
    /// The lease was renewed until `lease_ms` from now.
    Renewed { lease_ms: u64 },
    /// This rank's end is recorded (`remaining` ranks have not ended; the
    /// job is removed when none remain).
    Ended { remaining: u16 },
    /// This node serves its part of the ring ([`Request::RingInstall`]),
    /// with fragments of `frag_elems` (its `[node] ring_frag_elems`), until
    /// `lease_ms` from now unless renewed.
    RingInstalled { ring: u16, frag_elems: u32, lease_ms: u64 },
    /// Refused: nothing changed.
    Refused {
        /// Why, as a stable word (counted by it in `/metrics`).
        reason: Refusal,
        /// What to do, for a person.
        message: String,
    },
}

/// A created job, as every rank of the run learns it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobGrant {
    /// The AGG1 job id (never one of the node's file, never a live run's).
    pub job: u16,
    /// Counts the runs of this key: a restarted run's job is a new one.
    pub incarnation: u64,
    /// The node's contribution port for the job.
    pub port: u16,
    /// The node's RESULT port (its result service).
    pub result_port: u16,
    /// The workers' data sockets by rank (all of one family).
    pub workers: Vec<SocketAddr>,
    /// Renew within this many milliseconds, or the job is removed.
    pub lease_ms: u64,
    /// How the node's result service acknowledges (`[node] ack_mode`):
    /// the workers acknowledge alike.
    pub ack_mode: AckMode,
    /// Sequence numbers per group ACK (`[node] ack_group`).
    pub ack_group: u16,
    /// A leaf's job of a tree ([`TreeParent`]): the workers of the whole
    /// tree, the divisor of a float mean. Absent for a job of one node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tree_workers: Option<u16>,
    /// The run's ring, when its ranks asked for one ([`Request::Join`]'s
    /// `ring`): served by the ranks' own nodes, renewed and ended with the
    /// job by the node that granted it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ring: Option<RingGrant>,
}

/// A ring of a run on demand: a `[[ring]]` of these keys at every
/// member's node (docs/RING.md), weights all 1.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RingGrant {
    /// The AGR1 ring id.
    pub id: u16,
    /// The ring's UDP port on every member.
    pub port: u16,
    /// The members in ring order: rank r's data address is member r.
    pub members: Vec<Ipv4Addr>,
    /// Elements of the ring's vector.
    pub vector_len: u32,
    /// Elements per fragment (the members' `[node] ring_frag_elems`).
    pub frag_elems: u32,
}

/// Where a leaf node's job sends its partial results: the tree's root node
/// (docs/INTERFACE.md, "Trees on demand"). The leaf joins the root's
/// control endpoint itself, under the same tenant and run key, as rank
/// `leaf` of a run of `leaves` ranks whose data sockets are the leaves'
/// result sockets; its workers' joins are answered once the root's job
/// exists, and the leaf's job then sends upstream exactly as a `[[job]]`
/// with a `parent` does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TreeParent {
    /// The root node's control endpoint.
    pub node: SocketAddr,
    /// This leaf's rank among the root's workers.
    pub leaf: u16,
    /// Leaves of the tree (the root job's workers).
    pub leaves: u16,
    /// Workers of the whole tree (at least this leaf's).
    pub tree_workers: u16,
}

/// What a run asks of its job besides its ranks: the keys of a `[[job]]`
/// that are the run's to choose (the fields of [`Request::Join`] of the
/// same names). None: the node's defaults. Every rank of a run asks the
/// same.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct JobShape {
    pub vector_len: Option<u32>,
    pub window: Option<u32>,
    pub frag_elems: Option<u32>,
    pub parent: Option<TreeParent>,
    /// The control endpoint of this rank's own node, for a run with a
    /// ring (the one key that differs by rank: every rank names its own
    /// node, or none does).
    pub ring: Option<SocketAddr>,
}

/// Why a request was refused (docs/PROTOCOL.md lists them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Refusal {
    /// Not a frame of an envelope: bad length, not JSON, unknown fields.
    Malformed,
    /// The tenant is not in the node's key file.
    UnknownTenant,
    /// The tenant's credential was revoked.
    Revoked,
    /// The MAC does not verify under the tenant's key.
    BadMac,
    /// `time_ms` is outside the node's freshness window.
    Stale,
    /// This nonce was already used.
    Replayed,
    /// A quota of the tenant or of the node would be exceeded.
    OverQuota,
    /// The request contradicts the run's (another world size, a rank out
    /// of range or joined twice with another address, an address a live
    /// job of another run already uses).
    Conflict,
    /// No such job (ended, expired, or another tenant's).
    UnknownJob,
    /// The node cannot serve it now (no free job id or port).
    Unavailable,
}

impl Refusal {
    /// Every reason, in the order `/metrics` lists them.
    pub const ALL: [Refusal; 10] = [
        Refusal::Malformed,
        Refusal::UnknownTenant,
        Refusal::Revoked,
        Refusal::BadMac,
        Refusal::Stale,
        Refusal::Replayed,
        Refusal::OverQuota,
        Refusal::Conflict,
        Refusal::UnknownJob,
        Refusal::Unavailable,
    ];

    /// The word in `/metrics` and in the JSON.
    pub fn name(self) -> &'static str {
        match self {
            Refusal::Malformed => "malformed",
            Refusal::UnknownTenant => "unknown_tenant",
            Refusal::Revoked => "revoked",
            Refusal::BadMac => "bad_mac",
            Refusal::Stale => "stale",
            Refusal::Replayed => "replayed",
            Refusal::OverQuota => "over_quota",
            Refusal::Conflict => "conflict",
            Refusal::UnknownJob => "unknown_job",
            Refusal::Unavailable => "unavailable",
        }
    }
}

/// The bytes a request's MAC covers: the domain, tenant, nonce, clock and
/// request text, each on its own line.
pub fn mac_input(tenant: &str, nonce: &str, time_ms: u64, request: &str) -> Vec<u8> {
    format!("{MAC_DOMAIN}\n{tenant}\n{nonce}\n{time_ms}\n{request}").into_bytes()
}

fn hmac(key: &[u8]) -> Hmac<Sha256> {
    // HMAC takes a key of any length.
    Hmac::<Sha256>::new_from_slice(key).expect("HMAC accepts any key length")
}

impl Envelope {
    /// `request` signed with `key` as `tenant`.
    pub fn sign(tenant: &str, key: &[u8], nonce: [u8; NONCE_BYTES], time_ms: u64, request: &Request) -> Envelope {
        let request = serde_json::to_string(request).expect("a request serializes");
        let nonce = hex::encode(nonce);
        let mut mac = hmac(key);
        mac.update(&mac_input(tenant, &nonce, time_ms, &request));
        Envelope {
            tenant: tenant.to_string(),
            mac: hex::encode(mac.finalize().into_bytes()),
            nonce,
            time_ms,
            request,
        }
    }

    /// Whether the MAC verifies under `key` (in constant time).
    pub fn verifies(&self, key: &[u8]) -> bool {
        let Ok(tag) = hex::decode(&self.mac) else { return false };
        let mut mac = hmac(key);
        mac.update(&mac_input(&self.tenant, &self.nonce, self.time_ms, &self.request));
        mac.verify_slice(&tag).is_ok()
    }

    /// The nonce's bytes, when it is [`NONCE_BYTES`] of hex.
    pub fn nonce_bytes(&self) -> Option<[u8; NONCE_BYTES]> {
        hex::decode(&self.nonce).ok()?.try_into().ok()
    }
}

/// Why a frame could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("frame of {0} bytes: at most {MAX_FRAME}")]
    TooLong(usize),
    #[error("frame is not the expected JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// `value` as one frame.
pub fn encode_frame<T: Serialize>(value: &T) -> Result<Vec<u8>, FrameError> {
    let body = serde_json::to_vec(value)?;
    if body.len() > MAX_FRAME {
        return Err(FrameError::TooLong(body.len()));
    }
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

/// Writes `value` as one frame.
pub fn write_frame<T: Serialize>(w: &mut impl Write, value: &T) -> Result<(), FrameError> {
    w.write_all(&encode_frame(value)?)?;
    Ok(())
}

/// Reads one frame's body (its length checked before anything else is
/// read).
pub fn read_frame(r: &mut impl Read) -> Result<Vec<u8>, FrameError> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_be_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(FrameError::TooLong(len));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    Ok(body)
}

/// A fresh nonce from the kernel's random source.
pub fn fresh_nonce() -> std::io::Result<[u8; NONCE_BYTES]> {
    let mut n = [0u8; NONCE_BYTES];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut n)?;
    Ok(n)
}

/// The clock a request carries: ms since the Unix epoch.
pub fn clock_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// One request to the control endpoint `node`, signed as `tenant` with
/// `key` over a connection of its own, and the node's reply, each step
/// within `deadline`; an error says which step failed and why. What both
/// a worker and a leaf node (joining its tree's root) send.
pub fn exchange(
    node: std::net::SocketAddr,
    tenant: &str,
    key: &[u8],
    request: &Request,
    deadline: std::time::Duration,
) -> Result<Reply, String> {
    exchange_from(node, tenant, key, |_| Ok(request.clone()), deadline).map(|(reply, _)| reply)
}

/// [`exchange`] whose request is made once connected, from this end's
/// address on the connection (a leaf's data socket is on the address its
/// root is reached from); the reply and that address.
pub fn exchange_from(
    node: std::net::SocketAddr,
    tenant: &str,
    key: &[u8],
    request: impl FnOnce(std::net::SocketAddr) -> Result<Request, String>,
    deadline: std::time::Duration,
) -> Result<(Reply, std::net::SocketAddr), String> {
    let fail = |what: &str, e: &dyn std::fmt::Display| format!("control endpoint {node}: {what}: {e}");
    let mut stream = std::net::TcpStream::connect_timeout(&node, deadline).map_err(|e| fail("connect", &e))?;
    let _ = stream.set_nodelay(true);
    stream.set_read_timeout(Some(deadline)).map_err(|e| fail("socket", &e))?;
    let local = stream.local_addr().map_err(|e| fail("socket", &e))?;
    let request = request(local)?;
    let nonce = fresh_nonce().map_err(|e| fail("/dev/urandom", &e))?;
    let envelope = Envelope::sign(tenant, key, nonce, clock_ms(), &request);
    write_frame(&mut stream, &envelope).map_err(|e| fail("send", &e))?;
    let body = read_frame(&mut stream).map_err(|e| fail("no reply", &e))?;
    let reply = serde_json::from_slice(&body).map_err(|e| fail("reply", &e))?;
    Ok((reply, local))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn join() -> Request {
        Request::Join { run: "r1".into(), world: 4, rank: 2, data: "10.0.0.3:7700".parse().unwrap(), vector_len: None, window: None, frag_elems: None, parent: None, ring: None }
    }

    #[test]
    fn a_signed_request_verifies_under_its_key_only() {
        let e = Envelope::sign("alice", b"k1", [7; NONCE_BYTES], 1000, &join());
        assert!(e.verifies(b"k1"));
        assert!(!e.verifies(b"k2"));
        for tamper in [
            Envelope { tenant: "bob".into(), ..e.clone() },
            Envelope { time_ms: 1001, ..e.clone() },
            Envelope { nonce: hex::encode([8; NONCE_BYTES]), ..e.clone() },
            Envelope { request: e.request.replace("\"rank\":2", "\"rank\":3"), ..e.clone() },
            Envelope { mac: "00".into(), ..e.clone() },
        ] {
            assert!(!tamper.verifies(b"k1"), "{tamper:?}");
        }
        assert_eq!(serde_json::from_str::<Request>(&e.request).unwrap(), join());
    }

    #[test]
    fn frames_round_trip_and_refuse_oversized_lengths() {
        let e = Envelope::sign("alice", b"k1", [1; NONCE_BYTES], 5, &join());
        let bytes = encode_frame(&e).unwrap();
        let body = read_frame(&mut &bytes[..]).unwrap();
        assert_eq!(serde_json::from_slice::<Envelope>(&body).unwrap(), e);
        let mut huge = ((MAX_FRAME + 1) as u32).to_be_bytes().to_vec();
        huge.extend_from_slice(b"{}");
        assert!(matches!(read_frame(&mut &huge[..]), Err(FrameError::TooLong(_))));
        let short = [0u8, 0, 0, 10, b'{'];
        assert!(matches!(read_frame(&mut &short[..]), Err(FrameError::Io(_))));
    }

    #[test]
    fn unknown_fields_are_refused() {
        let e = r#"{"tenant":"a","nonce":"00","time_ms":1,"request":"{}","mac":"00","extra":1}"#;
        assert!(serde_json::from_str::<Envelope>(e).is_err());
        let r = r#"{"kind":"end","job":1,"incarnation":2,"rank":0,"x":3}"#;
        assert!(serde_json::from_str::<Request>(r).is_err());
    }
}
