//! Passage blocks on disk, beside the index (`<data_dir>/passages/<model>/`), so that a
//! restart or a second process reads a passage's keys and values instead of computing them.
//!
//! One file per block, named by its key (the hash of the tokens before the passage, which
//! hold the system prompt and the template's text, and of the passage's own tokens): a
//! changed template or a changed document is another name, never a stale file. The folder is
//! named by a hash of the model file's bytes and its RoPE, so another model never reads
//! these. Keys are 8-bit: each row of a head (one token's `head_dim` numbers) is scaled by
//! its largest magnitude / 127. Values are 4-bit, as KIVI (Liu et al., 2024) keeps them:
//! per token, in groups of 32 along the row, each group with its own minimum and step
//! (values are summed over many tokens by the attention, so their rounding averages out;
//! keys decide the attention weights and keep 8 bits). About a fifth of F32's bytes; the
//! error is measured in `tests`. A file ends with the XXH3-64 of everything before it; a
//! file whose checksum, header or length is wrong is deleted and counted, never served.
//! Writes go to a temporary name first and are renamed, so a crash leaves no half-written
//! block under a real name. The folder is bounded in bytes; the least recently used files
//! go first.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use mistralrs::{DType, Device, Tensor};

use super::{metrics, Block};

pub use docent_engine::DiskStats;

const MAGIC: &[u8; 8] = b"DOCENTKV";
/// 1: 8-bit keys and values with f32 scales; 2: 8-bit keys (f16 scales), 4-bit values.
const VERSION: u32 = 2;
/// magic, version, dtype, context hash, context length, tokens, layers, heads, head dim
const HEADER: usize = 8 + 4 + 4 + 8 + 4 * 5;

/// What went wrong with a file on disk.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    /// Reading, writing or removing the file failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// A tensor operation on the block's keys or values failed.
    #[error("{0}")]
    Tensor(#[from] candle_core::Error),
    /// The file is not a valid block (what is wrong with it).
    #[error("not a passage block: {0}")]
    Corrupt(&'static str),
}

/// The files of one model's blocks, bounded in bytes.
pub struct DiskBlocks {
    dir: PathBuf,
    limit: u64,
    index: Mutex<Index>,
    corrupt: AtomicU64,
}

#[derive(Default)]
struct Index {
    /// file name → (bytes, last use)
    files: HashMap<String, (u64, u64)>,
    bytes: u64,
    clock: u64,
}

/// The folder of `model`'s blocks under `root`: named by an XXH3-64 of the model file's
/// bytes and `salt` (its RoPE and this format's version).
pub fn model_dir(root: &Path, model: &Path, salt: &str) -> std::io::Result<PathBuf> {
    use std::io::Read;
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    let mut file = std::fs::File::open(model)?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    hasher.update(salt.as_bytes());
    hasher.update(&VERSION.to_le_bytes());
    Ok(root.join(format!("{:016x}", hasher.digest())))
}

impl DiskBlocks {
    /// Opens (creating) `dir`, bounded to `limit` bytes: temporary files a crash left are
    /// removed, the others are known by size and age (the oldest modified are evicted
    /// first).
    pub fn open(dir: &Path, limit: u64) -> std::io::Result<DiskBlocks> {
        std::fs::create_dir_all(dir)?;
        let mut found = Vec::new();
        for entry in std::fs::read_dir(dir)? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let meta = entry.metadata()?;
            if !meta.is_file() {
                continue;
            }
            if name.ends_with(".tmp") {
                let _ = std::fs::remove_file(entry.path());
                continue;
            }
            if name.ends_with(".kv") {
                let modified = meta.modified().unwrap_or(std::time::UNIX_EPOCH);
                found.push((modified, name, meta.len()));
            }
        }
        found.sort();
        let mut index = Index::default();
        for (_, name, bytes) in found {
            index.clock += 1;
            index.bytes += bytes;
            index.files.insert(name, (bytes, index.clock));
        }
        let disk = DiskBlocks {
            dir: dir.to_path_buf(),
            limit,
            index: Mutex::new(index),
            corrupt: AtomicU64::new(0),
        };
        disk.evict();
        Ok(disk)
    }

    /// The fence kept in the folder (`fence`), or `new` written there when none is (or it
    /// is not one): fenced prompts' passages are computed in it.
    pub fn fence(&self, new: &str) -> String {
        let path = self.dir.join("fence");
        let valid = |f: &str| {
            f.strip_prefix("doc-")
                .is_some_and(|h| h.len() == 8 && h.bytes().all(|b| b.is_ascii_hexdigit()))
        };
        match std::fs::read_to_string(&path) {
            Ok(f) if valid(f.trim()) => f.trim().to_string(),
            _ => {
                if let Err(e) = std::fs::write(&path, new) {
                    tracing::warn!(error = %e, file = %path.display(), "the passage fence was not kept");
                }
                new.to_string()
            }
        }
    }

    /// The folder the blocks are kept in.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn name(context: u64, tokens: &[u32]) -> String {
        format!(
            "{context:016x}-{:016x}.kv",
            super::hash_tokens(context, tokens)
        )
    }

    /// Whether a file for the block is there (not read).
    pub fn contains(&self, context: u64, tokens: &[u32]) -> bool {
        let index = self.index.lock().unwrap_or_else(|e| e.into_inner());
        index.files.contains_key(&Self::name(context, tokens))
    }

    /// The block of `tokens` after a context hashed `context`, when its file is there and
    /// whole; a damaged file is deleted (and counted) and `None` comes back.
    pub fn load(&self, context: u64, tokens: &[u32]) -> Option<Block> {
        let name = Self::name(context, tokens);
        {
            let mut index = self.index.lock().unwrap_or_else(|e| e.into_inner());
            index.clock += 1;
            let clock = index.clock;
            (index.files.get_mut(&name)?).1 = clock;
        }
        let path = self.dir.join(&name);
        let read = std::fs::read(&path)
            .map_err(DiskError::from)
            .and_then(|bytes| decode(&bytes, context, tokens));
        match read {
            Ok(block) => {
                // the file's age orders evictions after a restart
                if let Ok(f) = std::fs::File::options().write(true).open(&path) {
                    let _ = f.set_modified(std::time::SystemTime::now());
                }
                Some(block)
            }
            Err(e) => {
                tracing::warn!(file = %path.display(), error = %e, "a damaged passage block on disk was deleted; it is computed again");
                self.corrupt.fetch_add(1, Ordering::Relaxed);
                self.forget(&name);
                None
            }
        }
    }

    /// Writes `block` (a temporary file renamed into place), then evicts beyond the bound.
    pub fn store(&self, block: &Block) -> Result<(), DiskError> {
        let bytes = encode(block)?;
        if bytes.len() as u64 > self.limit {
            return Ok(());
        }
        let name = Self::name(block.context, &block.tokens);
        let path = self.dir.join(&name);
        let tmp = self.dir.join(format!("{name}.{}.tmp", std::process::id()));
        {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&bytes)?;
        }
        std::fs::rename(&tmp, &path)?;
        {
            let mut index = self.index.lock().unwrap_or_else(|e| e.into_inner());
            index.clock += 1;
            let clock = index.clock;
            if let Some((old, _)) = index.files.insert(name, (bytes.len() as u64, clock)) {
                index.bytes -= old;
            }
            index.bytes += bytes.len() as u64;
        }
        self.evict();
        Ok(())
    }

    fn forget(&self, name: &str) {
        let mut index = self.index.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((bytes, _)) = index.files.remove(name) {
            index.bytes -= bytes;
        }
        let _ = std::fs::remove_file(self.dir.join(name));
    }

    fn evict(&self) {
        let mut index = self.index.lock().unwrap_or_else(|e| e.into_inner());
        while index.bytes > self.limit {
            let Some(oldest) = index
                .files
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(n, _)| n.clone())
            else {
                break;
            };
            if let Some((bytes, _)) = index.files.remove(&oldest) {
                index.bytes -= bytes;
            }
            let _ = std::fs::remove_file(self.dir.join(&oldest));
        }
        metrics::metrics().disk_bytes.set(index.bytes as i64);
    }

    /// The files, bytes, bound and damaged files counted so far.
    pub fn stats(&self) -> DiskStats {
        let index = self.index.lock().unwrap_or_else(|e| e.into_inner());
        DiskStats {
            files: index.files.len(),
            bytes: index.bytes,
            limit: self.limit,
            corrupt: self.corrupt.load(Ordering::Relaxed),
        }
    }
}

fn dtype_code(d: DType) -> Result<u32, DiskError> {
    match d {
        DType::F32 => Ok(0),
        DType::F16 => Ok(1),
        DType::BF16 => Ok(2),
        _ => Err(DiskError::Corrupt(
            "keys and values of an unsupported dtype",
        )),
    }
}

/// The values' group along a row: 32 numbers, or the whole row when it does not divide.
fn group(head_dim: usize) -> usize {
    if head_dim.is_multiple_of(32) {
        32
    } else {
        head_dim
    }
}

/// Bytes of one layer's keys (a f16 scale and `head_dim` signed bytes per row) and values
/// (a f16 minimum and step per group, then two numbers a byte) for `rows` rows.
fn layer_bytes(rows: usize, head_dim: usize) -> usize {
    layer_bytes_wide(rows as u128, head_dim) as usize
}

/// [`layer_bytes`] without overflow, for sizes read from a file.
fn layer_bytes_wide(rows: u128, head_dim: usize) -> u128 {
    let (d, g) = (head_dim as u128, group(head_dim) as u128);
    rows * (2 + d) + rows * (d / g) * 4 + rows * d / 2
}

/// A block's file: header, tokens, every layer's keys then values, and the checksum.
pub fn encode(block: &Block) -> Result<Vec<u8>, DiskError> {
    let (k0, _) = block
        .layers
        .first()
        .ok_or(DiskError::Corrupt("a block without layers"))?;
    let (_, heads, n, head_dim) = k0.dims4()?;
    if !head_dim.is_multiple_of(2) {
        return Err(DiskError::Corrupt(
            "an odd head size (4-bit values need pairs)",
        ));
    }
    let rows = heads * n;
    let mut out =
        Vec::with_capacity(HEADER + 4 * n + block.layers.len() * layer_bytes(rows, head_dim) + 8);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&dtype_code(k0.dtype())?.to_le_bytes());
    out.extend_from_slice(&block.context.to_le_bytes());
    for v in [block.context_len, n, block.layers.len(), heads, head_dim] {
        out.extend_from_slice(&(v as u32).to_le_bytes());
    }
    for t in &block.tokens {
        out.extend_from_slice(&t.to_le_bytes());
    }
    for (k, v) in block.layers.iter() {
        for t in [k, v] {
            if t.dims4()? != (1, heads, n, head_dim) {
                return Err(DiskError::Corrupt("layers of different shapes"));
            }
        }
        let data = |t: &Tensor| -> Result<Vec<f32>, DiskError> {
            let data = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            // the scales, minimums and steps are f16
            if data.iter().any(|x| !x.is_finite() || x.abs() > 60_000.0) {
                return Err(DiskError::Corrupt(
                    "numbers beyond f16's range (the block stays in memory only)",
                ));
            }
            Ok(data)
        };
        quantize_keys(&data(k)?, head_dim, &mut out);
        quantize_values(&data(v)?, head_dim, &mut out);
    }
    let sum = xxhash_rust::xxh3::xxh3_64(&out);
    out.extend_from_slice(&sum.to_le_bytes());
    Ok(out)
}

/// Rows of `head_dim` as their scales (f16) then their signed bytes.
fn quantize_keys(data: &[f32], head_dim: usize, out: &mut Vec<u8>) {
    let scales: Vec<half::f16> = data
        .chunks_exact(head_dim)
        .map(|row| half::f16::from_f32(row.iter().fold(0f32, |m, x| m.max(x.abs())) / 127.0))
        .collect();
    for s in &scales {
        out.extend_from_slice(&s.to_le_bytes());
    }
    for (row, s) in data.chunks_exact(head_dim).zip(&scales) {
        let s = s.to_f32();
        let inv = if s > 0.0 { 1.0 / s } else { 0.0 };
        out.extend(
            row.iter()
                .map(|x| ((x * inv).round().clamp(-127.0, 127.0) as i8) as u8),
        );
    }
}

/// Rows of `head_dim` in groups (see [`group`]): every group's minimum and step (f16),
/// then the numbers as 4-bit steps above the minimum, the first of a pair in the low half.
fn quantize_values(data: &[f32], head_dim: usize, out: &mut Vec<u8>) {
    let g = group(head_dim);
    let ranges: Vec<(half::f16, half::f16)> = data
        .chunks_exact(g)
        .map(|part| {
            let (lo, hi) = part
                .iter()
                .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &x| {
                    (lo.min(x), hi.max(x))
                });
            let min = half::f16::from_f32(lo);
            // the step from the stored minimum, so the largest number stays within 15 steps
            let step = half::f16::from_f32((hi - min.to_f32()).max(0.0) / 15.0);
            (min, step)
        })
        .collect();
    for (min, step) in &ranges {
        out.extend_from_slice(&min.to_le_bytes());
        out.extend_from_slice(&step.to_le_bytes());
    }
    let mut nibbles = data
        .chunks_exact(g)
        .zip(&ranges)
        .flat_map(|(part, (min, step))| {
            let (min, step) = (min.to_f32(), step.to_f32());
            let inv = if step > 0.0 { 1.0 / step } else { 0.0 };
            part.iter()
                .map(move |x| ((x - min) * inv).round().clamp(0.0, 15.0) as u8)
        });
    while let (Some(a), Some(b)) = (nibbles.next(), nibbles.next()) {
        out.push(a | (b << 4));
    }
}

/// A block back from its file, checked against the key it was asked for.
pub fn decode(bytes: &[u8], context: u64, tokens: &[u32]) -> Result<Block, DiskError> {
    use DiskError::Corrupt;
    if bytes.len() < HEADER + 8 {
        return Err(Corrupt("shorter than a header"));
    }
    let (body, sum) = bytes.split_at(bytes.len() - 8);
    let sum = u64::from_le_bytes(sum.try_into().map_err(|_| Corrupt("checksum"))?);
    if xxhash_rust::xxh3::xxh3_64(body) != sum {
        return Err(Corrupt("checksum mismatch (damaged or truncated)"));
    }
    let u32_at = |at: usize| -> usize {
        u32::from_le_bytes([body[at], body[at + 1], body[at + 2], body[at + 3]]) as usize
    };
    if &body[..8] != MAGIC || u32_at(8) != VERSION as usize {
        return Err(Corrupt("another format or version"));
    }
    let dtype = match u32_at(12) {
        0 => DType::F32,
        1 => DType::F16,
        2 => DType::BF16,
        _ => return Err(Corrupt("unknown dtype")),
    };
    let stored_context =
        u64::from_le_bytes(body[16..24].try_into().map_err(|_| Corrupt("header"))?);
    let (context_len, n, layers, heads, head_dim) =
        (u32_at(24), u32_at(28), u32_at(32), u32_at(36), u32_at(40));
    if stored_context != context || n != tokens.len() || head_dim == 0 {
        return Err(Corrupt("another block's file"));
    }
    if !head_dim.is_multiple_of(2) {
        return Err(Corrupt("an odd head size"));
    }
    // in wide numbers: a header can say anything (the checksum is not a signature)
    let expected = HEADER as u128
        + 4 * n as u128
        + layers as u128 * layer_bytes_wide(heads as u128 * n as u128, head_dim);
    if body.len() as u128 != expected {
        return Err(Corrupt("length does not match the header"));
    }
    let rows = heads * n;
    let stored: Vec<u32> = body[HEADER..HEADER + 4 * n]
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    if stored != tokens {
        return Err(Corrupt("another passage's file"));
    }
    let f16_at = |b: &[u8]| half::f16::from_le_bytes([b[0], b[1]]).to_f32();
    let shape = (1, heads, n, head_dim);
    let g = group(head_dim);
    let mut at = HEADER + 4 * n;
    let mut take = |len: usize| {
        let part = &body[at..at + len];
        at += len;
        part
    };
    let mut next = || -> Result<(Tensor, Tensor), DiskError> {
        let (scales, numbers) = take(rows * (2 + head_dim)).split_at(rows * 2);
        let mut keys = Vec::with_capacity(rows * head_dim);
        for (s, row) in scales.chunks_exact(2).zip(numbers.chunks_exact(head_dim)) {
            let s = f16_at(s);
            keys.extend(row.iter().map(|&q| f32::from(q as i8) * s));
        }
        let groups = rows * head_dim / g;
        let (ranges, packed) = take(groups * 4 + rows * head_dim / 2).split_at(groups * 4);
        let mut values = Vec::with_capacity(rows * head_dim);
        for (r, part) in ranges.chunks_exact(4).zip(packed.chunks_exact(g / 2)) {
            let (min, step) = (f16_at(&r[..2]), f16_at(&r[2..]));
            for &b in part {
                values.push(min + f32::from(b & 15) * step);
                values.push(min + f32::from(b >> 4) * step);
            }
        }
        Ok((
            Tensor::from_vec(keys, shape, &Device::Cpu)?.to_dtype(dtype)?,
            Tensor::from_vec(values, shape, &Device::Cpu)?.to_dtype(dtype)?,
        ))
    };
    let mut kv = Vec::with_capacity(layers);
    for _ in 0..layers {
        kv.push(next()?);
    }
    let mut block = Block::new(&[], tokens.to_vec(), kv);
    block.context = context;
    block.context_len = context_len;
    block.exact = false;
    Ok(block)
}

/// Writes blocks on a thread of its own, so the engine's thread never waits on the disk.
pub struct Writer {
    tx: Mutex<std::sync::mpsc::Sender<Job>>,
}

enum Job {
    Write(Arc<Block>),
    /// Answered once every block sent before it is written.
    Flush(std::sync::mpsc::Sender<()>),
}

impl Writer {
    /// Starts the writer thread over `disk`; a block already on disk is not written again.
    pub fn spawn(disk: Arc<DiskBlocks>) -> Writer {
        let (tx, rx) = std::sync::mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("docent-passage-writer".into())
            .spawn(move || {
                for job in rx {
                    let block = match job {
                        Job::Write(b) => b,
                        Job::Flush(done) => {
                            let _ = done.send(());
                            continue;
                        }
                    };
                    if disk.contains(block.context, &block.tokens) {
                        continue;
                    }
                    if let Err(e) = disk.store(&block) {
                        tracing::warn!(error = %e, dir = %disk.dir().display(), "a passage block was not written to disk");
                    }
                }
            })
            .map(|_| ())
            .unwrap_or_else(|e| tracing::warn!(error = %e, "no passage writer thread"));
        Writer { tx: Mutex::new(tx) }
    }

    /// Queues `block` to be written; returns at once (a failed write is logged).
    pub fn send(&self, block: Arc<Block>) {
        if let Ok(tx) = self.tx.lock() {
            let _ = tx.send(Job::Write(block));
        }
    }

    /// Waits until every block sent so far is written (blocking).
    pub fn flush(&self) {
        let (done, wait) = std::sync::mpsc::channel();
        let sent = self
            .tx
            .lock()
            .map(|tx| tx.send(Job::Flush(done)).is_ok())
            .unwrap_or(false);
        if sent {
            let _ = wait.recv();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(context: &[u32], tokens: Vec<u32>, layers: usize) -> Block {
        let n = tokens.len();
        let kv = (0..layers)
            .map(|l| {
                let data = |off: f32| -> Vec<f32> {
                    (0..2 * n * 8)
                        .map(|i| {
                            ((i as f32 + off) * 0.731 + l as f32).sin() * (1.0 + i as f32 * 0.1)
                        })
                        .collect()
                };
                (
                    Tensor::from_vec(data(0.0), (1, 2, n, 8), &Device::Cpu).unwrap(),
                    Tensor::from_vec(data(0.5), (1, 2, n, 8), &Device::Cpu).unwrap(),
                )
            })
            .collect();
        Block::new(context, tokens, kv)
    }

    #[test]
    fn a_block_comes_back_within_its_rounding() {
        let b = block(&[1, 2, 3], vec![7, 8, 9, 10], 3);
        let bytes = encode(&b).unwrap();
        let back = decode(&bytes, b.context, &b.tokens).unwrap();
        assert_eq!(back.context_len, 3);
        assert_eq!(back.tokens, b.tokens);
        let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for ((k, v), (k2, v2)) in b.layers.iter().zip(back.layers.iter()) {
            // keys: half a step of the row's scale (largest magnitude / 127), the f16
            // scale's own rounding beside it
            for (row_a, row_c) in flat(k).chunks(8).zip(flat(k2).chunks(8)) {
                let max = row_a.iter().fold(0f32, |m, x| m.max(x.abs()));
                for (x, y) in row_a.iter().zip(row_c) {
                    assert!((x - y).abs() <= max / 254.0 * 1.01 + 1e-3 * max, "{x} {y}");
                }
            }
            // values: half a step of the group's range / 15 (the group is the whole row of
            // 8 here), the f16 minimum's rounding beside it
            for (row_a, row_c) in flat(v).chunks(8).zip(flat(v2).chunks(8)) {
                let (lo, hi) = row_a
                    .iter()
                    .fold((f32::MAX, f32::MIN), |(l, h), &x| (l.min(x), h.max(x)));
                let tolerance = (hi - lo) / 30.0 * 1.01 + 2e-3 * lo.abs().max(hi.abs());
                for (x, y) in row_a.iter().zip(row_c) {
                    assert!((x - y).abs() <= tolerance, "{x} {y} ({lo}..{hi})");
                }
            }
        }
        // per layer and row of 8: keys 2 + 8 bytes, values 4 + 4
        assert_eq!(bytes.len(), HEADER + 16 + 3 * (2 * 4) * (10 + 8) + 8);
    }

    /// A block of 2 heads of `head_dim` whose value groups have very different ranges.
    fn wide_block(tokens: Vec<u32>, head_dim: usize) -> Block {
        let n = tokens.len();
        let data = |off: f32| -> Vec<f32> {
            (0..2 * n * head_dim)
                .map(|i| {
                    // the group of 32 along a row sets the magnitude: 0.01 to 100
                    let g = (i % head_dim) / 32;
                    ((i as f32 + off) * 0.37).sin() * 10f32.powi(g as i32 - 2)
                })
                .collect()
        };
        let kv = vec![(
            Tensor::from_vec(data(0.0), (1, 2, n, head_dim), &Device::Cpu).unwrap(),
            Tensor::from_vec(data(0.5), (1, 2, n, head_dim), &Device::Cpu).unwrap(),
        )];
        Block::new(&[4, 2], tokens, kv)
    }

    #[test]
    fn groups_of_32_keep_each_groups_own_range() {
        for head_dim in [64, 128] {
            let b = wide_block(vec![3, 1, 4, 1, 5], head_dim);
            let bytes = encode(&b).unwrap();
            let back = decode(&bytes, b.context, &b.tokens).unwrap();
            let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let (v, v2) = (flat(&b.layers[0].1), flat(&back.layers[0].1));
            for (group, group2) in v.chunks(32).zip(v2.chunks(32)) {
                let (lo, hi) = group
                    .iter()
                    .fold((f32::MAX, f32::MIN), |(l, h), &x| (l.min(x), h.max(x)));
                // half a step of this group's own range (not the row's, whose largest
                // group is 10,000 times wider)
                let tolerance = (hi - lo) / 30.0 * 1.01 + 2e-3 * lo.abs().max(hi.abs());
                for (x, y) in group.iter().zip(group2) {
                    assert!(
                        (x - y).abs() <= tolerance,
                        "{head_dim}: {x} {y} ({lo}..{hi})"
                    );
                }
            }
            let (k, k2) = (flat(&b.layers[0].0), flat(&back.layers[0].0));
            for (row, row2) in k.chunks(head_dim).zip(k2.chunks(head_dim)) {
                let max = row.iter().fold(0f32, |m, x| m.max(x.abs()));
                for (x, y) in row.iter().zip(row2) {
                    assert!((x - y).abs() <= max / 254.0 * 1.01 + 1e-3 * max, "{x} {y}");
                }
            }
        }
    }

    #[test]
    fn a_header_that_lies_about_sizes_is_refused_even_with_a_good_checksum() {
        let b = block(&[1, 2, 3], vec![7, 8, 9], 2);
        let mut bytes = encode(&b).unwrap();
        bytes.truncate(bytes.len() - 8);
        // layers (at 32) and heads (at 36): huge, so that a narrow product would wrap
        for (at, value) in [(32, u32::MAX), (36, u32::MAX), (32, 3)] {
            let mut lying = bytes.clone();
            lying[at..at + 4].copy_from_slice(&value.to_le_bytes());
            let sum = xxhash_rust::xxh3::xxh3_64(&lying);
            lying.extend_from_slice(&sum.to_le_bytes());
            let e = decode(&lying, b.context, &b.tokens).err().expect("refused");
            assert!(e.to_string().contains("length"), "{e}");
        }
    }

    #[test]
    fn numbers_beyond_f16_are_not_written() {
        let mut b = block(&[1], vec![5, 6], 1);
        let (k, v) = b.layers[0].clone();
        let big = (v.clone() * 1e6).unwrap();
        Arc::get_mut(&mut b.layers).unwrap()[0] = (k, big);
        assert!(encode(&b).is_err());
    }

    #[test]
    fn values_are_grouped_by_32_along_a_row() {
        assert_eq!(group(128), 32);
        assert_eq!(group(64), 32);
        assert_eq!(group(8), 8);
        // the 1.5B (28 layers, 2 KV heads of 128) and the 0.5B (24, 2 of 64), a token
        assert_eq!(28 * layer_bytes(2, 128), 28 * (2 * 130 + 2 * (4 * 4 + 64)));
        assert_eq!(28 * layer_bytes(2, 128), 11_760);
        assert_eq!(24 * layer_bytes(2, 64), 5_088);
    }

    #[test]
    fn damaged_truncated_or_foreign_files_are_refused() {
        let b = block(&[1, 2, 3], vec![7, 8, 9], 2);
        let bytes = encode(&b).unwrap();
        let mut flipped = bytes.clone();
        flipped[HEADER + 20] ^= 0x40;
        assert!(decode(&flipped, b.context, &b.tokens).is_err());
        assert!(decode(&bytes[..bytes.len() - 9], b.context, &b.tokens).is_err());
        assert!(decode(&bytes[..10], b.context, &b.tokens).is_err());
        assert!(decode(&bytes, b.context ^ 1, &b.tokens).is_err());
        assert!(decode(&bytes, b.context, &[7, 8, 10]).is_err());
        assert!(decode(&bytes, b.context, &b.tokens).is_ok());
    }

    #[test]
    fn the_folder_stays_within_its_bound_and_deletes_damaged_files() {
        let dir = tempfile::tempdir().unwrap();
        let one = encode(&block(&[1], vec![5, 6], 1)).unwrap().len() as u64;
        let disk = DiskBlocks::open(dir.path(), 2 * one + one / 2).unwrap();
        let (a, b, c) = (
            block(&[1], vec![5, 6], 1),
            block(&[1], vec![5, 7], 1),
            block(&[1], vec![5, 8], 1),
        );
        disk.store(&a).unwrap();
        disk.store(&b).unwrap();
        assert!(disk.load(a.context, &a.tokens).is_some()); // a is now the most recent
        disk.store(&c).unwrap(); // evicts b
        assert!(disk.load(b.context, &b.tokens).is_none());
        assert_eq!(disk.stats().files, 2);
        assert!(disk.stats().bytes <= 2 * one + one / 2);
        // a restart finds them, and leftovers of an interrupted write are removed
        std::fs::write(dir.path().join("x.kv.1.tmp"), b"half").unwrap();
        drop(disk);
        let disk = DiskBlocks::open(dir.path(), 10 * one).unwrap();
        assert_eq!(disk.stats().files, 2);
        assert!(!dir.path().join("x.kv.1.tmp").exists());
        // a truncated file is deleted, counted, and not served
        let name = DiskBlocks::name(c.context, &c.tokens);
        let path = dir.path().join(&name);
        let len = std::fs::metadata(&path).unwrap().len();
        std::fs::File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(len - 3)
            .unwrap();
        assert!(disk.load(c.context, &c.tokens).is_none());
        assert!(!path.exists());
        assert_eq!(disk.stats().corrupt, 1);
        assert_eq!(disk.stats().files, 1);
        assert!(disk.load(a.context, &a.tokens).is_some());
    }
}
