//! Tests of the dispatchers, a module per topic.

mod booking;
mod kv_feed;
mod link;
mod retry;
mod select_on;
mod warm;
