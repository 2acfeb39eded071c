//! Experiment stub (not done yet).
use anyhow::{bail, Result};
use super::{BenchOptions, Context_, Section};
/// Run the experiment.
pub fn run(_opts: &BenchOptions, _ctx: &mut Context_) -> Result<Section> {
    bail!("not implemented yet")
}
