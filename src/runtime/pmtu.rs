//! Path MTU discovery for a communicator (`CommConfig::mtu` = 0, the
//! default): the MTU of the route to each other participant, read with a
//! connected UDP socket and `getsockopt(IP_MTU)` (the kernel's route MTU,
//! including a PMTU learned from ICMP), falling back to the MTU of the
//! interface that owns the route's source address (`SIOCGIFMTU`). The
//! communicator uses the smallest over the aggregator and every peer, capped
//! at [`MAX_IPV4_MTU`] (a loopback route says 65536; an IPv4 datagram is at
//! most 65535 bytes). It must run in the network namespace the communicator's
//! socket lives in (the builder calls it from `build`).

use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;

/// Largest IPv4 datagram (the total-length field).
pub const MAX_IPV4_MTU: usize = 65535;

/// MTU of the route to `to` (see the module docs). Errors when there is no
/// route and no interface owns the would-be source address.
pub fn path_mtu(to: IpAddr) -> io::Result<usize> {
    let any = match to {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
    };
    let sock = UdpSocket::bind(SocketAddr::new(any, 0))?;
    // Port 9 (discard): connect only selects the route, nothing is sent.
    sock.connect(SocketAddr::new(to, 9))?;
    if let Some(m) = ip_mtu(&sock, to.is_ipv6()) {
        return Ok(m.min(MAX_IPV4_MTU));
    }
    match sock.local_addr()?.ip() {
        IpAddr::V4(local) => crate::netif::interface_mtu_of(local).map(|m| m.min(MAX_IPV4_MTU)),
        IpAddr::V6(local) => interface_mtu_of6(local).map(|m| m.min(MAX_IPV4_MTU)),
    }
}

/// MTU of the interface that holds IPv6 address `addr`.
fn interface_mtu_of6(addr: std::net::Ipv6Addr) -> io::Result<usize> {
    let ifa = nix::ifaddrs::getifaddrs()
        .map_err(io::Error::from)?
        .find(|ifa| ifa.address.and_then(|a| a.as_sockaddr_in6().map(|s| s.ip())) == Some(addr))
        .ok_or_else(|| io::Error::other(format!("no interface holds {addr}")))?;
    let text = std::fs::read_to_string(format!("/sys/class/net/{}/mtu", ifa.interface_name))?;
    text.trim().parse().map_err(io::Error::other)
}

/// `getsockopt(IP_MTU)` (`IPV6_MTU` for IPv6) of a connected socket.
fn ip_mtu(sock: &UdpSocket, v6: bool) -> Option<usize> {
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    let (level, name) = if v6 { (libc::IPPROTO_IPV6, libc::IPV6_MTU) } else { (libc::IPPROTO_IP, libc::IP_MTU) };
    // SAFETY: valid fd, pointer and length of an int.
    let r = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            level,
            name,
            &mut v as *mut libc::c_int as *mut libc::c_void,
            &mut len,
        )
    };
    (r == 0 && v > 0).then_some(v as usize)
}

/// The smallest path MTU to any of `to` (the communicator's other
/// participants); destinations without a route are skipped; `None` when none
/// has one.
pub fn min_path_mtu(to: impl IntoIterator<Item = IpAddr>) -> Option<usize> {
    let mut seen: Vec<IpAddr> = Vec::new();
    let mut best: Option<usize> = None;
    for a in to {
        if seen.contains(&a) {
            continue;
        }
        seen.push(a);
        if let Ok(m) = path_mtu(a) {
            best = Some(best.map_or(m, |b| b.min(m)));
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_route_mtu_is_capped_at_the_ipv4_maximum() {
        // lo has MTU 65536 on Linux; a datagram can be at most 65535 bytes.
        let m = path_mtu(Ipv4Addr::LOCALHOST.into()).expect("route to 127.0.0.1");
        assert!((1280..=MAX_IPV4_MTU).contains(&m), "{m}");
        let lo = crate::netif::interface_mtu("lo").expect("SIOCGIFMTU lo");
        assert_eq!(m, lo.min(MAX_IPV4_MTU));
        assert_eq!(
            crate::netif::interface_mtu_of(Ipv4Addr::LOCALHOST).expect("lo holds 127.0.0.1"),
            lo
        );
        assert_eq!(
            min_path_mtu([Ipv4Addr::LOCALHOST.into(), Ipv4Addr::LOCALHOST.into()]),
            Some(m)
        );
    }
}
