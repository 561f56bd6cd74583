//! The crate's one error type.

use crate::driver::sys::CUresult;
use std::fmt;

/// What `dlopen` said about one library path it tried.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadAttempt {
    /// The path or soname handed to `dlopen`.
    pub path: String,
    /// `dlerror`'s message.
    pub message: String,
}

fn attempts(tried: &[LoadAttempt]) -> String {
    let parts: Vec<String> = tried.iter().map(|a| format!("{} ({})", a.path, a.message)).collect();
    parts.join("; ")
}

/// Everything that can go wrong in cuvmm.
#[derive(Clone, Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// No usable CUDA driver library could be opened.
    #[error("no CUDA driver found: tried {}", attempts(.tried))]
    DriverNotFound {
        /// Each path tried, with the loader's message.
        tried: Vec<LoadAttempt>,
    },
    /// The driver library lacks an entry point this crate requires.
    #[error("the CUDA driver at {library} lacks {name} at ABI version {version} ({reason})")]
    MissingEntryPoint {
        /// The library that was opened.
        library: String,
        /// The entry point's base name (`cuMemCreate`).
        name: &'static str,
        /// The ABI version asked for, as `cuGetProcAddress` takes it (12000 = CUDA 12.0).
        version: i32,
        /// Why it could not be resolved.
        reason: &'static str,
    },
    /// A driver call returned an error code.
    #[error("{call} failed: {name} ({code}): {description}")]
    Driver {
        /// The entry point that failed.
        call: &'static str,
        /// The code it returned.
        code: CUresult,
        /// `cuGetErrorName` of the code.
        name: String,
        /// `cuGetErrorString` of the code.
        description: String,
    },
    /// The driver, device or machine lacks a feature.
    #[error("unsupported: {what}: {why}")]
    Unsupported {
        /// The feature.
        what: String,
        /// Why it is unavailable.
        why: String,
    },
    /// An argument was rejected before reaching the driver.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// An operating-system call failed.
    #[error("{call} failed: {errno}")]
    Os {
        /// The call or step that failed.
        call: &'static str,
        /// The error number.
        errno: nix::errno::Errno,
    },
    /// A message received from a peer was malformed or refused.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// A peer's message did not arrive in time: the caller's deadline, or the socket's receive
    /// timeout with a message begun, passed (or, on a non-blocking socket, the rest of a begun
    /// message was not there yet). `received` of the frame's `expected` bytes had arrived: 0 means
    /// nothing was consumed. What became of a begun frame depends on the call (see
    /// [`recv_message`](crate::ipc::recv_message) and [`FrameReader`](crate::ipc::FrameReader)).
    #[error("timed out with {received} of {expected} bytes of a message received")]
    Timeout {
        /// Bytes of the frame received so far.
        received: usize,
        /// Bytes in a whole frame.
        expected: usize,
    },
    /// A driver call was made from a stream host function, where CUDA forbids it (it may
    /// deadlock). Nothing reached the driver; see [`crate::driver::callback`].
    #[error("{call} was called from a stream host function, where CUDA forbids driver calls")]
    InHostFunction {
        /// The entry point or operation refused.
        call: &'static str,
    },
}

impl Error {
    /// The driver's code, if this is a driver error.
    pub fn code(&self) -> Option<CUresult> {
        match self {
            Error::Driver { code, .. } => Some(*code),
            _ => None,
        }
    }

    /// Whether this is a driver error with the given code.
    pub fn is_code(&self, code: CUresult) -> bool {
        self.code() == Some(code)
    }

    /// Whether an operating-system call found nothing to do yet on a non-blocking socket or one
    /// with a timeout (`EAGAIN`): try again once it is ready.
    pub fn is_would_block(&self) -> bool {
        matches!(self, Error::Os { errno: nix::errno::Errno::EAGAIN, .. })
    }

    /// Whether a peer's message did not arrive in time ([`Error::Timeout`]).
    pub fn is_timeout(&self) -> bool {
        matches!(self, Error::Timeout { .. })
    }

    /// Whether the driver reported that it ran out of memory.
    pub fn is_out_of_memory(&self) -> bool {
        self.is_code(CUresult::ERROR_OUT_OF_MEMORY)
    }

    pub(crate) fn invalid(msg: impl fmt::Display) -> Error {
        Error::InvalidArgument(msg.to_string())
    }

    pub(crate) fn unsupported(what: impl fmt::Display, why: impl fmt::Display) -> Error {
        Error::Unsupported { what: what.to_string(), why: why.to_string() }
    }
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
