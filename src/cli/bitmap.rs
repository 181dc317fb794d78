//! `lightfoot bitmap`: the dirty bitmaps of an image, offline (no server writing through
//! them): list, show, add, remove, clear, enable, disable, merge (docs/bitmap.md).

use std::path::{Path, PathBuf};

use clap::{Args, Subcommand};
use lightfoot::backend::s3::{S3Options, S3Uri};
use lightfoot::backend::{Backend, S3Backend};
use lightfoot::bitmap::{self, BitmapFile, Location};
use lightfoot::error::{Error, ErrorKind, Op};

use super::human;

/// Work on the dirty bitmaps that `serve --dirty-bitmap` keeps for an image.
#[derive(Subcommand)]
pub enum BitmapCommand {
    /// List the bitmaps: name, state, granularity and the bytes marked changed.
    List(ListArgs),
    /// Print the changed ranges of one bitmap, one "OFFSET LENGTH" line each (bytes).
    Show(ShowArgs),
    /// Add an empty, enabled bitmap: changes from the next server on are marked in it.
    Add(AddArgs),
    /// Remove a bitmap.
    Remove(NameArgs),
    /// Start a new epoch: mark every block of a bitmap unchanged (after a backup of the image
    /// as it is now).
    Clear(NameArgs),
    /// Have servers mark a bitmap again.
    Enable(NameArgs),
    /// Stop servers marking a bitmap: it keeps the changes of its epoch (for differential
    /// backups, merged later).
    Disable(NameArgs),
    /// Mark in TARGET every block changed in any SOURCE (a differential: the changes of
    /// several epochs). TARGET is added, disabled, if missing.
    Merge(MergeArgs),
}

#[derive(Args)]
pub struct Where {
    /// The image the bitmaps are of: a file, a block device, or an s3:// block image (its
    /// bitmaps are the object KEY/lightfoot.bitmaps; a command that changes them takes the
    /// image's lease for its run).
    #[arg(value_name = "IMAGE")]
    image: PathBuf,

    /// The bitmap file, if not IMAGE.bitmaps (as given to serve --dirty-bitmap NAME=FILE).
    #[arg(long, value_name = "FILE")]
    bitmaps: Option<PathBuf>,
}

/// The image, opened as far as its bitmaps need: where they are, its size and what it is
/// now (`bitmap::identity`).
struct Image {
    at: Location,
    /// An `s3://` image, held open: a changing command holds its lease until the end.
    s3: Option<S3Backend>,
}

impl Where {
    /// The image; `change`: to change its bitmaps (an `s3://` image's lease is taken).
    fn open(&self, change: bool) -> lightfoot::Result<Image> {
        let Some(uri) = self.image.to_str().filter(|p| S3Uri::is_s3(p)) else {
            let path = self.bitmaps.clone().unwrap_or_else(|| bitmap::default_path(&self.image));
            return Ok(Image { at: Location::File(path), s3: None });
        };
        let refused =
            |why: &str| Error::new(ErrorKind::InvalidInput, Op::Bitmap).path(uri).detail(why.to_string());
        if self.bitmaps.is_some() {
            return Err(refused(
                "an s3:// image's bitmaps live beside its blocks (KEY/lightfoot.bitmaps): no --bitmaps",
            ));
        }
        let uri: S3Uri = uri.parse()?;
        let b = S3Backend::open(&uri, &S3Options { writable: change, ..S3Options::default() })?;
        let Some(t) = b.tracking() else {
            return Err(refused(
                "an image in one object has no bitmaps (serve --dirty-bitmap keeps them for block images)",
            ));
        };
        Ok(Image { at: Location::beside(t.store, &t.key, t.written_elsewhere), s3: Some(b) })
    }
}

impl Image {
    /// The image's size and what it is now.
    fn now(&self, image: &Path) -> lightfoot::Result<(u64, String)> {
        match &self.s3 {
            Some(b) => Ok((b.size().unwrap_or(0), b.identity().unwrap_or_default())),
            None => image_now(image),
        }
    }

    /// Another process writes through the bitmaps now (their marks are in its memory).
    fn in_use(&self) -> bool {
        BitmapFile::open(&self.at, false).is_err()
    }
}

#[derive(Args)]
pub struct ListArgs {
    #[command(flatten)]
    at: Where,

    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct ShowArgs {
    #[command(flatten)]
    at: Where,

    /// The bitmap.
    #[arg(value_name = "NAME")]
    name: String,

    /// Print JSON: [{"offset": …, "length": …}, …].
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct AddArgs {
    #[command(flatten)]
    at: Where,

    /// The new bitmap's name.
    #[arg(value_name = "NAME")]
    name: String,

    /// Bytes per bit: a power of two from 512 to 2G (K, M, G suffix). Smaller finds changes
    /// more exactly and takes more memory (a 1 TiB image: 2 MiB at 64K).
    #[arg(long, value_name = "SIZE", default_value = "64K", value_parser = parse_granularity)]
    granularity: u64,

    /// Add it disabled (servers do not mark it until `lightfoot bitmap enable`).
    #[arg(long)]
    disable: bool,
}

#[derive(Args)]
pub struct NameArgs {
    #[command(flatten)]
    at: Where,

    /// The bitmap.
    #[arg(value_name = "NAME")]
    name: String,
}

#[derive(Args)]
pub struct MergeArgs {
    #[command(flatten)]
    at: Where,

    /// The bitmap that receives the marks.
    #[arg(value_name = "TARGET")]
    target: String,

    /// The bitmaps whose marks it receives.
    #[arg(value_name = "SOURCE", required = true)]
    sources: Vec<String>,
}

fn parse_granularity(s: &str) -> Result<u64, String> {
    let n = lightfoot::copy::endpoint::parse_size(s).map_err(|e| e.to_string())?;
    bitmap::format::check_granularity(n)?;
    Ok(n)
}

pub fn run(cmd: BitmapCommand) -> i32 {
    super::init_logging(0);
    // A bad name fails before anything is made (add would make the file first).
    let named: Vec<&str> = match &cmd {
        BitmapCommand::Add(a) => vec![&a.name],
        BitmapCommand::Merge(a) => vec![&a.target],
        _ => vec![],
    };
    if let Some(e) = named.iter().find_map(|n| bitmap::format::check_name(n).err()) {
        return super::usage_error("bitmap", e);
    }
    let done = match cmd {
        BitmapCommand::List(a) => list(&a),
        BitmapCommand::Show(a) => show(&a),
        BitmapCommand::Add(a) => change(&a.at, true, |f| {
            f.add(&a.name, a.granularity)?;
            f.get_mut(&a.name)?.enabled = !a.disable;
            Ok(format!("bitmap '{}' added", a.name))
        }),
        BitmapCommand::Remove(a) => change(&a.at, false, |f| {
            f.get(&a.name)?;
            f.sidecar.bitmaps.retain(|b| b.name != a.name);
            Ok(format!("bitmap '{}' removed", a.name))
        }),
        BitmapCommand::Clear(a) => change(&a.at, false, |f| {
            let b = f.get_mut(&a.name)?;
            b.bits.clear();
            b.parent = b.epoch;
            b.epoch = bitmap::file::new_epoch();
            Ok(format!("bitmap '{}' cleared: a new epoch begins", a.name))
        }),
        BitmapCommand::Enable(a) => change(&a.at, false, |f| {
            f.get_mut(&a.name)?.enabled = true;
            Ok(format!("bitmap '{}' enabled", a.name))
        }),
        BitmapCommand::Disable(a) => change(&a.at, false, |f| {
            f.get_mut(&a.name)?.enabled = false;
            Ok(format!("bitmap '{}' disabled", a.name))
        }),
        BitmapCommand::Merge(a) => change(&a.at, false, |f| merge(f, &a.target, &a.sources)),
    };
    match done {
        Ok(()) => 0,
        Err(e) => {
            super::report(&e);
            1
        }
    }
}

/// The image's size and what it is now (`bitmap::identity`).
fn image_now(image: &Path) -> lightfoot::Result<(u64, String)> {
    use std::os::unix::fs::FileTypeExt;
    let f = std::fs::File::open(image).map_err(|e| Error::io(Op::Open, e).path(image))?;
    let m = f.metadata().map_err(|e| Error::io(Op::Stat, e).path(image))?;
    let size = if m.file_type().is_block_device() {
        lightfoot::io::sys::block_size_bytes(std::os::fd::AsFd::as_fd(&f))
            .map_err(|e| Error::io(Op::Size, e).path(image))?
    } else if m.is_file() {
        m.len()
    } else {
        return Err(Error::new(ErrorKind::InvalidInput, Op::Bitmap)
            .path(image)
            .detail("not a file or block device"));
    };
    Ok((size, bitmap::identity(image, size)?))
}

/// Opens the bitmap file exclusively (made if missing when `create`), accounts for writes no
/// bitmap saw, runs `op`, saves, and says what `op` did.
fn change(
    at: &Where,
    create: bool,
    op: impl FnOnce(&mut BitmapFile) -> lightfoot::Result<String>,
) -> lightfoot::Result<()> {
    let image = at.open(true)?;
    let path = image.at.name();
    let opened = BitmapFile::open(&image.at, true)?;
    // What the image is, once no server can be closing it any more (the lock is held).
    let (size, now) = image.now(&at.image)?;
    let mut f = match opened {
        Some(f) => f,
        None if create => BitmapFile::create(&image.at, size, now.clone())?,
        None => return Err(bitmap::file::no_file(&path)),
    };
    f.check_size(size)?;
    if let Some(why) = f.resolve(&now) {
        super::report(&format!(
            "{}: {why}: every block of its enabled bitmaps now counts as changed",
            path.display()
        ));
    }
    let said = op(&mut f)?;
    f.save()?;
    super::print_out(&format!("{said} ({})\n", path.display()));
    Ok(())
}

fn merge(f: &mut BitmapFile, target: &str, sources: &[String]) -> lightfoot::Result<String> {
    let mut finest = u64::MAX;
    for s in sources {
        finest = finest.min(f.get(s)?.bits.granularity());
    }
    let mut note = "";
    if f.sidecar.get(target).is_none() {
        f.add(target, finest)?;
        f.get_mut(target)?.enabled = false;
        note = " (added, disabled)";
    }
    let t = f.get(target)?.bits.clone();
    for s in sources.iter().filter(|s| *s != target) {
        t.merge(&f.get(s)?.bits);
    }
    Ok(format!("bitmap '{target}'{note} now holds the changes of {}", sources.join(", ")))
}

/// What a listing says of the whole file: in use (by whom), or changed since.
fn file_state(at: &Image, s: &bitmap::format::Sidecar, image: &Path) -> lightfoot::Result<&'static str> {
    let (size, now) = at.now(image)?;
    Ok(if s.in_use {
        if at.in_use() {
            "in use by a running server (figures from its start)"
        } else {
            "left in use by a server that was killed or whose final flush failed: enabled bitmaps count the whole image changed"
        }
    } else if s.size != size {
        "for an image of another size"
    } else if !s.image.is_empty() && s.image != now {
        "image changed since the last clean close: enabled bitmaps count the whole image changed"
    } else {
        "clean"
    })
}

fn list(a: &ListArgs) -> lightfoot::Result<()> {
    let image = a.at.open(false)?;
    let path = image.at.name();
    let s = BitmapFile::peek(&image.at)?;
    let state = file_state(&image, &s, &a.at.image)?;
    if a.json {
        let maps: Vec<_> = s
            .bitmaps
            .iter()
            .map(|b| {
                serde_json::json!({
                    "name": b.name,
                    "enabled": b.enabled,
                    "granularity": b.bits.granularity(),
                    "changed": b.bits.dirty_bytes(),
                    "epoch": format!("{:016x}", b.epoch),
                    "parent": format!("{:016x}", b.parent),
                })
            })
            .collect();
        let v = serde_json::json!({
            "file": path.display().to_string(), "size": s.size, "in_use": s.in_use, "state": state, "bitmaps": maps,
        });
        super::print_out(&format!("{}\n", serde_json::to_string_pretty(&v).expect("json")));
        return Ok(());
    }
    let mut out =
        format!("{}: {} bitmap(s) of {}, {state}\n", path.display(), s.bitmaps.len(), human::bytes(s.size));
    for b in &s.bitmaps {
        out += &format!(
            "  {:<20} {:<8} granularity {:>5}  changed {}\n",
            b.name,
            if b.enabled { "enabled" } else { "disabled" },
            human::bytes(b.bits.granularity()),
            human::bytes(b.bits.dirty_bytes()),
        );
    }
    super::print_out(&out);
    Ok(())
}

fn show(a: &ShowArgs) -> lightfoot::Result<()> {
    let image = a.at.open(false)?;
    let path = image.at.name();
    // Shared: refused while a server writes through it (its marks are in its memory).
    let mut f = BitmapFile::open(&image.at, false)?.ok_or_else(|| bitmap::file::no_file(&path))?;
    let (size, now) = image.now(&a.at.image)?;
    f.check_size(size)?;
    if let Some(why) = f.resolve(&now) {
        super::report(&format!("{}: {why}: the whole image counts as changed", path.display()));
    }
    let bits = &f.get(&a.name)?.bits;
    let mut at = 0;
    let mut ranges = Vec::new();
    for (len, dirty) in bits.extents(0, size, usize::MAX) {
        if dirty {
            ranges.push((at, len));
        }
        at += len;
    }
    let out = if a.json {
        let v: Vec<_> = ranges.iter().map(|(o, l)| serde_json::json!({"offset": o, "length": l})).collect();
        format!("{}\n", serde_json::to_string_pretty(&v).expect("json"))
    } else {
        ranges.iter().map(|(o, l)| format!("{o} {l}\n")).collect()
    };
    super::print_out(&out);
    Ok(())
}
