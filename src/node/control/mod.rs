//! Jobs on demand (docs/INTERFACE.md, "Jobs on demand"): the credentials a
//! run proves ([`keys`]) and the jobs runs create, renew and end
//! ([`registry`], without I/O). The messages are `wire::control` (AGC1).
//!
//! Not yet served: the TCP endpoint in `aggbox attach` that feeds the
//! registry and applies [`registry::Registry::desired`] to the node's
//! kernel state, and the clients' connect forms.

pub mod keys;
pub mod registry;

pub use keys::{Keys, Tenant};
pub use registry::{Limits, LiveJob, Registry};
