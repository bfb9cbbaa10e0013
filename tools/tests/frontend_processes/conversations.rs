//! Issue #40 through the processes: multi-turn conversations under the default worker card
//! (KV routing) stay on the prefill worker that holds their history, whatever the block size
//! the card advertises.

use super::*;

/// Three prefill workers with the default card at `block_size` tokens per block, a decode
/// worker and a frontend; `conversations` chats of `turns` turns each, sent turn by turn (a
/// turn waits for the previous answer, whose text joins the history), the conversations
/// interleaved. Every conversation's turns must land on one prefill worker.
fn conversations_stay_on_their_prefill_worker(block_size: u32, conversations: usize, turns: usize) {
    let cluster = Cluster::new();
    let block = block_size.to_string();
    let _prefill: Vec<Proc> = (1..=3)
        .map(|id| cluster.worker("prefill", id, &["--block-size", &block]))
        .collect();
    let _d = cluster.worker("decode", DECODE, &[]);
    let (_serve, addr) = cluster.serve(&[]);
    until("three prefill workers routable", || {
        let mut seen: Vec<u64> = (0..12)
            .filter_map(|n| {
                let r = post(
                    addr,
                    "/v1/chat/completions",
                    &chat(&format!("warm {n}"), 1, false),
                );
                (r.status == 200).then(|| prefill_worker(&r))
            })
            .collect();
        seen.sort_unstable();
        seen.dedup();
        seen == [1, 2, 3]
    });
    // Short chat turns (a system line of its own, then questions of about ten words and
    // answers of eight tokens): a conversation's history is its only cache and stays a few
    // hundred tokens, so the work each turn books (mostly the 4,096-token per-request
    // overhead) is large next to the history it reuses. The first turn fills a block or two,
    // so there is a history to keep from the second turn on.
    let mut histories: Vec<Vec<serde_json::Value>> = (0..conversations)
        .map(|c| {
            let system = format!("You are the helpful assistant of desk {c} at the library.");
            vec![json!({"role": "system", "content": system.repeat(3)})]
        })
        .collect();
    let mut homes: Vec<Vec<u64>> = vec![Vec::new(); conversations];
    for turn in 0..turns {
        for (c, history) in histories.iter_mut().enumerate() {
            let question = format!("conversation {c} turn {turn}: and what about item {turn}?");
            history.push(json!({"role": "user", "content": question}));
            let body = json!({"model": "mock-llm", "messages": history, "max_tokens": 8});
            let r = post(addr, "/v1/chat/completions", &body);
            assert_eq!(r.status, 200, "conversation {c} turn {turn}: {r:?}");
            homes[c].push(prefill_worker(&r));
            let answer = r.json()["choices"][0]["message"]["content"].clone();
            history.push(json!({"role": "assistant", "content": answer}));
        }
    }
    for (c, workers) in homes.iter().enumerate() {
        assert!(
            workers.iter().all(|&w| w == workers[0]),
            "block {block_size}: conversation {c} moved between prefill workers: {workers:?} \
             (all: {homes:?})"
        );
    }
    // The conversations were not all put on one worker either (new sessions spread by load).
    let mut used: Vec<u64> = homes.iter().map(|w| w[0]).collect();
    used.sort_unstable();
    used.dedup();
    assert!(
        used.len() > 1,
        "block {block_size}: every conversation on one worker: {homes:?}"
    );
}

#[test]
fn conversations_sent_turn_by_turn_stay_on_one_prefill_worker_at_block_16() {
    conversations_stay_on_their_prefill_worker(16, 4, 6);
}

#[test]
fn conversations_sent_turn_by_turn_stay_on_one_prefill_worker_at_block_32() {
    conversations_stay_on_their_prefill_worker(32, 4, 6);
}
