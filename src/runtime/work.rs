//! Non-blocking handles, like torch's `Work`: a call issued with one of the
//! `Communicator::i*` methods runs on the communicator's progress thread (in
//! issue order); the handle says whether it finished and waits for its result.

use std::sync::mpsc;
use std::sync::Mutex;

use crate::runtime::error::CommError;

/// The pending result of a non-blocking call.
#[derive(Debug)]
pub struct Work<T> {
    rx: Option<mpsc::Receiver<Result<T, CommError>>>,
    done: Mutex<Option<Result<T, CommError>>>,
}

impl<T> Work<T> {
    pub(crate) fn pending(rx: mpsc::Receiver<Result<T, CommError>>) -> Work<T> {
        Work {
            rx: Some(rx),
            done: Mutex::new(None),
        }
    }

    pub(crate) fn ready(r: Result<T, CommError>) -> Work<T> {
        Work {
            rx: None,
            done: Mutex::new(Some(r)),
        }
    }

    /// Whether the call finished (successfully or not); never blocks.
    pub fn is_completed(&self) -> bool {
        let mut done = self.done.lock().unwrap_or_else(|p| p.into_inner());
        if done.is_some() {
            return true;
        }
        match self.rx.as_ref().map(|rx| rx.try_recv()) {
            Some(Ok(r)) => {
                *done = Some(r);
                true
            }
            Some(Err(mpsc::TryRecvError::Empty)) => false,
            Some(Err(mpsc::TryRecvError::Disconnected)) | None => {
                *done = Some(Err(CommError::Closed));
                true
            }
        }
    }

    /// Blocks until the call finished and returns its result. Every call has
    /// a deadline, so this returns by then.
    pub fn wait(self) -> Result<T, CommError> {
        let done = self.done.into_inner().unwrap_or_else(|p| p.into_inner());
        if let Some(r) = done {
            return r;
        }
        match self.rx {
            Some(rx) => rx.recv().unwrap_or(Err(CommError::Closed)),
            None => Err(CommError::Closed),
        }
    }
}
