//! Human-readable figures.

/// `1536` → `1.5 KiB`; exact bytes below 1 KiB.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.1} {}", UNITS[u])
}

/// Parses `500ms`, `2s`, `1.5s`, `1m`, `1h` or `0`; a bare number is seconds.
pub fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    let s = s.trim();
    let digits = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (num, unit) = s.split_at(digits);
    let invalid = || format!("invalid time '{s}' (use a number with an optional ms, s, m or h suffix)");
    let n: f64 = num.parse().map_err(|_| invalid())?;
    let secs = match unit.trim() {
        "" | "s" => n,
        "ms" => n / 1000.0,
        "us" | "µs" => n / 1e6,
        "m" | "min" => n * 60.0,
        "h" => n * 3600.0,
        _ => return Err(invalid()),
    };
    std::time::Duration::try_from_secs_f64(secs).map_err(|_| invalid())
}

/// Requests made to object storage: `12 GET, 3 PUT, 1 DELETE, 1 LIST, 0 HEAD; 4.0 MiB got, 1.0 MiB put`.
pub fn requests(r: &lightfoot::backend::s3::Requests) -> String {
    format!(
        "object storage: {} GET, {} PUT, {} DELETE, {} LIST, {} HEAD; {} got, {} put",
        r.get,
        r.put,
        r.delete,
        r.list,
        r.head,
        bytes(r.bytes_got),
        bytes(r.bytes_put)
    )
}

#[cfg(test)]
mod tests {
    #[test]
    fn durations() {
        use std::time::Duration;
        assert_eq!(super::parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(super::parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(super::parse_duration("2"), Ok(Duration::from_secs(2)));
        assert_eq!(super::parse_duration("0"), Ok(Duration::ZERO));
        assert!(super::parse_duration("1d").is_err() && super::parse_duration("-1s").is_err());
    }

    #[test]
    fn bytes() {
        assert_eq!(super::bytes(0), "0 B");
        assert_eq!(super::bytes(1536), "1.5 KiB");
        assert_eq!(super::bytes(4 << 30), "4.0 GiB");
    }
}
