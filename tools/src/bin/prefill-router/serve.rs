//! `prefill-router serve`: the OpenAI-compatible HTTP frontend over a `PrefillHop`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use prefill_router::http::{ApiKeys, HttpConfig};
use prefill_router::migration::MigrationConfig;
use prefill_router::push::PushConfig;
use prefill_router::router::{AfterWait, FallbackPolicy, PrefillRouterConfig};
use prefill_router::{PrefillHop, PrefillHopConfig};
use tokio::net::TcpListener;

use crate::args::{CliError, Flags};
use crate::static_engines::StaticEngines;
use crate::store::{terminated, StoreSpec, DEFAULT_ETCD_ROOT};
use crate::tls::TlsFlags;
use prefill_router::discovery::{Discovery, MemoryConfig, MemoryDiscovery};

/// `serve` usage.
pub const USAGE: &str = "\
usage: prefill-router serve --discovery file://DIR|etcd://HOST:PORT[,...]|k8s://NS --namespace NS
                            [--listen 127.0.0.1:8000] [options]

An OpenAI-compatible HTTP frontend: POST /v1/completions, POST /v1/chat/completions
(\"stream\": true for server-sent events), GET /v1/models, /health, /ready, /metrics.
Requests prefill on the namespace's prefill set and decode on its decode set, both found in
discovery and followed as they change (docs/frontend.md). Prints one JSON line on stdout once
listening: {\"event\":\"listening\",\"addr\":...}. SIGTERM (or Ctrl-C) stops it in order:
/ready turns 503, the drain delay, stop accepting, drain in-flight requests up to the shutdown
bound, close the rest (saying how many on stderr); it prints
{\"event\":\"stopped\",\"closed_at_bound\":N} and exits within about drain delay + shutdown
bound. A second SIGTERM or Ctrl-C exits at once (status 130).

options:
  --engine vllm            the workers are engines speaking this protocol, given by URL:
  --prefill-url URL[,...]  the prefill engines (http://HOST:PORT; none: decode runs all)
  --router-mode MODE       how the prefill engines are picked: round-robin (default), random,
                           or kv (prefix-aware, predicted from the router's own picks)
  --decode-url URL[,...]   the decode engines; each engine is probed on /health and leaves
                           the routable set while it does not answer (docs/engines.md); then
                           --discovery and --namespace are optional (an in-process store)
  --check-events[=SECS]    with --router-mode kv: before listening, confirm within SECS
                           (default 60) that each prefill engine's KV events reach the router
                           and its blocks are the card's size (an engine with no history is
                           sent one probe prompt); refuse to start otherwise
  --engine-load-ms N       read each KV-mode engine's load from its /metrics every N ms and
                           count the requests it holds beyond this router's own (off by
                           default; docs/engines.md, \"Engine load\")
  --discovery SPEC         file://DIR (a directory shared on this host) or
                           etcd://HOST:PORT[,HOST:PORT...] (the members of one etcd cluster)
                           or k8s://NAMESPACE[?kubeconfig=PATH|?url=URL] (the workers'
                           EndpointSlices and pods; feature `kubernetes`, docs/kubernetes.md)
  --namespace NS           the deployment's namespace
  --listen ADDR            the HTTP address (default 127.0.0.1:8000: loopback only)
  --fallback POLICY        while prefill is not active: decode (bypass, the default), reject
                           (503), or wait-MS (wait up to MS ms, then bypass)
  --migration-limit N      how many times one stream may continue on another decode worker
                           after its decode worker died (default 3; 0: never, the client
                           gets the error; docs/health.md, \"Migration\")
  --request-timeout-ms N   deadline of one request, from its first byte to its last token
                           (default 30000): 504, or 408 while its body is still arriving
  --header-timeout-ms N    a request's headers must arrive within N ms of its first byte (of
                           the accept, on a new connection), else the connection is closed
                           (default 10000)
  --body-timeout-ms N      its body within N ms of its headers, else 408 and the connection
                           is closed (default 10000)
  --idle-timeout-ms N      a keep-alive connection idle for N ms is closed (default 75000)
  --max-connections N      most connections open at once; over it new connections wait in
                           the listen backlog until one closes (default 1024)
  --drain-delay-ms N       on SIGTERM, /ready answers 503 and requests are still served for N
                           ms before the listener closes (default 2000)
  --shutdown-timeout-ms N  then in-flight requests may finish for N ms; connections still
                           open are closed and the log says how many (default 20000)
  --body-limit BYTES       largest request body (default 1048576): 413
  --max-tokens N           max_tokens when a request does not say (default 16)
  --max-tokens-limit N     largest max_tokens accepted (default 4096)
  --model NAME             the model /v1/models lists (default mock-llm)
  --tokenizer DIR          tokenize prompts and detokenize output with the model folder's
                           tokenizer.json and chat template (chat_template.jinja or
                           tokenizer_config.json) instead of the built-in word tokenizer
                           (which mock workers need); a folder that does not load stops serve
  --check-tokenizer URL    with --tokenizer: compare a few fixed prompts with the engine's
                           POST URL/tokenize (vLLM) and refuse to start on a difference
  --name NAME              the router's name in logs and metrics (default prefill)
  --ttl-ms N               discovery lease TTL in milliseconds (default 10000)
  --etcd-root PREFIX       etcd key root (default prefill-router/v1/instances/)
  --api-key-file FILE      API keys, one per line (`#` comments and blank lines ignored):
                           every route but /health, /ready and /metrics then answers 401
                           (OpenAI `invalid_api_key`) without `Authorization: Bearer KEY`;
                           keys are compared in constant time and never logged. Without the
                           flag, the file named by $PREFILL_ROUTER_API_KEYS_FILE, if set.
                           Rotation: edit the file, restart (SIGTERM drains).
  --metrics-need-key       /metrics asks for a key too (needs a key file)
  --tls-ca FILE            talk to workers over TLS, trusting worker certificates that chain
                           to this CA (PEM); each is checked for the IP address dialled
  --tls-server-name NAME   check worker certificates for NAME instead of their IP address
  --tls-cert FILE          mutual TLS: present this client certificate chain (PEM) to
                           workers that require one (worker --tls-client-ca); with --tls-ca
  --tls-key FILE           the client certificate's private key (PEM)
                           A worker the frontend cannot do TLS with counts as unreachable:
                           its requests go elsewhere or fail per --fallback (docs/transport.md)";

/// The environment variable naming the API key file when `--api-key-file` is absent. A path,
/// not the keys: a process's environment is readable by whoever can inspect the process
/// (`/proc/PID/environ`, container specs), a file can be mode 0600 or a mounted secret.
pub const API_KEYS_FILE_ENV: &str = "PREFILL_ROUTER_API_KEYS_FILE";

/// Parsed `serve` options.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    discovery: StoreSpec,
    namespace: String,
    listen: SocketAddr,
    fallback: FallbackPolicy,
    http: HttpConfig,
    name: String,
    ttl: Duration,
    etcd_root: String,
    /// The API key file and where its name came from (read when serve starts).
    api_key_file: Option<(PathBuf, &'static str)>,
    tls: TlsFlags,
    /// `--engine` with `--prefill-url`/`--decode-url`: engines by URL (docs/engines.md).
    engines: StaticEngines,
    /// Whether `--discovery` was given (static engines default to an in-process store).
    discovery_given: bool,
    /// Whether `--model` was given (static engines default to the engines' model).
    model_given: bool,
    /// `--tokenizer DIR` and `--check-tokenizer URL` (loaded and checked when serve starts).
    tokenizer: Option<(PathBuf, Option<String>)>,
    /// `--check-events[=SECS]`: the bound of the check (`None`: no check).
    check_events: Option<Duration>,
    /// `--engine-load-ms N`: how often engines' load is read (`None`: never).
    engine_load: Option<Duration>,
    /// `--migration-limit N`: continuations per stream after a decode worker died.
    migration: MigrationConfig,
}

fn fallback(raw: &str) -> Result<FallbackPolicy, CliError> {
    match raw {
        "decode" => Ok(FallbackPolicy::Decode),
        "reject" => Ok(FallbackPolicy::Reject),
        _ => match raw.strip_prefix("wait-").and_then(|ms| ms.parse().ok()) {
            Some(ms) => Ok(FallbackPolicy::WaitUpTo {
                timeout: Duration::from_millis(ms),
                then: AfterWait::Decode,
            }),
            None => Err(CliError::Usage(format!(
                "--fallback: expected decode, reject or wait-MS, got `{raw}`"
            ))),
        },
    }
}

/// A positive duration in milliseconds (a zero timeout would close every connection at once).
fn millis(flags: &mut Flags<'_>, flag: &str) -> Result<Duration, CliError> {
    match flags.parsed::<u64>(flag)? {
        0 => Err(CliError::Usage(format!("{flag} must be positive"))),
        ms => Ok(Duration::from_millis(ms)),
    }
}

impl ServeOptions {
    /// Parse the arguments after `serve` (and [`API_KEYS_FILE_ENV`]).
    pub fn parse(args: &[String]) -> Result<Self, CliError> {
        Self::parse_with_env(args, std::env::var_os(API_KEYS_FILE_ENV))
    }

    /// [`ServeOptions::parse`] with the key file variable's value given.
    fn parse_with_env(
        args: &[String],
        keys_env: Option<std::ffi::OsString>,
    ) -> Result<Self, CliError> {
        let mut discovery = None;
        let mut namespace = None;
        let mut options = ServeOptions {
            discovery: StoreSpec::File(std::path::PathBuf::new()),
            namespace: String::new(),
            listen: SocketAddr::from(([127, 0, 0, 1], 8000)),
            fallback: FallbackPolicy::Decode,
            http: HttpConfig::default(),
            name: "prefill".to_owned(),
            ttl: Duration::from_secs(10),
            etcd_root: DEFAULT_ETCD_ROOT.to_owned(),
            api_key_file: None,
            tls: TlsFlags::default(),
            engines: StaticEngines::default(),
            discovery_given: false,
            model_given: false,
            tokenizer: None,
            check_events: None,
            engine_load: None,
            migration: MigrationConfig::default(),
        };
        let mut check_tokenizer = None;
        let mut flags = Flags::new(args);
        while let Some(flag) = flags.next_flag() {
            match flag {
                "--discovery" => discovery = Some(StoreSpec::parse(flag, flags.value(flag)?)?),
                "--namespace" => namespace = Some(flags.value(flag)?.to_owned()),
                "--listen" => options.listen = flags.parsed(flag)?,
                "--fallback" => options.fallback = fallback(flags.value(flag)?)?,
                "--request-timeout-ms" => {
                    options.http.request_timeout = Duration::from_millis(flags.parsed(flag)?)
                }
                "--header-timeout-ms" => options.http.header_timeout = millis(&mut flags, flag)?,
                "--body-timeout-ms" => options.http.body_timeout = millis(&mut flags, flag)?,
                "--idle-timeout-ms" => options.http.idle_timeout = millis(&mut flags, flag)?,
                "--max-connections" => {
                    options.http.max_connections = flags.parsed(flag)?;
                    if options.http.max_connections == 0 {
                        return Err(CliError::Usage("--max-connections must be positive".into()));
                    }
                }
                "--drain-delay-ms" => {
                    options.http.drain_delay = Duration::from_millis(flags.parsed(flag)?)
                }
                "--shutdown-timeout-ms" => {
                    options.http.shutdown_timeout = Duration::from_millis(flags.parsed(flag)?)
                }
                "--body-limit" => options.http.body_limit = flags.parsed(flag)?,
                "--max-tokens" => options.http.default_max_tokens = flags.parsed(flag)?,
                "--max-tokens-limit" => options.http.max_tokens_limit = flags.parsed(flag)?,
                "--model" => {
                    options.http.model = flags.value(flag)?.to_owned();
                    options.model_given = true;
                }
                "--name" => options.name = flags.value(flag)?.to_owned(),
                "--ttl-ms" => options.ttl = Duration::from_millis(flags.parsed(flag)?),
                "--etcd-root" => options.etcd_root = flags.value(flag)?.to_owned(),
                "--api-key-file" => {
                    options.api_key_file = Some((flags.value(flag)?.into(), "--api-key-file"))
                }
                "--metrics-need-key" => options.http.metrics_need_key = true,
                "--tokenizer" => options.tokenizer = Some((flags.value(flag)?.into(), None)),
                "--check-tokenizer" => check_tokenizer = Some(flags.value(flag)?.to_owned()),
                "--check-events" => options.check_events = Some(Duration::from_secs(60)),
                other if other.starts_with("--check-events=") => {
                    options.check_events = match other["--check-events=".len()..].parse() {
                        Ok(secs) if secs > 0 => Some(Duration::from_secs(secs)),
                        _ => {
                            return Err(CliError::Usage(format!(
                                "{other}: expected a positive number of seconds"
                            )))
                        }
                    }
                }
                "--engine-load-ms" => options.engine_load = Some(millis(&mut flags, flag)?),
                "--migration-limit" => options.migration.limit = flags.parsed(flag)?,
                "--help" | "-h" => return Err(CliError::Help(USAGE.to_owned())),
                other if options.tls.take(other, &mut flags, true)? => {}
                other if options.engines.take(other, &mut flags)? => {}
                other => return Err(CliError::Usage(format!("unknown serve option `{other}`"))),
            }
        }
        options.tls.check_client()?;
        match (&mut options.tokenizer, check_tokenizer) {
            (Some((_, check)), url) => *check = url,
            (None, Some(_)) => {
                return Err(CliError::Usage(
                    "--check-tokenizer needs --tokenizer".into(),
                ))
            }
            (None, None) => {}
        }
        options.engines.check()?;
        if options.check_events.is_some() && !options.engines.kv_mode() {
            return Err(CliError::Usage(
                "--check-events needs --engine with --router-mode kv".into(),
            ));
        }
        let engines = options.engines.given();
        options.discovery_given = discovery.is_some();
        options.discovery = match discovery {
            Some(spec) => spec,
            // Static engines: an in-process store (the placeholder is never opened).
            None if engines => options.discovery,
            None => return Err(CliError::Usage("serve needs --discovery".into())),
        };
        options.namespace = match namespace {
            Some(ns) => ns,
            None if engines => "engines".to_owned(),
            None => return Err(CliError::Usage("serve needs --namespace".into())),
        };
        if options.namespace.is_empty() || options.namespace.contains('/') {
            return Err(CliError::Usage(
                "--namespace must be non-empty, without `/`".into(),
            ));
        }
        if options.http.request_timeout.is_zero() {
            return Err(CliError::Usage(
                "--request-timeout-ms must be positive".into(),
            ));
        }
        if options.http.default_max_tokens == 0
            || options.http.default_max_tokens > options.http.max_tokens_limit
        {
            return Err(CliError::Usage(
                "--max-tokens must be between 1 and --max-tokens-limit".into(),
            ));
        }
        if options.api_key_file.is_none() {
            // Set but empty is the same as unset (a templated environment with no keys).
            options.api_key_file = keys_env
                .filter(|v| !v.is_empty())
                .map(|v| (PathBuf::from(v), API_KEYS_FILE_ENV));
        }
        if options.http.metrics_need_key && options.api_key_file.is_none() {
            return Err(CliError::Usage(format!(
                "--metrics-need-key needs API keys (--api-key-file or {API_KEYS_FILE_ENV})"
            )));
        }
        if options.ttl < Duration::from_millis(300) {
            return Err(CliError::Usage("--ttl-ms must be at least 300".into()));
        }
        Ok(options)
    }
}

/// Run the frontend until SIGTERM.
pub async fn run(options: ServeOptions) -> ExitCode {
    match serve(options).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("serve failed: {error}");
            ExitCode::FAILURE
        }
    }
}

/// Read the key file, saying on stderr how many keys it holds (never the keys) and warning
/// when other users may read it.
fn load_keys(path: &Path, from: &str) -> Result<ApiKeys, String> {
    let keys = ApiKeys::from_file(path)
        .map_err(|e| format!("API key file {} (from {from}): {e}", path.display()))?;
    #[cfg(unix)]
    if let Ok(meta) = std::fs::metadata(path) {
        use std::os::unix::fs::PermissionsExt;
        if meta.permissions().mode() & 0o077 != 0 {
            eprintln!(
                "serve: warning: the API key file {} is readable by group or others (chmod 600)",
                path.display()
            );
        }
    }
    Ok(keys)
}

async fn serve(mut options: ServeOptions) -> Result<(), String> {
    // Before anything else: a bad key file must stop serve before it listens unprotected.
    if let Some((path, from)) = &options.api_key_file {
        let keys = load_keys(path, from)?;
        eprintln!(
            "serve: {} API key(s) loaded from {}; every route but /health, /ready{} needs one",
            keys.len(),
            path.display(),
            if options.http.metrics_need_key {
                ""
            } else {
                " and /metrics"
            }
        );
        options.http.api_keys = Some(keys);
    }
    let api_keys = options.http.api_keys.as_ref().map_or(0, ApiKeys::len);
    // Before listening: a frontend tokenizing differently from its engine must not start.
    if let Some((dir, check)) = &options.tokenizer {
        options.http.tokenizer = crate::tokenizer_check::load(dir, check.as_deref())
            .await
            .map_err(|e| e.to_string())?;
        eprintln!(
            "serve: tokenizer of {}{}",
            dir.display(),
            check
                .as_ref()
                .map_or(String::new(), |url| format!(", matching {url}/tokenize"))
        );
    }
    // Read first: a bad certificate file fails the start, not every request.
    let tls = options.tls.client().map_err(|e| format!("TLS: {e}"))?;
    let discovery: Arc<dyn Discovery> = if options.discovery_given || !options.engines.given() {
        options
            .discovery
            .open(options.ttl, &options.etcd_root)
            .await?
    } else {
        Arc::new(MemoryDiscovery::new(MemoryConfig::with_ttl(options.ttl)))
    };
    if options.engines.given() && !options.model_given {
        if let Some(model) = options.engines.model().await {
            options.http.model = model;
        }
    }
    // Held to the end: the engines' registrars stop with it.
    let _engines = options.engines.start(&discovery, &options.namespace);
    // Each leg's own deadline is the request's: the HTTP layer answers 504 at the same time.
    let mut push = PushConfig {
        request_timeout: Some(options.http.request_timeout),
        ..PushConfig::default()
    };
    // Both legs, prefill and decode, dial workers with the same TLS.
    push.client.tls = tls;
    let config = PrefillHopConfig {
        router: PrefillRouterConfig {
            name: options.name.clone(),
            fallback: options.fallback,
            build_timeout: Duration::from_secs(10),
            ..PrefillRouterConfig::default()
        },
        push,
        engine: prefill_router::engine::EngineLinkConfig {
            load_interval: options.engine_load,
            ..Default::default()
        },
        migration: options.migration,
        ..PrefillHopConfig::default()
    };
    let hop = PrefillHop::start(discovery, &options.namespace, config)
        .await
        .map_err(|e| e.to_string())?;
    if let Some(bound) = options.check_events {
        crate::events_check::check(&hop, &options.engines.prefill_ids(), bound).await?;
    }
    let hop = Arc::new(hop);
    let listener = TcpListener::bind(options.listen)
        .await
        .map_err(|e| format!("listening on {}: {e}", options.listen))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    println!(
        "{}",
        serde_json::json!({"event": "listening", "addr": addr.to_string(), "pid": std::process::id(), "api_keys": api_keys})
    );
    // The first SIGTERM or Ctrl-C starts the ordered stop; a second one exits at once (an
    // impatient operator at a terminal), cutting off whatever is still in flight.
    let (first_tx, first_rx) = tokio::sync::oneshot::channel::<()>();
    let shutdown = async move {
        terminated().await;
        let _ = first_tx.send(());
    };
    tokio::spawn(async move {
        if first_rx.await.is_ok() {
            terminated().await;
            eprintln!("serve: second stop signal; exiting now");
            std::process::exit(130);
        }
    });
    let summary =
        prefill_router::http::serve(listener, Arc::clone(&hop), options.http, shutdown).await;
    if summary.closed_at_bound > 0 {
        eprintln!(
            "serve: closed {} connection(s) still open at the end of the shutdown bound (their requests were cut off)",
            summary.closed_at_bound
        );
    }
    hop.shutdown().await;
    println!(
        "{}",
        serde_json::json!({"event": "stopped", "closed_at_bound": summary.closed_at_bound})
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(line: &str) -> Vec<String> {
        line.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn serve_listens_on_loopback_by_default() {
        let options = ServeOptions::parse(&args("--discovery file:///tmp/x --namespace ns"))
            .ok()
            .unwrap();
        assert_eq!(options.listen, SocketAddr::from(([127, 0, 0, 1], 8000)));
        assert_eq!(options.fallback, FallbackPolicy::Decode);
    }

    #[test]
    fn serve_rejects_bad_flags_with_usage() {
        for line in [
            "--namespace ns",
            "--discovery file:///tmp/x",
            "--discovery etcd:// --namespace ns",
            "--discovery file:///tmp/x --namespace ns --fallback maybe",
            "--discovery file:///tmp/x --namespace ns --request-timeout-ms 0",
            "--discovery file:///tmp/x --namespace ns --listen nowhere",
            "--discovery file:///tmp/x --namespace ns --header-timeout-ms 0",
            "--discovery file:///tmp/x --namespace ns --idle-timeout-ms soon",
            "--discovery file:///tmp/x --namespace ns --max-connections 0",
            "--discovery file:///tmp/x --namespace ns --tls-cert c.pem --tls-key k.pem",
            "--discovery file:///tmp/x --namespace ns --tls-ca ca.pem --tls-cert c.pem",
            "--discovery file:///tmp/x --namespace ns --tls-client-ca ca.pem",
            "--discovery file:///tmp/x --namespace ns --check-tokenizer http://e:8100",
            "--engine vllm --decode-url http://127.0.0.1:1 --check-events",
            "--engine vllm --decode-url http://127.0.0.1:1 --router-mode kv --check-events=0",
            "--engine vllm --decode-url http://127.0.0.1:1 --router-mode kv --check-events=soon",
            "--engine vllm --decode-url http://127.0.0.1:1 --engine-load-ms 0",
        ] {
            assert!(
                matches!(ServeOptions::parse(&args(line)), Err(CliError::Usage(_))),
                "{line}"
            );
        }
        let wait = ServeOptions::parse(&args(
            "--discovery file:///tmp/x --namespace ns --fallback wait-250",
        ))
        .ok()
        .unwrap();
        assert!(matches!(wait.fallback, FallbackPolicy::WaitUpTo { .. }));
    }

    #[test]
    fn migration_limit_parses_and_zero_turns_it_off() {
        for (flag, limit) in [
            ("", 3),
            ("--migration-limit 5", 5),
            ("--migration-limit 0", 0),
        ] {
            let line = format!("--discovery file:///tmp/x --namespace ns {flag}");
            let options = ServeOptions::parse(&args(&line)).ok().unwrap();
            assert_eq!(options.migration.limit, limit, "{line}");
        }
        assert!(ServeOptions::parse(&args(
            "--discovery file:///tmp/x --namespace ns --migration-limit x"
        ))
        .is_err());
    }

    #[test]
    fn check_events_and_engine_load_parse() {
        let line =
            "--engine vllm --prefill-url http://127.0.0.1:1 --decode-url http://127.0.0.1:1 \
                    --router-mode kv --check-events=5 --engine-load-ms 250";
        let options = match ServeOptions::parse(&args(line)) {
            Ok(o) => o,
            Err(CliError::Usage(e) | CliError::Help(e)) => panic!("{e}"),
        };
        assert_eq!(options.check_events, Some(Duration::from_secs(5)));
        assert_eq!(options.engine_load, Some(Duration::from_millis(250)));
        let bare = ServeOptions::parse(&args(
            "--engine vllm --decode-url http://127.0.0.1:1 --router-mode kv --check-events",
        ))
        .ok()
        .unwrap();
        assert_eq!(bare.check_events, Some(Duration::from_secs(60)));
        assert_eq!(bare.engine_load, None);
        assert_eq!(bare.migration, MigrationConfig::default());
    }

    #[test]
    fn the_key_file_comes_from_the_flag_else_the_environment() {
        let base = "--discovery file:///tmp/x --namespace ns";
        let parse = |line: &str, env: Option<&str>| {
            ServeOptions::parse_with_env(&args(line), env.map(Into::into))
        };
        let from_env = parse(base, Some("/run/keys")).ok().unwrap();
        assert_eq!(
            from_env.api_key_file,
            Some((PathBuf::from("/run/keys"), API_KEYS_FILE_ENV))
        );
        let flag = parse(&format!("{base} --api-key-file /etc/k"), Some("/run/keys"))
            .ok()
            .unwrap();
        assert_eq!(
            flag.api_key_file,
            Some((PathBuf::from("/etc/k"), "--api-key-file"))
        );
        assert_eq!(parse(base, Some("")).ok().unwrap().api_key_file, None);
        assert_eq!(parse(base, None).ok().unwrap().api_key_file, None);
        assert!(matches!(
            parse(&format!("{base} --metrics-need-key"), None),
            Err(CliError::Usage(_))
        ));
        let guarded = parse(&format!("{base} --metrics-need-key"), Some("/run/keys"))
            .ok()
            .unwrap();
        assert!(guarded.http.metrics_need_key);
        assert!(matches!(
            parse(&format!("{base} --api-key-file"), None),
            Err(CliError::Usage(_))
        ));
    }
}
