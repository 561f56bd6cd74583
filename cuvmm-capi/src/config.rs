//! `CUVMM_ALLOC_CONF`: comma-separated `key=value` pairs.

use std::path::PathBuf;

/// What the environment variable says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Config {
    /// Physical page size in bytes (`page`).
    pub page: usize,
    /// Address space per large heap (`reserve`); 0 for twice the device's memory.
    pub reserve: usize,
    /// Page size of tagged large heaps (`tag_page`).
    pub tag_page: usize,
    /// Whether errors are written to stderr (`log`).
    pub log: bool,
    /// Whether freed pages are lent to the same stream's next blocks (`lend`).
    pub lend: bool,
    /// Untagged blocks of at least this size are one physical allocation each
    /// (`export_threshold`; 0: none).
    pub export_threshold: usize,
    /// Where allocations and frees are recorded (`trace`).
    pub trace: Option<PathBuf>,
    /// Whether running out of memory in `cuvmm_malloc` aborts the process (`oom=abort`) instead of
    /// returning NULL (`oom=null`): under `change_current_allocator` PyTorch turns a NULL into a
    /// tensor at address 0. `cuvmm_pool_malloc` always returns NULL, which PyTorch's `MemPool`
    /// turns into an `OutOfMemoryError`.
    pub abort_on_oom: bool,
}

impl Default for Config {
    /// The library's own defaults ([`cuvmm_lib::alloc::AllocatorConfig`]), logging on.
    fn default() -> Self {
        let lib = cuvmm_lib::alloc::AllocatorConfig::default();
        Config {
            page: lib.page,
            reserve: lib.reserve,
            tag_page: lib.tag_page,
            log: true,
            lend: lib.lend,
            export_threshold: lib.export_threshold,
            trace: None,
            abort_on_oom: false,
        }
    }
}

/// Parses `512`, `2MiB`, `2M`, `1.5GiB`-free integers with binary suffixes.
pub fn parse_bool(key: &str, v: &str) -> Result<bool, String> {
    match v.trim() {
        "1" | "true" | "on" => Ok(true),
        "0" | "false" | "off" => Ok(false),
        _ => Err(format!("{key} must be 0 or 1, not `{v}`")),
    }
}

fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: usize = num.parse().map_err(|_| format!("`{s}` is not a size"))?;
    let shift = match unit.trim() {
        "" | "B" => 0,
        "K" | "KiB" | "k" => 10,
        "M" | "MiB" => 20,
        "G" | "GiB" => 30,
        "T" | "TiB" => 40,
        u => return Err(format!("unknown size unit `{u}` in `{s}` (use KiB, MiB, GiB, TiB)")),
    };
    n.checked_mul(1usize << shift).ok_or_else(|| format!("`{s}` is too large"))
}

/// The physical memory granularity of every CUDA GPU: pages are multiples of it.
const GRANULARITY: usize = 2 << 20;

/// A page size for `key`: a non-zero multiple of [`GRANULARITY`], refused here rather than at the
/// first allocation, with the nearest size that works.
fn page_size(key: &str, v: &str) -> Result<usize, String> {
    let n = parse_size(v)?;
    if n == 0 || n % GRANULARITY != 0 {
        let fix = n.div_ceil(GRANULARITY).max(1) * (GRANULARITY >> 20);
        return Err(format!(
            "{key}={} is not a multiple of 2MiB, the page granularity of CUDA GPUs: use a multiple \
             such as {key}={fix}MiB",
            v.trim()
        ));
    }
    Ok(n)
}

impl Config {
    /// Parses the variable's value; `None` gives the defaults.
    pub fn parse(value: Option<&str>) -> Result<Config, String> {
        let mut c = Config::default();
        let Some(value) = value else { return Ok(c) };
        for item in value.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (k, v) = item.split_once('=').ok_or_else(|| format!("`{item}` is not key=value"))?;
            match k.trim() {
                "page" => c.page = page_size("page", v)?,
                "reserve" => c.reserve = parse_size(v)?,
                "tag_page" => c.tag_page = page_size("tag_page", v)?,
                "log" => c.log = parse_bool("log", v)?,
                "lend" => c.lend = parse_bool("lend", v)?,
                "export_threshold" => c.export_threshold = parse_size(v)?,
                "trace" => c.trace = Some(PathBuf::from(v.trim())),
                "oom" => {
                    c.abort_on_oom = match v.trim() {
                        "null" => false,
                        "abort" => true,
                        _ => return Err(format!("oom must be null or abort, not `{v}`")),
                    }
                }
                other => {
                    return Err(format!(
                        "unknown key `{other}` (page, reserve, tag_page, log, lend, export_threshold, trace, oom)"
                    ))
                }
            }
        }
        if c.tag_page % c.page != 0 {
            return Err(format!(
                "tag_page ({} MiB) is not a multiple of page ({} MiB): set tag_page to a multiple of page, \
                 such as tag_page={}MiB",
                c.tag_page >> 20,
                c.page >> 20,
                c.page >> 20
            ));
        }
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_take_binary_suffixes_and_refuse_nonsense() {
        assert_eq!(parse_size("512"), Ok(512));
        assert_eq!(parse_size("2MiB"), Ok(2 << 20));
        assert_eq!(parse_size("20M"), Ok(20 << 20));
        assert_eq!(parse_size("160GiB"), Ok(160 << 30));
        assert!(parse_size("2.5GiB").is_err());
        assert!(parse_size("2XB").is_err());
        assert!(parse_size("").is_err());
        assert!(parse_size("99999999999999999999TiB").is_err());
    }

    #[test]
    fn sizes_read_as_the_python_package_reads_them() {
        for line in include_str!("../tests/sizes.txt").lines().filter(|l| !l.starts_with('#')) {
            let (text, want) = line.rsplit_once('|').unwrap();
            match (parse_size(text), want) {
                (Err(_), "error") => {}
                (Ok(n), want) if want.parse() == Ok(n) => {}
                (got, _) => panic!("`{text}`: {got:?}, not {want}"),
            }
        }
    }

    #[test]
    fn every_key_is_read_and_unknown_ones_are_refused() {
        let c = Config::parse(Some(
            "page=8MiB, reserve=64GiB,tag_page=256MiB,log=0,lend=1,export_threshold=64MiB,trace=/tmp/t,oom=abort",
        ))
        .unwrap();
        let want = Config {
            page: 8 << 20,
            reserve: 64 << 30,
            tag_page: 256 << 20,
            log: false,
            lend: true,
            export_threshold: 64 << 20,
            trace: Some("/tmp/t".into()),
            abort_on_oom: true,
        };
        assert_eq!(c, want);
        assert!(!Config::parse(Some("oom=null")).unwrap().abort_on_oom);
        assert!(Config::parse(Some("oom=crash")).is_err());
        assert_eq!(Config::parse(None).unwrap(), Config::default());
        assert_eq!(Config::parse(Some("")).unwrap(), Config::default());
        assert!(Config::parse(Some("pages=2MiB")).is_err());
        assert!(Config::parse(Some("page")).is_err());
        assert!(Config::parse(Some("log=maybe")).is_err());
    }

    #[test]
    fn page_sizes_that_no_gpu_maps_are_refused_with_the_key_and_a_size_that_works() {
        for (conf, fix) in [
            ("page=3MiB", "page=4MiB"),
            ("page=0", "page=2MiB"),
            ("page=4096", "page=2MiB"),
            ("tag_page=129MiB", "tag_page=130MiB"),
            ("page=64MiB,tag_page=96MiB", "tag_page=64MiB"),
            ("page=256MiB", "tag_page=256MiB"),
        ] {
            let e = Config::parse(Some(conf)).unwrap_err();
            assert!(e.contains(fix), "{conf}: {e}");
            let key = fix.split('=').next().unwrap();
            assert!(e.starts_with(key), "{conf}: {e}");
        }
        let c = Config::parse(Some("page=6MiB,tag_page=12MiB")).unwrap();
        assert_eq!((c.page, c.tag_page), (6 << 20, 12 << 20));
    }
}
