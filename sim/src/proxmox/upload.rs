//! pveproxy's streaming multipart parser for `POST …/storage/{storage}/upload`,
//! reproduced phase by phase from pve-http-server src/PVE/APIServer/AnyEvent.pm
//! (`file_upload_multipart`, `parse_content_type` and the upload branch of
//! `authenticate_and_handle_request`), with its regular expressions, so that
//! what pveproxy refuses or mangles is refused or mangled here:
//! - the boundary is taken verbatim from `boundary=…`: a quoted boundary
//!   keeps its quotes and never matches, so the body ends in "upload failed";
//! - the fields are looked for in exactly the order `content`,
//!   `checksum-algorithm`, `checksum`, each only at the head of the buffer;
//!   for a field out of order the lazy `(.*?)` of the disposition spans the
//!   parts before it, and the `form-data` check refuses the upload;
//! - then the file part, whose headers must start with `Content-Disposition`
//!   and whose name must be `filename`;
//! - file data is everything up to the close delimiter (minus one newline).
//!   Headers of the file part that have not fully arrived when it is found
//!   end up in the file, as in pveproxy (its reads are large enough that
//!   this does not happen in practice; neither does it here).
//!
//! Divergence, to keep the simulator's memory bounded: a buffer that grows
//! past [`MAX_HEADER_BUFFER`] before the file part is found fails the upload.

use std::collections::BTreeMap;
use std::io::Write;

use regex::bytes::Regex;

/// Bytes buffered while looking for the form fields and the file part.
pub const MAX_HEADER_BUFFER: usize = 16 << 20;

/// Where the parser stands (pveproxy's `phase` 0, 1, 2, 100).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Preamble,
    Fields,
    File,
    Done,
}

/// One upload's parser state.
pub struct Multipart {
    phase: Phase,
    rbuf: Vec<u8>,
    /// Bytes consumed from the buffer so far (`$rstate->{read}`).
    read: u64,
    size: u64,
    boundlen: usize,
    delim: Regex,
    fields: [Regex; 3],
    file_part: Regex,
    until_data: Regex,
    value: Regex,
    close: Vec<u8>,
    /// Query parameters, then each form field found (`$rstate->{params}`).
    pub params: BTreeMap<String, String>,
    /// File bytes written.
    pub bytes: u64,
}

/// `parse_content_type`: the media type and the boundary, taken verbatim.
pub fn parse_content_type(ctype: &str) -> (String, Option<String>) {
    let split = Regex::new(r"\s*[;,]\s*").expect("static regex");
    let bound = Regex::new(r"^\s*boundary\s*=\s*(\S+?)\s*$").expect("static regex");
    let mut parts = split.split(ctype.as_bytes());
    let ct = String::from_utf8_lossy(parts.next().unwrap_or_default()).into_owned();
    for p in parts {
        if let Some(c) = bound.captures(p) {
            return (ct, Some(String::from_utf8_lossy(&c[1]).into_owned()));
        }
    }
    (ct, None)
}

impl Multipart {
    /// A parser for a body of `size` bytes (the Content-Length).
    pub fn new(boundary: &str, size: u64, params: BTreeMap<String, String>) -> Multipart {
        let b = regex::escape(boundary);
        let nl = r"\r?\n";
        let delim = format!("--{b}{nl}");
        let re = |p: &str| Regex::new(p).expect("pattern built from an escaped boundary");
        let field = |name: &str| {
            re(&format!(
                r#"(?s-u)^{delim}.*?Content-Disposition: (.*?); name="{name}"(.*?{delim})"#
            ))
        };
        Multipart {
            phase: Phase::Preamble,
            rbuf: Vec::new(),
            read: 0,
            size,
            boundlen: boundary.len() + 8,
            delim: re(&format!("(?s-u)^.*?({delim})")),
            fields: [
                field("content"),
                field("checksum-algorithm"),
                field("checksum"),
            ],
            file_part: re(&format!(
                r#"(?s-u)^{delim}Content-Disposition: (.*?); name="(.*?)"; filename="([^"]+)""#
            )),
            until_data: re(&format!("(?s-u)^.*?(?:{nl}){{2}}")),
            value: re(&format!("(?s-u)^(.*?)({delim})")),
            close: format!("--{boundary}--").into_bytes(),
            params,
            bytes: 0,
        }
    }

    /// Whether the close delimiter was seen (pveproxy then runs the API call).
    pub fn done(&self) -> bool {
        self.phase == Phase::Done
    }

    /// One `on_read` callback: `data` arrived; file data goes to `out`.
    /// An error is what pveproxy answers with 500.
    pub fn feed(&mut self, data: &[u8], out: &mut impl Write) -> Result<(), String> {
        self.rbuf.extend_from_slice(data);
        let startlen = self.rbuf.len();
        if self.phase == Phase::Preamble
            && let Some(c) = self.delim.captures(&self.rbuf)
        {
            let cut = c.get(1).expect("group").start();
            self.rbuf.drain(..cut);
            self.phase = Phase::Fields;
        }
        if self.phase == Phase::Fields {
            for (i, name) in ["content", "checksum-algorithm", "checksum"]
                .iter()
                .enumerate()
            {
                self.extract_field(i, name)?;
            }
            if let Some(c) = self.file_part.captures(&self.rbuf) {
                assert_form_disposition(&c[1])?;
                if &c[2] != b"filename" {
                    return Err(format!(
                        "wrong field name '{}' for file upload, expected 'filename'",
                        String::from_utf8_lossy(&c[2])
                    ));
                }
                let name = String::from_utf8_lossy(&c[3]).trim().to_owned();
                let end = c.get(0).expect("match").end();
                self.params.insert("filename".into(), name);
                self.rbuf.drain(..end);
                self.phase = Phase::File;
                self.remove_until_data();
            }
        }
        if self.phase != Phase::File
            && self.phase != Phase::Done
            && self.rbuf.len() > MAX_HEADER_BUFFER
        {
            return Err("upload failed".into());
        }
        if self.phase == Phase::File {
            let write = match memchr::memmem::find(&self.rbuf, &self.close) {
                Some(at) => {
                    let mut data_end = at;
                    if self.rbuf[..data_end].ends_with(b"\n") {
                        data_end -= 1;
                        if self.rbuf[..data_end].ends_with(b"\r") {
                            data_end -= 1;
                        }
                    }
                    out.write_all(&self.rbuf[..data_end])
                        .map_err(|e| format!("write to temporary file failed - {e}"))?;
                    self.bytes += data_end as u64;
                    self.rbuf.clear();
                    self.phase = Phase::Done;
                    0
                }
                None => self.rbuf.len().saturating_sub(self.boundlen),
            };
            if write > 0 {
                out.write_all(&self.rbuf[..write])
                    .map_err(|e| format!("write to temporary file failed - {e}"))?;
                self.bytes += write as u64;
                self.rbuf.drain(..write);
            }
        }
        self.read += (startlen - self.rbuf.len()) as u64;
        if self.read + self.rbuf.len() as u64 >= self.size && self.phase != Phase::Done {
            return Err("upload failed".into());
        }
        Ok(())
    }

    /// `$extract_form_disposition`: a field at the head of the buffer.
    fn extract_field(&mut self, i: usize, name: &str) -> Result<(), String> {
        let Some(c) = self.fields[i].captures(&self.rbuf) else {
            return Ok(());
        };
        assert_form_disposition(&c[1])?;
        let (whole, rest) = (c.get(0).expect("match"), c.get(2).expect("group"));
        let rest = rest.start()..whole.end();
        // s/^…(rest)/$1/: keep only the tail the pattern captured.
        self.rbuf.splice(..whole.end(), self.rbuf[rest].to_vec());
        self.remove_until_data();
        if let Some(c) = self.value.captures(&self.rbuf) {
            let v = String::from_utf8_lossy(&c[1]).trim().to_owned();
            let cut = c.get(2).expect("group").start();
            self.rbuf.drain(..cut);
            self.params.insert(name.to_owned(), v);
        }
        Ok(())
    }

    fn remove_until_data(&mut self) {
        if let Some(m) = self.until_data.find(&self.rbuf) {
            self.rbuf.drain(..m.end());
        }
    }
}

fn assert_form_disposition(d: &[u8]) -> Result<(), String> {
    if d == b"form-data" {
        Ok(())
    } else {
        Err(format!(
            "wrong Content-Disposition '{}' in multipart, expected 'form-data'",
            String::from_utf8_lossy(d)
        ))
    }
}

/// `PVE::Storage::normalize_content_filename`: the part after the last `/`
/// or `\`, every character outside `[a-zA-Z0-9_.-]` turned into `_`.
pub fn normalize_filename(name: &str) -> String {
    let name = name.strip_suffix('\n').unwrap_or(name);
    let base = name.rsplit(['/', '\\']).next().unwrap_or_default();
    base.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "_.-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const B: &str = "------------------------abc123";

    fn part(name: &str, value: &str) -> String {
        format!("--{B}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n")
    }

    fn file(name: &str, data: &str) -> String {
        format!(
            "--{B}\r\nContent-Disposition: form-data; name=\"{name}\"; filename=\"a b.raw\"\r\n\
             Content-Type: application/octet-stream\r\n\r\n{data}\r\n--{B}--\r\n"
        )
    }

    /// Feeds `body` in chunks of `chunk` bytes; the file bytes and params.
    fn parse(
        boundary: &str,
        body: &str,
        chunk: usize,
    ) -> Result<(Vec<u8>, BTreeMap<String, String>), String> {
        let mut p = Multipart::new(boundary, body.len() as u64, BTreeMap::new());
        let mut out = Vec::new();
        for c in body.as_bytes().chunks(chunk) {
            p.feed(c, &mut out)?;
            if p.done() {
                break;
            }
        }
        assert!(p.done());
        Ok((out, p.params))
    }

    fn good() -> String {
        [
            part("content", "import"),
            part("checksum-algorithm", "sha256"),
            part("checksum", "ABCD"),
            file("filename", "DATA\r\n--not-the-boundary\r\nMORE"),
        ]
        .concat()
    }

    #[test]
    fn fields_in_order_then_the_file_are_read() {
        for chunk in [256, 4096, 1 << 20] {
            let (data, params) = parse(B, &good(), chunk).unwrap();
            assert_eq!(data, b"DATA\r\n--not-the-boundary\r\nMORE", "chunk {chunk}");
            assert_eq!(params["content"], "import");
            assert_eq!(params["checksum-algorithm"], "sha256");
            assert_eq!(params["checksum"], "ABCD");
            assert_eq!(params["filename"], "a b.raw");
        }
    }

    #[test]
    fn a_field_out_of_order_is_refused() {
        let body = [
            part("checksum", "ABCD"),
            part("content", "import"),
            part("checksum-algorithm", "sha256"),
            file("filename", "DATA"),
        ]
        .concat();
        let err = parse(B, &body, 1 << 20).unwrap_err();
        assert!(
            err.starts_with("wrong Content-Disposition 'form-data; name=\"checksum\""),
            "{err}"
        );
        assert!(
            err.ends_with("' in multipart, expected 'form-data'"),
            "{err}"
        );
    }

    #[test]
    fn a_file_part_named_file_is_refused() {
        let body = [part("content", "import"), file("file", "DATA")].concat();
        assert_eq!(
            parse(B, &body, 1 << 20).unwrap_err(),
            "wrong field name 'file' for file upload, expected 'filename'"
        );
    }

    #[test]
    fn a_quoted_boundary_never_matches() {
        let (ct, boundary) = parse_content_type(&format!("multipart/form-data; boundary=\"{B}\""));
        assert_eq!(ct, "multipart/form-data");
        let boundary = boundary.unwrap();
        assert_eq!(boundary, format!("\"{B}\""));
        let mut p = Multipart::new(&boundary, good().len() as u64, BTreeMap::new());
        assert_eq!(
            p.feed(good().as_bytes(), &mut Vec::new()).unwrap_err(),
            "upload failed"
        );
    }

    #[test]
    fn a_body_shorter_than_announced_is_not_done() {
        let body = good();
        let mut p = Multipart::new(B, body.len() as u64 + 100, BTreeMap::new());
        p.feed(&body.as_bytes()[..body.len() - 20], &mut Vec::new())
            .unwrap();
        assert!(!p.done());
    }

    #[test]
    fn file_names_are_normalised() {
        assert_eq!(
            normalize_filename("../x/talos v1.11+ä.raw"),
            "talos_v1.11__.raw"
        );
        assert_eq!(normalize_filename("C:\\a\\b.qcow2"), "b.qcow2");
        assert_eq!(
            normalize_filename("cp-01_v1.11.2-abc.raw"),
            "cp-01_v1.11.2-abc.raw"
        );
    }
}
