//! The filter stack `serve` builds over an export, in one place: which filters, in which
//! order, the backends they open for their own work, and the front of each that every user (a
//! server connection) reaches the export through. The CLI, the tests and the fuzz targets all
//! build their stacks here, so what they test is what `serve` runs.
//!
//! Top down: prefetch, then coalesce, then the export's backend.
//!
//! - Coalesce writes back, fills gaps and passes every change of data through a writable
//!   backend of its own; each user's backend is for its reads only.
//! - Prefetch reads ahead through a read-only backend of its own, seen through a coalesce
//!   front when both are on: read-ahead must see held writes too, or it would buffer the old
//!   bytes under a write that was answered.
//! - A user's backend gets a coalesce front, then a prefetch front: a write reaches coalesce
//!   through prefetch, which drops what it buffered over it.

use std::sync::Arc;

use super::coalesce::{self, Coalesce, CoalesceConfig};
use super::prefetch::{Prefetch, PrefetchConfig};
use super::{Filter, Front};
use crate::backend::Backend;
use crate::error::Result;

/// Which filters, with their tuning.
#[derive(Debug, Clone, Copy, Default)]
pub struct StackConfig {
    /// The export is read-only: users' backends are opened read-only, and coalesce (which has
    /// no writes to hold) is left out.
    pub read_only: bool,
    /// `--prefetch`.
    pub prefetch: Option<PrefetchConfig>,
    /// `--coalesce`. Its allocation unit ([`CoalesceConfig::unit`]) is taken from the backend
    /// below ([`crate::backend::Caps::alloc_unit`]).
    pub coalesce: Option<CoalesceConfig>,
}

/// Opens one more backend onto the export's data, writable or not: a file opened again (its
/// own fd), or the same shared backend where there is no such thing (memory).
type Opener = dyn Fn(bool) -> Result<Arc<dyn Backend>> + Send + Sync;

/// The filters over one export, shared by its users (see the module doc).
pub struct Stack {
    open: Box<Opener>,
    read_only: bool,
    coalesce: Option<Arc<Coalesce>>,
    prefetch: Option<Arc<Prefetch>>,
}

impl Stack {
    /// Opens the filters' own backends with `open(writable)` and starts the filters.
    pub fn new(
        cfg: StackConfig,
        open: impl Fn(bool) -> Result<Arc<dyn Backend>> + Send + Sync + 'static,
    ) -> Result<Stack> {
        let coalesce = match cfg.coalesce {
            Some(_) if cfg.read_only => {
                tracing::warn!("--coalesce does nothing with --read-only");
                None
            }
            Some(mut c) => {
                let own = open(true)?;
                c.unit = own.caps().alloc_unit.unwrap_or(4096);
                // A block holds whole units: an object of a block image in object storage is
                // one block (one PUT), up to coalesce's largest block; beyond that, no gaps
                // are filled.
                let unit = u64::from(c.unit);
                if unit > c.block {
                    if unit <= coalesce::MAX_BLOCK {
                        c.block = unit;
                    } else {
                        c.unit = 4096;
                    }
                }
                c.block = c.block.next_multiple_of(u64::from(c.unit));
                tracing::info!("--coalesce: gaps filled within {}-byte units, blocks of {}", c.unit, c.block);
                Some(Arc::new(Coalesce::new(own, c)))
            }
            None => None,
        };
        let prefetch = match cfg.prefetch {
            Some(p) => {
                let mut own = open(false)?;
                if let Some(c) = &coalesce {
                    own = Arc::new(Front::new(c.clone(), own));
                }
                Some(Arc::new(Prefetch::new(own, p)))
            }
            None => None,
        };
        Ok(Stack { open: Box::new(open), read_only: cfg.read_only, coalesce, prefetch })
    }

    /// A backend for one more user: a backend of its own, with a front of each filter over it.
    /// Finishing it finishes that user's backend only.
    pub fn open(&self) -> Result<Arc<dyn Backend>> {
        let mut b = (self.open)(!self.read_only)?;
        if let Some(c) = &self.coalesce {
            b = Arc::new(Front::new(c.clone(), b));
        }
        if let Some(p) = &self.prefetch {
            b = Arc::new(Front::new(p.clone(), b));
        }
        Ok(b)
    }

    pub fn prefetch(&self) -> Option<&Arc<Prefetch>> {
        self.prefetch.as_ref()
    }

    pub fn coalesce(&self) -> Option<&Arc<Coalesce>> {
        self.coalesce.as_ref()
    }

    /// End of the export, once its users have gone: read-ahead stops, then held writes are
    /// written back and flushed. Both are done whatever the first one gives; the first error
    /// is returned.
    pub fn finish(&self) -> Result<()> {
        let p = self.prefetch.as_ref().map_or(Ok(()), |p| p.finish());
        let c = self.coalesce.as_ref().map_or(Ok(()), |c| c.finish());
        p.and(c)
    }
}
