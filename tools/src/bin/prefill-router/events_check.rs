//! `serve --check-events`: before serve listens, confirm that every prefill engine publishes KV
//! events the router can index: its feed subscribed and its history replayed, and the block
//! size of its stored blocks equal to its card's. An engine whose history holds no stored block
//! yet is sent one probe prompt (two blocks of fresh tokens, `max_tokens` 1) so that it stores
//! some. A KV router over engines whose events do not reach it is load balancing that looks
//! like KV routing: this turns that into a refusal to start.

use std::time::Duration;

use prefill_router::discovery::InstanceId;
use prefill_router::engine::{EngineKvStatus, FeedState};
use prefill_router::kv_events::{MirrorError, Picture};
use prefill_router::PrefillHop;
use prefill_router_tools::engines::{http_post_json, served_model, EngineUrl};
use tokio::time::Instant;

/// How often the check looks at the engines' feeds.
const POLL: Duration = Duration::from_millis(50);

/// Check each `(id, engine)` within `timeout` (for all of them together); one JSON line per
/// engine on stdout, or the first engine's reason.
pub async fn check(
    hop: &PrefillHop,
    engines: &[(InstanceId, EngineUrl)],
    timeout: Duration,
) -> Result<(), String> {
    let until = Instant::now() + timeout;
    for (id, engine) in engines {
        let status = check_one(hop, *id, engine, until)
            .await
            .map_err(|reason| format!("--check-events: engine {}: {reason}", engine.url))?;
        println!(
            "{}",
            serde_json::json!({
                "event": "events_checked",
                "engine": engine.url,
                "block_size": status.engine_block_size,
                "picture": format!("{:?}", status.picture).to_lowercase(),
                "history_batches": status.counts.batches,
            })
        );
    }
    Ok(())
}

/// Wait (until `until`) for `what` of `id`'s status; the status that satisfied it.
async fn wait_for(
    hop: &PrefillHop,
    id: InstanceId,
    until: Instant,
    what: &str,
    mut done: impl FnMut(&EngineKvStatus) -> Result<bool, String>,
) -> Result<EngineKvStatus, String> {
    loop {
        if let Some(status) = hop.binding_stats().engine_kv.status(id) {
            if done(&status)? {
                return Ok(status);
            }
        }
        if Instant::now() >= until {
            let now = hop.binding_stats().engine_kv.status(id);
            let said = now
                .as_ref()
                .and_then(EngineKvStatus::warning)
                .unwrap_or_else(|| "no KV event feed (is --router-mode kv given?)".to_owned());
            return Err(format!("{what} not reached in time: {said}"));
        }
        tokio::time::sleep(POLL).await;
    }
}

/// A wrong block size is the one failure no wait cures.
fn mismatch(status: &EngineKvStatus) -> Result<(), String> {
    match &status.last_error {
        Some(e @ MirrorError::BlockSizeMismatch { .. }) => Err(e.to_string()),
        _ => Ok(()),
    }
}

async fn check_one(
    hop: &PrefillHop,
    id: InstanceId,
    engine: &EngineUrl,
    until: Instant,
) -> Result<EngineKvStatus, String> {
    let status = wait_for(hop, id, until, "its history replayed", |s| {
        mismatch(s)?;
        match &s.state {
            FeedState::NoSources(reason) => Err(format!("no KV events: {reason}")),
            FeedState::Subscribed => Ok(s.picture != Picture::Unknown),
            FeedState::Starting => Ok(false),
        }
    })
    .await?;
    if status.engine_block_size.is_some() {
        return Ok(status);
    }
    // An empty history says nothing of the block size: make the engine store two blocks.
    let left = until.saturating_duration_since(Instant::now());
    let model = served_model(engine, left)
        .await
        .map_err(|e| format!("its model: {e}"))?;
    let salt = std::process::id().wrapping_mul(7919) ^ now_nanos();
    // Ids from 4 up (below are the usual special tokens), fresh per start: a cached prompt
    // would store nothing.
    let prompt: Vec<u32> = (0..512u32)
        .map(|i| 4 + (salt.wrapping_add(i.wrapping_mul(2_654_435_761)) >> 7) % 1000)
        .collect();
    let body = serde_json::json!({"model": model, "prompt": prompt, "max_tokens": 1});
    match http_post_json(engine.addr, "/v1/completions", &body, left).await {
        Ok((200, _)) => {}
        Ok((status, answer)) => {
            let answer = String::from_utf8_lossy(&answer);
            let answer: String = answer.chars().take(200).collect();
            return Err(format!("the probe prompt was answered {status}: {answer}"));
        }
        Err(e) => return Err(format!("the probe prompt: {e}")),
    }
    wait_for(hop, id, until, "a stored block after the probe", |s| {
        mismatch(s)?;
        Ok(s.engine_block_size.is_some())
    })
    .await
}

fn now_nanos() -> u32 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos())
}
