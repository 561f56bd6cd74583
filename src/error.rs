//! The crate's one error type.

use crate::driver::sys::CUresult;
use std::ffi::{c_char, CStr};
use std::fmt;
use std::sync::Mutex;

pub(crate) mod values;

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
    #[error(
        "no CUDA driver found: tried {}; install the NVIDIA driver, or set CUVMM_LIBCUDA to the path \
         of its libcuda.so.1",
        attempts(.tried)
    )]
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
    ///
    /// Making one costs nothing beyond the code: the driver's name and text for it
    /// ([`Error::driver_name`], [`Error::driver_description`]) are asked for only when the error is
    /// displayed, so a polling query's `CUDA_ERROR_NOT_READY` builds no string and makes no
    /// further driver call.
    #[error("{call} failed: {} ({code}): {}", texts.name(*code), texts.description(*code))]
    #[non_exhaustive]
    Driver {
        /// The entry point that failed.
        call: &'static str,
        /// The code it returned.
        code: CUresult,
        /// Where the code's name and text come from when asked.
        texts: DriverTexts,
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
    /// The peer closed the connection partway through a frame: `received` of the frame's
    /// `expected` bytes had arrived (a connection closed between frames is the end of the stream,
    /// no error). Its descriptors are closed; the connection is out of step.
    #[error("protocol error: the peer closed the socket after {received} of {expected} header bytes")]
    PeerClosed {
        /// Bytes of the frame received before the close.
        received: usize,
        /// Bytes in a whole frame.
        expected: usize,
    },
    /// The peer's credentials (`SO_PEERCRED`) are not those the receiver's policy accepts; nothing
    /// of its message was read.
    #[error("protocol error: peer pid {pid} runs as uid {uid}, which the policy {policy:?} refuses")]
    PeerRefused {
        /// The peer's process.
        pid: i32,
        /// The peer's effective uid.
        uid: u32,
        /// The policy that refused it.
        policy: values::PeerPolicy,
    },
    /// A well-formed message of another kind than the step expected (a grow where a share was
    /// expected, a share where a region was); its descriptor is closed.
    #[error("protocol error: a {got} message where {expected}")]
    UnexpectedMessage {
        /// The kind that arrived.
        got: values::Kind,
        /// What was expected, as the rest of the sentence (`a share message was expected`).
        expected: &'static str,
    },
    /// A well-formed message that breaks the layout of a growing region
    /// ([`RegionLayout`](crate::ipc::RegionLayout)): which rule, with its numbers. Nothing of it
    /// was mapped or unmapped.
    #[error("protocol error: {0}")]
    RegionRefused(values::RegionRefusal),
    /// A request refused for a reason a caller may want to act on ([`Refusal`]); the text says it
    /// with its numbers. Nothing was changed.
    #[error("{}: {detail}", why.category())]
    Refused {
        /// The reason.
        why: Refusal,
        /// The reason in words, with the request's numbers.
        detail: String,
    },
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
    /// [`Error::PeerClosed`].
    PeerClosed,
    /// [`Error::PeerRefused`].
    PeerRefused,
    /// [`Error::UnexpectedMessage`], with the kind that arrived.
    UnexpectedMessage(values::Kind),
    /// [`Error::RegionRefused`], with the rule broken.
    RegionRefused(values::RegionRefusal),
    /// [`Error::Refused`], with the reason.
    Refused(Refusal),
}

/// Why a request was refused ([`Error::Refused`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Refusal {
    /// An allocation larger than the device's memory, which could never be served.
    LargerThanDevice,
    /// A block that shares its physical allocation with other blocks was to be shared with
    /// another process, which could then reach them too.
    SharesItsAllocation,
    /// A shared vector would have to move (grow past its reservation) under its importers.
    WouldMove,
    /// Host memory that is registered with the driver already.
    AlreadyRegistered,
    /// A peer announced more bytes of an allocation than it exported (protocol).
    BeyondTheExport,
    /// A message came with more descriptors than its kind carries (protocol).
    TooManyDescriptors,
    /// A message's flags are not what its version allows (protocol).
    BadFlags,
    /// An allocation past the limit set on its allocator
    /// ([`StreamAllocator::set_memory_fraction`](crate::alloc::StreamAllocator::set_memory_fraction)):
    /// out of memory as far as its caller is concerned, though the device may have more.
    OverLimit,
}

impl Refusal {
    /// Whether a peer's message was refused, as opposed to the caller's own request.
    pub fn is_protocol(self) -> bool {
        matches!(self, Refusal::BeyondTheExport | Refusal::TooManyDescriptors | Refusal::BadFlags)
    }

    fn category(self) -> &'static str {
        if self.is_protocol() {
            "protocol error"
        } else if self == Refusal::OverLimit {
            "out of memory"
        } else {
            "invalid argument"
        }
    }
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
            Error::PeerClosed { .. } => ErrorKind::PeerClosed,
            Error::PeerRefused { .. } => ErrorKind::PeerRefused,
            Error::UnexpectedMessage { got, .. } => ErrorKind::UnexpectedMessage(*got),
            Error::RegionRefused(why) => ErrorKind::RegionRefused(*why),
            Error::Refused { why, .. } => ErrorKind::Refused(*why),
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

    /// Whether a peer's message or connection was refused: an [`Error::Protocol`] or one of the
    /// kinds that name the reason ([`Error::PeerClosed`], [`Error::PeerRefused`],
    /// [`Error::UnexpectedMessage`], [`Error::RegionRefused`]).
    pub fn is_protocol(&self) -> bool {
        matches!(
            self.kind(),
            ErrorKind::Protocol
                | ErrorKind::PeerClosed
                | ErrorKind::PeerRefused
                | ErrorKind::UnexpectedMessage(_)
                | ErrorKind::RegionRefused(_)
        ) || matches!(self.kind(), ErrorKind::Refused(why) if why.is_protocol())
    }

    /// Whether a peer's message did not arrive in time ([`Error::Timeout`]).
    pub fn is_timeout(&self) -> bool {
        self.kind() == ErrorKind::Timeout
    }

    /// A driver error for `call` returning `code`, whose name and text are cuvmm's own (no driver
    /// is asked): for fakes and models of the driver.
    pub fn driver(call: &'static str, code: CUresult) -> Error {
        Error::Driver { call, code, texts: DriverTexts::NONE }
    }

    /// For a driver error, the code's name (`CUDA_ERROR_OUT_OF_MEMORY`), asked of the driver now.
    pub fn driver_name(&self) -> Option<String> {
        match self {
            Error::Driver { code, texts, .. } => Some(texts.name(*code)),
            _ => None,
        }
    }

    /// For a driver error, the driver's description of the code, asked of it now.
    pub fn driver_description(&self) -> Option<String> {
        match self {
            Error::Driver { code, texts, .. } => Some(texts.description(*code)),
            _ => None,
        }
    }

    /// Whether the driver reported that it ran out of memory.
    pub fn is_out_of_memory(&self) -> bool {
        self.is_code(CUresult::ERROR_OUT_OF_MEMORY)
    }

    pub(crate) fn invalid(msg: impl fmt::Display) -> Error {
        Error::InvalidArgument(msg.to_string())
    }

    pub(crate) fn refused(why: Refusal, detail: impl fmt::Display) -> Error {
        Error::Refused { why, detail: detail.to_string() }
    }

    pub(crate) fn unsupported(what: impl fmt::Display, why: impl fmt::Display) -> Error {
        Error::Unsupported { what: what.to_string(), why: why.to_string() }
    }
}

/// `cuGetErrorName` or `cuGetErrorString`.
pub(crate) type ErrorTextFn = unsafe extern "C" fn(CUresult, *mut *const c_char) -> CUresult;

/// Where a driver error's name and text come from: the two entry points of the driver that
/// returned it, called only when the error is displayed. Copying it copies two pointers.
///
/// The pointers stay valid for the life of the process: a driver library, once opened, is never
/// closed.
#[derive(Clone, Copy)]
pub struct DriverTexts {
    name: Option<ErrorTextFn>,
    description: Option<ErrorTextFn>,
}

impl fmt::Debug for DriverTexts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.name.is_some() { "DriverTexts(driver)" } else { "DriverTexts(none)" })
    }
}

impl DriverTexts {
    /// No driver to ask: names are cuvmm's own.
    pub(crate) const NONE: DriverTexts = DriverTexts { name: None, description: None };

    pub(crate) fn new(name: Option<ErrorTextFn>, description: Option<ErrorTextFn>) -> DriverTexts {
        DriverTexts { name, description }
    }

    fn name(&self, code: CUresult) -> String {
        ask(self.name, code)
            .or_else(|| code.known_name().map(str::to_owned))
            .unwrap_or_else(|| format!("CUresult {}", code.0))
    }

    fn description(&self, code: CUresult) -> String {
        if self.description.is_some() && crate::driver::host_fn::in_host_function() {
            return "(not asked of the driver inside a host function)".to_owned();
        }
        ask(self.description, code).unwrap_or_else(|| "no description from the driver".to_owned())
    }
}

/// What `f` says about `code`; `None` without `f`, inside a stream host function (where no driver
/// call may be made), or for a code the driver does not know.
fn ask(f: Option<ErrorTextFn>, code: CUresult) -> Option<String> {
    let f = f?;
    if crate::driver::host_fn::in_host_function() {
        return None;
    }
    let mut p: *const c_char = std::ptr::null();
    // SAFETY: `f` is cuGetErrorName or cuGetErrorString of a driver that stays loaded (see
    // DriverTexts); they write a pointer to a static NUL-terminated string, or return an error for
    // a code they do not know.
    let rc = unsafe { f(code, &mut p) };
    if !rc.is_success() || p.is_null() {
        return None;
    }
    // SAFETY: the driver returned a pointer to a static, NUL-terminated string.
    Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// A destructor's failure, kept where a caller can read it: `Drop` cannot return one.
struct DropErrors {
    last: Option<Error>,
    count: u64,
}

static DROP_ERRORS: Mutex<DropErrors> = Mutex::new(DropErrors { last: None, count: 0 });

fn drop_errors() -> std::sync::MutexGuard<'static, DropErrors> {
    // Only plain assignments happen under the lock: a panic cannot leave it half-written.
    DROP_ERRORS.lock().unwrap_or_else(|p| p.into_inner())
}

/// Records what a destructor's driver call returned: an error becomes the process's last drop
/// error ([`last_drop_error`]) and counts in [`drop_error_count`].
pub(crate) fn record_drop<T>(r: Result<T>) {
    if let Err(e) = r {
        let mut d = drop_errors();
        d.last = Some(e);
        d.count += 1;
    }
}

/// The latest error a destructor met (a failed `cuMemRelease`, `cuStreamDestroy` and the like)
/// in this process, and clears it. Destructors cannot return errors and have nothing to retry,
/// so they record them here instead of dropping them, as does a stream allocator's free for what
/// the driver refused in the best-effort part of a free that succeeded (the event that lets other
/// streams reuse the block sooner): a program that wants to know whether its
/// teardown was clean reads this after dropping what it held (drops of device objects may run
/// on cuvmm's release thread a moment later, see [`crate::driver::callback`]).
pub fn take_drop_error() -> Option<Error> {
    drop_errors().last.take()
}

/// How many destructor errors this process has met, cleared or not.
pub fn drop_error_count() -> u64 {
    drop_errors().count
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;
    use nix::errno::Errno;

    #[test]
    fn each_error_has_its_kind_and_the_helpers_agree() {
        use values::Kind::Grow;
        let driver = |code| Error::driver("cuTest", code);
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
            (Error::PeerClosed { received: 70, expected: 144 }, ErrorKind::PeerClosed),
            (
                Error::PeerRefused { pid: 1, uid: 2, policy: values::PeerPolicy::Uid(3) },
                ErrorKind::PeerRefused,
            ),
            (
                Error::UnexpectedMessage { got: Grow, expected: "a share message was expected" },
                ErrorKind::UnexpectedMessage(Grow),
            ),
            (
                Error::RegionRefused(values::RegionRefusal::SecondRegion),
                ErrorKind::RegionRefused(values::RegionRefusal::SecondRegion),
            ),
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
            assert_eq!(e.is_protocol(), e.to_string().starts_with("protocol error: "), "{e}");
        }
        assert!(!driver(CUresult::ERROR_INVALID_VALUE).is_out_of_memory());
        assert!(!Error::Os { call: "recvmsg", errno: Errno::EINTR }.is_would_block());
    }

    #[test]
    fn a_refusal_reads_as_its_category_and_only_a_peers_counts_as_protocol() {
        let own = Error::refused(Refusal::LargerThanDevice, "9 bytes are more than 8");
        assert_eq!(own.to_string(), "invalid argument: 9 bytes are more than 8");
        assert_eq!(own.kind(), ErrorKind::Refused(Refusal::LargerThanDevice));
        assert!(!own.is_protocol());
        let peer = Error::refused(Refusal::BadFlags, "flags must be zero in version 1");
        assert_eq!(peer.to_string(), "protocol error: flags must be zero in version 1");
        assert!(peer.is_protocol());
        let over = Error::refused(Refusal::OverLimit, "8 bytes more than the limit");
        assert_eq!(over.to_string(), "out of memory: 8 bytes more than the limit");
        assert!(!over.is_protocol() && !over.is_out_of_memory(), "no driver said so");
    }

    #[test]
    fn a_driver_error_without_a_driver_names_its_code_itself() {
        let e = Error::driver("cuMemCreate", CUresult::ERROR_OUT_OF_MEMORY);
        assert_eq!(e.driver_name().as_deref(), Some("CUDA_ERROR_OUT_OF_MEMORY"));
        assert_eq!(
            e.to_string(),
            "cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY (2): no description from the driver"
        );
        assert_eq!(Error::driver("cuX", CUresult(12345)).driver_name().as_deref(), Some("CUresult 12345"));
        assert_eq!(Error::invalid("x").driver_name(), None);
    }

    #[test]
    fn the_protocol_sub_kinds_read_as_protocol_errors_did() {
        assert_eq!(
            Error::PeerClosed { received: 70, expected: 144 }.to_string(),
            "protocol error: the peer closed the socket after 70 of 144 header bytes"
        );
        assert_eq!(
            Error::PeerRefused { pid: 7, uid: 65534, policy: values::PeerPolicy::SameUid }.to_string(),
            "protocol error: peer pid 7 runs as uid 65534, which the policy SameUid refuses"
        );
        let got = values::Kind::Region;
        assert_eq!(
            Error::UnexpectedMessage { got, expected: "a share message was expected" }.to_string(),
            "protocol error: a region message where a share message was expected"
        );
    }

    #[test]
    fn a_destructors_error_is_kept_until_taken() {
        let before = drop_error_count();
        record_drop::<()>(Ok(()));
        record_drop::<()>(Err(Error::driver("cuMemRelease", CUresult::ERROR_INVALID_VALUE)));
        // Other tests of this process may record theirs meanwhile: only this one's count is sure.
        assert!(drop_error_count() > before);
        let taken = take_drop_error().expect("recorded");
        assert!(taken.code().is_some(), "{taken}");
    }
}
