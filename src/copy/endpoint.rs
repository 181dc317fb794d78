//! What the user names on the command line: [`Endpoint`], parsed from one argument
//! ([`FromStr`](std::str::FromStr)) or from the whole list, where a captive NBD server
//! (`[ CMD ARGS ]`) spans several ([`parse_endpoints`]): a file or block device path, `-`
//! (standard input or output), `null:[SIZE]`, an NBD URI or a captive server, or an image in
//! object storage (`s3://BUCKET/KEY`). Also [`parse_size`], the size syntax every option shares.
//! Opening an endpoint as a backend is [`super::open`]'s job.

use std::path::PathBuf;

use crate::backend::nbd::{Target, Uri};
use crate::backend::s3::S3Uri;
use crate::error::{Error, Op, Result};

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    Path(PathBuf),
    /// `-`
    Stdio,
    /// `null:` or `null:SIZE`
    Null(Option<u64>),
    /// An NBD URI or a captive server.
    Nbd(Target),
    /// `s3://BUCKET/KEY`
    S3(S3Uri),
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Path(p) => write!(f, "{}", p.display()),
            Endpoint::Stdio => f.write_str("-"),
            Endpoint::Null(None) => f.write_str("null:"),
            Endpoint::Null(Some(n)) => write!(f, "null:{n}"),
            Endpoint::Nbd(t) => write!(f, "{t}"),
            Endpoint::S3(u) => write!(f, "{u}"),
        }
    }
}

/// Groups command-line arguments into endpoints: `[ CMD ARGS… ]` (the brackets separate
/// arguments) is a captive NBD server; every other argument is one endpoint.
pub fn parse_endpoints(args: &[String]) -> Result<Vec<Endpoint>> {
    let mut out = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "]" {
            return Err(Error::invalid(Op::Parse, "']' without '['"));
        }
        if a != "[" {
            out.push(a.parse()?);
            continue;
        }
        let mut argv = Vec::new();
        loop {
            match it.next() {
                Some(x) if x == "]" => break,
                Some(x) if x == "[" => {
                    return Err(Error::invalid(Op::Parse, "'[' inside '[ … ]': captive servers do not nest"))
                }
                Some(x) => argv.push(x.clone()),
                None => {
                    return Err(Error::invalid(
                        Op::Parse,
                        "'[' without ']': write captive servers as [ CMD ARGS ]",
                    ))
                }
            }
        }
        if argv.is_empty() {
            return Err(Error::invalid(Op::Parse, "'[ ]' names no server command"));
        }
        out.push(Endpoint::Nbd(Target::Captive(argv)));
    }
    Ok(out)
}

impl std::str::FromStr for Endpoint {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        if s == "-" {
            return Ok(Endpoint::Stdio);
        }
        if let Some(size) = s.strip_prefix("null:") {
            if size.is_empty() {
                return Ok(Endpoint::Null(None));
            }
            return parse_size(size)
                .map(|n| Endpoint::Null(Some(n)))
                .map_err(|e| Error::after(Op::Parse, &e).detail(format!("'{s}'")));
        }
        if s.is_empty() {
            return Err(Error::invalid(
                Op::Parse,
                "an empty endpoint (''): name a file, a device, -, null:, a URI or [ CMD ARGS ]",
            ));
        }
        if Uri::is_nbd(s) {
            return s.parse().map(|u| Endpoint::Nbd(Target::Uri(u)));
        }
        if S3Uri::is_s3(s) {
            return s.parse().map(Endpoint::S3);
        }
        Ok(Endpoint::Path(PathBuf::from(s)))
    }
}

/// Parses `4096`, `64K`, `4M`, `1G`, `2T` (powers of 1024; `KiB`/`MiB`/... also accepted).
pub fn parse_size(s: &str) -> Result<u64> {
    let s = s.trim();
    let digits = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(digits);
    let invalid = || {
        Error::invalid(
            Op::Parse,
            format!("invalid size '{s}' (use a whole number with an optional K, M, G or T suffix)"),
        )
    };
    let n: u64 = num.parse().map_err(|_| invalid())?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kib" | "kb" => 10,
        "m" | "mib" | "mb" => 20,
        "g" | "gib" | "gb" => 30,
        "t" | "tib" | "tb" => 40,
        _ => return Err(invalid()),
    };
    n.checked_mul(1u64 << shift).ok_or_else(|| Error::invalid(Op::Parse, format!("size '{s}' is too large")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_endpoints_and_sizes() {
        assert_eq!("-".parse::<Endpoint>().unwrap(), Endpoint::Stdio);
        assert_eq!("null:".parse::<Endpoint>().unwrap(), Endpoint::Null(None));
        assert_eq!("null:1G".parse::<Endpoint>().unwrap(), Endpoint::Null(Some(1 << 30)));
        assert_eq!("a/b".parse::<Endpoint>().unwrap(), Endpoint::Path("a/b".into()));
        assert!(matches!("nbd://h/e".parse::<Endpoint>().unwrap(), Endpoint::Nbd(Target::Uri(_))));
        assert!(matches!("nbds://h/e".parse::<Endpoint>().unwrap(), Endpoint::Nbd(Target::Uri(_))));
        assert!("nbds://h/e?tls-type=psk".parse::<Endpoint>().is_err());
        assert_eq!(parse_size("4M").unwrap(), 4 << 20);
        assert_eq!(parse_size("64KiB").unwrap(), 64 << 10);
        assert!(parse_size("4Q").is_err());
        assert!(parse_size("99999999999T").is_err());
    }

    #[test]
    fn groups_captive_servers() {
        let args = |s: &str| s.split(' ').map(String::from).collect::<Vec<_>>();
        let eps = parse_endpoints(&args("[ qemu-nbd -f qcow2 d.qcow2 ] out.img")).unwrap();
        assert_eq!(eps.len(), 2);
        assert_eq!(eps[0], Endpoint::Nbd(Target::Captive(args("qemu-nbd -f qcow2 d.qcow2"))));
        assert_eq!(eps[0].to_string(), "[ qemu-nbd -f qcow2 d.qcow2 ]");
        assert_eq!(eps[1], Endpoint::Path("out.img".into()));
        let eps = parse_endpoints(&args("a [ nbdkit memory 1G ]")).unwrap();
        assert_eq!(eps[1], Endpoint::Nbd(Target::Captive(args("nbdkit memory 1G"))));
        for bad in ["[ x", "[ ] a", "a ]", "[ a [ b ] ]"] {
            assert!(parse_endpoints(&args(bad)).is_err(), "{bad}");
        }
    }
}
