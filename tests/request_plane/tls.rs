//! TLS on the request plane (feature `tls`), with certificates made at test time: round trips
//! over TLS and mutual TLS, and every refusal the configuration promises (a worker certificate
//! from another CA, an expired one, the wrong name; no client certificate, one from another
//! CA, an expired one; a client that does not speak TLS; a client stalling in the handshake).

use std::sync::Arc;
use std::time::Duration;

use crate::certs::{Ca, Leaf, Validity};
use crate::support::*;
use futures_util::StreamExt;
use prefill_router::request::GenerateRequest;
use prefill_router::transport::{
    serve, ClientConfig, ClientTls, Connection, Engine, ServerConfig, ServerHandle, ServerTls,
    TlsError, TlsIdentity, TlsRoots, TransportError,
};
use tokio::io::AsyncReadExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{timeout, Instant};

/// How long a refused request may take to fail: a refusal is immediate, so anything near the
/// generous [`WAIT`] would mean a hang bounded only by some timeout.
const REFUSED_WITHIN: Duration = Duration::from_secs(3);

/// Where every test's workers live: 127.0.0.1, so the leaf needs that IP as a SAN.
const LOOPBACK: &str = "127.0.0.1";

fn identity(leaf: &Leaf) -> TlsIdentity {
    TlsIdentity::from_pem(leaf.cert_pem.as_bytes(), leaf.key_pem.as_bytes()).expect("identity")
}

fn roots(ca: &Ca) -> TlsRoots {
    TlsRoots::from_pem(ca.pem().as_bytes()).expect("roots")
}

async fn tls_worker(engine: Arc<dyn Engine>, tls: ServerTls) -> ServerHandle {
    let listener = TcpListener::bind((LOOPBACK, 0)).await.expect("bind");
    let config = ServerConfig {
        tls: Some(tls),
        ..ServerConfig::default()
    };
    serve(listener, engine, config).expect("serve")
}

fn client(tls: ClientTls) -> ClientConfig {
    ClientConfig {
        tls: Some(tls),
        ..ClientConfig::default()
    }
}

/// One request of `max_tokens` ticks on `conn`, collected.
async fn ticks(conn: &Connection, max_tokens: u32) -> Result<Vec<u32>, TransportError> {
    let stream = conn
        .generate(GenerateRequest::new(vec![1, 2, 3], max_tokens), None)
        .await?;
    let items: Vec<_> = timeout(WAIT, stream.collect::<Vec<_>>())
        .await
        .expect("stream ends in time");
    let mut tokens = Vec::new();
    for item in items {
        tokens.extend(item?.token_ids);
    }
    Ok(tokens)
}

/// A worker with server TLS, a client trusting its CA: streamed tokens arrive in order, and
/// many requests multiplexed on the one TLS connection each get their own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_round_trip_streams_and_multiplexes() {
    let ca = Ca::new("workers");
    let worker_tls = ServerTls::new(identity(&ca.leaf(&[LOOPBACK], Validity::Current))).unwrap();
    assert!(!worker_tls.requires_client_cert());
    let worker = tls_worker(TickEngine::new(Duration::from_millis(1)), worker_tls).await;
    let conn = Connection::connect(
        worker.local_addr(),
        client(ClientTls::new(roots(&ca)).unwrap()),
    )
    .await
    .expect("TLS connect");
    assert_eq!(ticks(&conn, 5).await.unwrap(), vec![0, 1, 2, 3, 4]);
    let mut tasks = Vec::new();
    for n in 1..=32u32 {
        let conn = conn.clone();
        tasks.push(tokio::spawn(async move { (n, ticks(&conn, n).await) }));
    }
    for task in tasks {
        let (n, tokens) = task.await.expect("task");
        assert_eq!(tokens.unwrap(), (0..n).collect::<Vec<_>>());
    }
    assert_eq!(worker.open_connections(), 1);
    assert_eq!(worker.tls_handshake_failures(), 0);
}

/// Mutual TLS: a frontend presenting a certificate from the worker's client CA is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_serves_a_client_certificate_from_the_client_ca() {
    let (server_ca, client_ca) = (Ca::new("workers"), Ca::new("frontends"));
    let worker_tls = ServerTls::mutual(
        identity(&server_ca.leaf(&[LOOPBACK], Validity::Current)),
        roots(&client_ca),
    )
    .unwrap();
    assert!(worker_tls.requires_client_cert());
    let worker = tls_worker(TickEngine::new(Duration::from_millis(1)), worker_tls).await;
    let frontend = ClientTls::mutual(
        roots(&server_ca),
        identity(&client_ca.leaf(&["frontend"], Validity::Current)),
    )
    .unwrap();
    let conn = Connection::connect(worker.local_addr(), client(frontend))
        .await
        .expect("mutual TLS connect");
    assert_eq!(ticks(&conn, 3).await.unwrap(), vec![0, 1, 2]);
    assert_eq!(worker.tls_handshake_failures(), 0);
}

/// A mutual-TLS worker with a certificate from `server_ca`, accepting frontends whose
/// certificates chain to `client_ca`.
async fn mutual_worker(server_ca: &Ca, client_ca: &Ca, engine: Arc<dyn Engine>) -> ServerHandle {
    let worker_tls = ServerTls::mutual(
        identity(&server_ca.leaf(&[LOOPBACK], Validity::Current)),
        roots(client_ca),
    )
    .unwrap();
    tls_worker(engine, worker_tls).await
}

/// Send one request with `frontend` to `worker` and expect a refusal: the request fails
/// within [`REFUSED_WITHIN`] with a typed error (TLS 1.3 lets the client finish its side of
/// the handshake before the worker checks its certificate, so the refusal may arrive as an
/// alert on the first read: [`TransportError::Tls`], or a dropped connection), and the worker
/// counts one more failed handshake.
async fn assert_refused(worker: &ServerHandle, frontend: ClientTls, prompt: Vec<u32>) {
    let failures = worker.tls_handshake_failures();
    let started = Instant::now();
    let outcome = timeout(WAIT, async {
        let conn = Connection::connect(worker.local_addr(), client(frontend)).await?;
        let mut stream = conn.generate(GenerateRequest::new(prompt, 1), None).await?;
        match stream.next().await {
            Some(Ok(_)) => Ok(()),
            Some(Err(e)) => Err(e),
            None => Err(TransportError::Disconnected {
                reason: "stream ended without a response".into(),
            }),
        }
    })
    .await
    .expect("refused, not hung");
    let error = outcome.expect_err("a refused client must not be served");
    assert!(
        // Tls carries the worker's alert (CertificateRequired, UnknownCA, CertificateExpired);
        // a request write that lost the race with the close sees the connection drop instead.
        matches!(
            error,
            TransportError::Tls { .. } | TransportError::Disconnected { .. }
        ),
        "{error:?}"
    );
    assert!(
        started.elapsed() < REFUSED_WITHIN,
        "{:?}",
        started.elapsed()
    );
    wait_for(|| worker.tls_handshake_failures() == failures + 1).await;
}

async fn wait_for(condition: impl Fn() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !condition() {
        assert!(Instant::now() < deadline, "condition not met in time");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "current_thread")]
async fn mutual_tls_refuses_a_client_without_a_certificate() {
    let (server_ca, client_ca) = (Ca::new("workers"), Ca::new("frontends"));
    let engine = PrefillEngine::new(1, 4);
    let worker = mutual_worker(&server_ca, &client_ca, engine.clone()).await;
    let frontend = ClientTls::new(roots(&server_ca)).unwrap();
    assert_refused(&worker, frontend, (0..16).collect()).await;
    assert!(engine.cache.lock().is_empty(), "the engine saw the request");
}

#[tokio::test(flavor = "current_thread")]
async fn mutual_tls_refuses_a_client_certificate_from_another_ca() {
    let (server_ca, client_ca) = (Ca::new("workers"), Ca::new("frontends"));
    let stranger = Ca::new("not the frontends' CA");
    let engine = PrefillEngine::new(1, 4);
    let worker = mutual_worker(&server_ca, &client_ca, engine.clone()).await;
    let frontend = ClientTls::mutual(
        roots(&server_ca),
        identity(&stranger.leaf(&["frontend"], Validity::Current)),
    )
    .unwrap();
    assert_refused(&worker, frontend, (0..16).collect()).await;
    assert!(engine.cache.lock().is_empty(), "the engine saw the request");
}

/// The client CA did sign this one, but it expired: refused, while a current certificate of
/// the same CA is served (only the expiry differs).
#[tokio::test(flavor = "current_thread")]
async fn mutual_tls_refuses_an_expired_client_certificate() {
    let (server_ca, client_ca) = (Ca::new("workers"), Ca::new("frontends"));
    let engine = PrefillEngine::new(1, 4);
    let worker = mutual_worker(&server_ca, &client_ca, engine.clone()).await;
    let frontend = |validity| {
        ClientTls::mutual(
            roots(&server_ca),
            identity(&client_ca.leaf(&["frontend"], validity)),
        )
        .unwrap()
    };
    let good = Connection::connect(worker.local_addr(), client(frontend(Validity::Current)))
        .await
        .expect("connect");
    let mut served = good
        .generate(GenerateRequest::new((0..16).collect(), 1), None)
        .await
        .unwrap();
    timeout(WAIT, served.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_refused(&worker, frontend(Validity::Expired), (100..116).collect()).await;
    assert_eq!(
        engine.cache.lock().len(),
        4,
        "only the current certificate's request reached the engine"
    );
}

/// Connecting with `frontend` to a worker serving `leaf` fails with [`TransportError::Tls`]
/// (at connect: the client checks the worker's certificate during its own handshake), and
/// the reason mentions `expect`.
async fn assert_client_refuses(leaf: &Leaf, frontend: ClientTls, expect: &str) {
    let worker = tls_worker(
        TickEngine::new(Duration::from_millis(1)),
        ServerTls::new(identity(leaf)).unwrap(),
    )
    .await;
    let started = Instant::now();
    let error = Connection::connect(worker.local_addr(), client(frontend))
        .await
        .expect_err("the client must refuse this worker");
    assert!(started.elapsed() < REFUSED_WITHIN);
    match &error {
        TransportError::Tls { addr, reason } => {
            assert_eq!(*addr, worker.local_addr());
            assert!(
                reason.to_lowercase().contains(expect),
                "`{reason}` should mention {expect}"
            );
        }
        other => panic!("expected a TLS error, got {other:?}"),
    }
}

#[tokio::test(flavor = "current_thread")]
async fn the_client_refuses_a_worker_certificate_from_another_ca() {
    let (trusted, other) = (Ca::new("workers"), Ca::new("impostors"));
    assert_client_refuses(
        &other.leaf(&[LOOPBACK], Validity::Current),
        ClientTls::new(roots(&trusted)).unwrap(),
        "issuer",
    )
    .await;
}

#[tokio::test(flavor = "current_thread")]
async fn the_client_refuses_an_expired_worker_certificate() {
    let ca = Ca::new("workers");
    assert_client_refuses(
        &ca.leaf(&[LOOPBACK], Validity::Expired),
        ClientTls::new(roots(&ca)).unwrap(),
        "expired",
    )
    .await;
}

/// By default the worker's certificate must name the IP address dialled; a certificate for a
/// DNS name only is refused, and accepted once the client checks that name instead.
#[tokio::test(flavor = "current_thread")]
async fn the_worker_certificate_must_name_the_address_or_the_configured_name() {
    let ca = Ca::new("workers");
    let named = ca.leaf(&["worker.pool.test"], Validity::Current);
    assert_client_refuses(&named, ClientTls::new(roots(&ca)).unwrap(), "name").await;
    let worker = tls_worker(
        TickEngine::new(Duration::from_millis(1)),
        ServerTls::new(identity(&named)).unwrap(),
    )
    .await;
    let by_name = ClientTls::new(roots(&ca))
        .unwrap()
        .with_server_name("worker.pool.test")
        .unwrap();
    let conn = Connection::connect(worker.local_addr(), client(by_name))
        .await
        .expect("connect by name");
    assert_eq!(ticks(&conn, 2).await.unwrap(), vec![0, 1]);
}

/// A frontend without TLS against a TLS worker: its request fails quickly (the worker reads
/// the frame as a bad TLS record and closes), the failure is counted, and a TLS frontend
/// connecting afterwards is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_client_fails_fast_against_a_tls_worker_which_keeps_serving() {
    let ca = Ca::new("workers");
    let worker = tls_worker(
        TickEngine::new(Duration::from_millis(1)),
        ServerTls::new(identity(&ca.leaf(&[LOOPBACK], Validity::Current))).unwrap(),
    )
    .await;
    let started = Instant::now();
    let plain = timeout(WAIT, async {
        let conn = Connection::connect(worker.local_addr(), ClientConfig::default()).await?;
        ticks(&conn, 2).await
    })
    .await
    .expect("failed, not hung");
    assert!(plain.is_err(), "{plain:?}");
    assert!(
        started.elapsed() < REFUSED_WITHIN,
        "{:?}",
        started.elapsed()
    );
    wait_for(|| worker.tls_handshake_failures() == 1).await;
    let conn = Connection::connect(
        worker.local_addr(),
        client(ClientTls::new(roots(&ca)).unwrap()),
    )
    .await
    .expect("TLS connect");
    assert_eq!(ticks(&conn, 3).await.unwrap(), vec![0, 1, 2]);
}

/// A TLS frontend against a plain worker: a typed TLS error at connect, within the bound.
#[tokio::test(flavor = "current_thread")]
async fn a_tls_client_against_a_plain_worker_gets_a_tls_error() {
    let ca = Ca::new("workers");
    let worker = start_worker(TickEngine::new(Duration::from_millis(1))).await;
    let started = Instant::now();
    let error = timeout(
        WAIT,
        Connection::connect(
            worker.local_addr(),
            client(ClientTls::new(roots(&ca)).unwrap()),
        ),
    )
    .await
    .expect("failed, not hung")
    .expect_err("a plain worker cannot complete a handshake");
    assert!(matches!(error, TransportError::Tls { .. }), "{error:?}");
    assert!(
        started.elapsed() < REFUSED_WITHIN,
        "{:?}",
        started.elapsed()
    );
}

/// A client that opens a connection and sends nothing holds no one up: a TLS frontend is
/// served meanwhile, and the staller is closed once the handshake timeout passes (its slot
/// freed, the failure counted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_stalling_in_the_handshake_blocks_no_one_and_is_cut_at_the_timeout() {
    let ca = Ca::new("workers");
    // Long enough that the good client below is served well inside it on a loaded box.
    let handshake_timeout = Duration::from_secs(2);
    let worker_tls = ServerTls::new(identity(&ca.leaf(&[LOOPBACK], Validity::Current)))
        .unwrap()
        .with_handshake_timeout(handshake_timeout);
    assert_eq!(worker_tls.handshake_timeout(), handshake_timeout);
    let worker = tls_worker(TickEngine::new(Duration::from_millis(1)), worker_tls).await;
    // Taken before the connects: the worker starts each staller's clock at its accept, which
    // is later, so every staller is cut no sooner than `opened + handshake_timeout`.
    let opened = Instant::now();
    let mut stallers = Vec::new();
    for _ in 0..4 {
        stallers.push(TcpStream::connect(worker.local_addr()).await.unwrap());
    }
    wait_for(|| worker.open_connections() == 4).await;
    let conn = Connection::connect(
        worker.local_addr(),
        client(ClientTls::new(roots(&ca)).unwrap()),
    )
    .await
    .expect("served while others stall");
    assert_eq!(ticks(&conn, 2).await.unwrap(), vec![0, 1]);
    // Served while every staller still held its connection (none cut yet).
    assert_eq!(
        worker.tls_handshake_failures(),
        0,
        "the good client was served only after the stallers were cut ({:?})",
        opened.elapsed()
    );
    // Each staller sees its connection closed (EOF), no sooner than the timeout.
    for staller in &mut stallers {
        let mut byte = [0u8; 1];
        let read = timeout(WAIT, staller.read(&mut byte))
            .await
            .expect("the worker closes a stalled handshake");
        assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    }
    assert!(opened.elapsed() >= handshake_timeout);
    wait_for(|| worker.tls_handshake_failures() == 4 && worker.open_connections() == 1).await;
}

/// Configuration errors are typed: a missing file, PEM without a certificate or a key, a key
/// that is not the certificate's, an invalid server name.
#[test]
fn bad_tls_material_gives_typed_errors() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("workers");
    let leaf = ca.leaf(&[LOOPBACK], Validity::Current);
    let (cert, key) = leaf.write(dir.path(), "worker");
    assert!(TlsIdentity::from_pem_files(&cert, &key).is_ok());
    let ca_file = ca.write(dir.path(), "ca.crt");
    assert!(TlsRoots::from_pem_file(&ca_file).is_ok());

    let missing = dir.path().join("missing.crt");
    assert!(matches!(
        TlsIdentity::from_pem_files(&missing, &key),
        Err(TlsError::Read { path, .. }) if path == missing
    ));
    assert!(matches!(
        TlsRoots::from_pem_file(&missing),
        Err(TlsError::Read { .. })
    ));
    // A key file given as the certificate: PEM, but no CERTIFICATE section.
    assert!(matches!(
        TlsIdentity::from_pem_files(&key, &key),
        Err(TlsError::NoCertificate { .. })
    ));
    assert!(matches!(
        TlsIdentity::from_pem_files(&cert, &cert),
        Err(TlsError::NoKey { .. })
    ));
    assert!(matches!(
        TlsRoots::from_pem(b"not PEM at all"),
        Err(TlsError::NoCertificate { .. })
    ));
    let other = ca.leaf(&[LOOPBACK], Validity::Current);
    let mismatched =
        TlsIdentity::from_pem(leaf.cert_pem.as_bytes(), other.key_pem.as_bytes()).unwrap();
    assert!(matches!(
        ServerTls::new(mismatched),
        Err(TlsError::BadIdentity { .. })
    ));
    assert!(matches!(
        ClientTls::new(roots(&ca))
            .unwrap()
            .with_server_name("not a name!"),
        Err(TlsError::ServerName { .. })
    ));
    // Debug output never carries the key.
    let shown = format!("{:?}", identity(&leaf));
    assert!(!shown.contains("PRIVATE"), "{shown}");
}
