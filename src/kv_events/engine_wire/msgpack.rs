//! The small part of msgpack the engines' KV event batches use: a bounded, non-allocating
//! reader of value heads and a writer. Written here rather than pulled in as a dependency so the
//! decoder's bounds (length prefixes checked against the remaining input, skip depth) are ours.

use super::error::EngineDecodeError;
use super::limits::MAX_DEPTH;

/// The head of one msgpack value. Strings and bins borrow their bytes (already consumed);
/// arrays and maps carry their element count, their elements follow.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Head<'a> {
    Nil,
    Bool(bool),
    /// Any non-negative integer (positive fixint, uint8..64, or int8..64 holding a value >= 0).
    Uint(u64),
    /// A negative integer.
    Neg(i64),
    Float(f64),
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Array(usize),
    Map(usize),
    /// An extension value (payload consumed, ignored).
    Ext,
}

pub(super) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(super) fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    pub(super) fn pos(&self) -> usize {
        self.pos
    }

    pub(super) fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], EngineDecodeError> {
        let truncated = EngineDecodeError::Truncated { at: self.pos };
        let end = self.pos.checked_add(n).ok_or(truncated.clone())?;
        let bytes = self.buf.get(self.pos..end).ok_or(truncated)?;
        self.pos = end;
        Ok(bytes)
    }

    fn be(&mut self, n: usize) -> Result<u64, EngineDecodeError> {
        Ok(self
            .take(n)?
            .iter()
            .fold(0u64, |acc, &b| (acc << 8) | u64::from(b)))
    }

    fn len(&mut self, n: usize) -> Result<usize, EngineDecodeError> {
        // A length beyond usize cannot fit the input either: report it as truncation.
        usize::try_from(self.be(n)?).map_err(|_| EngineDecodeError::Truncated { at: self.pos })
    }

    /// A container of `n` elements each at least one byte long: refuse counts the remaining
    /// input cannot hold, so that a caller may reserve `n` slots.
    fn container(&mut self, n: usize, per_entry: usize) -> Result<usize, EngineDecodeError> {
        if n.saturating_mul(per_entry) > self.remaining() {
            return Err(EngineDecodeError::Truncated { at: self.pos });
        }
        Ok(n)
    }

    /// Read the next value's head (and a string's, bin's or ext's payload).
    pub(super) fn head(&mut self) -> Result<Head<'a>, EngineDecodeError> {
        let at = self.pos;
        let marker = self.take(1)?[0];
        let signed = |v: i64| {
            if v < 0 {
                Head::Neg(v)
            } else {
                Head::Uint(v as u64)
            }
        };
        Ok(match marker {
            0x00..=0x7f => Head::Uint(u64::from(marker)),
            0x80..=0x8f => Head::Map(self.container(usize::from(marker & 0x0f), 2)?),
            0x90..=0x9f => Head::Array(self.container(usize::from(marker & 0x0f), 1)?),
            0xa0..=0xbf => Head::Str(self.take(usize::from(marker & 0x1f))?),
            0xc0 => Head::Nil,
            0xc2 => Head::Bool(false),
            0xc3 => Head::Bool(true),
            0xc4..=0xc6 => {
                let n = self.len(1 << (marker - 0xc4))?;
                Head::Bin(self.take(n)?)
            }
            0xc7..=0xc9 => {
                let n = self.len(1 << (marker - 0xc7))?;
                self.take(1)?; // type
                self.take(n)?;
                Head::Ext
            }
            0xca => Head::Float(f64::from(f32::from_bits(self.be(4)? as u32))),
            0xcb => Head::Float(f64::from_bits(self.be(8)?)),
            0xcc..=0xcf => Head::Uint(self.be(1 << (marker - 0xcc))?),
            0xd0 => signed(i64::from(self.be(1)? as u8 as i8)),
            0xd1 => signed(i64::from(self.be(2)? as u16 as i16)),
            0xd2 => signed(i64::from(self.be(4)? as u32 as i32)),
            0xd3 => signed(self.be(8)? as i64),
            0xd4..=0xd8 => {
                self.take(1 + (1 << (marker - 0xd4)))?;
                Head::Ext
            }
            0xd9..=0xdb => {
                let n = self.len(1 << (marker - 0xd9))?;
                Head::Str(self.take(n)?)
            }
            0xdc | 0xdd => {
                let n = self.len(2 << (marker - 0xdc))?;
                Head::Array(self.container(n, 1)?)
            }
            0xde | 0xdf => {
                let n = self.len(2 << (marker - 0xde))?;
                Head::Map(self.container(n, 2)?)
            }
            0xe0..=0xff => Head::Neg(i64::from(marker as i8)),
            0xc1 => return Err(EngineDecodeError::BadMarker { at, byte: marker }),
        })
    }

    /// Skip the elements of a value whose head was just read; `depth` is the head's nesting
    /// level (the batch array is level 0).
    pub(super) fn skip_rest(
        &mut self,
        head: Head<'_>,
        depth: usize,
    ) -> Result<(), EngineDecodeError> {
        let items = match head {
            Head::Array(n) => n,
            Head::Map(n) => n.saturating_mul(2),
            _ => return Ok(()),
        };
        if depth >= MAX_DEPTH {
            return Err(EngineDecodeError::TooDeep { at: self.pos });
        }
        for _ in 0..items {
            self.skip(depth + 1)?;
        }
        Ok(())
    }

    /// Skip one whole value at nesting level `depth`.
    pub(super) fn skip(&mut self, depth: usize) -> Result<(), EngineDecodeError> {
        let head = self.head()?;
        self.skip_rest(head, depth)
    }
}

/// msgpack writer over a byte vector (smallest encoding of each integer, as msgspec writes).
pub(super) struct Writer(pub(super) Vec<u8>);

impl Writer {
    pub(super) fn nil(&mut self) {
        self.0.push(0xc0);
    }

    pub(super) fn uint(&mut self, v: u64) {
        match v {
            0..=0x7f => self.0.push(v as u8),
            0x80..=0xff => self.0.extend_from_slice(&[0xcc, v as u8]),
            0x100..=0xffff => {
                self.0.push(0xcd);
                self.0.extend_from_slice(&(v as u16).to_be_bytes());
            }
            0x1_0000..=0xffff_ffff => {
                self.0.push(0xce);
                self.0.extend_from_slice(&(v as u32).to_be_bytes());
            }
            _ => {
                self.0.push(0xcf);
                self.0.extend_from_slice(&v.to_be_bytes());
            }
        }
    }

    pub(super) fn int(&mut self, v: i64) {
        match v {
            0.. => self.uint(v as u64),
            -32..=-1 => self.0.push(v as i8 as u8),
            -128..=-33 => self.0.extend_from_slice(&[0xd0, v as i8 as u8]),
            -32768..=-129 => {
                self.0.push(0xd1);
                self.0.extend_from_slice(&(v as i16).to_be_bytes());
            }
            -2_147_483_648..=-32769 => {
                self.0.push(0xd2);
                self.0.extend_from_slice(&(v as i32).to_be_bytes());
            }
            _ => {
                self.0.push(0xd3);
                self.0.extend_from_slice(&v.to_be_bytes());
            }
        }
    }

    pub(super) fn f64(&mut self, v: f64) {
        self.0.push(0xcb);
        self.0.extend_from_slice(&v.to_bits().to_be_bytes());
    }

    /// The 16- or 32-bit length form: `marker16`, or the next marker for 32 bits.
    fn wide_len(&mut self, marker16: u8, n: usize) {
        if let Ok(n) = u16::try_from(n) {
            self.0.push(marker16);
            self.0.extend_from_slice(&n.to_be_bytes());
        } else {
            // Lengths beyond u32 never occur: batches are bounded far below 4 GiB.
            let n = u32::try_from(n).unwrap_or(u32::MAX);
            self.0.push(marker16 + 1);
            self.0.extend_from_slice(&n.to_be_bytes());
        }
    }

    pub(super) fn str(&mut self, s: &str) {
        match s.len() {
            n @ 0..=31 => self.0.push(0xa0 | n as u8),
            n @ 32..=255 => self.0.extend_from_slice(&[0xd9, n as u8]),
            n => self.wide_len(0xda, n),
        }
        self.0.extend_from_slice(s.as_bytes());
    }

    pub(super) fn opt_str(&mut self, s: Option<&str>) {
        match s {
            Some(s) => self.str(s),
            None => self.nil(),
        }
    }

    /// Engines send bin only for digest hashes, which this crate writes as ints: tests only.
    #[cfg(test)]
    pub(super) fn bin(&mut self, b: &[u8]) {
        match u8::try_from(b.len()) {
            Ok(n) => self.0.extend_from_slice(&[0xc4, n]),
            Err(_) => self.wide_len(0xc5, b.len()),
        }
        self.0.extend_from_slice(b);
    }

    pub(super) fn array(&mut self, n: usize) {
        match n {
            0..=15 => self.0.push(0x90 | n as u8),
            _ => self.wide_len(0xdc, n),
        }
    }

    pub(super) fn map(&mut self, n: usize) {
        match n {
            0..=15 => self.0.push(0x80 | n as u8),
            _ => self.wide_len(0xde, n),
        }
    }
}
