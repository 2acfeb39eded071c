//! Ethernet frames as the XDP program parses them, for the user-space path
//! that receives whole frames (AF_XDP, `src/kernel/afxdp.rs`).
//!
//! The twin of `src/bpf/parse.h` and `aggbox_parse_l3`: Ethernet with at
//! most one VLAN tag (802.1Q or 802.1ad), IPv4 with its IHL honoured or IPv6
//! with UDP right after its 40-byte header, UDP whose payload length comes
//! from the UDP header. A frame the XDP program would not hand over (not
//! UDP over IPv4 or IPv6; over IPv6 an extension header or a UDP checksum
//! of 0, which it drops) is `None` here too, so both paths read the same
//! datagram out of the same bytes; a change to one is a change to the
//! other.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::ops::Range;

const ETH_HLEN: usize = 14;
const VLAN_HLEN: usize = 4;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const IPV6_HLEN: usize = 40;
const ETH_P_8021Q: u16 = 0x8100;
const ETH_P_8021AD: u16 = 0x88a8;
const IPV4_MIN_HLEN: usize = 20;
const IPPROTO_UDP: u8 = 17;
const UDP_HLEN: usize = 8;

/// A parsed frame: addresses and the UDP payload's range in the frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parsed {
    /// IP source.
    pub saddr: IpAddr,
    /// IP destination.
    pub daddr: IpAddr,
    /// The UDP payload: from after the UDP header to the UDP length, which
    /// may end before the frame does (Ethernet padding).
    pub payload: Range<usize>,
}

/// Ethernet [+ one VLAN tag] / IPv4 (IHL honoured) or IPv6 (no extension
/// header) / UDP, as the XDP program parses it; the UDP payload length
/// comes from the UDP header. `None` for anything else, an IPv6 UDP
/// checksum of 0, or a frame too short for what it claims.
pub fn parse_frame(f: &[u8]) -> Option<Parsed> {
    let mut off = ETH_HLEN;
    let mut proto = u16::from_be_bytes([*f.get(12)?, *f.get(13)?]);
    if proto == ETH_P_8021Q || proto == ETH_P_8021AD {
        proto = u16::from_be_bytes([*f.get(16)?, *f.get(17)?]);
        off += VLAN_HLEN;
    }
    let (saddr, daddr, udp) = match proto {
        ETH_P_IP => {
            let ip = f.get(off..off + IPV4_MIN_HLEN)?;
            if ip[0] >> 4 != 4 || ip[9] != IPPROTO_UDP {
                return None;
            }
            let ihl = usize::from(ip[0] & 0x0f) * 4;
            if ihl < IPV4_MIN_HLEN {
                return None;
            }
            let saddr = Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]);
            let daddr = Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]);
            (IpAddr::V4(saddr), IpAddr::V4(daddr), off + ihl)
        }
        ETH_P_IPV6 => {
            let ip = f.get(off..off + IPV6_HLEN)?;
            if ip[0] >> 4 != 6 || ip[6] != IPPROTO_UDP {
                return None;
            }
            let saddr: [u8; 16] = ip[8..24].try_into().ok()?;
            let daddr: [u8; 16] = ip[24..40].try_into().ok()?;
            (IpAddr::V6(Ipv6Addr::from(saddr)), IpAddr::V6(Ipv6Addr::from(daddr)), off + IPV6_HLEN)
        }
        _ => return None,
    };
    let h = f.get(udp..udp + UDP_HLEN)?;
    let ulen = usize::from(u16::from_be_bytes([h[4], h[5]]));
    if ulen < UDP_HLEN || udp + ulen > f.len() {
        return None;
    }
    if saddr.is_ipv6() && h[6..8] == [0, 0] {
        return None;
    }
    Some(Parsed {
        saddr,
        daddr,
        payload: udp + UDP_HLEN..udp + ulen,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const SRC: [u8; 4] = [10, 0, 0, 1];
    const DST: [u8; 4] = [10, 0, 0, 2];

    /// A frame: Ethernet (with `vlan` as its one tag), IPv4 with `options`
    /// bytes of options, UDP of length `udp_len` over `payload`.
    fn frame(vlan: Option<u16>, options: usize, udp_len: u16, payload: &[u8]) -> Vec<u8> {
        let mut f = vec![0u8; 12];
        if let Some(tpid) = vlan {
            f.extend_from_slice(&tpid.to_be_bytes());
            f.extend_from_slice(&[0, 7]);
        }
        f.extend_from_slice(&ETH_P_IP.to_be_bytes());
        let ihl = (IPV4_MIN_HLEN + options) / 4;
        let mut ip = vec![0u8; IPV4_MIN_HLEN + options];
        ip[0] = 0x40 | ihl as u8;
        ip[9] = IPPROTO_UDP;
        ip[12..16].copy_from_slice(&SRC);
        ip[16..20].copy_from_slice(&DST);
        f.extend_from_slice(&ip);
        f.extend_from_slice(&[0x30, 0x39, 0x30, 0x3a]);
        f.extend_from_slice(&udp_len.to_be_bytes());
        f.extend_from_slice(&[0, 0]);
        f.extend_from_slice(payload);
        f
    }

    #[test]
    fn plain_and_vlan_tagged() {
        let body = b"AGG1 and more";
        let ulen = (UDP_HLEN + body.len()) as u16;
        for (vlan, at) in [(None, 42), (Some(ETH_P_8021Q), 46), (Some(ETH_P_8021AD), 46)] {
            let f = frame(vlan, 0, ulen, body);
            let p = parse_frame(&f).expect("parses");
            assert_eq!((p.saddr, p.daddr), (IpAddr::from(SRC), IpAddr::from(DST)));
            assert_eq!(p.payload, at..at + body.len(), "{vlan:?}");
            assert_eq!(&f[p.payload], body);
        }
    }

    #[test]
    fn ip_options_move_the_udp_header() {
        let body = [1u8, 2, 3, 4];
        let f = frame(None, 8, (UDP_HLEN + body.len()) as u16, &body);
        let p = parse_frame(&f).expect("parses");
        assert_eq!(p.payload, 50..54);
        assert_eq!(&f[p.payload], &body);
        // IHL below 5 is no IPv4 header.
        let mut bad = frame(None, 0, (UDP_HLEN + body.len()) as u16, &body);
        bad[14] = 0x44;
        assert_eq!(parse_frame(&bad), None);
    }

    #[test]
    fn udp_length_bounds_the_payload() {
        let body = [9u8; 10];
        // Shorter than the frame (Ethernet padding): the UDP length wins.
        let p = parse_frame(&frame(None, 0, (UDP_HLEN + 4) as u16, &body)).expect("parses");
        assert_eq!(p.payload.len(), 4);
        // Below the UDP header, or past the frame's end: not a datagram.
        assert_eq!(parse_frame(&frame(None, 0, 7, &body)), None);
        assert_eq!(parse_frame(&frame(None, 0, (UDP_HLEN + 11) as u16, &body)), None);
        // Frames cut inside a header.
        let f = frame(None, 0, (UDP_HLEN + body.len()) as u16, &body);
        for len in [0, 13, 33, 41] {
            assert_eq!(parse_frame(&f[..len]), None, "{len} bytes");
        }
    }

    /// An IPv6 frame: Ethernet, the 40-byte header (next header `next`),
    /// UDP of length `udp_len` and checksum `csum` over `payload`.
    fn frame6(vlan: Option<u16>, next: u8, udp_len: u16, csum: u16, payload: &[u8]) -> Vec<u8> {
        let mut f = vec![0u8; 12];
        if let Some(tpid) = vlan {
            f.extend_from_slice(&tpid.to_be_bytes());
            f.extend_from_slice(&[0, 7]);
        }
        f.extend_from_slice(&ETH_P_IPV6.to_be_bytes());
        let mut ip = vec![0u8; IPV6_HLEN];
        ip[0] = 0x60;
        ip[4..6].copy_from_slice(&udp_len.to_be_bytes());
        ip[6] = next;
        ip[8..24].copy_from_slice(&SRC6);
        ip[24..40].copy_from_slice(&DST6);
        f.extend_from_slice(&ip);
        f.extend_from_slice(&[0x30, 0x39, 0x30, 0x3a]);
        f.extend_from_slice(&udp_len.to_be_bytes());
        f.extend_from_slice(&csum.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    const SRC6: [u8; 16] = [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
    const DST6: [u8; 16] = [0xfd, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2];

    #[test]
    fn ipv6_plain_and_vlan_tagged() {
        let body = b"AGG1 and more";
        let ulen = (UDP_HLEN + body.len()) as u16;
        for (vlan, at) in [(None, 62), (Some(ETH_P_8021Q), 66)] {
            let f = frame6(vlan, IPPROTO_UDP, ulen, 0x1234, body);
            let p = parse_frame(&f).expect("parses");
            assert_eq!((p.saddr, p.daddr), (IpAddr::from(SRC6), IpAddr::from(DST6)));
            assert_eq!(p.payload, at..at + body.len(), "{vlan:?}");
        }
        // What the XDP program drops, never hands over: an extension
        // header (hop-by-hop here) before UDP, a UDP checksum of 0.
        assert_eq!(parse_frame(&frame6(None, 0, ulen, 0x1234, body)), None);
        assert_eq!(parse_frame(&frame6(None, IPPROTO_UDP, ulen, 0, body)), None);
        // Cut inside the IPv6 or UDP header.
        let f = frame6(None, IPPROTO_UDP, ulen, 0x1234, body);
        for len in [20, 53, 61] {
            assert_eq!(parse_frame(&f[..len]), None, "{len} bytes");
        }
    }

    #[test]
    fn only_udp_over_ipv4_or_ipv6() {
        let body = [0u8; 4];
        let ulen = (UDP_HLEN + body.len()) as u16;
        // IPv6 EtherType over an IPv4 header.
        let mut f = frame(None, 0, ulen, &body);
        f[12..14].copy_from_slice(&0x86ddu16.to_be_bytes());
        assert_eq!(parse_frame(&f), None);
        // IPv4 EtherType, version 6 in the header.
        let mut f = frame(None, 0, ulen, &body);
        f[14] = 0x65;
        assert_eq!(parse_frame(&f), None);
        // TCP.
        let mut f = frame(None, 0, ulen, &body);
        f[14 + 9] = 6;
        assert_eq!(parse_frame(&f), None);
        // Two VLAN tags: the inner one is not IPv4 to this parser either.
        let mut f = frame(Some(ETH_P_8021AD), 0, ulen, &body);
        f[16..18].copy_from_slice(&ETH_P_8021Q.to_be_bytes());
        assert_eq!(parse_frame(&f), None);
    }
}
