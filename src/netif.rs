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
    let ifs = nix::ifaddrs::getifaddrs().map_err(io::Error::from)?;
    Ok(ifs
        .filter(|i| i.interface_name == name)
        .filter_map(|i| i.address.as_ref().and_then(|a| a.as_sockaddr_in().map(|s| s.ip())))
        .collect())
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
