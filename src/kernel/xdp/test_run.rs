//! Running XDP programs with BPF_PROG_TEST_RUN: the tests' and benchmarks'
//! runner, and the control plane's way to run its helper programs
//! (`aggbox_reclaim`, `aggbox_fast_discard`).

use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use super::{Result, XdpError, XdpPlane};

impl XdpPlane {
    /// Run the XDP entry program once on `frame` with BPF_PROG_TEST_RUN;
    /// returns the XDP verdict and the frame as the program left it.
    pub fn test_run(&self, frame: &[u8]) -> Result<(u32, Vec<u8>)> {
        self.test_runner()?.run(frame)
    }

    /// A handle that runs the XDP entry program with BPF_PROG_TEST_RUN and
    /// can be sent to other threads (each may pin itself to a CPU).
    pub fn test_runner(&self) -> Result<TestRunner> {
        let fd = self
            .xdp_prog_fd()
            .try_clone_to_owned()
            .map_err(|e| XdpError::TestRun(libbpf_rs::Error::from(e)))?;
        Ok(TestRunner { fd })
    }
}

/// A duplicated descriptor of the XDP entry program for BPF_PROG_TEST_RUN
/// (`Send + Sync`; the dataplane's maps stay shared with it).
#[derive(Debug)]
pub struct TestRunner {
    pub(super) fd: OwnedFd,
}

impl TestRunner {
    /// A runner of any loaded XDP program (benchmarks compare others with
    /// AggBox's: the floor aggregator, count-and-drop).
    pub fn for_program(prog: &libbpf_rs::ProgramMut<'_>) -> Result<TestRunner> {
        TestRunner::for_fd(prog.as_fd())
    }

    /// A runner of the XDP program behind `prog` (one loaded without a
    /// skeleton, e.g. a test's hand-assembled probe).
    pub fn for_fd(prog: std::os::fd::BorrowedFd<'_>) -> Result<TestRunner> {
        let fd = prog
            .try_clone_to_owned()
            .map_err(|e| XdpError::TestRun(libbpf_rs::Error::from(e)))?;
        Ok(TestRunner { fd })
    }
}

impl TestRunner {
    /// Run the program once on `frame`; returns the verdict and output frame.
    pub fn run(&self, frame: &[u8]) -> Result<(u32, Vec<u8>)> {
        self.run_timed(frame).map(|(verdict, out, _)| (verdict, out))
    }

    /// [`TestRunner::run`] plus the kernel's measured run time of the whole
    /// chain in nanoseconds (BPF_PROG_TEST_RUN's `duration`, which excludes
    /// the copies in and out): what `benches/xdp_chain.rs` reports.
    pub fn run_timed(&self, frame: &[u8]) -> Result<(u32, Vec<u8>, u32)> {
        self.test_run(frame, 1)
    }

    /// BPF_PROG_TEST_RUN of `frame`, `repeat` times on the same buffer:
    /// verdict, output frame and mean run time (ns) of the runs.
    fn test_run(&self, frame: &[u8], repeat: u32) -> Result<(u32, Vec<u8>, u32)> {
        let mut out = vec![0u8; frame.len() + 256];
        // SAFETY: zeroed opts are valid; sz set; buffers outlive the call.
        let mut opts: libbpf_sys::bpf_test_run_opts = unsafe { std::mem::zeroed() };
        opts.sz = std::mem::size_of::<libbpf_sys::bpf_test_run_opts>() as _;
        opts.data_in = frame.as_ptr().cast();
        opts.data_size_in = frame.len() as u32;
        opts.data_out = out.as_mut_ptr().cast();
        opts.data_size_out = out.len() as u32;
        opts.repeat = repeat as i32;
        // SAFETY: valid program fd and opts pointing at live buffers.
        let rc = unsafe { libbpf_sys::bpf_prog_test_run_opts(self.fd.as_raw_fd(), &mut opts) };
        if rc < 0 {
            let err = std::io::Error::from_raw_os_error(-rc);
            return Err(XdpError::TestRun(libbpf_rs::Error::from(err)));
        }
        out.truncate(opts.data_size_out as usize);
        Ok((opts.retval, out, opts.duration))
    }

    /// Mean run time (ns) of `repeat` runs of the program on one `frame`
    /// (BPF_PROG_TEST_RUN with `repeat`: one buffer, so each run sees
    /// what the run before left in it; benches/xdp_chain.rs's feeder
    /// rewrites it into the next contribution).
    pub fn run_repeated(&self, frame: &[u8], repeat: u32) -> Result<u32> {
        self.test_run(frame, repeat).map(|(_, _, ns)| ns)
    }
}
