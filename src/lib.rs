//! AggBox: in-kernel aggregation and broadcast for distributed communication.
//!
//! The library holds the product; `src/main.rs` (the `aggbox` binary) is a
//! thin command line over it. The evaluation is an executable of its own
//! on this public API (`src/bin/aggbox-bench/`, `make bench`), and the
//! network-namespace testbed it shares with the tests lives in
//! `src/testing/`, outside the library.
//!
//! The folders are the layers, and dependencies point one way:
//! `wire` ← `config` ← `kernel` ← `node`, and `wire` ← `config` ← `runtime`.
//! `wire` imports nothing of the crate, `config` only `wire`; `node` and
//! `runtime` never import each other, nor `runtime` the `kernel`: what both
//! stacks need lives in `wire` (the ring memory, the fragment size).
//! `netif` imports nothing and the layers above `config` may read it. In
//! the runtime, the public API (`api`, `comm`, `control`, `calls`, `driver`, `striped`,
//! `collective`, `ring`, `runtime/mod.rs`) sits on the engine and the
//! modules it is built from, which never import the API. Unit tests may use
//! any layer. `tests/layers.rs` checks every import against these rules.
//!
//! - [`wire`]: what is on the wire and in the maps: the ABI mirror of
//!   `include/aggbox/abi.h`, the message codecs, the reference reducer.
//! - [`config`]: the node TOML that the daemon and the workers' runtime both
//!   read (one file describes a deployment).
//! - [`netif`]: interface facts (MTU) that the node and the runtime both read.
//! - [`kernel`]: the BPF programs' user-space halves: the XDP aggregator,
//!   the TC broadcaster, AF_XDP sockets and the user-space aggregation path
//!   they feed.
//! - [`node`]: `aggbox attach` and its services: pins, status, upkeep,
//!   Prometheus metrics, operator tools.
//! - [`runtime`]: the application library (broadcast / reduce / allreduce):
//!   a state machine without I/O and the driver that gives it sockets.

pub mod config;
pub mod kernel;
pub mod netif;
pub mod node;
pub mod runtime;
pub mod wire;

/// `impl std::ops::Op for Type` that applies `Op::method` to each field of
/// two values of a struct of counters (`Add` to sum communicators or
/// stripes, `Sub` for a delta): the field-wise operator written once. The
/// fields are listed after the type; the struct literal it builds makes
/// leaving a field out a compile error.
///
/// ```
/// #[derive(Debug, Clone, Copy, PartialEq, Eq)]
/// pub struct Fates {
///     pub dropped: u64,
///     pub passed: u64,
/// }
/// aggbox::fieldwise! {
///     /// Two sets of counters added up.
///     impl Add::add, Sub::sub for Fates { dropped, passed }
/// }
/// let a = Fates { dropped: 3, passed: 5 };
/// assert_eq!(a + a - Fates { dropped: 1, passed: 0 }, Fates { dropped: 5, passed: 10 });
/// ```
#[macro_export]
macro_rules! fieldwise {
    (
        $(#[$meta:meta])*
        impl $($op:ident :: $method:ident),+ for $name:ident { $($field:ident),+ $(,)? }
    ) => {
        $crate::fieldwise!(@ops [$(#[$meta])*] $name [$($field)+] $($op $method)+);
    };
    (@ops $meta:tt $name:ident $fields:tt $($op:ident $method:ident)+) => {
        $( $crate::fieldwise!(@op $meta $op $method $name $fields); )+
    };
    (@op [$(#[$meta:meta])*] $op:ident $method:ident $name:ident [$($field:ident)+]) => {
        $(#[$meta])*
        impl ::std::ops::$op for $name {
            type Output = $name;
            fn $method(self, o: $name) -> $name {
                $name { $( $field: ::std::ops::$op::$method(self.$field, o.$field) ),+ }
            }
        }
    };
}
