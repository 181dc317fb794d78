//! The bitmap file's bytes: [`Sidecar`] to bytes and back, every field checked, so a damaged
//! or foreign file is a clear error and never a wrong bitmap.
//!
//! Little-endian throughout:
//!
//! ```text
//! "LFBITMAP"  version u32 (1)  flags u32 (bit 0: in use)  image size u64
//! identity length u16, identity (UTF-8: what the image was at the last clean close)
//! count u32, then per bitmap:
//!   name length u16, name (UTF-8)  flags u32 (bit 0: enabled)  granularity u64
//!   epoch u64  parent u64 (the epoch before the last clear, 0: none)
//!   bits length u64, bits (one per block, block i = bit i % 8 of byte i / 8)
//! CRC-32 (ISO-HDLC, as zlib's) of everything before it, u32
//! ```

use std::sync::Arc;

use super::bits::Bits;

pub const MAGIC: &[u8; 8] = b"LFBITMAP";
pub const VERSION: u32 = 1;
/// Bitmaps in one file (qemu's qcow2 allows 65535; a backup scheme uses a handful).
pub const MAX_BITMAPS: usize = 64;
/// Longest bitmap name in bytes (qemu's limit too).
pub const MAX_NAME: usize = 1023;
/// Longest identity string.
pub const MAX_IDENTITY: usize = 4096;
/// The granularities allowed (qemu's range: 512 bytes to 2 GiB).
pub const MIN_GRANULARITY: u64 = 512;
pub const MAX_GRANULARITY: u64 = 1 << 31;

const FLAG_IN_USE: u32 = 1;
const FLAG_ENABLED: u32 = 1;

/// Everything a bitmap file holds.
#[derive(Debug)]
pub struct Sidecar {
    /// The image's size: every bitmap covers exactly this.
    pub size: u64,
    /// A writer had it open and did not close it cleanly (yet): its bitmaps may miss writes.
    pub in_use: bool,
    /// What the image was when last closed cleanly (see `file::identity`); empty: unknown.
    pub image: String,
    pub bitmaps: Vec<Bitmap>,
}

/// One named bitmap.
#[derive(Debug)]
pub struct Bitmap {
    pub name: String,
    /// Marked by writes through a server (a disabled one keeps what it had: a closed epoch).
    pub enabled: bool,
    /// A random number drawn when the bitmap was made or last cleared: names its epoch.
    pub epoch: u64,
    /// The epoch the last clear ended (0: none): a copy brought up to date from it is what
    /// this epoch's changes apply to.
    pub parent: u64,
    pub bits: Arc<Bits>,
}

impl Sidecar {
    pub fn get(&self, name: &str) -> Option<&Bitmap> {
        self.bitmaps.iter().find(|b| b.name == name)
    }

    pub fn names(&self) -> Vec<&str> {
        self.bitmaps.iter().map(|b| b.name.as_str()).collect()
    }
}

/// Checks a name a user gives: what [`decode`] would accept.
pub fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > MAX_NAME {
        return Err(format!("a bitmap name has 1 to {MAX_NAME} bytes"));
    }
    if name.chars().any(|c| c.is_control() || c == '=') {
        return Err("a bitmap name has no control characters and no '='".into());
    }
    Ok(())
}

/// Checks a granularity a user gives.
pub fn check_granularity(g: u64) -> Result<(), String> {
    if !g.is_power_of_two() || !(MIN_GRANULARITY..=MAX_GRANULARITY).contains(&g) {
        return Err(format!("the granularity is a power of two from {MIN_GRANULARITY} to 2G"));
    }
    Ok(())
}

pub fn crc32(bytes: &[u8]) -> u32 {
    crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32IsoHdlc, bytes) as u32
}

pub fn encode(s: &Sidecar) -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(MAGIC);
    v.extend_from_slice(&VERSION.to_le_bytes());
    v.extend_from_slice(&(if s.in_use { FLAG_IN_USE } else { 0 }).to_le_bytes());
    v.extend_from_slice(&s.size.to_le_bytes());
    v.extend_from_slice(&(s.image.len() as u16).to_le_bytes());
    v.extend_from_slice(s.image.as_bytes());
    v.extend_from_slice(&(s.bitmaps.len() as u32).to_le_bytes());
    for b in &s.bitmaps {
        v.extend_from_slice(&(b.name.len() as u16).to_le_bytes());
        v.extend_from_slice(b.name.as_bytes());
        v.extend_from_slice(&(if b.enabled { FLAG_ENABLED } else { 0 }).to_le_bytes());
        v.extend_from_slice(&b.bits.granularity().to_le_bytes());
        v.extend_from_slice(&b.epoch.to_le_bytes());
        v.extend_from_slice(&b.parent.to_le_bytes());
        let bits = b.bits.to_bytes();
        v.extend_from_slice(&(bits.len() as u64).to_le_bytes());
        v.extend_from_slice(&bits);
    }
    let crc = crc32(&v);
    v.extend_from_slice(&crc.to_le_bytes());
    v
}

/// Reads what [`encode`] wrote; anything else is an error saying what is wrong.
pub fn decode(bytes: &[u8]) -> Result<Sidecar, String> {
    if bytes.len() < MAGIC.len() || &bytes[..MAGIC.len()] != MAGIC {
        return Err("not a lightfoot bitmap file".into());
    }
    if bytes.len() < MAGIC.len() + 4 {
        return Err("cut short in the header".into());
    }
    let Some((body, crc)) = bytes.split_last_chunk::<4>() else { unreachable!("longer than the magic") };
    let mut r = Reader { bytes: body, at: MAGIC.len() };
    let version = r.u32()?;
    if version != VERSION {
        return Err(format!("version {version} (this lightfoot reads version {VERSION})"));
    }
    if crc32(body) != u32::from_le_bytes(*crc) {
        return Err("checksum mismatch: the file is damaged".into());
    }
    let flags = r.u32()?;
    if flags & !FLAG_IN_USE != 0 {
        return Err(format!("unknown flags {flags:#x}"));
    }
    let size = r.u64()?;
    let len = r.u16()? as usize;
    if len > MAX_IDENTITY {
        return Err(format!("identity of {len} bytes"));
    }
    let image = r.string(len, "identity")?;
    let count = r.u32()? as usize;
    if count > MAX_BITMAPS {
        return Err(format!("{count} bitmaps (at most {MAX_BITMAPS})"));
    }
    let mut bitmaps: Vec<Bitmap> = Vec::with_capacity(count);
    for i in 0..count {
        let len = r.u16()? as usize;
        let name = r.string(len, "bitmap name")?;
        check_name(&name).map_err(|e| format!("bitmap {i}: {e}"))?;
        if bitmaps.iter().any(|b| b.name == name) {
            return Err(format!("two bitmaps named '{name}'"));
        }
        let flags = r.u32()?;
        if flags & !FLAG_ENABLED != 0 {
            return Err(format!("bitmap '{name}': unknown flags {flags:#x}"));
        }
        let granularity = r.u64()?;
        check_granularity(granularity).map_err(|e| format!("bitmap '{name}': {e}"))?;
        let epoch = r.u64()?;
        let parent = r.u64()?;
        let len = r.u64()?;
        let raw = r.take(len, "bits")?;
        let bits = Bits::from_bytes(size, granularity, raw)
            .ok_or_else(|| format!("bitmap '{name}': bits do not fit an image of {size} bytes"))?;
        bitmaps.push(Bitmap {
            name,
            enabled: flags & FLAG_ENABLED != 0,
            epoch,
            parent,
            bits: Arc::new(bits),
        });
    }
    if r.at != body.len() {
        return Err(format!("{} bytes after the last bitmap", body.len() - r.at));
    }
    Ok(Sidecar { size, in_use: flags & FLAG_IN_USE != 0, image, bitmaps })
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8], String> {
        let left = (self.bytes.len() - self.at) as u64;
        if n > left {
            return Err(format!("cut short in the {what}"));
        }
        let s = &self.bytes[self.at..self.at + n as usize];
        self.at += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], String> {
        Ok(self.take(N as u64, "header")?.try_into().expect("N bytes"))
    }

    fn u16(&mut self) -> Result<u16, String> {
        self.array().map(u16::from_le_bytes)
    }

    fn u32(&mut self) -> Result<u32, String> {
        self.array().map(u32::from_le_bytes)
    }

    fn u64(&mut self) -> Result<u64, String> {
        self.array().map(u64::from_le_bytes)
    }

    fn string(&mut self, n: usize, what: &str) -> Result<String, String> {
        let raw = self.take(n as u64, what)?;
        String::from_utf8(raw.to_vec()).map_err(|_| format!("{what} is not UTF-8"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Sidecar {
        let a = Bits::new(1 << 20, 65536);
        a.mark(100_000, 70_000);
        Sidecar {
            size: 1 << 20,
            in_use: true,
            image: "file:1:2:3".into(),
            bitmaps: vec![
                Bitmap { name: "nightly".into(), enabled: true, epoch: 7, parent: 3, bits: Arc::new(a) },
                Bitmap {
                    name: "weekly ü".into(),
                    enabled: false,
                    epoch: 9,
                    parent: 0,
                    bits: Arc::new(Bits::new(1 << 20, 512)),
                },
            ],
        }
    }

    #[test]
    fn round_trips_and_refuses_damage() {
        let bytes = encode(&sample());
        let s = decode(&bytes).unwrap();
        assert_eq!(encode(&s), bytes);
        assert!(s.in_use && s.image == "file:1:2:3" && s.names() == ["nightly", "weekly ü"]);
        let n = s.get("nightly").unwrap();
        assert!(n.enabled && n.epoch == 7 && n.parent == 3 && n.bits.dirty_bytes() == 2 * 65536);
        // Any one flipped bit is caught (the CRC, or the magic before it).
        for i in (0..bytes.len()).step_by(7) {
            let mut bad = bytes.clone();
            bad[i] ^= 0x10;
            assert!(decode(&bad).is_err(), "byte {i} flipped");
        }
        for cut in [0, 5, 8, 20, bytes.len() - 1] {
            assert!(decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        assert_eq!(decode(b"qcow2 image").unwrap_err(), "not a lightfoot bitmap file");
    }

    #[test]
    fn names_and_granularities_are_checked() {
        assert!(
            check_name("").is_err()
                && check_name(&"x".repeat(1024)).is_err()
                && check_name("a\nb").is_err()
                && check_name("a=b").is_err()
        );
        check_name("backup-2026.11").unwrap();
        assert!(
            check_granularity(4096).is_ok()
                && check_granularity(256).is_err()
                && check_granularity(3 << 12).is_err()
        );
    }
}
