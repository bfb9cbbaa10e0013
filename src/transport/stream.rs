//! A connection's two halves, over plain TCP or TLS.
//!
//! An enum rather than a boxed trait object: the plain-TCP path (the default) costs one
//! branch per poll, and no allocation or dynamic call; TLS is the one other variant.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

/// The TLS stream, client or server side (one type, so each half has one TLS variant).
#[cfg(feature = "tls")]
pub(crate) type Tls = tokio_rustls::TlsStream<TcpStream>;

/// The read half of a connection.
pub(crate) enum ReadHalf {
    Tcp(OwnedReadHalf),
    #[cfg(feature = "tls")]
    Tls(tokio::io::ReadHalf<Tls>),
}

/// The write half of a connection.
pub(crate) enum WriteHalf {
    Tcp(OwnedWriteHalf),
    #[cfg(feature = "tls")]
    Tls(tokio::io::WriteHalf<Tls>),
}

/// Split a plain TCP connection (no lock between the halves).
pub(crate) fn split_tcp(stream: TcpStream) -> (ReadHalf, WriteHalf) {
    let (rd, wr) = stream.into_split();
    (ReadHalf::Tcp(rd), WriteHalf::Tcp(wr))
}

/// Split a TLS connection. The halves share the TLS session behind tokio's split lock, which
/// is held only for the duration of one poll.
#[cfg(feature = "tls")]
pub(crate) fn split_tls(stream: Tls) -> (ReadHalf, WriteHalf) {
    let (rd, wr) = tokio::io::split(stream);
    (ReadHalf::Tls(rd), WriteHalf::Tls(wr))
}

impl AsyncRead for ReadHalf {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ReadHalf::Tcp(rd) => Pin::new(rd).poll_read(cx, buf),
            #[cfg(feature = "tls")]
            ReadHalf::Tls(rd) => Pin::new(rd).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for WriteHalf {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            WriteHalf::Tcp(wr) => Pin::new(wr).poll_write(cx, buf),
            #[cfg(feature = "tls")]
            WriteHalf::Tls(wr) => Pin::new(wr).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            WriteHalf::Tcp(wr) => Pin::new(wr).poll_write_vectored(cx, bufs),
            #[cfg(feature = "tls")]
            WriteHalf::Tls(wr) => Pin::new(wr).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            WriteHalf::Tcp(wr) => wr.is_write_vectored(),
            #[cfg(feature = "tls")]
            WriteHalf::Tls(wr) => wr.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            WriteHalf::Tcp(wr) => Pin::new(wr).poll_flush(cx),
            #[cfg(feature = "tls")]
            WriteHalf::Tls(wr) => Pin::new(wr).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            WriteHalf::Tcp(wr) => Pin::new(wr).poll_shutdown(cx),
            #[cfg(feature = "tls")]
            WriteHalf::Tls(wr) => Pin::new(wr).poll_shutdown(cx),
        }
    }
}
