//! Unit tests of the state machine: several engines, a simulated network, a fake clock.
