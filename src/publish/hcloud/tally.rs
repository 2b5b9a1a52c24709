//! How much of the image the bytes sent to the rescue system stand for: the
//! stream is compressed, so a count of bytes on the wire says little about
//! how far through the image a transfer is.

use std::collections::VecDeque;
use std::io::Read;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Counts the bytes read through it into a shared counter (the image side,
/// beneath the compressor).
pub(super) struct Tally<R> {
    inner: R,
    count: Arc<AtomicU64>,
}

impl<R> Tally<R> {
    pub(super) fn new(inner: R, count: Arc<AtomicU64>) -> Self {
        Tally { inner, count }
    }
}

impl<R: Read> Read for Tally<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.count.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

/// Marks for a compressed stream, oldest first: after each read, how many
/// compressed bytes were out and how many image bytes the compressor had
/// consumed by then.
type Queue = Arc<Mutex<VecDeque<(u64, u64)>>>;

/// The compressor's output side: records a mark per read. The marks follow
/// the data through the sender's queue, so [`Marks::sent`] can say which
/// part of the image the compressed bytes that left stand for.
pub(super) struct Marked<R> {
    pub(super) inner: R,
    image: Arc<AtomicU64>,
    out: u64,
    marks: Queue,
}

impl<R: Read> Read for Marked<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.out += n as u64;
        let image = self.image.load(Ordering::Relaxed);
        self.marks.lock().unwrap().push_back((self.out, image));
        Ok(n)
    }
}

/// The sending side: turns "n more compressed bytes left" into "this much
/// of the image has left".
pub(super) struct Marks {
    marks: Queue,
    sent: u64,
    image: u64,
}

/// A compressor's output wrapped for marking, and the reader of its marks.
/// `image` is the counter a [`Tally`] beneath the compressor keeps.
pub(super) fn marked<R>(inner: R, image: Arc<AtomicU64>) -> (Marked<R>, Marks) {
    let marks = Queue::default();
    (
        Marked {
            inner,
            image,
            out: 0,
            marks: marks.clone(),
        },
        Marks {
            marks,
            sent: 0,
            image: 0,
        },
    )
}

impl Marks {
    /// `n` more compressed bytes left; returns (image bytes they cover,
    /// compressed bytes sent in all).
    pub(super) fn sent(&mut self, n: u64) -> (u64, u64) {
        self.sent += n;
        let mut marks = self.marks.lock().unwrap();
        while let Some(&(out, image)) = marks.front() {
            if out > self.sent {
                break;
            }
            self.image = image;
            marks.pop_front();
        }
        (self.image, self.sent)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Zeros compress to almost nothing: the image position must follow the
    /// compressed bytes sent, reaching the whole image only at the end.
    #[test]
    fn marks_map_sent_bytes_to_the_image_behind_them() {
        let data: Vec<u8> = (0..(4u32 << 20))
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        let count = Arc::new(AtomicU64::new(0));
        let tally = Tally::new(std::io::Cursor::new(data.clone()), count.clone());
        let encoder = zstd::stream::read::Encoder::new(tally, 1).unwrap();
        let (mut reader, mut marks) = marked(encoder, count);
        let mut compressed = Vec::new();
        let mut seen = Vec::new();
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let n = reader.read(&mut buf).unwrap();
            if n == 0 {
                break;
            }
            compressed.extend_from_slice(&buf[..n]);
            seen.push(marks.sent(n as u64));
        }
        let (image, sent) = *seen.last().unwrap();
        assert_eq!(sent, compressed.len() as u64);
        assert_eq!(image, data.len() as u64);
        assert!(seen.windows(2).all(|w| w[0].0 <= w[1].0), "{seen:?}");
        assert!(
            seen[0].0 < image,
            "the first chunk cannot cover the whole image: {seen:?}"
        );
        assert_eq!(zstd::decode_all(&compressed[..]).unwrap(), data);
    }
}
