//! The choices a copy makes from its two endpoints, with what the user asked for taking
//! precedence: how many workers, how large a request, how many NBD connections, whether the
//! requests in flight are kept apart and whether neutral local reads bypass the cache. The CLI
//! parses and prints; the policy is here, where it can be read and tested in one place.

use super::{CopyOptions, Endpoint};
use crate::backend::nbd::Target;
use crate::error::{Error, ErrorKind, Op, Result};

/// What the user set (`--workers`, `--request-size`, `--connections`, `--object-size`);
/// `None`: choose.
#[derive(Debug, Clone, Copy, Default)]
pub struct Asked {
    pub workers: Option<u16>,
    pub request_size: Option<usize>,
    pub connections: Option<u16>,
    pub object_size: Option<u64>,
}

/// How a copy between two endpoints is carried out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    pub workers: u16,
    pub request_size: usize,
    /// NBD connections to the source's and the destination's server.
    pub src_connections: usize,
    pub dst_connections: usize,
    /// Keep the requests in flight from being neighbours ([`CopyOptions::interleave`]).
    pub interleave: bool,
    /// Many requests in flight: neutral reads of local files use O_DIRECT, as the server's do
    /// (`io::Tuning::many_in_flight`). With 16 workers reading 256 KiB each, DONTCACHE's
    /// readahead ran past the spill guard and left 78-97 MiB of a 4 GiB source cached
    /// (docs/benchmarks/runs/nbd.md).
    pub many_in_flight: bool,
}

impl Plan {
    /// The plan for copying `src` to `dst`; an error where the two cannot be copied between
    /// (one export on both sides).
    pub fn new(src: &Endpoint, dst: &Endpoint, asked: Asked) -> Result<Plan> {
        // One export on both sides (however the URIs are spelt): the destination's up-front
        // zeroing would wipe the source. Different addresses of one server cannot be told
        // apart.
        if let (Endpoint::Nbd(Target::Uri(a)), Endpoint::Nbd(Target::Uri(b))) = (src, dst) {
            if a.address == b.address && a.export == b.export {
                return Err(Error::new(ErrorKind::InvalidInput, Op::Copy)
                    .path(dst.to_string())
                    .detail("source and destination are the same export"));
            }
        }
        let nbd = |ep: &Endpoint| matches!(ep, Endpoint::Nbd(_));
        // NBD: many small requests in flight. Servers pay per request for large buffers
        // (qemu-nbd used twice the CPU for 1-4 MiB requests as for 256 KiB ones,
        // docs/benchmarks/runs/nbd.md), and round trips hide behind each other.
        let over_nbd = nbd(src) || nbd(dst);
        // Object storage: each request fans out into one request per object (up to
        // backend::s3's limit in flight), so fewer, larger requests keep as many in flight.
        let over_s3 = matches!(src, Endpoint::S3(_)) || matches!(dst, Endpoint::S3(_));
        let workers = asked.workers.unwrap_or(if over_nbd {
            16
        } else if over_s3 {
            8
        } else {
            2
        });
        // Into an s3:// block image, at least a whole object a request (up to the largest
        // request): a piece of one would be read, patched and written back by the next
        // request again.
        let whole_objects = asked.object_size.map_or(0, |o| o.min(256 << 20) as usize);
        let request_size = asked.request_size.unwrap_or(if over_nbd {
            256 << 10
        } else if over_s3 {
            whole_objects.max(8 << 20)
        } else {
            4 << 20
        });
        // A captive server is started for this copy alone: one connection; a server of the
        // user's, 4 where it advertises multi-conn.
        let connections = |ep: &Endpoint| {
            let captive = matches!(ep, Endpoint::Nbd(Target::Captive(_)));
            asked.connections.unwrap_or(if captive { 1 } else { 4 }) as usize
        };
        Ok(Plan {
            workers,
            request_size,
            src_connections: connections(src),
            dst_connections: connections(dst),
            // Keep neighbours apart, so the block layer does not merge them into multi-MiB
            // requests (copy::interleaved). Not with fewer workers, where local neutral reads
            // use readahead (see `many_in_flight`).
            interleave: over_nbd && workers >= 8,
            many_in_flight: workers >= 8,
        })
    }

    /// The engine's options: `destination_is_zero` as the opened destination says, `sparse`
    /// and `flush` as the user says, and only what a dirty bitmap marks with `changed_only`.
    pub fn options(
        &self,
        destination_is_zero: bool,
        sparse: bool,
        flush: bool,
        changed_only: bool,
    ) -> CopyOptions {
        CopyOptions {
            workers: self.workers as usize,
            request_size: self.request_size,
            destination_is_zero,
            sparse,
            flush,
            interleave: self.interleave,
            changed_only,
            whole_units: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(s: &str) -> Endpoint {
        crate::copy::endpoint::parse_endpoints(&[s.to_string()]).unwrap().remove(0)
    }

    #[test]
    fn local_copies_take_few_large_requests_and_nbd_many_small_ones() {
        let local = Plan::new(&ep("/a"), &ep("/b"), Asked::default()).unwrap();
        assert_eq!(
            (local.workers, local.request_size, local.interleave, local.many_in_flight),
            (2, 4 << 20, false, false)
        );
        let nbd = Plan::new(&ep("/a"), &ep("nbd://h/e"), Asked::default()).unwrap();
        assert_eq!(
            (nbd.workers, nbd.request_size, nbd.interleave, nbd.many_in_flight),
            (16, 256 << 10, true, true)
        );
        assert_eq!((nbd.src_connections, nbd.dst_connections), (4, 4));
        let few =
            Plan::new(&ep("nbd://h/e"), &ep("/b"), Asked { workers: Some(4), ..Asked::default() }).unwrap();
        assert_eq!((few.workers, few.interleave, few.many_in_flight), (4, false, false));
    }

    #[test]
    fn object_storage_takes_whole_objects_a_request() {
        let asked = |object_size| Asked { object_size, ..Asked::default() };
        let plan = |o| Plan::new(&ep("/a"), &ep("s3://b/k"), asked(o)).unwrap();
        assert_eq!((plan(None).workers, plan(None).request_size), (8, 8 << 20));
        assert_eq!(plan(Some(1 << 20)).request_size, 8 << 20);
        assert_eq!(plan(Some(32 << 20)).request_size, 32 << 20);
        assert_eq!(plan(Some(1 << 30)).request_size, 256 << 20);
        let set = Asked { request_size: Some(1 << 20), ..asked(Some(32 << 20)) };
        assert_eq!(Plan::new(&ep("/a"), &ep("s3://b/k"), set).unwrap().request_size, 1 << 20);
    }

    #[test]
    fn one_export_on_both_sides_is_refused() {
        let e = Plan::new(&ep("nbd://h/e"), &ep("nbd://h:10809/e"), Asked::default()).unwrap_err();
        assert!(e.to_string().contains("same export"), "{e}");
        assert!(Plan::new(&ep("nbd://h/e"), &ep("nbd://h/f"), Asked::default()).is_ok());
    }
}
