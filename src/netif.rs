//! Facts about this host's network interfaces, and socket settings, that
//! the node and the runtime both need: one place, below both.

use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket};
use std::os::fd::AsRawFd;

/// MTU of the interface that holds address `addr`.
pub fn interface_mtu_of(addr: Ipv4Addr) -> io::Result<usize> {
    let ifs = nix::ifaddrs::getifaddrs().map_err(io::Error::from)?;
    for i in ifs {
        let Some(a) = i
            .address
            .as_ref()
            .and_then(|a| a.as_sockaddr_in().map(|s| s.ip()))
        else {
            continue;
        };
        if a == addr {
            return interface_mtu(&i.interface_name);
        }
    }
    Err(io::Error::new(
        io::ErrorKind::NotFound,
        format!("no interface holds {addr}"),
    ))
}

/// The addresses of interface `name`, IPv4 and IPv6 (none: an empty
/// list), the IPv6 link-local ones left out: no job, ring or group names
/// those.
pub fn interface_addrs(name: &str) -> io::Result<Vec<IpAddr>> {
    let mut addrs: Vec<IpAddr> = interface_ipv4(name)?.into_iter().map(IpAddr::V4).collect();
    let ifs = nix::ifaddrs::getifaddrs().map_err(io::Error::from)?;
    addrs.extend(
        ifs.filter(|i| i.interface_name == name)
            .filter_map(|i| Some(i.address.as_ref()?.as_sockaddr_in6()?.ip()))
            .filter(|a| a.segments()[0] & 0xffc0 != 0xfe80)
            .map(IpAddr::V6),
    );
    Ok(addrs)
}

/// A UDP socket bound to `at`; an IPv6 one takes IPv6 only
/// (`IPV6_V6ONLY`), so that it and an IPv4 socket of the same port are
/// two sockets, one per family (a node serves IPv4 and IPv6 jobs at once).
pub fn bind_udp(at: SocketAddr) -> io::Result<UdpSocket> {
    use nix::sys::socket::{bind, setsockopt, socket, sockopt::Ipv6V6Only, AddressFamily, SockFlag, SockType, SockaddrStorage};
    let family = if at.is_ipv6() { AddressFamily::Inet6 } else { AddressFamily::Inet };
    let fd = socket(family, SockType::Datagram, SockFlag::SOCK_CLOEXEC, None).map_err(io::Error::from)?;
    if at.is_ipv6() {
        setsockopt(&fd, Ipv6V6Only, &true).map_err(io::Error::from)?;
    }
    bind(fd.as_raw_fd(), &SockaddrStorage::from(at)).map_err(io::Error::from)?;
    Ok(UdpSocket::from(fd))
}

/// The IPv4 addresses of interface `name` (none: an empty list).
pub fn interface_ipv4(name: &str) -> io::Result<Vec<Ipv4Addr>> {
    Ok(interface_ipv4_nets(name)?.into_iter().map(|(addr, _)| addr).collect())
}

/// `SIOCGIFMTU` of interface `name`.
pub fn interface_mtu(name: &str) -> io::Result<usize> {
    let sock = UdpSocket::bind(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0))?;
    // SAFETY: ifreq is plain data; zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    let bytes = name.as_bytes();
    if bytes.len() >= req.ifr_name.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("interface name {name:?} too long"),
        ));
    }
    for (d, s) in req.ifr_name.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    // SAFETY: valid fd and a valid ifreq for SIOCGIFMTU.
    let r = unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFMTU as _, &mut req) };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: SIOCGIFMTU filled the ifru_mtu member.
    let mtu = unsafe { req.ifr_ifru.ifru_mtu };
    usize::try_from(mtu).map_err(|_| io::Error::other(format!("interface {name}: MTU {mtu}")))
}

/// Socket buffers of `bytes`: the `*FORCE` options (beyond `rmem_max` /
/// `wmem_max`, with CAP_NET_ADMIN) first, else the capped ones.
pub fn set_socket_buffers(sock: &UdpSocket, bytes: i32) {
    for (force, opt) in [
        (libc::SO_RCVBUFFORCE, libc::SO_RCVBUF),
        (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF),
    ] {
        // SAFETY: valid fd, pointer to an int of the right size.
        unsafe {
            let p = &bytes as *const i32 as *const libc::c_void;
            if libc::setsockopt(sock.as_raw_fd(), libc::SOL_SOCKET, force, p, 4) != 0 {
                libc::setsockopt(sock.as_raw_fd(), libc::SOL_SOCKET, opt, p, 4);
            }
        }
    }
}

/// The IPv4 networks of interface `name`: each address with its netmask.
pub fn interface_ipv4_nets(name: &str) -> io::Result<Vec<(Ipv4Addr, Ipv4Addr)>> {
    let ifs = nix::ifaddrs::getifaddrs().map_err(io::Error::from)?;
    Ok(ifs
        .filter(|i| i.interface_name == name)
        .filter_map(|i| {
            let addr = i.address.as_ref()?.as_sockaddr_in()?.ip();
            let mask = i.netmask.as_ref()?.as_sockaddr_in()?.ip();
            Some((addr, mask))
        })
        .collect())
}

/// How this host sends a datagram to an address: what the kernel's route
/// to it says (`ip route get ADDR`, `ip -6 route get ADDR`).
#[derive(Debug)]
pub enum Route {
    /// It leaves by interface `ifindex`, handed to the neighbour `next_hop`
    /// there: the gateway when a router is on the way, else the address
    /// itself.
    Out {
        /// The egress interface.
        ifindex: u32,
        /// The neighbour to resolve on it (of the address's family).
        next_hop: IpAddr,
    },
    /// It does not leave by an interface to a unicast next hop: an address
    /// of this host (a local route), or a broadcast or multicast one.
    NotOut,
    /// There is no route: the kernel's answer (ENETUNREACH, EHOSTUNREACH,
    /// EACCES for a prohibit route, ...).
    Unreachable(io::Error),
}

/// The kernel's route to each of `addrs` (IPv4 or IPv6), in order
/// (rtnetlink RTM_GETROUTE, what `ip route get ADDR` asks: the output route
/// of this host). An error is a failure to ask; a refused address is
/// [`Route::Unreachable`].
pub fn routes<A: Into<IpAddr> + Copy>(addrs: &[A]) -> io::Result<Vec<(IpAddr, Route)>> {
    use netlink_packet_core::NLM_F_REQUEST;
    use netlink_packet_route::route::{RouteAddress, RouteAttribute, RouteMessage, RouteType};
    use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};

    let mut out = Vec::with_capacity(addrs.len());
    if addrs.is_empty() {
        return Ok(out);
    }
    let mut rtnl = Rtnl::open()?;
    for &addr in addrs {
        let addr: IpAddr = addr.into();
        let mut msg = RouteMessage::default();
        (msg.header.address_family, msg.header.destination_prefix_length) = match addr {
            IpAddr::V4(_) => (AddressFamily::Inet, 32),
            IpAddr::V6(_) => (AddressFamily::Inet6, 128),
        };
        msg.attributes = vec![RouteAttribute::Destination(RouteAddress::from(addr))];
        let route = match rtnl.request(RouteNetlinkMessage::GetRoute(msg), NLM_F_REQUEST)? {
            Reply::Error(e) => Route::Unreachable(e),
            Reply::Message(RouteNetlinkMessage::NewRoute(r)) if r.header.kind == RouteType::Unicast => {
                let ifindex = r.attributes.iter().find_map(|a| match a {
                    RouteAttribute::Oif(i) => Some(*i),
                    _ => None,
                });
                let gateway = r.attributes.iter().find_map(|a| match a {
                    RouteAttribute::Gateway(RouteAddress::Inet(g)) => Some(IpAddr::V4(*g)),
                    RouteAttribute::Gateway(RouteAddress::Inet6(g)) => Some(IpAddr::V6(*g)),
                    _ => None,
                });
                match ifindex {
                    Some(ifindex) => Route::Out { ifindex, next_hop: gateway.unwrap_or(addr) },
                    None => return Err(io::Error::other(format!("rtnetlink: the route to {addr} names no interface"))),
                }
            }
            Reply::Message(RouteNetlinkMessage::NewRoute(_)) => Route::NotOut,
            Reply::Message(m) => return Err(io::Error::other(format!("rtnetlink: unexpected answer to RTM_GETROUTE {addr}: {m:?}"))),
            Reply::Ack => return Err(io::Error::other(format!("rtnetlink: an acknowledgement for RTM_GETROUTE {addr}"))),
        };
        out.push((addr, route));
    }
    Ok(out)
}

/// Asks the kernel to resolve the link-layer address of each of `addrs`
/// (IPv4 or IPv6) on interface `ifindex` now (rtnetlink RTM_NEWNEIGH with
/// NTF_USE, what `ip neigh replace ADDR dev IF use` sends): an entry is
/// created if there is none and an ARP request, or for IPv6 a neighbour
/// solicitation, goes out; an existing one is left as it is. Returns at
/// once (the answers come later), the first refusal as an error.
pub fn resolve_neighbours<A: Into<IpAddr> + Copy>(ifindex: u32, addrs: &[A]) -> io::Result<()> {
    use netlink_packet_core::{NLM_F_ACK, NLM_F_CREATE, NLM_F_REPLACE, NLM_F_REQUEST};
    use netlink_packet_route::neighbour::{NeighbourAddress, NeighbourAttribute, NeighbourFlags, NeighbourMessage};
    use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};

    if addrs.is_empty() {
        return Ok(());
    }
    let mut rtnl = Rtnl::open()?;
    for &addr in addrs {
        let addr: IpAddr = addr.into();
        let mut neigh = NeighbourMessage::default();
        let (family, destination) = match addr {
            IpAddr::V4(a) => (AddressFamily::Inet, NeighbourAddress::Inet(a)),
            IpAddr::V6(a) => (AddressFamily::Inet6, NeighbourAddress::Inet6(a)),
        };
        neigh.header.family = family;
        neigh.header.ifindex = ifindex;
        neigh.header.flags = NeighbourFlags::Use;
        neigh.attributes = vec![NeighbourAttribute::Destination(destination)];
        let flags = NLM_F_REQUEST | NLM_F_CREATE | NLM_F_REPLACE | NLM_F_ACK;
        match rtnl.request(RouteNetlinkMessage::NewNeighbour(neigh), flags)? {
            Reply::Ack => {}
            Reply::Error(e) => return Err(e),
            Reply::Message(m) => return Err(io::Error::other(format!("rtnetlink: unexpected answer to RTM_NEWNEIGH {addr}: {m:?}"))),
        }
    }
    Ok(())
}

/// The one answer to an rtnetlink request.
enum Reply {
    /// An acknowledgement (NLMSG_ERROR with code 0).
    Ack,
    /// The kernel refused: its errno.
    Error(io::Error),
    /// A message (the answer to a GET request).
    Message(netlink_packet_route::RouteNetlinkMessage),
}

/// A NETLINK_ROUTE socket of this network namespace that sends one request
/// at a time and reads its one answer.
struct Rtnl {
    socket: netlink_sys::Socket,
    seq: u32,
}

impl Rtnl {
    fn open() -> io::Result<Rtnl> {
        use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};

        let mut socket = Socket::new(NETLINK_ROUTE)?;
        socket.bind_auto()?;
        socket.connect(&SocketAddr::new(0, 0))?;
        Ok(Rtnl { socket, seq: 0 })
    }

    fn request(&mut self, message: netlink_packet_route::RouteNetlinkMessage, flags: u16) -> io::Result<Reply> {
        use netlink_packet_core::{NetlinkHeader, NetlinkMessage, NetlinkPayload};
        use netlink_packet_route::RouteNetlinkMessage;

        self.seq += 1;
        let mut header = NetlinkHeader::default();
        header.flags = flags;
        header.sequence_number = self.seq;
        let mut msg = NetlinkMessage::new(header, NetlinkPayload::from(message));
        msg.finalize();
        let mut buf = vec![0; msg.buffer_len()];
        msg.serialize(&mut buf);
        self.socket.send(&buf, 0)?;
        let mut reply = vec![0; 8192];
        let n = self.socket.recv(&mut &mut reply[..], 0)?;
        match NetlinkMessage::<RouteNetlinkMessage>::deserialize(&reply[..n]) {
            Ok(m) => match m.payload {
                NetlinkPayload::Error(e) => Ok(match e.code {
                    Some(code) => Reply::Error(io::Error::from_raw_os_error(-code.get())),
                    None => Reply::Ack,
                }),
                NetlinkPayload::InnerMessage(inner) => Ok(Reply::Message(inner)),
                other => Err(io::Error::other(format!("rtnetlink: unexpected reply {other:?}"))),
            },
            Err(e) => Err(io::Error::other(format!("rtnetlink reply: {e}"))),
        }
    }
}
