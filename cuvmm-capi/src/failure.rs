//! Errors as the C ABI reports them: a code a C caller matches on (`cuvmm_error_t` of cuvmm.h,
//! [`crate::cuvmm_last_error_code`]), derived from the kind of [`cuvmm_lib::Error`], and the text
//! for people ([`crate::cuvmm_last_error`]).

use cuvmm_lib::driver::sys::CUresult;
use cuvmm_lib::{Error, ErrorKind, Refusal};

/// `cuvmm_error_t` of cuvmm.h. The numbers are the ABI: never renumbered, only added to.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// No error yet on this thread.
    None = 0,
    /// An argument was refused (a bad size, a null output, a bad tag name, a tag asleep, a bad
    /// `CUVMM_ALLOC_CONF`): nothing changed.
    InvalidArgument = 1,
    /// Out of memory: the driver said so, the request is larger than the device, or it would pass
    /// the memory fraction.
    OutOfMemory = 2,
    /// Another error of a driver call.
    Driver = 3,
    /// No usable CUDA driver.
    NoDriver = 4,
    /// The driver, device or machine lacks a feature.
    Unsupported = 5,
    /// An operating-system call failed.
    Os = 6,
    /// A peer's message or connection was malformed or refused.
    Protocol = 7,
    /// A peer's credentials are not those the policy accepts.
    PeerRefused = 8,
    /// A peer did not answer in time.
    Timeout = 9,
    /// A driver call from a stream host function, where CUDA forbids it.
    InHostFunction = 10,
    /// A panic caught at the C boundary, or an error this build does not know.
    Internal = 11,
}

impl ErrorCode {
    /// The code of `e`'s kind.
    pub(crate) fn of(e: &Error) -> ErrorCode {
        match e.kind() {
            ErrorKind::Driver(CUresult::ERROR_OUT_OF_MEMORY)
            | ErrorKind::Refused(Refusal::LargerThanDevice | Refusal::OverLimit) => ErrorCode::OutOfMemory,
            ErrorKind::Refused(why) if why.is_protocol() => ErrorCode::Protocol,
            ErrorKind::InvalidArgument | ErrorKind::Refused(_) => ErrorCode::InvalidArgument,
            ErrorKind::Driver(_) => ErrorCode::Driver,
            ErrorKind::DriverNotFound | ErrorKind::MissingEntryPoint => ErrorCode::NoDriver,
            ErrorKind::Unsupported => ErrorCode::Unsupported,
            ErrorKind::Os(_) => ErrorCode::Os,
            ErrorKind::Protocol
            | ErrorKind::PeerClosed
            | ErrorKind::UnexpectedMessage(_)
            | ErrorKind::RegionRefused(_) => ErrorCode::Protocol,
            ErrorKind::PeerRefused => ErrorCode::PeerRefused,
            ErrorKind::Timeout => ErrorCode::Timeout,
            ErrorKind::InHostFunction => ErrorCode::InHostFunction,
            _ => ErrorCode::Internal,
        }
    }
}

/// What is written to stderr once ([`crate::fail`]): the same failure of the same entry point
/// with other sizes or addresses is one group. A driver's error is told apart by its call and
/// result too, an operating system's by its call.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Group {
    pub code: ErrorCode,
    pub call: Option<&'static str>,
    pub result: Option<i32>,
}

/// A failed call: its code, its group, and its text.
#[derive(Clone, Debug)]
pub(crate) struct Failure {
    pub group: Group,
    pub message: String,
}

impl Failure {
    /// A failure of the C ABI's own checks, with `code`.
    pub(crate) fn new(code: ErrorCode, message: impl Into<String>) -> Failure {
        Failure { group: Group { code, call: None, result: None }, message: message.into() }
    }

    pub(crate) fn code(&self) -> ErrorCode {
        self.group.code
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Failure {
        let (call, result) = match &e {
            Error::Driver { call, code, .. } => (Some(*call), Some(code.0)),
            Error::Os { call, .. } => (Some(*call), None),
            _ => (None, None),
        };
        Failure { group: Group { code: ErrorCode::of(&e), call, result }, message: e.to_string() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_of_error_has_the_code_a_c_caller_acts_on() {
        let oom = Error::driver("cuMemCreate", CUresult::ERROR_OUT_OF_MEMORY);
        let failure = Failure::from(oom.clone());
        assert_eq!(failure.code(), ErrorCode::OutOfMemory);
        assert_eq!(failure.group.call, Some("cuMemCreate"));
        assert_eq!(failure.message, oom.to_string());
        for (e, code) in [
            (Error::driver("cuMemMap", CUresult::ERROR_INVALID_VALUE), ErrorCode::Driver),
            (Error::InvalidArgument("negative size".into()), ErrorCode::InvalidArgument),
            (Error::DriverNotFound { tried: Vec::new() }, ErrorCode::NoDriver),
            (Error::Protocol("bad".into()), ErrorCode::Protocol),
            (Error::Timeout { received: 0, expected: 8 }, ErrorCode::Timeout),
            (Error::InHostFunction { call: "cuMemMap" }, ErrorCode::InHostFunction),
            (refused(Refusal::LargerThanDevice), ErrorCode::OutOfMemory),
            (refused(Refusal::OverLimit), ErrorCode::OutOfMemory),
            (refused(Refusal::SharesItsAllocation), ErrorCode::InvalidArgument),
            (refused(Refusal::BadFlags), ErrorCode::Protocol),
        ] {
            assert_eq!(ErrorCode::of(&e), code, "{e}");
        }
        // The ABI's numbers.
        assert_eq!(
            [ErrorCode::None, ErrorCode::OutOfMemory, ErrorCode::Internal].map(|c| c as i32),
            [0, 2, 11]
        );
        assert_eq!(Failure::new(ErrorCode::InvalidArgument, "x").code(), ErrorCode::InvalidArgument);
    }

    /// The header's `cuvmm_error_t` is written by hand (cbindgen cannot give its constants their C
    /// names): every code must be there under its name, with its number.
    #[test]
    fn the_header_declares_every_code_with_its_number() {
        let header = include_str!("../include/cuvmm.h");
        let name = |c: ErrorCode| match c {
            ErrorCode::None => "CUVMM_OK",
            ErrorCode::InvalidArgument => "CUVMM_ERROR_INVALID_ARGUMENT",
            ErrorCode::OutOfMemory => "CUVMM_ERROR_OUT_OF_MEMORY",
            ErrorCode::Driver => "CUVMM_ERROR_DRIVER",
            ErrorCode::NoDriver => "CUVMM_ERROR_NO_DRIVER",
            ErrorCode::Unsupported => "CUVMM_ERROR_UNSUPPORTED",
            ErrorCode::Os => "CUVMM_ERROR_OS",
            ErrorCode::Protocol => "CUVMM_ERROR_PROTOCOL",
            ErrorCode::PeerRefused => "CUVMM_ERROR_PEER_REFUSED",
            ErrorCode::Timeout => "CUVMM_ERROR_TIMEOUT",
            ErrorCode::InHostFunction => "CUVMM_ERROR_IN_HOST_FUNCTION",
            ErrorCode::Internal => "CUVMM_ERROR_INTERNAL",
        };
        let all = [
            ErrorCode::None,
            ErrorCode::InvalidArgument,
            ErrorCode::OutOfMemory,
            ErrorCode::Driver,
            ErrorCode::NoDriver,
            ErrorCode::Unsupported,
            ErrorCode::Os,
            ErrorCode::Protocol,
            ErrorCode::PeerRefused,
            ErrorCode::Timeout,
            ErrorCode::InHostFunction,
            ErrorCode::Internal,
        ];
        for c in all {
            let line = format!("{} = {}", name(c), c as i32);
            assert!(header.contains(&line), "cuvmm.h lacks `{line}`");
        }
        let in_header = header
            .lines()
            .filter(|l| l.trim_start().starts_with("CUVMM_ERROR_") || l.trim_start().starts_with("CUVMM_OK"))
            .count();
        assert_eq!(in_header, all.len(), "a code in cuvmm.h that the library does not have");
    }

    fn refused(why: Refusal) -> Error {
        Error::Refused { why, detail: "detail".into() }
    }
}
