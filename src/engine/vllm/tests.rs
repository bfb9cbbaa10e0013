use super::*;

fn addr() -> SocketAddr {
    "127.0.0.1:9".parse().unwrap()
}

/// vLLM 0.32.0's prefill answer, verbatim (trimmed of the prompt echo).
const PREFILL: &str = r#"{"id":"cmpl-t1","object":"text_completion","choices":[{"index":0,"text":"pe","logprobs":null,"finish_reason":"length","stop_reason":null,"token_ids":[343]}],"usage":{"prompt_tokens":36,"total_tokens":37,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":32}},"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[1,2]],"remote_engine_id":"d71bd04f","remote_request_id":"cmpl-t1-0-90692388","remote_host":"127.0.0.1","remote_port":5600,"tp_size":1,"remote_num_tokens":36,"remote_blocks_expiry_time":null,"transfer_mode":"pull","remote_prefill_cached_tokens":0,"a_field_from_a_newer_vllm":1.50000000000000000001}}"#;

#[test]
fn the_prefill_handoff_is_kept_verbatim() {
    let response = prefill_answer(addr(), 7, 32, PREFILL.as_bytes()).unwrap();
    let info = response.prefill.unwrap();
    let params = info.engine_params.unwrap();
    let start = PREFILL.find("\"kv_transfer_params\":").unwrap() + "\"kv_transfer_params\":".len();
    assert_eq!(params, &PREFILL[start..PREFILL.len() - 1]);
    assert_eq!(
        (info.worker, info.prompt_tokens, info.cached_blocks),
        (7, 36, 1)
    );
    assert_eq!(response.token_ids, vec![343]);
    assert_eq!(response.finish, Some(FinishReason::Length));
    assert_eq!(response.usage.unwrap().cached_tokens, Some(32));
}

#[test]
fn a_prefill_without_params_has_no_handoff() {
    let body = br#"{"choices":[{"text":"x","token_ids":[5],"finish_reason":"length"}],"kv_transfer_params":null}"#;
    let response = prefill_answer(addr(), 1, 32, body).unwrap();
    assert_eq!(response.prefill.unwrap().engine_params, None);
}

#[test]
fn junk_answers_are_typed_errors() {
    for body in [
        &b"not json"[..],
        b"{}",
        b"[1,2]",
        br#"{"choices":[{"token_ids":["x"]}]}"#,
        br#"{"choices":[{"token_ids":[-1]}]}"#,
        b"{\"choices\":[{\"token_ids\":[1]",
    ] {
        let error = prefill_answer(addr(), 1, 32, body).unwrap_err();
        assert!(
            matches!(
                error,
                TransportError::Http {
                    error: HttpError::Malformed { .. },
                    ..
                }
            ),
            "{error}"
        );
    }
    let error =
        prefill_answer(addr(), 1, 32, br#"{"error":{"message":"boom","code":503}}"#).unwrap_err();
    assert_eq!(
        error,
        TransportError::Http {
            addr: addr(),
            error: HttpError::Status {
                status: 503,
                message: "boom".into()
            }
        }
    );
}

#[test]
fn the_decode_body_carries_the_handoff_verbatim_and_the_hop_owns_its_fields() {
    let raw = r#"{"remote_block_ids":[[1, 2]],"x":1.50000000000000000001}"#;
    let mut request = GenerateRequest::new(vec![5, 6, 7], 9);
    request.engine_fields = Some(
        r#"{"temperature":0,"ignore_eos":true,"max_tokens":1,"stream":false,"kv_transfer_params":{"forged":true}}"#.into(),
    );
    request.handoff = Some(PrefillInfo {
        engine_params: Some(raw.into()),
        ..PrefillInfo::default()
    });
    let body = String::from_utf8(decode_body(&request).unwrap()).unwrap();
    assert!(
        body.ends_with(&format!("\"kv_transfer_params\":{raw}}}")),
        "{body}"
    );
    assert!(!body.contains("forged"));
    let value: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(value["max_tokens"], 9);
    assert_eq!(value["stream"], true);
    assert_eq!(value["temperature"], 0);
    assert_eq!(value["ignore_eos"], true);
    assert_eq!(value["prompt"], serde_json::json!([5, 6, 7]));
    assert_eq!(value["stream_options"]["include_usage"], true);
}

#[test]
fn a_bypass_decode_carries_no_handoff_and_the_prefill_asks_for_one() {
    let request = GenerateRequest::new(vec![5], 4);
    let decode: Value = serde_json::from_slice(&decode_body(&request).unwrap()).unwrap();
    assert!(decode.get("kv_transfer_params").is_none());
    let prefill: Value = serde_json::from_slice(&prefill_body(&request).unwrap()).unwrap();
    assert_eq!(prefill["max_tokens"], 1);
    assert_eq!(prefill["stream"], false);
    assert_eq!(prefill["kv_transfer_params"]["do_remote_decode"], true);
}
