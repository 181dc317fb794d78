//! `s3://BUCKET/KEY` and where its store and credentials come from, as AWS users expect: the
//! `AWS_*` environment variables first, then the shared files (`~/.aws/credentials` and
//! `~/.aws/config`, or `AWS_SHARED_CREDENTIALS_FILE` and `AWS_CONFIG_FILE`) for the profile
//! `AWS_PROFILE` (default `default`).
//!
//! Read from the environment: `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
//! `AWS_SESSION_TOKEN`, `AWS_REGION` (or `AWS_DEFAULT_REGION`), `AWS_ENDPOINT_URL_S3` (or
//! `AWS_ENDPOINT_URL`), `AWS_CA_BUNDLE`. From a profile: `aws_access_key_id`,
//! `aws_secret_access_key`, `aws_session_token`, `region`, `endpoint_url`, `ca_bundle`. Not
//! read: `credential_process`, SSO and assumed roles (export the keys they give instead).
//!
//! Secrets never leave this module in text: [`Secret`] prints as `<redacted>`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::error::{Error, Op, Result};

/// A parsed `s3://BUCKET/KEY`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct S3Uri {
    pub bucket: String,
    /// The object (one-object layout), or the prefix of the block objects `KEY/%016x`.
    pub key: String,
}

impl S3Uri {
    /// True when `s` is meant as an S3 URI (so it is parsed as one, not taken as a file name).
    pub fn is_s3(s: &str) -> bool {
        s.split_once("://").is_some_and(|(scheme, _)| scheme.eq_ignore_ascii_case("s3"))
    }
}

impl std::fmt::Display for S3Uri {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "s3://{}/{}", self.bucket, self.key)
    }
}

impl std::str::FromStr for S3Uri {
    type Err = Error;

    /// Refuses credentials in the URI (`s3://KEY:SECRET@bucket/…`) without repeating them:
    /// a secret typed on a command line ends up in shell histories and process lists.
    fn from_str(s: &str) -> Result<Self> {
        let rest = match s.split_once("://") {
            Some((scheme, rest)) if scheme.eq_ignore_ascii_case("s3") => rest,
            _ => return Err(bad("not an s3:// URI")),
        };
        let (bucket, key) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.contains('@') {
            return Err(bad(
                "credentials in an s3:// URI are refused (they would show in process lists and \
                 shell histories): use AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY or a profile",
            ));
        }
        if bucket.is_empty() {
            return Err(bad(format!("'{s}': no bucket (write s3://BUCKET/KEY)")));
        }
        if key.is_empty() || key.ends_with('/') || key.split('/').any(str::is_empty) {
            return Err(bad(format!(
                "'{s}': the key must be an object name, not empty, without an empty segment or a trailing '/'"
            )));
        }
        if key.contains(['?', '#']) {
            return Err(bad(format!("'{s}': no query or fragment in s3:// URIs")));
        }
        Ok(S3Uri { bucket: bucket.to_string(), key: key.to_string() })
    }
}

/// A URI or a setting that cannot be used: `msg` names it (without a secret) and says why.
fn bad(msg: impl Into<String>) -> Error {
    Error::invalid(Op::Parse, msg)
}

/// A secret: kept, handed to the client library, never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(s: impl Into<String>) -> Secret {
        Secret(s.into())
    }

    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

/// Where the store is and who we are to it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct S3Config {
    pub access_key_id: Option<String>,
    pub secret_access_key: Option<Secret>,
    pub session_token: Option<Secret>,
    pub region: Option<String>,
    /// `https://…` or `http://…` (allowed, with a warning: requests then travel unencrypted).
    pub endpoint: Option<String>,
    /// PEM certificates trusted besides the system's.
    pub ca_bundle: Option<PathBuf>,
    /// Where each setting came from, for `--verbose` (never the values of secrets).
    pub sources: Vec<String>,
}

impl S3Config {
    /// The configuration from this process's environment and the shared files it names.
    pub fn from_env() -> Result<S3Config> {
        let env: HashMap<String, String> = std::env::vars().filter(|(k, _)| k.starts_with("AWS_")).collect();
        let home = std::env::var_os("HOME").map(PathBuf::from);
        S3Config::resolve(&env, home.as_deref())
    }

    /// [`Self::from_env`] with the environment and home folder given (for tests).
    pub fn resolve(env: &HashMap<String, String>, home: Option<&Path>) -> Result<S3Config> {
        let get = |k: &str| env.get(k).filter(|v| !v.is_empty()).cloned();
        let profile = get("AWS_PROFILE").unwrap_or_else(|| "default".into());
        let named = get("AWS_PROFILE").is_some();
        let file =
            |var: &str, default: &str| get(var).map(PathBuf::from).or_else(|| home.map(|h| h.join(default)));
        let creds_path = file("AWS_SHARED_CREDENTIALS_FILE", ".aws/credentials");
        let config_path = file("AWS_CONFIG_FILE", ".aws/config");
        let read = |p: &Option<PathBuf>, section: &str| -> Result<Option<HashMap<String, String>>> {
            match p {
                Some(p) => match std::fs::read_to_string(p) {
                    Ok(text) => Ok(ini_section(&text, section)),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                    Err(e) => Err(Error::io(Op::Read, e).path(p)),
                },
                None => Ok(None),
            }
        };
        let creds = read(&creds_path, &profile)?;
        // In the config file every profile but `default` is written `[profile NAME]`.
        let conf_section =
            if profile == "default" { "default".to_string() } else { format!("profile {profile}") };
        let conf = read(&config_path, &conf_section)?;
        if named && creds.is_none() && conf.is_none() {
            return Err(bad(format!(
                "AWS_PROFILE={profile}: no such profile in the shared credentials or config file"
            )));
        }
        let mut c = S3Config::default();
        let from_files = |k: &str| {
            creds.as_ref().and_then(|m| m.get(k)).or_else(|| conf.as_ref().and_then(|m| m.get(k))).cloned()
        };
        let mut take = |env_keys: &[&str], file_key: &str, what: &str| -> Option<String> {
            for k in env_keys {
                if let Some(v) = get(k) {
                    c.sources.push(format!("{what} from {k}"));
                    return Some(v);
                }
            }
            let v = from_files(file_key)?;
            c.sources.push(format!("{what} from profile {profile}"));
            Some(v)
        };
        let env_keys = get("AWS_ACCESS_KEY_ID").is_some();
        let id = take(&["AWS_ACCESS_KEY_ID"], "aws_access_key_id", "access key id");
        // Keys come as a pair: an id from the environment with a secret from a file would mix
        // two identities.
        let secret = if env_keys {
            get("AWS_SECRET_ACCESS_KEY")
        } else {
            take(&["AWS_SECRET_ACCESS_KEY"], "aws_secret_access_key", "secret access key")
        };
        let token = if env_keys {
            get("AWS_SESSION_TOKEN")
        } else {
            take(&["AWS_SESSION_TOKEN"], "aws_session_token", "session token")
        };
        if id.is_some() != secret.is_some() {
            return Err(bad("an access key id needs its secret access key and the other way round \
                 (AWS_ACCESS_KEY_ID with AWS_SECRET_ACCESS_KEY, or both in one profile)"));
        }
        c.region = take(&["AWS_REGION", "AWS_DEFAULT_REGION"], "region", "region");
        c.endpoint = take(&["AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"], "endpoint_url", "endpoint");
        c.ca_bundle = take(&["AWS_CA_BUNDLE"], "ca_bundle", "CA bundle").map(PathBuf::from);
        c.access_key_id = id;
        c.secret_access_key = secret.map(Secret::new);
        c.session_token = token.map(Secret::new);
        if let Some(e) = &c.endpoint {
            // Refused as credentials in an s3:// URI are: the HTTP client's own trace logs
            // (RUST_LOG) print the URL, and requests are signed with the keys anyway.
            if let Some(user) = userinfo(e) {
                let e = e.replacen(&format!("{user}@"), "<redacted>@", 1);
                return Err(bad(format!(
                    "endpoint '{e}': credentials in the endpoint URL are refused (they would show in \
                     logs): use AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY or a profile"
                )));
            }
            if !(e.starts_with("http://") || e.starts_with("https://")) {
                return Err(bad(format!("endpoint '{e}': write it as https://HOST[:PORT] (or http://)")));
            }
        }
        Ok(c)
    }
}

/// The `USER:PASSWORD` of an endpoint written `https://USER:PASSWORD@HOST`.
fn userinfo(endpoint: &str) -> Option<&str> {
    let rest = endpoint.split_once("://").map_or(endpoint, |(_, r)| r);
    let authority = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
    authority.rsplit_once('@').map(|(user, _)| user)
}

/// The `key = value` pairs of `[section]` in an INI file as the AWS tools write them (`#` and
/// `;` comments, keys case-insensitive, nested `key =` blocks skipped); `None` when there is
/// no such section.
fn ini_section(text: &str, section: &str) -> Option<HashMap<String, String>> {
    let mut found = None;
    let mut in_section = false;
    for line in text.lines() {
        let t = line.trim();
        if t.is_empty() || t.starts_with('#') || t.starts_with(';') {
            continue;
        }
        if let Some(name) = t.strip_prefix('[').and_then(|r| r.strip_suffix(']')) {
            in_section = name.split_whitespace().collect::<Vec<_>>().join(" ") == section;
            if in_section {
                found.get_or_insert_with(HashMap::new);
            }
            continue;
        }
        // Lines indented under a `key =` with no value belong to a nested block (`s3 =`).
        if !in_section || line.starts_with([' ', '\t']) {
            continue;
        }
        if let Some((k, v)) = t.split_once('=') {
            let v = v.trim();
            if !v.is_empty() {
                found.get_or_insert_with(HashMap::new).insert(k.trim().to_ascii_lowercase(), v.to_string());
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris() {
        let u: S3Uri = "s3://bucket/dir/disk.img".parse().unwrap();
        assert_eq!((u.bucket.as_str(), u.key.as_str()), ("bucket", "dir/disk.img"));
        assert_eq!(u.to_string(), "s3://bucket/dir/disk.img");
        assert!(S3Uri::is_s3("S3://b/k") && !S3Uri::is_s3("nbd://h/e") && !S3Uri::is_s3("s3.img"));
        for (bad, says) in [
            ("s3://b", "the key"),
            ("s3://b/", "the key"),
            ("s3://b/k/", "trailing"),
            ("s3://b//k", "empty segment"),
            ("s3:///k", "no bucket"),
            ("s3://b/k?x=1", "no query"),
        ] {
            let e = bad.parse::<S3Uri>().unwrap_err().to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
        let e = "s3://AKIAX:topsecret@b/k".parse::<S3Uri>().unwrap_err().to_string();
        assert!(e.contains("refused") && !e.contains("topsecret") && !e.contains("AKIAX"), "{e}");
    }

    fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn environment_first_then_the_profile() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join(".aws")).unwrap();
        std::fs::write(
            dir.path().join(".aws/credentials"),
            "[default]\naws_access_key_id = FILEID\naws_secret_access_key = filesecret\n\
             [work]\naws_access_key_id=WORKID\naws_secret_access_key=worksecret\naws_session_token = tok\n",
        )
        .unwrap();
        std::fs::write(
            dir.path().join(".aws/config"),
            "[default]\nregion = eu-west-1\n[profile work]\nregion = us-east-2\nendpoint_url = http://127.0.0.1:8333\n\
             s3 =\n  addressing_style = path\n",
        )
        .unwrap();
        let home = Some(dir.path());
        let c = S3Config::resolve(&env(&[]), home).unwrap();
        assert_eq!(c.access_key_id.as_deref(), Some("FILEID"));
        assert_eq!(c.region.as_deref(), Some("eu-west-1"));
        let c = S3Config::resolve(&env(&[("AWS_PROFILE", "work")]), home).unwrap();
        assert_eq!(c.access_key_id.as_deref(), Some("WORKID"));
        assert_eq!(c.session_token.as_ref().map(Secret::expose), Some("tok"));
        assert_eq!(c.endpoint.as_deref(), Some("http://127.0.0.1:8333"));
        assert_eq!(c.region.as_deref(), Some("us-east-2"));
        let c = S3Config::resolve(
            &env(&[
                ("AWS_PROFILE", "work"),
                ("AWS_ACCESS_KEY_ID", "ENVID"),
                ("AWS_SECRET_ACCESS_KEY", "envsecret"),
                ("AWS_REGION", "ap-south-1"),
            ]),
            home,
        )
        .unwrap();
        // The environment's keys come without the profile's session token.
        assert_eq!((c.access_key_id.as_deref(), c.session_token.is_none()), (Some("ENVID"), true));
        assert_eq!(c.region.as_deref(), Some("ap-south-1"));
        let printed = format!("{c:?}");
        assert!(!printed.contains("envsecret") && printed.contains("<redacted>"), "{printed}");
        let e = S3Config::resolve(&env(&[("AWS_PROFILE", "nope")]), home).unwrap_err().to_string();
        assert!(e.contains("no such profile"), "{e}");
        let e = S3Config::resolve(&env(&[("AWS_ACCESS_KEY_ID", "X")]), home).unwrap_err().to_string();
        assert!(e.contains("needs its secret"), "{e}");
        let e =
            S3Config::resolve(&env(&[("AWS_ENDPOINT_URL", "127.0.0.1:9")]), home).unwrap_err().to_string();
        assert!(e.contains("https://"), "{e}");
        for (endpoint, shown) in
            [("http://u:pw1234@h:9/x@y", "http://<redacted>@h:9/x@y"), ("pw1234@h", "<redacted>@h")]
        {
            let e = S3Config::resolve(&env(&[("AWS_ENDPOINT_URL", endpoint)]), home).unwrap_err().to_string();
            assert!(e.contains(shown) && e.contains("refused") && !e.contains("pw1234"), "{e}");
        }
    }
}
