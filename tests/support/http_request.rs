//! Reading one HTTP/1.1 request off a keep-alive connection, for the stub engines of the engine
//! tests (`tests/engine_link.rs`, `tools/tests/engines_serve.rs`).

use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

/// The next request on `socket`: its head (lower-cased) and its body (by `Content-Length`).
/// `buffer` keeps what was read past it; `None` once the connection ends.
pub async fn next_request(
    socket: &mut TcpStream,
    buffer: &mut Vec<u8>,
) -> Option<(String, String)> {
    let head_end = loop {
        if let Some(i) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        read_more(socket, buffer).await?;
    };
    let head = String::from_utf8_lossy(&buffer[..head_end]).to_lowercase();
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    while buffer.len() < head_end + length {
        read_more(socket, buffer).await?;
    }
    let body = String::from_utf8_lossy(&buffer[head_end..head_end + length]).into_owned();
    buffer.drain(..head_end + length);
    Some((head, body))
}

async fn read_more(socket: &mut TcpStream, buffer: &mut Vec<u8>) -> Option<()> {
    let mut chunk = [0u8; 4096];
    match socket.read(&mut chunk).await {
        Ok(0) | Err(_) => None,
        Ok(n) => {
            buffer.extend_from_slice(&chunk[..n]);
            Some(())
        }
    }
}
