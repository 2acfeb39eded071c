//! Facts about this host's network interfaces, and socket settings, that
//! the node and the runtime both need: one place, below both.

use std::io;
use std::net::{Ipv4Addr, SocketAddrV4, UdpSocket};
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

/// Of `addrs`, those on one of interface `name`'s IPv4 networks (reached
/// without a router), each once, not the interface's own.
pub fn on_link(name: &str, addrs: impl IntoIterator<Item = Ipv4Addr>) -> io::Result<Vec<Ipv4Addr>> {
    let nets = interface_ipv4_nets(name)?;
    let mut out: Vec<Ipv4Addr> = Vec::new();
    for a in addrs {
        let inside = nets.iter().any(|(n, m)| u32::from(a) & u32::from(*m) == u32::from(*n) & u32::from(*m));
        if inside && !nets.iter().any(|(n, _)| *n == a) && !out.contains(&a) {
            out.push(a);
        }
    }
    Ok(out)
}

/// Asks the kernel to resolve the link-layer address of each of `addrs`
/// on interface `ifindex` now (rtnetlink RTM_NEWNEIGH with NTF_USE, what
/// `ip neigh replace ADDR dev IF use` sends): an entry is created if there
/// is none and an ARP request goes out; an existing one is left as it is.
/// Returns at once (the answers come later), the first refusal as an error.
pub fn resolve_neighbours(ifindex: u32, addrs: &[Ipv4Addr]) -> io::Result<()> {
    use netlink_packet_core::{
        NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_CREATE, NLM_F_REPLACE, NLM_F_REQUEST,
    };
    use netlink_packet_route::neighbour::{NeighbourAddress, NeighbourAttribute, NeighbourFlags, NeighbourMessage};
    use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};
    use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};

    if addrs.is_empty() {
        return Ok(());
    }
    let mut socket = Socket::new(NETLINK_ROUTE)?;
    socket.bind_auto()?;
    socket.connect(&SocketAddr::new(0, 0))?;
    for (seq, addr) in addrs.iter().enumerate() {
        let mut neigh = NeighbourMessage::default();
        neigh.header.family = AddressFamily::Inet;
        neigh.header.ifindex = ifindex;
        neigh.header.flags = NeighbourFlags::Use;
        neigh.attributes = vec![NeighbourAttribute::Destination(NeighbourAddress::Inet(*addr))];
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | NLM_F_CREATE | NLM_F_REPLACE | NLM_F_ACK;
        header.sequence_number = seq as u32 + 1;
        let mut msg = NetlinkMessage::new(header, NetlinkPayload::from(RouteNetlinkMessage::NewNeighbour(neigh)));
        msg.finalize();
        let mut buf = vec![0; msg.buffer_len()];
        msg.serialize(&mut buf);
        socket.send(&buf, 0)?;
        let mut reply = vec![0; 4096];
        let n = socket.recv(&mut &mut reply[..], 0)?;
        match NetlinkMessage::<RouteNetlinkMessage>::deserialize(&reply[..n]) {
            Ok(m) => {
                if let NetlinkPayload::Error(e) = m.payload {
                    if let Some(code) = e.code {
                        return Err(io::Error::from_raw_os_error(-code.get()));
                    }
                }
            }
            Err(e) => return Err(io::Error::other(format!("rtnetlink reply: {e}"))),
        }
    }
    Ok(())
}
