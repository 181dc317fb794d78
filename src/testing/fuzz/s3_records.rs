//! The two small records an `s3://` block image keeps beside its objects, read from any
//! bytes (another program, or a damaged object, may have put anything there): the manifest
//! (`KEY/lightfoot.json`, `Geometry::parse`) and the lease (`KEY/lightfoot.lease`,
//! `Record::parse`). Neither panics; a manifest accepted describes a valid layout (objects of
//! 1 byte to 1 GiB, the size a multiple of them) and survives its own encoding; a lease
//! accepted survives its own encoding.
//!
//! The first byte picks the reader (even: manifest, odd: lease); the rest is the object.

use crate::backend::s3::lease::Record;
use crate::backend::s3::manifest::Geometry;

pub fn run(data: &[u8]) {
    let Some((pick, bytes)) = data.split_first() else { return };
    if pick & 1 == 0 {
        let Ok(g) = Geometry::parse(bytes) else { return };
        assert!(g.object_size > 0 && g.object_size <= 1 << 30 && g.size % g.object_size == 0, "{g:?}");
        let again = Geometry::parse(&g.encode()).expect("its own encoding reads back");
        assert_eq!((again.size, again.object_size), (g.size, g.object_size));
    } else {
        let Some(r) = Record::parse(bytes) else { return };
        assert_eq!(Record::parse(&r.encode()), Some(r));
    }
}
