//! Application experiments (not done yet).
use anyhow::{bail, Result};
use super::{BenchOptions, Context_, Section};
/// GEMM.
pub fn run_gemm(_opts: &BenchOptions, _ctx: &mut Context_) -> Result<Section> { bail!("not implemented yet") }
/// Parameter server.
pub fn run_ps(_opts: &BenchOptions, _ctx: &mut Context_) -> Result<Section> { bail!("not implemented yet") }
/// Word count.
pub fn run_wordcount(_opts: &BenchOptions, _ctx: &mut Context_) -> Result<Section> { bail!("not implemented yet") }
/// Broadcast apps.
pub fn run_bcast_apps(_opts: &BenchOptions, _ctx: &mut Context_) -> Result<Section> { bail!("not implemented yet") }
