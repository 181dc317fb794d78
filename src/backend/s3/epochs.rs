//! What an incremental copy records in the `s3://` block image it brought up to date: the
//! epoch of each source bitmap, in `KEY/lightfoot.epochs` (JSON, `{"NAME": "16 hex digits"}`),
//! as a file keeps it in an extended attribute (`copy --bitmap`, docs/bitmap.md). Written by
//! the copy that holds the image's lease, conditional on the version read.

use std::collections::BTreeMap;

use bytes::Bytes;

use super::store::{replacing, Store};
use crate::error::{Error, ErrorKind, Op, Result};

/// Named so that it sorts after the block names, as the manifest.
pub const EPOCHS: &str = "lightfoot.epochs";

type Records = BTreeMap<String, String>;

/// The records and the ETag of their version; none when the object is missing. One that is
/// not a record (damaged, another program's) counts as none, as a file without the attribute:
/// the next copy is not checked.
fn read(store: &Store, key: &str) -> Result<(Records, Option<Option<String>>)> {
    let name = format!("{key}/{EPOCHS}");
    let Some((bytes, meta)) = store.run(store.get(&name, None, None))? else {
        return Ok((Records::new(), None));
    };
    let records = serde_json::from_slice(&bytes).unwrap_or_else(|e| {
        tracing::warn!("{}: not an epoch record ({e}): ignored", store.uri(&name));
        Records::new()
    });
    Ok((records, Some(meta.etag)))
}

/// The epoch of bitmap `bitmap` the image under `key` was brought up to, if recorded.
pub fn get(store: &Store, key: &str, bitmap: &str) -> Result<Option<u64>> {
    let (records, _) = read(store, key)?;
    Ok(records.get(bitmap).and_then(|h| u64::from_str_radix(h, 16).ok()))
}

/// Records `epoch` for bitmap `bitmap` (`None`: removes its record).
pub fn set(store: &Store, key: &str, bitmap: &str, epoch: Option<u64>) -> Result<()> {
    let (mut records, version) = read(store, key)?;
    let before = records.get(bitmap).cloned();
    match epoch {
        Some(e) => records.insert(bitmap.to_string(), format!("{e:016x}")),
        None => records.remove(bitmap),
    };
    if records.get(bitmap) == before.as_ref() {
        return Ok(());
    }
    let name = format!("{key}/{EPOCHS}");
    let body = Bytes::from(serde_json::to_vec(&records).expect("records serialize"));
    match store.run(store.put(&name, body, replacing(version.as_ref())))? {
        Some(_) => Ok(()),
        None => Err(Error::new(ErrorKind::Io, Op::Write).path(store.uri(&name)).detail(
            "changed by another writer while it was being recorded (one without the image's lease?)",
        )),
    }
}
