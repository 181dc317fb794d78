//! lightfoot: copy and serve disk images without trampling the host's page cache.
//!
//! The crate is layered; dependencies run one way, down this list:
//!
//! - [`server`]: the NBD server, a driver that serves one backend to many connections.
//! - [`copy`]: the copy engine, a driver that moves requests between two backends with
//!   parallel workers, skipping holes and zeroes ([`copy::copy`]).
//! - [`filters`]: read-ahead (`--prefetch`) and write coalescing (`--coalesce`), each shared by
//!   an export's users through a front per user, stacked in one place ([`filters::Stack`]).
//! - [`bitmap`]: dirty bitmaps (`serve --dirty-bitmap`, `lightfoot bitmap`): which blocks of
//!   an image changed since an epoch began, kept in a sidecar file beside the image.
//! - [`backend`]: the [`backend::Backend`] trait and where bytes live: files and block
//!   devices, memory, `null:`, pipes.
//! - [`run`]: `lightfoot run -- CMD`'s side of the preload library (`preload/`): its records
//!   and the final sweep.
//! - [`io`]: the cache policy (`--cache=neutral|keep|drop|direct`) and every system call that
//!   touches the page cache ([`io::PolicyFile`], [`io::policy::choose`]).
//! - [`proto`]: the NBD wire format only (no sockets, no threads, no policy); [`stream`]: the
//!   byte streams (TCP, Unix) NBD runs over, and [`tls`] the TLS one over them (STARTTLS).
//! - [`error`]: one error type with a kind, the operation and its context.
//!
//! `testing` (tests and fuzz targets only: the `testing` feature) holds the conformance suite
//! every backend and filter stack must pass, the fault injector, an in-memory duplex stream,
//! and the fuzz harnesses (docs/fuzzing.md).
//! The binary (`src/main.rs`, `src/cli/`) is the only place that prints and exits.

// `unsafe` lives in `io::sys` alone (it allows `unsafe_code`, nothing else may), and every
// block there says what makes it sound in a `// SAFETY:` comment. tests/unsafe_rule.rs fails
// if these lines go or another module allows `unsafe_code` back.
#![deny(unsafe_code)]
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod backend;
pub mod bitmap;
pub mod copy;
pub mod error;
pub mod filters;
pub mod io;
pub mod proto;
pub mod run;
pub mod server;
pub mod stream;
#[cfg(any(test, feature = "testing"))]
pub mod testing;
pub mod tls;

pub use error::{Error, ErrorKind, Op, Result};
