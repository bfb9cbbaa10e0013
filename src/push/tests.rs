//! Tests of the dispatchers, a module per topic.

mod avoid;
mod block_size;
mod booking;
mod handoff;
mod kv_admission;
mod kv_feed;
mod link;
mod reported;
mod retry;
mod select_on;
mod sessions;
mod warm;
