//! How the ring's threads write: ordinary stores, or non-temporal ones where they save a pass
//! over memory.

use crate::error::{Error, Result};

/// How a staging ring's threads copy between its pinned slots and pageable memory:
/// [`StagingConfig::host_copy`](super::StagingConfig::host_copy).
///
/// An ordinary store first reads the line it writes; into a destination larger than the caches
/// that costs a memory pass per byte the copy does not need. Non-temporal stores skip it
/// (docs/PERFORMANCE.md, "Figures behind the defaults"). Elsewhere than on x86-64 both are the
/// ordinary copy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum HostCopy {
    /// Ordinary stores everywhere.
    Plain,
    /// Non-temporal stores into pageable memory on the way to the host, and into the slots for the
    /// last bytes of a transfer to the device (whose DMAs otherwise read lines still in a core's
    /// private cache); ordinary stores for the rest of the way to the device, whose slots the DMA
    /// engine reads from the cache soon after.
    #[default]
    Streaming,
}

impl HostCopy {
    /// Both, the default first.
    pub const ALL: [HostCopy; 2] = [HostCopy::Streaming, HostCopy::Plain];

    /// Its name: `plain` or `streaming`.
    pub fn name(self) -> &'static str {
        match self {
            HostCopy::Plain => "plain",
            HostCopy::Streaming => "streaming",
        }
    }
}

impl std::fmt::Display for HostCopy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for HostCopy {
    type Err = Error;

    /// `plain` or `streaming` (any case, surrounding blanks ignored).
    fn from_str(s: &str) -> Result<HostCopy> {
        let s = s.trim();
        HostCopy::ALL
            .into_iter()
            .find(|c| c.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| Error::invalid(format!("unknown host copy {s:?} (plain or streaming)")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_read_back_and_anything_else_is_refused() {
        for c in HostCopy::ALL {
            assert_eq!(c.name().parse::<HostCopy>().unwrap(), c);
            assert_eq!(c.to_string(), c.name());
        }
        assert_eq!(" Plain\n".parse::<HostCopy>().unwrap(), HostCopy::Plain);
        assert_eq!(HostCopy::default(), HostCopy::Streaming);
        for bad in ["", "both", "nt", "streamingx"] {
            assert!(bad.parse::<HostCopy>().is_err(), "{bad:?}");
        }
    }
}
