//! Option haggling, both ways: the server parses option requests and builds reply payloads;
//! the client builds requests and parses replies.

use super::*;

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
}
