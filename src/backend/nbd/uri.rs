//! NBD URIs (`../shared/reference/nbd-uri.md`): `nbd://host[:port]/export` and
//! `nbd+unix:///export?socket=PATH`, and their TLS forms `nbds://` and `nbds+unix://`, which
//! must use TLS (X.509). TLS query parameters, as libnbd reads them: `tls-certificates=DIR`
//! (`ca-cert.pem`, and `client-cert.pem` with `client-key.pem`), `tls-hostname=NAME` (the
//! name the server's certificate must carry; default: the URI's host, none over a Unix
//! socket), `tls-verify-peer=0|1`, `tls-type=x509`. On `nbd://` URIs they are ignored: lightfoot
//! does not upgrade plain URIs to TLS opportunistically.

use std::path::PathBuf;

use crate::error::{Error, Op, Result};

/// The IANA port for NBD, the default when a URI names none.
pub const DEFAULT_PORT: u16 = 10809;

/// Where the server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Address {
    Tcp {
        host: String,
        port: u16,
    },
    /// A socket file, or an abstract socket when the name starts with a NUL byte.
    Unix(PathBuf),
}

/// A parsed NBD URI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Uri {
    /// As the user wrote it (for messages).
    pub text: String,
    pub address: Address,
    /// The path without its leading `/`, percent-decoded (may be empty: the default export).
    pub export: String,
    /// `nbds` schemes: TLS, with these settings.
    pub tls: Option<TlsParams>,
}

/// The TLS settings of an `nbds://` or `nbds+unix://` URI.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TlsParams {
    /// `tls-certificates=DIR`.
    pub certificates: Option<PathBuf>,
    /// `tls-hostname=NAME`.
    pub hostname: Option<String>,
    /// `tls-verify-peer=0` turns verification of the server off.
    pub verify_peer: bool,
}

impl Uri {
    /// True when `s` looks like a URI of an NBD scheme (so it is parsed as one, not taken as a
    /// file name).
    pub fn is_nbd(s: &str) -> bool {
        s.split_once("://").is_some_and(|(scheme, _)| scheme.to_ascii_lowercase().starts_with("nbd"))
    }
}

impl std::fmt::Display for Uri {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

impl std::str::FromStr for Uri {
    type Err = Error;

    fn from_str(input: &str) -> Result<Uri> {
        // Messages (and `text`) show the URI without a password in it.
        let s = &redacted(input);
        let (scheme, rest) = input.split_once("://").ok_or_else(|| bad(format!("'{s}' is not a URI")))?;
        // Schemes are case-insensitive (RFC 3986).
        let (unix, tls) = match scheme.to_ascii_lowercase().as_str() {
            "nbd" => (false, false),
            "nbd+unix" => (true, false),
            "nbds" => (false, true),
            "nbds+unix" => (true, true),
            _ => {
                return Err(bad(format!(
                    "'{s}': unknown scheme '{scheme}' (use nbd://, nbd+unix://, nbds:// or nbds+unix://)"
                )))
            }
        };
        let mut params = TlsParams { verify_peer: true, ..TlsParams::default() };
        let rest = rest.split_once('#').map_or(rest, |(r, _)| r);
        let (before_query, query) = rest.split_once('?').unwrap_or((rest, ""));
        let (authority, path) = match before_query.find('/') {
            Some(i) => before_query.split_at(i),
            None => (before_query, ""),
        };
        let export = decode(path.strip_prefix('/').unwrap_or(path)).map_err(within(s))?;
        if export.contains('\0') {
            return Err(bad(format!("'{s}': an export name may not hold a NUL (%00)")));
        }

        let mut socket = None;
        for param in query.split('&').filter(|p| !p.is_empty()) {
            let (key, value) = param.split_once('=').unwrap_or((param, ""));
            match key {
                "socket" => socket = Some(decode(value).map_err(within(s))?),
                "tls-certificates" => {
                    params.certificates = Some(PathBuf::from(decode(value).map_err(within(s))?))
                }
                "tls-hostname" => params.hostname = Some(decode(value).map_err(within(s))?),
                "tls-verify-peer" => {
                    params.verify_peer = match value {
                        "1" | "true" | "on" | "yes" => true,
                        "0" | "false" | "off" | "no" => false,
                        _ => return Err(bad(format!("'{s}': tls-verify-peer takes 0 or 1, not '{value}'"))),
                    }
                }
                "tls-type" => match value {
                    "x509" => {}
                    "psk" if tls => {
                        return Err(bad(format!(
                            "'{s}': TLS-PSK is not supported (rustls has no external pre-shared keys; see docs/tls.md)"
                        )))
                    }
                    "anon" if tls => return Err(bad(format!("'{s}': anonymous TLS is not supported; use x509"))),
                    "psk" | "anon" => {}
                    _ => return Err(bad(format!("'{s}': unknown tls-type '{value}' (x509, psk or anon)"))),
                },
                "tls-psk-file" | "tls-username" if tls => {
                    return Err(bad(format!(
                        "'{s}': TLS-PSK is not supported (rustls has no external pre-shared keys; see docs/tls.md)"
                    )))
                }
                "tls-psk-file" | "tls-username" => {}
                _ => return Err(bad(format!("'{s}': unknown query parameter '{key}'"))),
            }
        }

        let address = if unix {
            if !authority.is_empty() {
                return Err(bad(format!(
                    "'{s}': nbd+unix URIs take no host (nbd+unix:///EXPORT?socket=PATH)"
                )));
            }
            let socket = socket.filter(|p| !p.is_empty()).ok_or_else(|| {
                bad(format!("'{s}': nbd+unix URIs need ?socket=PATH (nbd+unix:///EXPORT?socket=PATH)"))
            })?;
            Address::Unix(PathBuf::from(socket))
        } else {
            if socket.is_some() {
                return Err(bad(format!("'{s}': socket= is only for nbd+unix:// URIs")));
            }
            let (host, port) = host_port(authority).map_err(within(s))?;
            Address::Tcp { host, port }
        };
        Ok(Uri { text: s.to_string(), address, export, tls: tls.then_some(params) })
    }
}

/// `s` with the password of a `user:password@` in its authority replaced: the spec has a
/// user name there (for TLS kinds lightfoot does not support, and ignores), but a password
/// typed into a URI must not reach a message.
fn redacted(s: &str) -> String {
    let Some((scheme, rest)) = s.split_once("://") else { return s.to_string() };
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    match rest[..end].rsplit_once('@') {
        Some((userinfo, host)) if userinfo.contains(':') => {
            let user = userinfo.split_once(':').map_or(userinfo, |(u, _)| u);
            format!("{scheme}://{user}:<redacted>@{host}{}", &rest[end..])
        }
        _ => s.to_string(),
    }
}

/// A URI that does not parse: `msg` names it (without a password) and says why.
fn bad(msg: impl Into<String>) -> Error {
    Error::invalid(Op::Parse, msg)
}

/// An error in a part of URI `s`, said of the whole.
fn within(s: &str) -> impl Fn(Error) -> Error + '_ {
    move |e| Error::after(Op::Parse, &e).detail(format!("'{s}'"))
}

/// Splits `[user@]host[:port]`; IPv6 literals come in brackets.
fn host_port(authority: &str) -> Result<(String, u16)> {
    let hostport = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let (host, port) = if let Some(v6) = hostport.strip_prefix('[') {
        let (host, after) = v6.split_once(']').ok_or_else(|| bad("unclosed '[' in the host"))?;
        match after {
            "" => (host, None),
            p => (host, Some(p.strip_prefix(':').ok_or_else(|| bad("junk after the IPv6 address"))?)),
        }
    } else {
        match hostport.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (hostport, None),
        }
    };
    if host.is_empty() {
        return Err(bad("nbd:// URIs need a host (nbd://HOST[:PORT]/EXPORT)"));
    }
    let port = match port {
        None | Some("") => DEFAULT_PORT,
        // Digits only: `parse` would also take a sign.
        Some(p) if p.bytes().all(|c| c.is_ascii_digit()) => {
            p.parse().map_err(|_| bad(format!("invalid port '{p}'")))?
        }
        Some(p) => return Err(bad(format!("invalid port '{p}'"))),
    };
    Ok((decode(host)?, port))
}

/// Percent-decoding (RFC 3986); the result must be UTF-8 except for a NUL, which export names
/// may not hold but abstract socket names start with.
fn decode(s: &str) -> Result<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = s.get(i + 1..i + 3).ok_or_else(|| bad(format!("bad percent escape in '{s}'")))?;
            // Two hex digits: `from_str_radix` would also take a sign ("%+1").
            if !hex.bytes().all(|c| c.is_ascii_hexdigit()) {
                return Err(bad(format!("bad percent escape '%{hex}'")));
            }
            out.push(u8::from_str_radix(hex, 16).map_err(|_| bad(format!("bad percent escape '%{hex}'")))?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| bad(format!("'{s}' does not decode to UTF-8")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Uri {
        s.parse().unwrap()
    }

    #[test]
    fn export_names_follow_the_spec_table() {
        for (uri, export) in [
            ("nbd://example.com/disk", "disk"),
            ("nbd+unix:///disk?socket=sock", "disk"),
            ("nbd://example.com/", ""),
            ("nbd://example.com", ""),
            ("nbd://example.com//disk", "/disk"),
            ("nbd://example.com/hello%20world", "hello world"),
        ] {
            assert_eq!(parse(uri).export, export, "{uri}");
        }
    }

    #[test]
    fn addresses() {
        assert_eq!(parse("nbd://h/e").address, Address::Tcp { host: "h".into(), port: DEFAULT_PORT });
        assert_eq!(parse("nbd://u@h:99/e").address, Address::Tcp { host: "h".into(), port: 99 });
        assert_eq!(parse("nbd://[::1]:5/").address, Address::Tcp { host: "::1".into(), port: 5 });
        assert_eq!(parse("nbd://[::1]").address, Address::Tcp { host: "::1".into(), port: DEFAULT_PORT });
        assert_eq!(parse("nbd+unix://?socket=/a%20b.sock").address, Address::Unix("/a b.sock".into()));
        assert_eq!(parse("nbd+unix:///x?socket=%00abs").address, Address::Unix("\0abs".into()));
    }

    #[test]
    fn a_password_never_shows() {
        let u = parse("nbd://alice:hunter2@h:99/e");
        assert_eq!(u.address, Address::Tcp { host: "h".into(), port: 99 });
        assert_eq!(u.to_string(), "nbd://alice:<redacted>@h:99/e");
        assert_eq!(parse("nbd://alice@h/e").to_string(), "nbd://alice@h/e");
        let e = "nbd://alice:hunter2@h:port/e".parse::<Uri>().unwrap_err().to_string();
        assert!(e.contains("invalid port") && !e.contains("hunter2"), "{e}");
    }

    #[test]
    fn bad_uris_are_diagnosed() {
        for (uri, says) in [
            ("nbds://h/e?tls-type=psk", "TLS-PSK"),
            ("nbds://h/e?tls-psk-file=k", "TLS-PSK"),
            ("nbds://h/e?tls-verify-peer=maybe", "0 or 1"),
            ("nbds+unix:///e", "socket="),
            ("http://h/e", "unknown scheme"),
            ("nbd+unix:///e", "socket="),
            ("nbd+unix://h/e?socket=s", "no host"),
            ("nbd:///e", "need a host"),
            ("nbd://h:port/e", "invalid port"),
            ("nbd://h:70000/e", "invalid port"),
            ("nbd://h/e?socket=s", "only for nbd+unix"),
            ("nbd://h/e?frob=1", "unknown query parameter"),
            ("nbd://h/%zz", "percent"),
            ("nbd://h/%+1", "percent"),
            ("nbd://h:+80/e", "invalid port"),
            ("nbd://h/a%00b", "NUL"),
            ("nbd://[::1/e", "unclosed"),
        ] {
            let e = uri.parse::<Uri>().unwrap_err().to_string();
            assert!(e.contains(says), "{uri}: {e}");
        }
        assert!(Uri::is_nbd("nbd+unix:///"));
        assert!(Uri::is_nbd("nbds://h/"));
        assert!(!Uri::is_nbd("disk.img"));
        // Schemes are case-insensitive.
        assert!(Uri::is_nbd("NBD://h/"));
        assert_eq!(parse("NBD+Unix:///e?socket=/s").address, Address::Unix("/s".into()));
    }

    #[test]
    fn tls_schemes_and_parameters() {
        assert_eq!(parse("nbd://h/e").tls, None);
        // Plain URIs ignore TLS parameters, as libnbd does.
        assert_eq!(parse("nbd://h/e?tls-certificates=/d&tls-type=psk").tls, None);
        let u = parse("nbds://h:7/e");
        assert_eq!(u.address, Address::Tcp { host: "h".into(), port: 7 });
        assert_eq!(u.tls, Some(TlsParams { certificates: None, hostname: None, verify_peer: true }));
        let u =
            parse("nbds+unix:///e?socket=/s&tls-certificates=/my%20dir&tls-hostname=srv&tls-verify-peer=0");
        assert_eq!(u.address, Address::Unix("/s".into()));
        assert_eq!(
            u.tls,
            Some(TlsParams {
                certificates: Some("/my dir".into()),
                hostname: Some("srv".into()),
                verify_peer: false
            })
        );
        assert!(parse("nbds://h/?tls-type=x509").tls.is_some());
    }
}
