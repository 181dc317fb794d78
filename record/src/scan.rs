//! Which blocks of a file hold pages, found with few looks: a range that holds some is halved
//! and each half looked at, down to single blocks. A file with nothing cached (the common case)
//! costs one look; one with `k` cached blocks of `n` about `2k·log2(n/k)`, where a look per
//! block would cost `n` (a cachestat is about a microsecond, 16384 of them for 32 GiB).

use crate::SHIFT;

/// What a look at a range finds: its counts of pages (cachestat's, or only how many are
/// cached).
pub trait Counts: Copy {
    /// Pages of the range in the page cache.
    fn cached(&self) -> u64;
}

impl Counts for u64 {
    fn cached(&self) -> u64 {
        *self
    }
}

/// Reports to `found` each block of `[lo, hi)` that holds pages, with its counts, given the
/// `counts` of the whole range. `look(offset, len)` counts a byte range (a range of blocks
/// `[a, b)` is `a << SHIFT`, `(b - a) << SHIFT`: the caller clips it to the file if it must).
/// A failed look (`None`) leaves its blocks unreported; the result is false if one failed.
/// Recursion is at most `log2(hi - lo)` deep and nothing is allocated.
pub fn scan<C: Counts>(
    lo: u64,
    hi: u64,
    counts: C,
    look: &mut impl FnMut(u64, u64) -> Option<C>,
    found: &mut impl FnMut(u64, C),
) -> bool {
    if counts.cached() == 0 || hi <= lo {
        return true;
    }
    if hi - lo == 1 {
        found(lo, counts);
        return true;
    }
    let mid = lo + (hi - lo) / 2;
    let mut all = true;
    for (a, b) in [(lo, mid), (mid, hi)] {
        all &= match look(a << SHIFT, (b - a) << SHIFT) {
            Some(c) => scan(a, b, c, look, found),
            None => false,
        };
    }
    all
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::BLOCK;

    /// A file of `pages` pages per block, and a look that counts them (failing where `broken`).
    fn scan_model(pages: &[u64], broken: Option<u64>) -> (Vec<u64>, bool, usize) {
        let mut looks = 0;
        let mut look = |off: u64, len: u64| {
            looks += 1;
            let (a, b) = (off / BLOCK, (off + len) / BLOCK);
            if broken.is_some_and(|x| (a..b).contains(&x)) {
                return None;
            }
            Some(pages[a as usize..b as usize].iter().sum::<u64>())
        };
        let mut blocks = Vec::new();
        let whole = pages.iter().sum::<u64>();
        let all = scan(0, pages.len() as u64, whole, &mut look, &mut |b, c: u64| {
            assert_eq!(c, pages[b as usize]);
            blocks.push(b);
        });
        (blocks, all, looks)
    }

    #[test]
    fn finds_every_block_that_holds_pages_and_only_those() {
        let mut pages = vec![0u64; 1000];
        for b in [0, 1, 517, 999] {
            pages[b] = 3;
        }
        let (blocks, all, looks) = scan_model(&pages, None);
        assert_eq!(blocks, vec![0, 1, 517, 999]);
        assert!(all);
        assert!(looks < 100, "{looks} looks for 4 blocks of 1000");
    }

    #[test]
    fn an_empty_range_costs_no_look() {
        assert_eq!(scan_model(&[0; 64], None), (vec![], true, 0));
        assert_eq!(scan_model(&[], None), (vec![], true, 0));
        assert_eq!(scan_model(&[5], None), (vec![0], true, 0));
    }

    #[test]
    fn a_failed_look_leaves_its_blocks_out_and_says_so() {
        let mut pages = vec![0u64; 16];
        pages[3] = 1;
        pages[12] = 1;
        let (blocks, all, _) = scan_model(&pages, Some(12));
        assert_eq!(blocks, vec![3]);
        assert!(!all);
    }
}
