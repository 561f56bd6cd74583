//! Byte sizes on the command line: `4096`, `64MiB`, `16GiB`, `2M`, `1g`.

/// Parses a size with an optional binary suffix (K, M, G, T; "iB" and "B" optional, any case).
pub fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: usize = num.parse().map_err(|_| format!("'{s}' is not a size (like 4096, 64MiB, 16GiB)"))?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        other => return Err(format!("unknown size unit '{other}' in '{s}'")),
    };
    n.checked_mul(1usize << shift).ok_or_else(|| format!("'{s}' overflows"))
}

/// Parses a comma-separated list of sizes.
pub fn parse_sizes(s: &str) -> Result<Vec<usize>, String> {
    s.split(',').map(parse_size).collect()
}

/// Parses a comma-separated list of positive counts (`4,8,16`).
pub fn parse_counts(s: &str) -> Result<Vec<usize>, String> {
    s.split(',')
        .map(|t| match t.trim().parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(format!("'{t}' is not a positive count (in '{s}')")),
        })
        .collect()
}

/// `67108864` → `64 MiB`.
pub fn show(bytes: usize) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if v.fract() == 0.0 {
        format!("{v:.0} {}", UNITS[u])
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_units() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("64MiB").unwrap(), 64 << 20);
        assert_eq!(parse_size("16GiB").unwrap(), 16 << 30);
        assert_eq!(parse_size("2m").unwrap(), 2 << 20);
        assert_eq!(parse_size(" 1G ").unwrap(), 1 << 30);
        assert!(parse_size("").is_err());
        assert!(parse_size("MiB").is_err());
        assert!(parse_size("12XB").is_err());
        assert!(parse_size("99999999999999999999").is_err());
        assert!(parse_size("20000000TiB").is_err());
        assert_eq!(parse_sizes("2MiB,8MiB").unwrap(), vec![2 << 20, 8 << 20]);
        assert_eq!(parse_counts("4, 8,16").unwrap(), vec![4, 8, 16]);
        assert!(parse_counts("4,0").is_err());
        assert!(parse_counts("x").is_err());
    }

    #[test]
    fn sizes_show_in_binary_units() {
        assert_eq!(show(64 << 20), "64 MiB");
        assert_eq!(show(1536), "1.50 KiB");
        assert_eq!(show(3), "3 B");
    }
}
