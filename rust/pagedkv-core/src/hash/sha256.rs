//! SHA-256 straight through the compression function: raw bytes
//! (`sha256_bytes`) and the direct path of the common `sha256_cbor` block,
//! encoded in place in its SHA-256 blocks.

use super::BlockHash;
use super::encode::CBOR_NULL;
use sha2::block_api::compress256;

/// Most tokens [`sha256_cbor_direct`] encodes on the stack.
pub(super) const DIRECT_MAX_TOKENS: usize = 64;
/// Tokens whose block message always fits two SHA-256 blocks with its padding
/// (37 + 5 x 16 = 117 <= 119 bytes).
const TWO_BLOCK_MAX_TOKENS: usize = 16;

/// Writes `(parent, tokens, None)` as canonical CBOR at the start of `m`
/// (`[0x83, bytes(parent), array(tokens), null]`, shortest integer heads: the
/// bytes of the general encoder); returns the length. `m` holds at least
/// `38 + 5 * tokens.len()` bytes and `tokens.len() < 256`.
fn encode_block_cbor(m: &mut [u8], parent: &[u8; 32], tokens: &[u32]) -> usize {
    m[0] = 0x83;
    m[1] = 0x58;
    m[2] = 32;
    m[3..35].copy_from_slice(parent);
    let mut i = 35;
    if tokens.len() < 24 {
        m[i] = 0x80 | tokens.len() as u8;
        i += 1;
    } else {
        m[i] = 0x98;
        m[i + 1] = tokens.len() as u8;
        i += 2;
    }
    for &t in tokens {
        // One 8-byte store per token (the buffer has the slack), then advance by
        // the encoded length: 1, 2, 3 or 5 bytes.
        let (word, len) = match t {
            0..24 => (u64::from(t), 1),
            24..256 => (0x18 | u64::from(t) << 8, 2),
            256..65536 => (0x19 | u64::from(t >> 8) << 8 | u64::from(t & 0xff) << 16, 3),
            _ => (0x1a | u64::from(t.swap_bytes()) << 8, 5),
        };
        m[i..i + 8].copy_from_slice(&word.to_le_bytes());
        i += len;
    }
    m[i] = CBOR_NULL;
    i + 1
}

/// `sha256_cbor` of `(parent, tokens, None)`, the common block (no extra keys):
/// the canonical CBOR is written into a stack buffer and fed straight to the
/// compression function; a block of up to 16 tokens is encoded in place in the
/// two SHA-256 blocks it takes, padded there, and compressed in one call. None
/// when the block does not fit the buffer or the parent is not a 32-byte digest.
// Inlined into the hasher's one call site: out of line, its 33-byte result
// goes through memory and a chained block costs more (docs/perf-log.md).
#[allow(clippy::inline_always)]
#[inline(always)]
pub(super) fn sha256_cbor_direct(parent: &BlockHash, tokens: &[u32]) -> Option<BlockHash> {
    let parent: &[u8; 32] = parent.as_bytes().try_into().ok()?;
    if tokens.len() <= TWO_BLOCK_MAX_TOKENS {
        // 117 bytes at most, + 8 of store slack, inside 128 (and the padding
        // store at `len` ends by 126). The message is encoded in the two
        // SHA-256 blocks themselves and compressed where it lies: a copy into
        // a block array would have to wait for the encoder's stores.
        let mut blocks = [[0u8; 64]; 2];
        let m = blocks.as_flattened_mut();
        let len = encode_block_cbor(m, parent, tokens);
        // The padding marker, and zeros over the up to 7 bytes the encoder's
        // slack stores left past the message, in one store.
        m[len..len + 8].copy_from_slice(&0x80u64.to_le_bytes());
        let n = if len < 56 { 1 } else { 2 };
        m[n * 64 - 8..n * 64].copy_from_slice(&((len as u64) * 8).to_be_bytes());
        let mut state = SHA256_H0;
        compress256(&mut state, &blocks[..n]);
        return Some(BlockHash {
            bytes: state_bytes(state),
            len: 32,
        });
    }
    if tokens.len() > DIRECT_MAX_TOKENS {
        return None;
    }
    let mut m = [0u8; 38 + 5 * DIRECT_MAX_TOKENS + 8];
    let len = encode_block_cbor(&mut m, parent, tokens);
    Some(BlockHash {
        bytes: sha256_bytes(&m[..len]),
        len: 32,
    })
}

/// SHA-256's initial state (FIPS 180-4, 5.3.3).
const SHA256_H0: [u32; 8] = [
    0x6a09_e667,
    0xbb67_ae85,
    0x3c6e_f372,
    0xa54f_f53a,
    0x510e_527f,
    0x9b05_688c,
    0x1f83_d9ab,
    0x5be0_cd19,
];

/// SHA-256 of raw bytes, straight through the compression function (SHA-NI
/// where the CPU has it): whole 64-byte blocks are read from `data` itself, the
/// tail and its padding from one stack buffer; no hasher object, no copies of
/// the message. A block's CBOR message (~86 bytes for 16 tokens) is two
/// compressions.
#[must_use]
pub fn sha256_bytes(data: &[u8]) -> [u8; 32] {
    let mut state = SHA256_H0;
    let (blocks, rem) = data.as_chunks::<64>();
    compress256(&mut state, blocks);
    let mut tail = [[0u8; 64]; 2];
    tail[0][..rem.len()].copy_from_slice(rem);
    tail[0][rem.len()] = 0x80;
    // The 64-bit message length in bits closes the last block; it needs 8 free
    // bytes after the 0x80 marker, or a second block.
    let n = if rem.len() < 56 { 1 } else { 2 };
    tail[n - 1][56..].copy_from_slice(&((data.len() as u64) * 8).to_be_bytes());
    compress256(&mut state, &tail[..n]);
    state_bytes(state)
}

/// The digest of a final SHA-256 state (its words big-endian).
fn state_bytes(state: [u32; 8]) -> [u8; 32] {
    let mut out = [0u8; 32];
    for (o, w) in out.chunks_exact_mut(4).zip(state) {
        o.copy_from_slice(&w.to_be_bytes());
    }
    out
}
