//! A fake engine's HTTP side for the engine tests (`tests/engine_events.rs`,
//! `tests/engine_load.rs`): on loopback, every request of every keep-alive connection answered
//! by the test's route.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;

#[path = "http_request.rs"]
mod http_request;

/// Serve on a free loopback port until the runtime ends; `route` maps a request's head
/// (lower-cased, e.g. `get /metrics http/1.1 ...`) to its status (`"200 OK"`) and JSON or text
/// body. The port.
pub async fn serve<F>(route: F) -> SocketAddr
where
    F: Fn(&str) -> (&'static str, String) + Send + Sync + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let route = Arc::new(route);
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let route = Arc::clone(&route);
            tokio::spawn(async move {
                let mut buffer = Vec::new();
                while let Some((head, _)) =
                    http_request::next_request(&mut socket, &mut buffer).await
                {
                    let (status, body) = route(&head);
                    let answer = format!(
                        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    if socket.write_all(answer.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}
