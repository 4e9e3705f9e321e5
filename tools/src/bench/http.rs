//! The load generator's HTTP client: blocking HTTP/1.1 over one keep-alive connection per
//! client thread, JSON bodies, responses framed by `Content-Length` (what both actix-web
//! and uvicorn send for JSON). It drives docent and the peer alike, so its own cost (a few
//! microseconds a request, no async runtime between the clock and the socket) weighs the
//! same on both sides.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

pub struct Connection {
    reader: BufReader<TcpStream>,
    host: String,
}

fn bad(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg)
}

impl Connection {
    pub fn open(addr: SocketAddr) -> io::Result<Self> {
        let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(Duration::from_secs(120)))?;
        Ok(Connection {
            reader: BufReader::new(stream),
            host: addr.to_string(),
        })
    }

    /// Sends one JSON request and reads the whole response: (status, body).
    pub fn request(&mut self, method: &str, path: &str, body: &[u8]) -> io::Result<(u16, Vec<u8>)> {
        self.send(method, path, "application/json", None, body)
    }

    /// Sends one request with this content type and, when given, `Authorization: Bearer
    /// key`; reads the whole response: (status, body).
    pub fn send(
        &mut self,
        method: &str,
        path: &str,
        content_type: &str,
        key: Option<&str>,
        body: &[u8],
    ) -> io::Result<(u16, Vec<u8>)> {
        let auth = key.map_or(String::new(), |k| format!("Authorization: Bearer {k}\r\n"));
        let mut request = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\n{auth}Content-Type: {content_type}\r\nContent-Length: {}\r\n\r\n",
            self.host,
            body.len()
        )
        .into_bytes();
        request.extend_from_slice(body);
        self.reader.get_mut().write_all(&request)?;
        let mut line = String::new();
        self.reader.read_line(&mut line)?;
        let status = line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse::<u16>().ok())
            .ok_or_else(|| bad(format!("bad status line {line:?}")))?;
        let mut length = None;
        loop {
            line.clear();
            if self.reader.read_line(&mut line)? == 0 {
                return Err(bad("connection closed in the headers".into()));
            }
            let header = line.trim_end();
            if header.is_empty() {
                break;
            }
            if let Some((name, value)) = header.split_once(':') {
                let name = name.trim();
                if name.eq_ignore_ascii_case("content-length") {
                    length = value.trim().parse::<usize>().ok();
                } else if name.eq_ignore_ascii_case("transfer-encoding") {
                    return Err(bad(format!("unsupported transfer encoding {value:?}")));
                }
            }
        }
        let length = length.ok_or_else(|| bad("response without Content-Length".into()))?;
        let mut body = vec![0; length];
        self.reader.read_exact(&mut body)?;
        Ok((status, body))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    #[test]
    fn reads_keep_alive_responses_by_content_length() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut seen = Vec::new();
            let mut buf = [0u8; 4096];
            // two requests on one connection, answered in turn
            for (reply, end) in [("hello", "\r\n\r\n{}"), ("{\"a\":1}", "\r\n\r\n")] {
                let mut got = String::new();
                while !got.ends_with(end) {
                    let n = s.read(&mut buf).unwrap();
                    assert!(n > 0, "client closed early: {got:?}");
                    got.push_str(&String::from_utf8_lossy(&buf[..n]));
                }
                seen.push(got);
                let r = format!(
                    "HTTP/1.1 201 Created\r\ncontent-length: {}\r\n\r\n{reply}",
                    reply.len()
                );
                s.write_all(r.as_bytes()).unwrap();
            }
            seen
        });
        let mut c = Connection::open(addr).unwrap();
        assert_eq!(
            c.request("POST", "/x", b"{}").unwrap(),
            (201, b"hello".to_vec())
        );
        assert_eq!(
            c.request("GET", "/y", b"").unwrap(),
            (201, b"{\"a\":1}".to_vec())
        );
        let seen = server.join().unwrap();
        assert!(seen[0].starts_with("POST /x HTTP/1.1\r\n"), "{}", seen[0]);
        assert!(
            seen[0].ends_with("Content-Length: 2\r\n\r\n{}"),
            "{}",
            seen[0]
        );
        assert!(seen[1].starts_with("GET /y HTTP/1.1\r\n"), "{}", seen[1]);
    }
}
