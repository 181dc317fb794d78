//! Reads by the chosen mechanism, and the one fallback when it fails for good.

use std::io;

use super::{footprint, read_full, PolicyFile};
use crate::error::{io_message, Error, Op, Result};
use crate::io::policy::{read_fallback, ReadMech};
use crate::io::sys;

impl PolicyFile {
    /// Reads into `buf` at `offset`; returns `buf.len()`, or fewer only at end of file.
    pub fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<usize> {
        let len = buf.len() as u64;
        let err = |e: io::Error| Error::io(Op::Read, e).path(&self.path).at(offset, len);
        self.touch(offset, len);
        loop {
            let mech = self.read_mech();
            let res = match mech {
                ReadMech::Buffered => read_full(self.fd(), buf, offset, 0),
                ReadMech::Direct => self.read_direct(buf, offset),
                ReadMech::DontCache | ReadMech::EvictBehind => {
                    let flags = if mech == ReadMech::DontCache { sys::RWF_DONTCACHE } else { 0 };
                    if !self.guard_reads {
                        read_full(self.fd(), buf, offset, flags)
                    } else {
                        if let Err(e) = self.evict.before_read(self.fd(), offset, len) {
                            if self.demote_reads(mech, &format!("cachestat failed ({})", io_message(&e))) {
                                continue;
                            }
                            // No O_DIRECT here (squashfs, iso9660): the blocks it could not
                            // check count as cached before (never evicted), and the read goes on.
                            self.note(format!(
                                "residency check failed ({e}): unchecked blocks are left cached"
                            ));
                        }
                        let res = read_full(self.fd(), buf, offset, flags);
                        if let (Ok(n), ReadMech::DontCache) = (&res, mech) {
                            footprint::dontcache_read(self.evict.ours_within(offset, *n as u64));
                        }
                        self.evict.after_read(self.fd(), offset, len);
                        res
                    }
                }
            };
            match res {
                Err(e)
                    if mech == ReadMech::DontCache
                        && e.raw_os_error() == Some(libc::EOPNOTSUPP)
                        && self.demote_reads(mech, "DONTCACHE read refused") => {}
                other => return other.map_err(err),
            }
        }
    }

    /// Falls back from read mechanism `from` for good ([`read_fallback`]), saying `why`;
    /// false if there is nothing to fall back to.
    fn demote_reads(&self, from: ReadMech, why: &str) -> bool {
        let Some(to) = read_fallback(from, self.direct.is_some()) else { return false };
        self.read_mech.store(to as u8, std::sync::atomic::Ordering::Relaxed);
        self.note(format!(
            "{why}: switching reads to {}",
            if to == ReadMech::Direct { "O_DIRECT" } else { to.name() }
        ));
        true
    }
}
