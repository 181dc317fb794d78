//! Filters: layers between the users of an export and its backend that change how requests
//! reach it. They never know which backend is below them.
//!
//! - [`prefetch`]: multi-stream read-ahead into a bounded buffer (`serve --prefetch`).
//! - [`coalesce`]: safe write coalescing of small scattered writes (`serve --coalesce`).
//! - [`Stack`]: the filters `serve` stacks over an export, in their order, with the backends
//!   they open and a front per connection. The CLI, the tests and the fuzz targets all build
//!   their stacks here.
//!
//! The model: **one shared filter, a front per user.** What a filter holds (read-ahead, the
//! streams it found, held writes) belongs to the export, so one filter serves all of the
//! export's users (the server's connections): a stream is followed whichever connection its
//! reads arrive on, and every connection reads every connection's held writes. Each user
//! reaches the filter through a [`Front`], a [`Backend`] over a backend of that user's own (its
//! own open file: readahead state and writeback-error reporting belong to the open file
//! description, KERNEL-NOTES). Every request through a front reaches the [`Filter`] with the
//! front's backend as `below`; the filter decides what goes there and what goes through the
//! backend of its own that it was made with (read-ahead, write-back, and for coalesce every
//! change of data). Finishing a front finishes its backend only; finishing the filter
//! ([`Filter::finish`], once every user has gone) stops its threads, writes back what it holds
//! and finishes its own backend. [`Front::whole`] is the filter on its own over its own
//! backend, for a single user (and the unit tests).

pub mod coalesce;
pub mod prefetch;
pub mod stack;

pub use stack::{Stack, StackConfig};

use std::sync::Arc;

use crate::backend::{Backend, CacheInfo, Caps, Extent, Report, ZeroFlags};
use crate::error::Result;

/// A filter shared by the fronts over it: the [`Backend`] operations with the front's own
/// backend as `below`. As with [`Backend`], no method has a default body: a new operation must
/// make every filter decide what it does with it (a caching filter that passed it through
/// unseen could return stale data).
pub trait Filter: Send + Sync {
    fn caps(&self, below: &dyn Backend) -> Caps;
    fn read(&self, below: &dyn Backend, buf: &mut [u8], offset: u64) -> Result<usize>;
    fn read_at_hand(&self, below: &dyn Backend, buf: &mut [u8], offset: u64) -> Option<Result<usize>>;
    fn write(&self, below: &dyn Backend, buf: &[u8], offset: u64, fua: bool) -> Result<()>;
    fn write_at_hand(&self, below: &dyn Backend, buf: &[u8], offset: u64) -> Option<Result<()>>;
    fn write_merged(&self, below: &dyn Backend, buf: &[u8], offset: u64, fua: bool) -> Result<()>;
    fn will_write(&self, below: &dyn Backend, offset: u64, len: u64);
    fn zero(&self, below: &dyn Backend, offset: u64, len: u64, flags: ZeroFlags) -> Result<()>;
    fn trim(&self, below: &dyn Backend, offset: u64, len: u64, fua: bool) -> Result<()>;
    fn flush(&self, below: &dyn Backend) -> Result<()>;
    fn cache(&self, below: &dyn Backend, offset: u64, len: u64) -> Result<()>;
    fn extents(&self, below: &dyn Backend, offset: u64, len: u64) -> Result<Vec<Extent>>;

    /// The backend the filter was made with, for its own work.
    fn own(&self) -> &Arc<dyn Backend>;

    /// End of the job for the filter itself (not for one front): stops its threads, writes
    /// back what it holds, and finishes its own backend.
    fn finish(&self) -> Result<()>;
}

/// One user's view of a shared filter: a [`Backend`] whose every request goes to the filter
/// with this front's own backend as `below` (see the module doc).
pub struct Front<F: Filter> {
    filter: Arc<F>,
    below: Arc<dyn Backend>,
    /// [`Front::whole`]: finishing the front finishes the filter.
    whole: bool,
}

impl<F: Filter> Front<F> {
    /// A front for one more user of the filter, over `below`, that user's own backend onto the
    /// same data. Finishing it finishes `below` only.
    pub fn new(filter: Arc<F>, below: Arc<dyn Backend>) -> Front<F> {
        Front { filter, below, whole: false }
    }

    /// The filter on its own, over the backend it was made with: finishing it finishes the
    /// filter.
    pub fn whole(filter: F) -> Front<F> {
        let below = filter.own().clone();
        Front { filter: Arc::new(filter), below, whole: true }
    }
}

/// A front is a handle on its shared filter, as an `Arc` is: the filter's own methods (its
/// counters) are reached through it. The [`Backend`] methods are the front's.
impl<F: Filter> std::ops::Deref for Front<F> {
    type Target = F;

    fn deref(&self) -> &F {
        &self.filter
    }
}

impl<F: Filter> Backend for Front<F> {
    fn name(&self) -> &str {
        self.below.name()
    }

    fn size(&self) -> Option<u64> {
        self.below.size()
    }

    fn caps(&self) -> Caps {
        self.filter.caps(&*self.below)
    }

    fn read(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        self.filter.read(&*self.below, buf, offset)
    }

    fn read_at_hand(&self, buf: &mut [u8], offset: u64) -> Option<Result<usize>> {
        self.filter.read_at_hand(&*self.below, buf, offset)
    }

    fn write(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        self.filter.write(&*self.below, buf, offset, fua)
    }

    fn write_at_hand(&self, buf: &[u8], offset: u64) -> Option<Result<()>> {
        self.filter.write_at_hand(&*self.below, buf, offset)
    }

    fn write_merged(&self, buf: &[u8], offset: u64, fua: bool) -> Result<()> {
        self.filter.write_merged(&*self.below, buf, offset, fua)
    }

    fn will_write(&self, offset: u64, len: u64) {
        self.filter.will_write(&*self.below, offset, len)
    }

    fn zero(&self, offset: u64, len: u64, flags: ZeroFlags) -> Result<()> {
        self.filter.zero(&*self.below, offset, len, flags)
    }

    fn trim(&self, offset: u64, len: u64, fua: bool) -> Result<()> {
        self.filter.trim(&*self.below, offset, len, fua)
    }

    fn flush(&self) -> Result<()> {
        self.filter.flush(&*self.below)
    }

    fn cache(&self, offset: u64, len: u64) -> Result<()> {
        self.filter.cache(&*self.below, offset, len)
    }

    fn extents(&self, offset: u64, len: u64) -> Result<Vec<Extent>> {
        self.filter.extents(&*self.below, offset, len)
    }

    fn cache_info(&self) -> Option<CacheInfo> {
        self.below.cache_info()
    }

    fn report(&self) -> Report {
        self.below.report()
    }

    fn finish(&self) -> Result<()> {
        if self.whole {
            self.filter.finish()
        } else {
            self.below.finish()
        }
    }
}
