//! The handshake, both ways: the greeting and the client's flags, then option haggling (the
//! server parses option requests and builds replies; the client builds requests and parses
//! replies), and the answer to `NBD_OPT_EXPORT_NAME`.

use super::*;

/// Size of the server's greeting.
pub const GREETING_LEN: usize = 18;

/// What an old-style server sends where a newstyle one sends `IHAVEOPT` (the spec's
/// `cliserv_magic`).
pub const OLDSTYLE_MAGIC: u64 = 0x0000_4202_8186_1253;

/// The server's greeting: `NBDMAGIC`, `IHAVEOPT`, the handshake flags (`FLAG_*`).
pub fn greeting(flags: u16) -> [u8; GREETING_LEN] {
    let mut b = [0u8; GREETING_LEN];
    b[0..8].copy_from_slice(&NBDMAGIC.to_be_bytes());
    b[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
    b[16..18].copy_from_slice(&flags.to_be_bytes());
    b
}

/// A greeting, as the client reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Greeting {
    /// Newstyle negotiation, with these handshake flags (`FLAG_*`).
    Newstyle { flags: u16 },
    /// Oldstyle negotiation (no options; the spec's reference server dropped it in 3.10).
    Oldstyle,
}

/// `None` when the bytes are not an NBD greeting at all.
pub fn parse_greeting(b: &[u8; GREETING_LEN]) -> Option<Greeting> {
    if be64(&b[0..8]) != NBDMAGIC {
        return None;
    }
    match be64(&b[8..16]) {
        IHAVEOPT => Some(Greeting::Newstyle { flags: be16(&b[16..18]) }),
        OLDSTYLE_MAGIC => Some(Greeting::Oldstyle),
        _ => None,
    }
}

/// The client's flags (`FLAG_C_*`), its answer to the greeting.
pub fn client_flags(flags: u32) -> [u8; 4] {
    flags.to_be_bytes()
}

pub fn parse_client_flags(b: &[u8; 4]) -> u32 {
    be32(b)
}

/// Size of the answer to `NBD_OPT_EXPORT_NAME` without its zeroes: export size and
/// transmission flags.
pub const EXPORT_NAME_REPLY_LEN: usize = 10;

/// The zeroes after it, unless the client asked for none (`FLAG_C_NO_ZEROES`).
pub const EXPORT_NAME_ZEROES: usize = 124;

/// The answer to `NBD_OPT_EXPORT_NAME` (it has no option reply header).
pub fn export_name_reply(size: u64, flags: u16, no_zeroes: bool) -> Vec<u8> {
    let zeroes = if no_zeroes { 0 } else { EXPORT_NAME_ZEROES };
    let mut v = Vec::with_capacity(EXPORT_NAME_REPLY_LEN + zeroes);
    v.extend_from_slice(&size.to_be_bytes());
    v.extend_from_slice(&flags.to_be_bytes());
    v.resize(EXPORT_NAME_REPLY_LEN + zeroes, 0);
    v
}

/// The export size and transmission flags (what follows them is reserved).
pub fn parse_export_name_reply(b: &[u8; EXPORT_NAME_REPLY_LEN]) -> (u64, u16) {
    (be64(&b[0..8]), be16(&b[8..10]))
}

/// The 16-byte header of an option request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    pub option: u32,
    pub len: u32,
}

/// `None` when the magic is not `IHAVEOPT` (the client is not speaking NBD).
pub fn parse_option_header(b: &[u8; 16]) -> Option<OptionHeader> {
    if be64(&b[0..8]) != IHAVEOPT {
        return None;
    }
    Some(OptionHeader { option: be32(&b[8..12]), len: be32(&b[12..16]) })
}

/// The longest string (export name, query) the spec allows: "MUST be no longer than 4096
/// bytes". Longer ones are refused as malformed.
pub const MAX_STRING: usize = 4096;

/// A malformed option payload: answered with `NBD_REP_ERR_INVALID`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid(pub &'static str);

/// Reads length-prefixed fields from an option payload.
struct Fields<'a>(&'a [u8]);

impl<'a> Fields<'a> {
    fn u16(&mut self) -> Result<u16, Invalid> {
        let b = self.take(2)?;
        Ok(be16(b))
    }

    fn u32(&mut self) -> Result<u32, Invalid> {
        let b = self.take(4)?;
        Ok(be32(b))
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], Invalid> {
        if self.0.len() < n {
            return Err(Invalid("option data shorter than its fields"));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    fn string(&mut self) -> Result<String, Invalid> {
        let n = self.u32()? as usize;
        if n > MAX_STRING {
            return Err(Invalid("string longer than 4096 bytes"));
        }
        let b = self.take(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| Invalid("string is not UTF-8"))
    }

    fn done(&self) -> Result<(), Invalid> {
        if self.0.is_empty() {
            Ok(())
        } else {
            Err(Invalid("option data longer than its fields"))
        }
    }
}

/// `NBD_OPT_INFO` / `NBD_OPT_GO` data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GoRequest {
    pub name: String,
    pub infos: Vec<u16>,
}

pub fn parse_go(data: &[u8]) -> Result<GoRequest, Invalid> {
    let mut f = Fields(data);
    let name = f.string()?;
    let n = f.u16()?;
    let infos = (0..n).map(|_| f.u16()).collect::<Result<Vec<_>, _>>()?;
    f.done()?;
    Ok(GoRequest { name, infos })
}

/// `NBD_OPT_LIST_META_CONTEXT` / `NBD_OPT_SET_META_CONTEXT` data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaRequest {
    pub export: String,
    pub queries: Vec<String>,
}

pub fn parse_meta(data: &[u8]) -> Result<MetaRequest, Invalid> {
    let mut f = Fields(data);
    let export = f.string()?;
    let n = f.u32()?;
    if n as usize > data.len() / 4 {
        return Err(Invalid("more queries than the data can hold"));
    }
    let queries = (0..n).map(|_| f.string()).collect::<Result<Vec<_>, _>>()?;
    f.done()?;
    Ok(MetaRequest { export, queries })
}

/// An option reply header (20 bytes) for `option`, of `ty`, with `len` bytes of data.
pub fn option_reply_header(option: u32, ty: u32, len: u32) -> [u8; 20] {
    let mut b = [0u8; 20];
    b[0..8].copy_from_slice(&REPLY_MAGIC.to_be_bytes());
    b[8..12].copy_from_slice(&option.to_be_bytes());
    b[12..16].copy_from_slice(&ty.to_be_bytes());
    b[16..20].copy_from_slice(&len.to_be_bytes());
    b
}

/// An option reply: its header, and the data to send after it. The data of an error reply is
/// a string, which the spec limits to [`MAX_STRING`] bytes: a longer one (a message echoing a
/// client's name, which may be as long itself) is cut, at a character boundary.
pub fn option_reply(option: u32, ty: u32, data: &[u8]) -> ([u8; 20], &[u8]) {
    let data = if ty & REP_ERR != 0 && data.len() > MAX_STRING {
        let cut = &data[..MAX_STRING];
        match std::str::from_utf8(cut) {
            Ok(_) => cut,
            Err(e) => &cut[..e.valid_up_to()],
        }
    } else {
        data
    };
    (option_reply_header(option, ty, data.len() as u32), data)
}

/// `NBD_INFO_EXPORT`: size and transmission flags.
pub fn info_export(size: u64, flags: u16) -> Vec<u8> {
    let mut v = INFO_EXPORT.to_be_bytes().to_vec();
    v.extend_from_slice(&size.to_be_bytes());
    v.extend_from_slice(&flags.to_be_bytes());
    v
}

/// `NBD_INFO_BLOCK_SIZE`: minimum, preferred and maximum block sizes.
pub fn info_block_size(min: u32, preferred: u32, max: u32) -> Vec<u8> {
    let mut v = INFO_BLOCK_SIZE.to_be_bytes().to_vec();
    for x in [min, preferred, max] {
        v.extend_from_slice(&x.to_be_bytes());
    }
    v
}

/// `NBD_INFO_NAME` or `NBD_INFO_DESCRIPTION`: a string without a length prefix.
pub fn info_string(ty: u16, s: &str) -> Vec<u8> {
    let mut v = ty.to_be_bytes().to_vec();
    v.extend_from_slice(s.as_bytes());
    v
}

/// `NBD_REP_SERVER` data: a length-prefixed export name.
pub fn rep_server(name: &str) -> Vec<u8> {
    let mut v = (name.len() as u32).to_be_bytes().to_vec();
    v.extend_from_slice(name.as_bytes());
    v
}

/// `NBD_REP_META_CONTEXT` data: the context id and its name.
pub fn rep_meta_context(id: u32, name: &str) -> Vec<u8> {
    let mut v = id.to_be_bytes().to_vec();
    v.extend_from_slice(name.as_bytes());
    v
}

/// An option request: the 16-byte header and its data (client side).
pub fn option_request(option: u32, data: &[u8]) -> Vec<u8> {
    let mut v = IHAVEOPT.to_be_bytes().to_vec();
    v.extend_from_slice(&option.to_be_bytes());
    v.extend_from_slice(&(data.len() as u32).to_be_bytes());
    v.extend_from_slice(data);
    v
}

/// `NBD_OPT_INFO` / `NBD_OPT_GO` data: the export name and the information types asked for.
pub fn go_data(name: &str, infos: &[u16]) -> Vec<u8> {
    let mut v = rep_server(name);
    v.extend_from_slice(&(infos.len() as u16).to_be_bytes());
    for i in infos {
        v.extend_from_slice(&i.to_be_bytes());
    }
    v
}

/// `NBD_OPT_LIST_META_CONTEXT` / `NBD_OPT_SET_META_CONTEXT` data.
pub fn meta_data(export: &str, queries: &[&str]) -> Vec<u8> {
    let mut v = rep_server(export);
    v.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for q in queries {
        v.extend_from_slice(&rep_server(q));
    }
    v
}

/// The header of an option reply (client side).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionReply {
    pub option: u32,
    pub ty: u32,
    pub len: u32,
}

/// `None` when the magic is wrong.
pub fn parse_option_reply(b: &[u8; 20]) -> Option<OptionReply> {
    (be64(&b[0..8]) == REPLY_MAGIC).then(|| OptionReply {
        option: be32(&b[8..12]),
        ty: be32(&b[12..16]),
        len: be32(&b[16..20]),
    })
}

/// One `NBD_REP_INFO` payload, as the client understands it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Info {
    Export {
        size: u64,
        flags: u16,
    },
    BlockSize {
        minimum: u32,
        preferred: u32,
        maximum: u32,
    },
    /// A type the client did not ask about or does not use (names, descriptions).
    Other(u16),
}

pub fn parse_info(data: &[u8]) -> Result<Info, Invalid> {
    let mut f = Fields(data);
    let ty = f.u16()?;
    let info = match ty {
        INFO_EXPORT => {
            let size = u64::from(f.u32()?) << 32 | u64::from(f.u32()?);
            Info::Export { size, flags: f.u16()? }
        }
        INFO_BLOCK_SIZE => Info::BlockSize { minimum: f.u32()?, preferred: f.u32()?, maximum: f.u32()? },
        other => return Ok(Info::Other(other)),
    };
    f.done()?;
    Ok(info)
}

/// `NBD_REP_META_CONTEXT` data: the context id and its name.
pub fn parse_meta_context(data: &[u8]) -> Result<(u32, String), Invalid> {
    let mut f = Fields(data);
    let id = f.u32()?;
    let name = String::from_utf8(f.0.to_vec()).map_err(|_| Invalid("context name is not UTF-8"))?;
    Ok((id, name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_side_parses_what_the_server_side_builds() {
        assert_eq!(
            parse_info(&info_export(1 << 40, 0x1234)).unwrap(),
            Info::Export { size: 1 << 40, flags: 0x1234 }
        );
        assert_eq!(
            parse_info(&info_block_size(1, 4096, 32 << 20)).unwrap(),
            Info::BlockSize { minimum: 1, preferred: 4096, maximum: 32 << 20 }
        );
        assert_eq!(parse_info(&info_string(INFO_NAME, "x")).unwrap(), Info::Other(INFO_NAME));
        assert!(parse_info(&info_export(1, 1)[..9]).is_err());
        assert_eq!(
            parse_meta_context(&rep_meta_context(7, BASE_ALLOCATION)).unwrap(),
            (7, BASE_ALLOCATION.into())
        );
        let m = parse_meta(&meta_data("e", &[BASE_ALLOCATION])).unwrap();
        assert_eq!(m, MetaRequest { export: "e".into(), queries: vec![BASE_ALLOCATION.into()] });
        let r = option_reply_header(OPT_GO, REP_ACK, 0);
        assert_eq!(parse_option_reply(&r), Some(OptionReply { option: OPT_GO, ty: REP_ACK, len: 0 }));
        let o = option_request(OPT_GO, &go_data("d", &[]));
        assert_eq!(
            parse_option_header(o[..16].try_into().unwrap()),
            Some(OptionHeader { option: OPT_GO, len: 7 })
        );
    }

    #[test]
    fn go_parses_and_rejects_bad_lengths() {
        let d = go_data("disk", &[INFO_BLOCK_SIZE, INFO_NAME]);
        assert_eq!(parse_go(&d).unwrap(), GoRequest { name: "disk".into(), infos: vec![3, 1] });
        assert!(parse_go(&d[..d.len() - 1]).is_err());
        let mut long = d.clone();
        long.push(0);
        assert!(parse_go(&long).is_err());
        // A name length past the end of the data.
        let mut bad = d.clone();
        bad[3] = 200;
        assert!(parse_go(&bad).is_err());
    }

    #[test]
    fn meta_parses_queries() {
        let mut d = rep_server("");
        d.extend_from_slice(&2u32.to_be_bytes());
        d.extend_from_slice(&rep_server("base:allocation"));
        d.extend_from_slice(&rep_server("qemu:dirty-bitmap:x"));
        let m = parse_meta(&d).unwrap();
        assert_eq!(m.queries, vec!["base:allocation".to_string(), "qemu:dirty-bitmap:x".to_string()]);
        // A query one byte over the spec's string limit, and an export name.
        let long = "q".repeat(MAX_STRING + 1);
        assert_eq!(parse_meta(&meta_data("", &[&long])), Err(Invalid("string longer than 4096 bytes")));
        assert!(parse_meta(&meta_data("", &[&long[1..]])).is_ok());
        assert!(parse_go(&go_data(&long, &[])).is_err());
        assert!(parse_go(&go_data(&long[1..], &[])).is_ok());
        let mut huge = rep_server("");
        huge.extend_from_slice(&u32::MAX.to_be_bytes());
        assert!(parse_meta(&huge).is_err());
    }

    #[test]
    fn option_header_checks_magic() {
        let mut b = [0u8; 16];
        b[0..8].copy_from_slice(&IHAVEOPT.to_be_bytes());
        b[8..12].copy_from_slice(&OPT_GO.to_be_bytes());
        b[12..16].copy_from_slice(&10u32.to_be_bytes());
        assert_eq!(parse_option_header(&b), Some(OptionHeader { option: OPT_GO, len: 10 }));
        b[0] = 0;
        assert_eq!(parse_option_header(&b), None);
    }

    #[test]
    fn greeting_and_export_name_reply_round_trip() {
        let g = greeting(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
        assert_eq!(&g[0..8], b"NBDMAGIC");
        assert_eq!(&g[8..16], b"IHAVEOPT");
        assert_eq!(&g[16..18], &[0, 3]);
        assert_eq!(parse_greeting(&g), Some(Greeting::Newstyle { flags: 3 }));
        let mut old = g;
        old[8..16].copy_from_slice(&OLDSTYLE_MAGIC.to_be_bytes());
        assert_eq!(parse_greeting(&old), Some(Greeting::Oldstyle));
        let mut bad = g;
        bad[0] = b'X';
        assert_eq!(parse_greeting(&bad), None);
        bad = g;
        bad[15] ^= 1;
        assert_eq!(parse_greeting(&bad), None);

        let f = client_flags(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES);
        assert_eq!(f, [0, 0, 0, 3]);
        assert_eq!(parse_client_flags(&f), 3);

        let r = export_name_reply(1 << 40, 0x1234, false);
        assert_eq!(r.len(), 134);
        assert!(r[10..].iter().all(|&b| b == 0));
        assert_eq!(parse_export_name_reply(r[..10].try_into().unwrap()), (1 << 40, 0x1234));
        assert_eq!(export_name_reply(1 << 40, 0x1234, true), r[..10]);
    }

    #[test]
    fn option_error_strings_are_cut_at_the_spec_limit() {
        // 4095 bytes, then a 2-byte character across the limit.
        let long = format!("{}é", "x".repeat(MAX_STRING - 1));
        let (h, data) = option_reply(OPT_GO, REP_ERR_UNKNOWN, long.as_bytes());
        assert_eq!(data.len(), MAX_STRING - 1);
        assert_eq!(parse_option_reply(&h).unwrap().len as usize, MAX_STRING - 1);
        // Not an error: the data goes whole.
        let (h, data) = option_reply(OPT_GO, REP_INFO, long.as_bytes());
        assert_eq!((data.len(), parse_option_reply(&h).unwrap().len as usize), (long.len(), long.len()));
    }

    /// Whatever the bytes, the option parsers answer `Err`: they never panic.
    #[test]
    fn arbitrary_option_data_never_panics() {
        let mut rng = crate::testing::conformance::Rng::new(0x9e37_79b9_7f4a_7c15);
        for _ in 0..20_000 {
            let mut b = [0u8; 24];
            rng.fill(&mut b);
            // Small string and count fields, so that they fit the data now and then.
            b[0..3].fill(0);
            b[3] %= 16;
            let d = &b[..rng.below(25) as usize];
            let _ = (parse_go(d), parse_meta(d), parse_info(d), parse_meta_context(d));
            let _ = parse_greeting(b[..GREETING_LEN].try_into().unwrap());
            let _ = parse_option_reply(b[..20].try_into().unwrap());
            let _ = parse_option_header(b[..16].try_into().unwrap());
        }
    }
}
