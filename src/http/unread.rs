//! Saying so when a request's body is left unread.
//!
//! A handler may answer before it reads its request's body: a refusal
//! decided by the headers (no token, a declared length over the limit) or a
//! body cut off at its limit. HTTP/1.1 carries the next request after the
//! body, so the server cannot read that request without reading the rest of
//! the body first: hyper reads what already arrived and, when the body has
//! not ended, closes the connection after the answer — without saying so. A
//! client that pooled the connection sends its next request into a socket
//! being closed and gets no answer. [`close_if_unread`] says so: an
//! HTTP/1.x answer given while the request's body was not read to its end
//! carries `Connection: close`, and the client opens a new connection.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::Request;
use axum::http::{header, HeaderValue, Version};
use axum::middleware::Next;
use axum::response::Response;
use http_body::{Frame, SizeHint};

/// Middleware: `Connection: close` on an HTTP/1.x answer whose request
/// body was not read to its end.
pub async fn close_if_unread(req: Request, next: Next) -> Response {
    if req.version() >= Version::HTTP_2 || req.body().is_end_stream() {
        return next.run(req).await;
    }
    let ended = Arc::new(AtomicBool::new(false));
    let watched = ended.clone();
    let req = req.map(|inner| {
        Body::new(Watched {
            inner,
            ended: watched,
        })
    });
    let mut resp = next.run(req).await;
    if !ended.load(Ordering::Acquire) {
        resp.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }
    resp
}

/// A request body that records reaching its end.
struct Watched {
    inner: Body,
    ended: Arc<AtomicBool>,
}

impl HttpBody for Watched {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(polled, Poll::Ready(None)) || self.inner.is_end_stream() {
            self.ended.store(true, Ordering::Release);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
