//! The rendezvous wire format: frames `[kind u8][len u32 LE][payload]` on the group's TCP
//! connections, their kinds, and the connections' timeouts.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

pub(super) const MAGIC: &[u8; 8] = b"GDP-RDV1";
pub(super) const HELLO: u8 = 1;
pub(super) const WELCOME: u8 = 2;
pub(super) const REJECT: u8 = 3;
pub(super) const ABORT: u8 = 4;
pub(super) const BYE: u8 = 5;
/// Largest payload accepted (the blob and abort reasons are small; anything bigger is not us).
const MAX_PAYLOAD: usize = 1 << 20;
/// How long rank 0 waits for a fresh connection to introduce itself (short in unit tests, which
/// check that it does not outlive the handshake).
pub(super) const HELLO_TIMEOUT: Duration = if cfg!(test) {
    Duration::from_millis(200)
} else {
    Duration::from_secs(5)
};
/// How long a write on the health channel may block.
const WRITE_TIMEOUT: Duration = Duration::from_secs(2);

pub(super) fn write_frame(w: &mut impl Write, kind: u8, payload: &[u8]) -> io::Result<()> {
    let mut buf = Vec::with_capacity(5 + payload.len());
    buf.push(kind);
    buf.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    buf.extend_from_slice(payload);
    w.write_all(&buf)?;
    w.flush()
}

pub(super) fn read_frame(r: &mut impl Read) -> io::Result<(u8, Vec<u8>)> {
    let mut head = [0u8; 5];
    r.read_exact(&mut head)?;
    let len = u32::from_le_bytes([head[1], head[2], head[3], head[4]]) as usize;
    if len > MAX_PAYLOAD {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {len} bytes (not a gdp rendezvous peer?)"),
        ));
    }
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload)?;
    Ok((head[0], payload))
}

pub(super) fn u32_at(p: &[u8], at: usize) -> Option<u32> {
    p.get(at..at + 4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// A blocking read half and a write half (with a write timeout) of one connection.
pub(super) fn split(s: TcpStream) -> io::Result<(TcpStream, TcpStream)> {
    s.set_nodelay(true)?;
    let writer = s.try_clone()?;
    writer.set_write_timeout(Some(WRITE_TIMEOUT))?;
    Ok((s, writer))
}
