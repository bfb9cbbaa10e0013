//! File-store specifics: the on-disk layout and its lease by mtime.

use super::*;
use prefill_router::discovery::encode_record;

fn record_path(h: &FileHarness, key: &str) -> std::path::PathBuf {
    h.dir
        .path()
        .join("v1")
        .join("instances")
        .join(key.replace('/', "."))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_record_files_are_ignored_and_reaped() {
    let h = FileHarness::start().await.unwrap();
    let ep = endpoint("ns", "prefill");
    let (stale, fresh) = (instance(&ep, 1), instance(&ep, 2));
    for i in [&stale, &fresh] {
        let bytes = encode_record(i, &card("m", SelectionMode::KV));
        h.write_raw(&record_key(&ep, i.instance_id), bytes).await;
    }
    // A heartbeat two TTLs ago: expired, as a crashed worker's file would be.
    let stale_path = record_path(&h, &record_key(&ep, 1));
    std::fs::File::options()
        .write(true)
        .open(&stale_path)
        .unwrap()
        .set_modified(std::time::SystemTime::now() - h.ttl * 2)
        .unwrap();
    let store = h.client().await;
    assert_eq!(
        store.list_instances(&ep).await.unwrap(),
        vec![fresh.clone()]
    );
    let mut watch = store.watch(&ep).await.unwrap();
    assert_eq!(next(&mut watch).await, InstanceEvent::Added(fresh));
    // This process's reaper deletes the expired file.
    let started = Instant::now();
    while stale_path.exists() {
        assert!(
            started.elapsed() < EVENT_WAIT,
            "expired record never reaped"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn temp_files_are_never_read_as_records() {
    let h = FileHarness::start().await.unwrap();
    let ep = endpoint("ns", "prefill");
    let store = h.client().await;
    let mut watch = store.watch(&ep).await.unwrap();
    let half_written = encode_record(&instance(&ep, 1), &card("m", SelectionMode::KV));
    let dir = h.dir.path().join("v1").join("instances");
    std::fs::write(dir.join(".tmp-half-written"), half_written).unwrap();
    assert!(store.list_instances(&ep).await.unwrap().is_empty());
    assert_quiet(&mut watch).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_are_published_by_atomic_rename_in_the_documented_layout() {
    let h = FileHarness::start().await.unwrap();
    let ep = endpoint("ns", "prefill");
    let a = instance(&ep, 0x2a);
    let _r = h
        .client()
        .await
        .register(a.clone(), card("m", SelectionMode::KV))
        .await
        .unwrap();
    let path = record_path(&h, &record_key(&ep, 0x2a));
    assert!(path.ends_with("ns.prefill.generate.000000000000002a"));
    let bytes = std::fs::read(&path).unwrap();
    let (read, _) =
        prefill_router::discovery::decode_record(&record_key(&ep, 0x2a), &bytes).unwrap();
    assert_eq!(read, a);
    // Nothing but the record is left behind (the temp file was renamed, not copied).
    let names: Vec<_> = std::fs::read_dir(path.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 1, "{names:?}");
}
