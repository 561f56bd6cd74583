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

/// What kind of error an [`Error`] is, without its details: what a caller or a test matches on
/// rather than the message, which is for people and may be reworded.
///
/// ```
/// use cuvmm::{ErrorKind, driver::sys::CUresult};
/// fn retry_smaller(e: &cuvmm::Error) -> bool {
///     matches!(e.kind(), ErrorKind::Driver(CUresult::ERROR_OUT_OF_MEMORY))
/// }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// [`Error::DriverNotFound`].
    DriverNotFound,
    /// [`Error::MissingEntryPoint`].
    MissingEntryPoint,
    /// [`Error::Driver`], with the code the driver returned (`ERROR_OUT_OF_MEMORY`: the device
    /// ran out of memory, as [`Error::is_out_of_memory`] says).
    Driver(CUresult),
    /// [`Error::Unsupported`].
    Unsupported,
    /// [`Error::InvalidArgument`].
    InvalidArgument,
    /// [`Error::Os`], with the error number.
    Os(nix::errno::Errno),
    /// [`Error::Protocol`].
    Protocol,
    /// [`Error::Timeout`].
    Timeout,
    /// [`Error::InHostFunction`].
    InHostFunction,
}

impl Error {
    /// Its kind, to match on.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::DriverNotFound { .. } => ErrorKind::DriverNotFound,
            Error::MissingEntryPoint { .. } => ErrorKind::MissingEntryPoint,
            Error::Driver { code, .. } => ErrorKind::Driver(*code),
            Error::Unsupported { .. } => ErrorKind::Unsupported,
            Error::InvalidArgument(_) => ErrorKind::InvalidArgument,
            Error::Os { errno, .. } => ErrorKind::Os(*errno),
            Error::Protocol(_) => ErrorKind::Protocol,
            Error::Timeout { .. } => ErrorKind::Timeout,
            Error::InHostFunction { .. } => ErrorKind::InHostFunction,
        }
    }

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
        self.kind() == ErrorKind::Os(nix::errno::Errno::EAGAIN)
    }

    /// Whether a peer's message did not arrive in time ([`Error::Timeout`]).
    pub fn is_timeout(&self) -> bool {
        self.kind() == ErrorKind::Timeout
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

#[cfg(test)]
mod tests {
    use super::*;
    use nix::errno::Errno;

    #[test]
    fn each_error_has_its_kind_and_the_helpers_agree() {
        let driver =
            |code| Error::Driver { call: "cuTest", code, name: String::new(), description: String::new() };
        let cases = [
            (Error::DriverNotFound { tried: Vec::new() }, ErrorKind::DriverNotFound),
            (
                Error::MissingEntryPoint {
                    library: "x".into(),
                    name: "cuX",
                    version: 12000,
                    reason: "absent",
                },
                ErrorKind::MissingEntryPoint,
            ),
            (driver(CUresult::ERROR_OUT_OF_MEMORY), ErrorKind::Driver(CUresult::ERROR_OUT_OF_MEMORY)),
            (Error::unsupported("a", "b"), ErrorKind::Unsupported),
            (Error::invalid("x"), ErrorKind::InvalidArgument),
            (Error::Os { call: "recvmsg", errno: Errno::EAGAIN }, ErrorKind::Os(Errno::EAGAIN)),
            (Error::Protocol("x".into()), ErrorKind::Protocol),
            (Error::Timeout { received: 1, expected: 2 }, ErrorKind::Timeout),
            (Error::InHostFunction { call: "cuX" }, ErrorKind::InHostFunction),
        ];
        for (e, kind) in &cases {
            assert_eq!(e.kind(), *kind, "{e}");
            assert_eq!(
                e.is_out_of_memory(),
                *kind == ErrorKind::Driver(CUresult::ERROR_OUT_OF_MEMORY),
                "{e}"
            );
            assert_eq!(e.is_would_block(), *kind == ErrorKind::Os(Errno::EAGAIN), "{e}");
            assert_eq!(e.is_timeout(), *kind == ErrorKind::Timeout, "{e}");
        }
        assert!(!driver(CUresult::ERROR_INVALID_VALUE).is_out_of_memory());
        assert!(!Error::Os { call: "recvmsg", errno: Errno::EINTR }.is_would_block());
    }
}
