//! Benchmark driver for scripts/bench.sh: times runner's own paths through the library, one
//! line of JSON per measurement set. `ctr` is timed by the script, side by side, in one run.
//!
//! Usage: bench oneshot|exec|concurrent N [ARGS] (CONTAINERD_ADDRESS, CONTAINERD_NAMESPACE,
//! RUNNER_STATE_DIR, BENCH_IMAGE).

use std::time::{Duration, Instant};

use runner::containerd::Containerd;
use runner::manifest;
use runner::runtime::containerd::Engine;
use runner::runtime::{ExecRequest, Runtime, RuntimeOptions};
use runner::spec::{self, HostEnv};
use tokio_util::sync::CancellationToken;

/// A number from the environment, or `default` when unset; a value that is not one fails.
fn env_number(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) => v.parse().unwrap_or_else(|_| panic!("{name}={v:?} is not a number")),
        Err(_) => default,
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

#[tokio::main]
async fn main() {
    if let Ok(filter) = std::env::var("RUNNER_LOG") {
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_ansi(false)
            .init();
    }
    let args: Vec<String> = std::env::args().collect();
    let mode = args.get(1).map(String::as_str).unwrap_or("exec");
    let n: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(20);
    if mode == "http" {
        http(n);
        return;
    }
    if mode == "http-burst" {
        http_burst(n);
        return;
    }
    let address = std::env::var("CONTAINERD_ADDRESS").expect("CONTAINERD_ADDRESS");
    let namespace = std::env::var("CONTAINERD_NAMESPACE").unwrap_or_else(|_| "runner-bench".into());
    let state = std::path::PathBuf::from(std::env::var("RUNNER_STATE_DIR").expect("RUNNER_STATE_DIR"));
    let image = std::env::var("BENCH_IMAGE").unwrap_or_else(|_| "local/busybox:1.35".into());
    let client = Containerd::connect(std::path::Path::new(&address), &namespace)
        .await
        .expect("connect");
    let host = HostEnv::detect(&state);
    let options = RuntimeOptions {
        // BENCH_DURABLE=1: output through the shim-run logger, as Jobs do.
        durable_output: std::env::var_os("BENCH_DURABLE").is_some(),
        logger_binary: std::env::var_os("BENCH_RUNNER").map(std::path::PathBuf::from),
        // BENCH_POOL=1: one-shot jobs claim members of a pool `runner pool create` made (the
        // session tools are part of the pool key); used members are retired, as the CLI
        // leaves them for its background filler, and torn down after the last result.
        use_pools: std::env::var_os("BENCH_POOL").is_some(),
        on_claim: std::env::var_os("BENCH_POOL").map(|_| runner::runtime::ClaimHook(std::sync::Arc::new(|_: &str| {}))),
        tools: if std::env::var_os("BENCH_POOL").is_some() {
            runner::service::sessions::tools()
        } else {
            Vec::new()
        },
        ..RuntimeOptions::default()
    };
    let engine = Engine::new(client, &state, host.clone(), options);
    let dir = tempfile::tempdir().unwrap();
    // BENCH_HOST_USERS=1: no user namespace (the default gives each container its own);
    // BENCH_WORKSPACE=1: the job has a workspace (idmapped in a user namespace).
    std::fs::create_dir_all(dir.path().join("ws")).unwrap();
    let plan_for = |host_users: bool, workspace: bool| {
        let host_users = if host_users { "  hostUsers: true\n" } else { "" };
        let workspace = if workspace { "  workspace: ./ws\n" } else { "" };
        let yaml = format!(
            "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {{name: bb}}\nspec:\n  image: {image}\n{host_users}---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: bench}}\nspec:\n  environment: bb\n{workspace}  command: [\"sh\", \"-c\", \"true\"]\n"
        );
        let set = manifest::parse_str(&yaml, dir.path(), None).unwrap();
        let bound = set.bind(&set.jobs[0], None).unwrap();
        spec::resolve(&bound, &host).unwrap()
    };
    let plan = plan_for(
        std::env::var_os("BENCH_HOST_USERS").is_some(),
        std::env::var_os("BENCH_WORKSPACE").is_some(),
    );
    match mode {
        "exec" => {
            let live = engine.spawn_live(&plan).await.expect("spawn");
            let mut times = Vec::new();
            for _ in 0..n {
                let t = Instant::now();
                let r = live
                    .execute(ExecRequest {
                        argv: vec!["/bin/true".into()],
                        ..Default::default()
                    })
                    .await
                    .expect("exec");
                assert_eq!(r.exit_code, Some(0));
                times.push(t.elapsed().as_secs_f64() * 1e3);
            }
            live.cleanup().await.expect("cleanup");
            println!("{{\"exec_ms_median\": {:.2}, \"runs\": {n}}}", median(times));
        }
        "userns" => {
            // The cost of a user namespace per job, in steady state: blocks of BENCH_BLOCK (5)
            // jobs with a workspace, alternately in their own user namespace and with
            // `hostUsers: true`, so drift hits both. A block's first job is reported apart: it
            // follows a job of the other kind and may pay for what that one left behind, where
            // in a stream of one kind each job pays for its own predecessor.
            let (own, shared) = (plan_for(false, true), plan_for(true, true));
            let block = (env_number("BENCH_BLOCK", 5) as usize).max(2);
            let mut steady = [Vec::new(), Vec::new()];
            let mut first = [Vec::new(), Vec::new()];
            for j in 0..2 * n.div_ceil(block - 1) {
                let which = j % 2;
                let p = if which == 0 { &own } else { &shared };
                for k in 0..block {
                    let t = Instant::now();
                    let r = engine.run_oneshot(p, &CancellationToken::new()).await.expect("job");
                    assert_eq!(r.exit_code, Some(0));
                    let ms = t.elapsed().as_secs_f64() * 1e3;
                    if k == 0 {
                        first[which].push(ms)
                    } else {
                        steady[which].push(ms)
                    }
                }
            }
            let [u, h] = steady.map(median);
            let [uf, hf] = first.map(median);
            println!(
                "{{\"userns_ms_median\": {u:.2}, \"host_users_ms_median\": {h:.2}, \"cost_ms\": {:.2}, \"after_other_kind_ms_median\": [{uf:.2}, {hf:.2}], \"jobs_per_kind\": {}}}",
                u - h,
                n.div_ceil(block - 1) * (block - 1)
            );
        }
        "concurrent" => {
            let engine = std::sync::Arc::new(engine);
            let t = Instant::now();
            let mut handles = Vec::new();
            for _ in 0..n {
                let (e, p) = (engine.clone(), plan.clone());
                handles.push(tokio::spawn(async move {
                    e.run_oneshot(&p, &CancellationToken::new()).await.expect("job")
                }));
            }
            let mut pooled = 0;
            for h in handles {
                let r = h.await.unwrap();
                assert_eq!(r.exit_code, Some(0));
                pooled += usize::from(r.pool.is_some());
            }
            let secs = t.elapsed().as_secs_f64();
            // What the results did not wait for: the used members' teardown.
            let retired = engine.retired().await.expect("retired members");
            futures::future::join_all(retired.iter().map(|id| engine.teardown(id))).await;
            let all = t.elapsed().as_secs_f64();
            println!(
                "{{\"jobs\": {n}, \"pooled\": {pooled}, \"seconds\": {secs:.3}, \"jobs_per_second\": {:.1}, \"with_teardown_seconds\": {all:.3}}}",
                n as f64 / secs
            );
        }
        _ => {
            let anchor = if std::env::var_os("BENCH_ANCHOR").is_some() {
                Some(engine.spawn_live(&plan).await.unwrap())
            } else {
                None
            };
            let mut times = Vec::new();
            for _ in 0..n {
                let t = Instant::now();
                let r = engine.run_oneshot(&plan, &CancellationToken::new()).await.expect("job");
                assert_eq!(r.exit_code, Some(0));
                times.push(t.elapsed().as_secs_f64() * 1e3);
            }
            if let Some(a) = anchor {
                a.cleanup().await.unwrap();
            }
            println!("{{\"oneshot_ms_median\": {:.2}, \"runs\": {n}}}", median(times));
        }
    }
    let _ = Duration::ZERO;
}

/// `bench http-burst N` (BENCH_URL, BENCH_TOKEN, BENCH_ENV): N sessions of an Environment
/// created at once, each by a thread of its own (a pool of N serves them when the server keeps
/// one), until the last is created and until each has answered one shell call; then all are
/// deleted. Sessions per second, and how many a pool served.
fn http_burst(n: usize) {
    let url = std::env::var("BENCH_URL").expect("BENCH_URL");
    let token = std::env::var("BENCH_TOKEN").expect("BENCH_TOKEN");
    let environment = serde_json::to_string(&std::env::var("BENCH_ENV").expect("BENCH_ENV")).unwrap();
    let auth = format!("Bearer {token}");
    let agent = ureq::AgentBuilder::new().max_idle_connections_per_host(n).build();
    let start = Instant::now();
    let threads: Vec<_> = (0..n)
        .map(|_| {
            let (agent, url, auth, environment) = (agent.clone(), url.clone(), auth.clone(), environment.clone());
            std::thread::spawn(move || {
                let r = agent
                    .post(&format!("{url}/v1/sessions"))
                    .set("Authorization", &auth)
                    .send_string(&format!(r#"{{"environment": {environment}}}"#))
                    .expect("creating a session");
                let session: serde_json::Value = serde_json::from_str(&r.into_string().unwrap()).unwrap();
                let created = start.elapsed();
                let id = session["id"].as_str().unwrap().to_string();
                let r = agent
                    .post(&format!("{url}/v1/sessions/{id}/shell"))
                    .set("Authorization", &auth)
                    .send_string(r#"{"command": "true"}"#)
                    .expect("a shell call");
                let answer: serde_json::Value = serde_json::from_str(&r.into_string().unwrap()).unwrap();
                assert_eq!(answer["exitCode"], 0);
                (id, created, start.elapsed(), !session["pool"].is_null())
            })
        })
        .collect();
    let done: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let created = done.iter().map(|d| d.1).max().unwrap_or_default().as_secs_f64();
    let answered = done.iter().map(|d| d.2).max().unwrap_or_default().as_secs_f64();
    let pooled = done.iter().filter(|d| d.3).count();
    for (id, ..) in &done {
        agent
            .delete(&format!("{url}/v1/sessions/{id}"))
            .set("Authorization", &auth)
            .call()
            .expect("deleting a session");
    }
    println!(
        "{{\"sessions\": {n}, \"from_pool\": {pooled}, \"created_per_s\": {:.1}, \"answered_per_s\": {:.1}, \"last_created_ms\": {:.1}, \"last_answer_ms\": {:.1}}}",
        n as f64 / created,
        n as f64 / answered,
        created * 1e3,
        answered * 1e3
    );
}

/// `bench http N` (BENCH_URL, BENCH_TOKEN, BENCH_IMAGE or BENCH_ENV, an Environment of the
/// server's env dir): medians over BENCH_SESSIONS sessions (5) of their creation alone and
/// until the first command is answered (BENCH_PAUSE_MS between them, for a pool's refill),
/// then medians of shell and exec round trips over HTTP in the last one.
fn http(n: usize) {
    let url = std::env::var("BENCH_URL").expect("BENCH_URL");
    let token = std::env::var("BENCH_TOKEN").expect("BENCH_TOKEN");
    let image = std::env::var("BENCH_IMAGE").unwrap_or_else(|_| "local/busybox:1.35".into());
    let auth = format!("Bearer {token}");
    // One keep-alive connection, as runner's clients (the Python client's pool) use: a new
    // connection per call is not what a user's session pays.
    let agent = ureq::AgentBuilder::new().build();
    let post = |path: &str, body: &str| -> serde_json::Value {
        let r = agent
            .post(&format!("{url}{path}"))
            .set("Authorization", &auth)
            .send_string(body)
            .expect(path);
        serde_json::from_str(&r.into_string().unwrap()).unwrap()
    };
    let environment = match std::env::var("BENCH_ENV") {
        Ok(name) => serde_json::to_string(&name).unwrap(),
        Err(_) => format!(r#"{{"image": "{image}"}}"#),
    };
    // Several sessions, one after another (each deleted before the next; from a pool, after
    // a pause for the refill): one creation is too noisy a sample to hold against a target.
    let sessions = env_number("BENCH_SESSIONS", 5) as usize;
    let pause = Duration::from_millis(env_number("BENCH_PAUSE_MS", 0));
    let (mut created, mut answered, mut pools) = (Vec::new(), Vec::new(), Vec::new());
    let delete = |id: &str| {
        agent
            .delete(&format!("{url}/v1/sessions/{id}"))
            .set("Authorization", &auth)
            .call()
            .expect("deleting a session");
    };
    let mut id = String::new();
    for i in 0..sessions {
        if i > 0 {
            delete(&id);
            std::thread::sleep(pause);
        }
        let t = Instant::now();
        let session = post("/v1/sessions", &format!(r#"{{"environment": {environment}}}"#));
        created.push(t.elapsed().as_secs_f64() * 1e3);
        id = session["id"].as_str().unwrap().to_string();
        let first = post(&format!("/v1/sessions/{id}/shell"), r#"{"command": "true"}"#);
        assert_eq!(first["exitCode"], 0);
        answered.push(t.elapsed().as_secs_f64() * 1e3);
        pools.push(session["pool"].clone());
    }
    let pooled = pools.iter().filter(|p| !p.is_null()).count();
    let (created_ms, create_ms) = (median(created), median(answered.clone()));
    let spread = format!(
        "{:.1}..{:.1}",
        answered.iter().cloned().fold(f64::MAX, f64::min),
        answered.iter().cloned().fold(0.0, f64::max)
    );
    let mut shell = Vec::new();
    let mut exec = Vec::new();
    for _ in 0..n {
        let t = Instant::now();
        post(&format!("/v1/sessions/{id}/shell"), r#"{"command": "true"}"#);
        shell.push(t.elapsed().as_secs_f64() * 1e3);
        let t = Instant::now();
        post(&format!("/v1/sessions/{id}/exec"), r#"{"command": ["/bin/true"]}"#);
        exec.push(t.elapsed().as_secs_f64() * 1e3);
    }
    delete(&id);
    println!(
        "{{\"session_create_ms\": {created_ms:.1}, \"session_create_to_first_answer_ms\": {create_ms:.1}, \"first_answer_range_ms\": \"{spread}\", \"sessions\": {sessions}, \"from_pool\": {pooled}, \"pool\": {}, \"shell_ms_median\": {:.2}, \"exec_ms_median\": {:.2}, \"runs\": {n}}}",
        pools.last().cloned().unwrap_or_default(),
        median(shell),
        median(exec)
    );
}
