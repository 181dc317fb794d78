//! The manifest of a block image, `KEY/lightfoot.json`, and the [`Geometry`] it records (the
//! image's size and object size), so that later opens need no `--size` or `--object-size`.
//! At open, a manifest (or those two flags) is what tells a block image from an image in
//! one object.

use bytes::Bytes;
use object_store::PutMode;

use super::lease;
use super::store::Store;
use crate::error::{Error, ErrorKind, Op, Result};

/// The manifest of a block image, `KEY/lightfoot.json`. Named so that nbdkit's S3 plugin never
/// deletes it: its TRIM deletes what it lists under `KEY/` from the first block's name up to
/// (not including) the name of the block after the last, and `l` sorts after every hex digit.
/// lightfoot itself deletes only names of the form `KEY/` + 16 hex digits.
pub const MANIFEST: &str = "lightfoot.json";

const FORMAT: &str = "lightfoot-s3-blocks";

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct Manifest {
    format: String,
    version: u32,
    size: u64,
    object_size: u64,
}

/// The layout of a block image: `size` bytes in objects of `object_size` bytes each.
#[derive(Debug, Clone, Copy)]
pub struct Geometry {
    pub size: u64,
    pub object_size: u64,
    /// Its manifest exists (else a writable open saves one).
    pub stored: bool,
}

impl Geometry {
    /// The block image under `key` as its manifest describes it, or as `size` and
    /// `object_size` (`--size`, `--object-size`) do for one without a manifest; `None` when
    /// there is neither: `key` is one object. Fails when flags and manifest disagree, when
    /// only one flag is given, or when the two make no valid image.
    pub fn find(
        store: &Store,
        key: &str,
        name: &str,
        size: Option<u64>,
        object_size: Option<u64>,
    ) -> Result<Option<Geometry>> {
        let manifest_key = format!("{key}/{MANIFEST}");
        let manifest = match store.run(store.get(&manifest_key, None, None))? {
            None => None,
            Some((bytes, _)) => {
                Some(Geometry::parse(&bytes).map_err(|why| bad(&store.uri(&manifest_key), why))?)
            }
        };
        let g = match (manifest, size, object_size) {
            (Some(m), size, osize) => {
                if size.is_some_and(|s| s != m.size) || osize.is_some_and(|o| o != m.object_size) {
                    return Err(bad(
                        name,
                        format!(
                            "the image is {} bytes in objects of {} (its manifest says so): --size and --object-size differ",
                            m.size, m.object_size
                        ),
                    ));
                }
                m
            }
            (None, Some(size), Some(object_size)) => Geometry { size, object_size, stored: false },
            (None, None, Some(_)) => {
                return Err(bad(
                    name,
                    "--object-size needs --size (the image's size) for a new block image".into(),
                ))
            }
            (None, Some(_), None) => {
                return Err(bad(name, "--size needs --object-size (the block layout's object size)".into()))
            }
            (None, None, None) => return Ok(None),
        };
        g.check().map_err(|why| bad(name, why))?;
        Ok(Some(g))
    }

    /// A manifest's bytes read: the geometry it records, checked.
    pub fn parse(bytes: &[u8]) -> Result<Geometry, String> {
        let m: Manifest = serde_json::from_slice(bytes).map_err(|e| format!("not a manifest: {e}"))?;
        if m.format != FORMAT || m.version != 1 {
            return Err(format!("unknown format {} version {}", m.format, m.version));
        }
        let g = Geometry { size: m.size, object_size: m.object_size, stored: true };
        g.check()?;
        Ok(g)
    }

    /// The manifest's bytes for this geometry.
    pub fn encode(&self) -> Vec<u8> {
        let m =
            Manifest { format: FORMAT.into(), version: 1, size: self.size, object_size: self.object_size };
        serde_json::to_vec_pretty(&m).expect("manifest serializes")
    }

    fn check(&self) -> Result<(), String> {
        let Geometry { size, object_size, .. } = *self;
        if object_size == 0 || size % object_size != 0 || object_size > 1 << 30 {
            return Err(format!(
                "the size ({size}) must be a multiple of the object size ({object_size}), at most 1 GiB"
            ));
        }
        Ok(())
    }

    /// The number of objects the image spans.
    pub fn blocks(&self) -> u64 {
        self.size / self.object_size
    }

    /// Stores the manifest of the image under `key`, created only if absent: two first opens
    /// racing agree, or the one that lost fails at its next open.
    pub fn save(&self, store: &Store, key: &str) -> Result<()> {
        let manifest_key = format!("{key}/{MANIFEST}");
        let body = Bytes::from(self.encode());
        if let Some((_, version)) = store.run(store.put(&manifest_key, body, PutMode::Create))? {
            lease::warn_if_versioned(store, &manifest_key, version.as_deref());
        }
        Ok(())
    }
}

fn bad(name: &str, detail: String) -> Error {
    Error::new(ErrorKind::InvalidInput, Op::Open).path(name).detail(detail)
}
