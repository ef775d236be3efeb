//! Serialising a block's hash input: canonical CBOR exactly as vLLM's
//! `cbor2.dumps(obj, canonical=True)` writes it (integers, text, bytes, the
//! token array, extra keys, generic `CborValue`s), and the typed,
//! length-prefixed extra-key encoding of pagedkv's own `xxh3_native`.

use super::ExtraKey;
use crate::error::{Result, invalid};

/// A generic CBOR value, for hashing arbitrary extra-key shapes (function-level
/// vectors and callers reproducing older vLLM key formats).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CborValue {
    /// `None`.
    Null,
    /// A bool.
    Bool(bool),
    /// An integer (CBOR's range: -2**64 ..= 2**64 - 1).
    Int(i128),
    /// A text string.
    Text(String),
    /// A byte string.
    Bytes(Vec<u8>),
    /// An array (a Python tuple or list).
    Array(Vec<CborValue>),
}

pub(super) fn cbor_head(buf: &mut Vec<u8>, major: u8, v: u64) {
    let m = major << 5;
    if v < 24 {
        buf.push(m | v as u8);
    } else if u8::try_from(v).is_ok() {
        buf.extend_from_slice(&[m | 0x18, v as u8]);
    } else if u16::try_from(v).is_ok() {
        buf.push(m | 0x19);
        buf.extend_from_slice(&(v as u16).to_be_bytes());
    } else if u32::try_from(v).is_ok() {
        buf.push(m | 0x1a);
        buf.extend_from_slice(&(v as u32).to_be_bytes());
    } else {
        buf.push(m | 0x1b);
        buf.extend_from_slice(&v.to_be_bytes());
    }
}

pub(super) fn cbor_text(buf: &mut Vec<u8>, s: &str) {
    cbor_head(buf, 3, s.len() as u64);
    buf.extend_from_slice(s.as_bytes());
}

pub(super) fn cbor_bytes(buf: &mut Vec<u8>, b: &[u8]) {
    cbor_head(buf, 2, b.len() as u64);
    buf.extend_from_slice(b);
}

pub(super) fn cbor_int(buf: &mut Vec<u8>, v: i64) {
    if v >= 0 {
        cbor_head(buf, 0, v as u64);
    } else {
        cbor_head(buf, 1, (-1 - v) as u64);
    }
}

pub(super) const CBOR_NULL: u8 = 0xf6;

impl CborValue {
    /// Appends the canonical CBOR encoding. Integers outside the 64-bit CBOR range
    /// are not representable without bignum tags and are rejected.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) when an integer does not fit CBOR's major types 0/1.
    pub fn encode(&self, buf: &mut Vec<u8>) -> Result<()> {
        match self {
            Self::Null => buf.push(CBOR_NULL),
            Self::Bool(b) => buf.push(if *b { 0xf5 } else { 0xf4 }),
            Self::Int(v) => {
                if *v >= 0 {
                    let u =
                        u64::try_from(*v).map_err(|_| invalid(format!("integer {v} too large")))?;
                    cbor_head(buf, 0, u);
                } else {
                    let u = u64::try_from(-1 - *v)
                        .map_err(|_| invalid(format!("integer {v} too small")))?;
                    cbor_head(buf, 1, u);
                }
            }
            Self::Text(s) => cbor_text(buf, s),
            Self::Bytes(b) => cbor_bytes(buf, b),
            Self::Array(items) => {
                cbor_head(buf, 4, items.len() as u64);
                for it in items {
                    it.encode(buf)?;
                }
            }
        }
        Ok(())
    }
}

pub(super) fn encode_extra_cbor(buf: &mut Vec<u8>, keys: &[ExtraKey]) {
    if keys.is_empty() {
        buf.push(CBOR_NULL);
        return;
    }
    cbor_head(buf, 4, keys.len() as u64);
    for k in keys {
        match k {
            ExtraKey::Lora { name, path } => {
                buf.push(0x83);
                cbor_text(buf, "lora");
                cbor_text(buf, name);
                match path {
                    Some(p) => cbor_text(buf, p),
                    None => buf.push(CBOR_NULL),
                }
            }
            ExtraKey::Mm { identifier, offset } => {
                buf.push(0x83);
                cbor_text(buf, "mm");
                cbor_text(buf, identifier);
                cbor_int(buf, *offset);
            }
            ExtraKey::CacheSalt(s) => {
                buf.push(0x82);
                cbor_text(buf, "cache_salt");
                cbor_text(buf, s);
            }
            ExtraKey::PromptEmbeds(d) => {
                buf.push(0x82);
                cbor_text(buf, "prompt_embeds");
                cbor_bytes(buf, d);
            }
        }
    }
}

fn native_str(buf: &mut Vec<u8>, s: &str) {
    buf.extend_from_slice(&(s.len() as u32).to_le_bytes());
    buf.extend_from_slice(s.as_bytes());
}

pub(super) fn encode_extra_native(buf: &mut Vec<u8>, keys: &[ExtraKey]) {
    buf.extend_from_slice(&(keys.len() as u32).to_le_bytes());
    for k in keys {
        match k {
            ExtraKey::Lora { name, path } => {
                buf.push(1);
                native_str(buf, name);
                match path {
                    Some(p) => {
                        buf.push(1);
                        native_str(buf, p);
                    }
                    None => buf.push(0),
                }
            }
            ExtraKey::Mm { identifier, offset } => {
                buf.push(2);
                native_str(buf, identifier);
                buf.extend_from_slice(&offset.to_le_bytes());
            }
            ExtraKey::CacheSalt(s) => {
                buf.push(3);
                native_str(buf, s);
            }
            ExtraKey::PromptEmbeds(d) => {
                buf.push(4);
                buf.extend_from_slice(d);
            }
        }
    }
}

pub(super) fn encode_tokens_cbor(buf: &mut Vec<u8>, tokens: &[u32]) {
    cbor_head(buf, 4, tokens.len() as u64);
    buf.reserve(tokens.len() * 5);
    for &t in tokens {
        // Unsigned ints, shortest form (the same bytes as `cbor_head(buf, 0, t)`).
        match t {
            0..24 => buf.push(t as u8),
            24..256 => buf.extend_from_slice(&[24, t as u8]),
            256..65536 => {
                let b = (t as u16).to_be_bytes();
                buf.extend_from_slice(&[25, b[0], b[1]]);
            }
            _ => {
                let b = t.to_be_bytes();
                buf.extend_from_slice(&[26, b[0], b[1], b[2], b[3]]);
            }
        }
    }
}
