//! `difftx serve` as a process: it prints where it listens, answers over HTTP, and on SIGTERM
//! stops accepting, lets the running request finish, and exits 0.

use candle_core::{DType, Device};
use difftx_core::{checkpoint, model::init_weights, Family, ModelConfig};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// One HTTP/1.1 request on its own connection; (status, body).
fn http(addr: &str, method: &str, path: &str, body: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect(addr)?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut resp = String::new();
    s.read_to_string(&mut resp)?;
    let status = resp.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = resp.split_once("\r\n\r\n").map_or(String::new(), |(_, b)| b.to_string());
    Ok((status, body))
}

#[test]
fn serve_answers_and_exits_0_on_sigterm_after_finishing_the_running_request() {
    let root = tempfile::tempdir().unwrap();
    let mut cfg = ModelConfig::preset("nano", Family::DiffV1).unwrap();
    cfg.max_seq_len = 4096;
    let dir = root.path().join("model");
    checkpoint::save_model(&dir, &cfg, &init_weights(&cfg, 1, DType::F32, &Device::Cpu).unwrap()).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_difftx"))
        .args(["serve", "--model", dir.to_str().unwrap(), "--port", "0", "--shutdown-grace", "60"])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    let addr = loop {
        line.clear();
        assert!(stderr.read_line(&mut line).unwrap() > 0, "serve exited before listening");
        if let Some(at) = line.find("on http://") {
            break line[at + "on http://".len()..].trim().to_string();
        }
    };
    let (status, body) = http(&addr, "POST", "/v1/completions", r#"{"prompt": "hi", "max_tokens": 3}"#).unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"completion_tokens\":3"), "{body}");

    // A long request is running when SIGTERM arrives.
    let running = {
        let addr = addr.clone();
        std::thread::spawn(move || http(&addr, "POST", "/v1/completions", r#"{"prompt": "a", "max_tokens": 3000}"#))
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while !http(&addr, "GET", "/metrics", "").unwrap().1.contains("difftx_running_requests 1") {
        assert!(Instant::now() < deadline, "the request never started");
        std::thread::sleep(Duration::from_millis(5));
    }
    let term = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert!(term.success());
    let (status, body) = running.join().unwrap().unwrap();
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"completion_tokens\":3000"), "{body}");
    let exit = child.wait().unwrap();
    assert!(exit.success(), "serve exited with {exit:?}");
    let mut rest = String::new();
    stderr.read_to_string(&mut rest).unwrap();
    assert!(rest.contains("shutting down") && rest.contains("stopped"), "{rest}");
    // Nobody listens any more.
    assert!(TcpStream::connect(&addr).is_err());
}
