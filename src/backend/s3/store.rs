//! The store behind an `s3://` backend: object_store's S3 client, its async runtime, the one
//! retry loop, and counts of the requests made. The rest of lightfoot is synchronous: each
//! call here blocks its thread on the runtime (`block_on` from any number of threads), and
//! the calls that fan out (one request per object) run their requests concurrently.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path;
use object_store::{
    BackoffConfig, ClientOptions, GetOptions, GetRange, ObjectStore, ObjectStoreExt, PutMode, PutOptions,
    PutPayload, RetryConfig, UpdateVersion,
};

use super::config::{S3Config, S3Uri};
use crate::error::{Error, ErrorKind, Op, Result};

/// How long a request may take and how long transient failures (5xx, throttling, timeouts,
/// refused connections) are retried before the error is the caller's.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// From a request's first attempt to the last retry's start. object_store's own default
    /// is 3 minutes, which a client waiting on a READ takes for a hang.
    pub retry: Duration,
    /// One attempt, connecting included.
    pub request: Duration,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits { retry: Duration::from_secs(10), request: Duration::from_secs(20) }
    }
}

/// Requests made, by type, and bytes moved (for `--stats` and `--json`).
#[derive(Debug, Default)]
pub struct Counters {
    pub get: AtomicU64,
    pub put: AtomicU64,
    pub delete: AtomicU64,
    pub list: AtomicU64,
    pub head: AtomicU64,
    pub bytes_got: AtomicU64,
    pub bytes_put: AtomicU64,
}

/// A snapshot of [`Counters`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Requests {
    pub get: u64,
    pub put: u64,
    pub delete: u64,
    pub list: u64,
    pub head: u64,
    pub bytes_got: u64,
    pub bytes_put: u64,
}

impl Counters {
    pub fn snapshot(&self) -> Requests {
        Requests {
            get: self.get.load(Relaxed),
            put: self.put.load(Relaxed),
            delete: self.delete.load(Relaxed),
            list: self.list.load(Relaxed),
            head: self.head.load(Relaxed),
            bytes_got: self.bytes_got.load(Relaxed),
            bytes_put: self.bytes_put.load(Relaxed),
        }
    }
}

/// An object's size and version as the store reports them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Meta {
    pub size: u64,
    pub etag: Option<String>,
}

/// The PUT that replaces exactly the version `known` of an object: create it where none is
/// known to exist (`None`), `If-Match` its ETag, or overwrite one the store gave no ETag for
/// (nothing to be conditional on).
pub fn replacing(known: Option<&Option<String>>) -> PutMode {
    match known {
        None => PutMode::Create,
        Some(Some(e)) => PutMode::Update(UpdateVersion { e_tag: Some(e.clone()), version: None }),
        Some(None) => PutMode::Overwrite,
    }
}

pub struct Store {
    rt: tokio::runtime::Runtime,
    s3: Arc<AmazonS3>,
    /// `s3://BUCKET/` (error messages name objects by their URI).
    prefix: String,
    /// Values no message may carry (see [`Self::scrub`]).
    secrets: Vec<String>,
    /// Requests go unsigned: no credentials were found.
    anonymous: bool,
    pub counters: Counters,
}

impl Store {
    pub fn open(uri: &S3Uri, cfg: &S3Config, limits: Limits) -> Result<Store> {
        let bad = |detail: String| {
            Error::new(ErrorKind::InvalidInput, Op::Open).path(uri.to_string()).detail(detail)
        };
        // rustls needs one crypto provider for the process: ring, as the NBD TLS code uses.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut opts = ClientOptions::new().with_timeout(limits.request).with_connect_timeout(limits.request);
        if let Some(ca) = &cfg.ca_bundle {
            let pem =
                std::fs::read(ca).map_err(|e| Error::io(Op::Open, e).path(ca).detail("AWS_CA_BUNDLE"))?;
            let certs = object_store::Certificate::from_pem_bundle(&pem)
                .map_err(|e| bad(format!("CA bundle {}: {e}", ca.display())))?;
            if certs.is_empty() {
                return Err(bad(format!(
                    "CA bundle {}: no PEM certificate in the file (AWS_CA_BUNDLE)",
                    ca.display()
                )));
            }
            for c in certs {
                opts = opts.with_root_certificate(c);
            }
        }
        let mut b = AmazonS3Builder::new()
            .with_bucket_name(&uri.bucket)
            .with_region(cfg.region.clone().unwrap_or_else(|| "us-east-1".into()))
            .with_retry(RetryConfig {
                backoff: BackoffConfig {
                    init_backoff: Duration::from_millis(100),
                    max_backoff: Duration::from_secs(2),
                    base: 2.0,
                },
                max_retries: 20,
                retry_timeout: limits.retry,
            });
        let mut secrets = Vec::new();
        if let Some(e) = &cfg.endpoint {
            if e.starts_with("http://") {
                tracing::warn!("{e}: plain HTTP: requests and data travel unencrypted");
                opts = opts.with_allow_http(true);
            }
            b = b.with_endpoint(e);
        }
        match (&cfg.access_key_id, &cfg.secret_access_key) {
            (Some(id), Some(secret)) => {
                b = b.with_access_key_id(id).with_secret_access_key(secret.expose());
                secrets.push(secret.expose().to_string());
                if let Some(t) = &cfg.session_token {
                    b = b.with_token(t.expose());
                    secrets.push(t.expose().to_string());
                }
            }
            // No keys: anonymous requests (public buckets, stores without identities).
            _ => b = b.with_skip_signature(true),
        }
        let secrets: Vec<String> = secrets.into_iter().filter(|s| !s.is_empty()).collect();
        let s3 = b.with_client_options(opts).build().map_err(|e| bad(scrub(&secrets, &e.to_string())))?;
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("lightfoot-s3")
            .enable_all()
            .build()
            .map_err(|e| Error::io(Op::Open, e).path(uri.to_string()))?;
        Ok(Store {
            rt,
            s3: Arc::new(s3),
            prefix: format!("s3://{}/", uri.bucket),
            anonymous: cfg.secret_access_key.is_none(),
            secrets,
            counters: Counters::default(),
        })
    }

    /// The client itself (for what this wrapper does not cover: multipart uploads).
    pub fn s3(&self) -> &AmazonS3 {
        &self.s3
    }

    /// Runs `f` on the store's runtime in the background.
    pub fn spawn<F>(&self, f: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.rt.spawn(f)
    }

    /// Runs `f` to completion on the store's runtime, blocking this thread.
    pub fn run<F: std::future::Future>(&self, f: F) -> F::Output {
        self.rt.block_on(f)
    }

    /// `text` with every secret replaced: the store's error bodies may quote a request back
    /// (SignatureDoesNotMatch carries the canonical request, session token header and all).
    pub fn scrub(&self, text: &str) -> String {
        scrub(&self.secrets, text)
    }

    /// `s3://BUCKET/KEY` of `key`.
    pub fn uri(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    /// The lightfoot error for a failed request on `key`.
    pub fn error(&self, op: Op, key: &str, e: &object_store::Error) -> Error {
        use object_store::Error as E;
        let kind = match e {
            E::NotFound { .. } => ErrorKind::NotFound,
            E::PermissionDenied { .. } | E::Unauthenticated { .. } => ErrorKind::Permission,
            E::NotSupported { .. } | E::NotImplemented { .. } => ErrorKind::NotSupported,
            _ => ErrorKind::Io,
        };
        let mut detail = explain(&full_message(e), self.anonymous);
        if self.anonymous && kind == ErrorKind::Permission && !detail.contains(NO_CREDENTIALS) {
            detail = format!("{NO_CREDENTIALS}: {detail}");
        }
        Error::new(kind, op).path(self.uri(key)).detail(self.scrub(&detail))
    }

    /// GETs `range` of `key` (all of it when `None`), only from version `if_match` when
    /// given. `None` when there is no such object (404; a 403 is an error, never "missing").
    /// Also returns the object's whole size and its ETag.
    pub async fn get(
        &self,
        key: &str,
        range: Option<Range<u64>>,
        if_match: Option<&str>,
    ) -> Result<Option<(Bytes, Meta)>> {
        let Some((res, meta)) = self.start_get(key, range, if_match).await? else { return Ok(None) };
        let bytes = res.bytes().await.map_err(|e| self.error(Op::Read, key, &e))?;
        self.counters.bytes_got.fetch_add(bytes.len() as u64, Relaxed);
        Ok(Some((bytes, meta)))
    }

    /// As [`Store::get`], the body written into `dst`'s slices in turn as it arrives, never
    /// held whole (a collected body is one more copy of every read in memory). `check` sees
    /// the object's size and ETag before the body is read, and may refuse it. Returns the
    /// bytes written: fewer than `dst` holds when the object ends early; a body longer than
    /// `dst` is an error.
    pub async fn get_into(
        &self,
        key: &str,
        range: Option<Range<u64>>,
        if_match: Option<&str>,
        mut dst: Vec<&mut [u8]>,
        check: impl FnOnce(&Meta) -> Result<()>,
    ) -> Result<Option<(u64, Meta)>> {
        let room: usize = dst.iter().map(|d| d.len()).sum();
        let Some((res, meta)) = self.start_get(key, range, if_match).await? else { return Ok(None) };
        check(&meta)?;
        dst.retain(|d| !d.is_empty());
        let mut body = res.into_stream();
        let (mut got, mut slot) = (0u64, 0usize);
        let mut at = 0usize;
        while let Some(piece) = body.next().await {
            let piece = piece.map_err(|e| self.error(Op::Read, key, &e))?;
            let mut piece = &piece[..];
            while !piece.is_empty() {
                let Some(d) = dst.get_mut(slot) else {
                    return Err(Error::new(ErrorKind::Io, Op::Read)
                        .path(self.uri(key))
                        .detail(format!("the store answered more than the {room} bytes asked")));
                };
                let n = piece.len().min(d.len() - at);
                d[at..at + n].copy_from_slice(&piece[..n]);
                (piece, at, got) = (&piece[n..], at + n, got + n as u64);
                if at == d.len() {
                    (slot, at) = (slot + 1, 0);
                }
            }
        }
        self.counters.bytes_got.fetch_add(got, Relaxed);
        Ok(Some((got, meta)))
    }

    /// Sends a GET and waits for its answer's head: the body is the caller's to read.
    async fn start_get(
        &self,
        key: &str,
        range: Option<Range<u64>>,
        if_match: Option<&str>,
    ) -> Result<Option<(object_store::GetResult, Meta)>> {
        self.counters.get.fetch_add(1, Relaxed);
        let opts = GetOptions {
            range: range.map(GetRange::Bounded),
            if_match: if_match.map(str::to_string),
            ..Default::default()
        };
        let res = match self.s3.get_opts(&Path::from(key), opts).await {
            Ok(r) => r,
            Err(e @ object_store::Error::NotFound { .. }) if full_message(&e).contains("NoSuchBucket") => {
                return Err(Error::new(ErrorKind::NotFound, Op::Read)
                    .path(self.uri(""))
                    .detail("no such bucket"))
            }
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(object_store::Error::Precondition { .. }) => {
                return Err(Error::new(ErrorKind::Io, Op::Read)
                    .path(self.uri(key))
                    .detail("the object was replaced while it was being read (its ETag changed)"))
            }
            Err(e) => return Err(self.error(Op::Read, key, &e)),
        };
        let meta = Meta { size: res.meta.size, etag: res.meta.e_tag.clone() };
        Ok(Some((res, meta)))
    }

    /// HEAD: the object's size and ETag, `None` when it does not exist.
    pub async fn head(&self, key: &str) -> Result<Option<Meta>> {
        self.counters.head.fetch_add(1, Relaxed);
        match self.s3.head(&Path::from(key)).await {
            Ok(m) => Ok(Some(Meta { size: m.size, etag: m.e_tag })),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.error(Op::Open, key, &e)),
        }
    }

    /// PUTs `data` as `key` with `mode` (overwrite, create only, or replace one version).
    /// Returns the new ETag and version id, or `None` when the condition failed (412, or
    /// "already exists" for a create).
    pub async fn put(
        &self,
        key: &str,
        data: Bytes,
        mode: PutMode,
    ) -> Result<Option<(Option<String>, Option<String>)>> {
        self.counters.put.fetch_add(1, Relaxed);
        let len = data.len() as u64;
        let opts = PutOptions { mode, ..Default::default() };
        match self.s3.put_opts(&Path::from(key), PutPayload::from_bytes(data), opts).await {
            Ok(r) => {
                self.counters.bytes_put.fetch_add(len, Relaxed);
                Ok(Some((r.e_tag, r.version)))
            }
            Err(object_store::Error::Precondition { .. } | object_store::Error::AlreadyExists { .. }) => {
                Ok(None)
            }
            Err(e) => Err(self.error(Op::Write, key, &e)),
        }
    }

    /// Deletes `keys` with batched deletes (up to 1,000 a request). A key that did not exist
    /// is no error; any per-key error in an answer of 200 is.
    pub async fn delete(&self, keys: Vec<String>) -> Result<()> {
        if keys.is_empty() {
            return Ok(());
        }
        self.counters.delete.fetch_add(keys.len().div_ceil(1000) as u64, Relaxed);
        let paths = futures::stream::iter(keys.into_iter().map(|k| Ok(Path::from(k)))).boxed();
        let mut results = self.s3.delete_stream(paths);
        while let Some(r) = results.next().await {
            match r {
                Ok(_) | Err(object_store::Error::NotFound { .. }) => {}
                // The message names the key that failed.
                Err(e) => return Err(self.error(Op::Delete, "", &e)),
            }
        }
        Ok(())
    }

    /// Every object under `prefix` + `/`, with its size and ETag.
    pub async fn list(&self, prefix: &str) -> Result<Vec<(String, Meta)>> {
        self.counters.list.fetch_add(1, Relaxed);
        let items: Vec<_> = self
            .s3
            .list(Some(&Path::from(prefix)))
            .map_ok(|m| (m.location.to_string(), Meta { size: m.size, etag: m.e_tag }))
            .try_collect()
            .await
            .map_err(|e| self.error(Op::List, prefix, &e))?;
        // object_store pages through LIST for us; count the pages as requests.
        let pages = (items.len() as u64).div_ceil(1000).max(1);
        self.counters.list.fetch_add(pages - 1, Relaxed);
        Ok(items)
    }
}

/// `text` with each of `secrets` replaced, and what a store (or a proxy in front of it) may
/// quote back of a request: its `Authorization` header and signatures. A signature is good
/// for one request only, but no message needs it.
fn scrub(secrets: &[String], text: &str) -> String {
    // (Secrets shorter than 4 bytes would match everywhere; no real one is.)
    let mut t = text.to_string();
    for s in secrets {
        t = t.replace(s.as_str(), "<redacted>");
    }
    let t = redact_after(&t, "authorization:", |c| c == '\n' || c == '\r');
    redact_after(&t, "signature=", |c| !c.is_ascii_alphanumeric())
}

/// `text` with what follows each `marker` (ASCII, any case) up to a character `end` accepts
/// replaced by `<redacted>`.
fn redact_after(text: &str, marker: &str, end: impl Fn(char) -> bool) -> String {
    let lower = text.to_ascii_lowercase();
    let (mut out, mut from) = (String::with_capacity(text.len()), 0);
    while let Some(i) = lower[from..].find(marker) {
        let after = from + i + marker.len();
        let value = after + (text[after..].len() - text[after..].trim_start_matches(' ').len());
        let stop = text[value..].find(&end).map_or(text.len(), |j| value + j);
        out.push_str(&text[from..value]);
        if stop > value {
            out.push_str("<redacted>");
        }
        from = stop;
    }
    out.push_str(&text[from..]);
    out
}

/// What an anonymous caller is told when the store refuses it.
const NO_CREDENTIALS: &str = "no credentials were found, so the request went unsigned: set \
     AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE";

/// The longest part of a store's answer that is not S3's XML (an HTML page of a proxy, a
/// plain-text body) kept in a message.
const BODY_SHOWN: usize = 300;

/// object_store's message with the store's XML error body (if any) replaced by its code and
/// what to do about the common ones; another body is cut to its first line. `anonymous`: the
/// request went unsigned.
fn explain(msg: &str, anonymous: bool) -> String {
    let tag = |t: &str| {
        let (open, close) = (format!("<{t}>"), format!("</{t}>"));
        let start = msg.find(&open)? + open.len();
        Some(msg[start..start + msg[start..].find(&close)?].to_string())
    };
    let Some(code) = tag("Code") else {
        if msg.contains("invalid peer certificate") {
            return format!(
                "the store's certificate is not trusted here: AWS_CA_BUNDLE names the CA of a \
                 store with certificates of its own ({msg})"
            );
        }
        // The first line, and not much of it: enough to tell a proxy's page from the store.
        let line = msg.lines().next().unwrap_or_default();
        return match line.char_indices().nth(BODY_SHOWN) {
            Some((i, _)) => format!("{}…", &line[..i]),
            None => line.to_string(),
        };
    };
    let head = msg.find("<?xml").or_else(|| msg.find('<')).map_or(msg, |i| &msg[..i]);
    let head = head.trim_end().trim_end_matches(':');
    let hint = match code.as_str() {
        "SignatureDoesNotMatch" | "InvalidAccessKeyId" => {
            "wrong credentials: check the access key and secret (AWS_ACCESS_KEY_ID and \
             AWS_SECRET_ACCESS_KEY, or the profile's)"
        }
        "AccessDenied" if anonymous => NO_CREDENTIALS,
        "AccessDenied" => {
            "these credentials may not do this (docs/object-storage.md lists the permissions needed)"
        }
        "RequestTimeTooSkewed" => "this machine's clock is too far from the store's: fix the clock",
        "AuthorizationHeaderMalformed" | "PermanentRedirect" => {
            "wrong region: set AWS_REGION to the bucket's region"
        }
        "NoSuchBucket" => "no such bucket",
        "SlowDown" | "ServiceUnavailable" | "InternalError" => {
            "the store is busy or failing (retried until the bound)"
        }
        _ => "",
    };
    let message = tag("Message").unwrap_or_default();
    match hint {
        "" => format!("{code}: {message} ({head})"),
        h => format!("{code}: {h} ({head})"),
    }
}

/// An error with its chain of causes (object_store's own text stops at the first).
fn full_message(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(c) = src {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        src = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::{explain, scrub, NO_CREDENTIALS};

    #[test]
    fn store_errors_are_explained() {
        let m = "Generic S3 error: Error performing GET http://h/b/k in 2ms - Server returned non-2xx status code: \
                 403 Forbidden: <?xml version=\"1.0\"?><Error><Code>RequestTimeTooSkewed</Code><Message>The difference \
                 is too large</Message></Error>";
        let e = explain(m, false);
        assert!(e.starts_with("RequestTimeTooSkewed: this machine's clock"), "{e}");
        assert!(e.contains("403 Forbidden)") && !e.contains("<?xml"), "{e}");
        let e = explain("... 400 Bad Request: <Error><Code>Odd</Code><Message>Why</Message></Error>", false);
        assert!(e.starts_with("Odd: Why ("), "{e}");
        assert_eq!(explain("connection refused", false), "connection refused");
        let denied = "... 403 Forbidden: <Error><Code>AccessDenied</Code></Error>";
        assert!(explain(denied, false).contains("these credentials may not"));
        assert!(explain(denied, true).starts_with(&format!("AccessDenied: {NO_CREDENTIALS}")));
        // A body that is not S3's: its first line, cut short.
        let e = explain(&format!("... 403 Forbidden: <html>{}\nmore", "x".repeat(1000)), false);
        assert!(e.ends_with('…') && e.len() < 400 && !e.contains("more"), "{e}");
    }

    #[test]
    fn secrets_headers_and_signatures_are_scrubbed() {
        let quoted = "403: GET /b/k\nx-amz-security-token: TOKEN1234\nAuthorization: AWS4-HMAC-SHA256 \
                      Credential=AKID/x, Signature=0123abcd\nhost: h?X-Amz-Signature=feed99&y=1 SECRET5678";
        let t = scrub(&["SECRET5678".into(), "TOKEN1234".into()], quoted);
        for gone in ["SECRET5678", "TOKEN1234", "AWS4-HMAC", "0123abcd", "feed99"] {
            assert!(!t.contains(gone), "{gone} in {t}");
        }
        assert!(t.contains("Authorization: <redacted>\nhost: h?X-Amz-Signature=<redacted>&y=1"), "{t}");
    }
}
