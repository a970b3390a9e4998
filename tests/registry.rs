//! `runner image pull|push|tag` and `imagePullPolicy` against real registries: Debian's
//! docker-registry on loopback, plain HTTP, TLS with htpasswd auth, and TLS demanding a
//! client certificate, started by
//! scripts/registries.sh (scripts/test.sh runs it). skopeo is the independent client: it
//! reads what runner pushes and pushes what runner pulls. Each test uses a containerd
//! namespace of its own, so a blob one test stored never stands in for another's download.

mod common;

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use common::{containerd_env, image_dir, json_of, runner_bin};
use sha2::{Digest, Sha256};

/// The registries the test script started; panics (never skips) without them.
struct Registries {
    plain: String,
    plain_log: PathBuf,
    plain_data: PathBuf,
    tls: String,
    ca: PathBuf,
    user: String,
    password: String,
}

fn registries() -> Registries {
    let var = |name: &str| {
        std::env::var(name).unwrap_or_else(|_| {
            panic!("registry tests need {name}: run scripts/test.sh, which starts the test registries (scripts/registries.sh)")
        })
    };
    Registries {
        plain: var("RUNNER_TEST_REGISTRY"),
        plain_log: var("RUNNER_TEST_REGISTRY_LOG").into(),
        plain_data: var("RUNNER_TEST_REGISTRY_DATA").into(),
        tls: var("RUNNER_TEST_TLS_REGISTRY"),
        ca: var("RUNNER_TEST_TLS_REGISTRY_CA").into(),
        user: var("RUNNER_TEST_TLS_REGISTRY_USER"),
        password: var("RUNNER_TEST_TLS_REGISTRY_PASSWORD"),
    }
}

/// A repository name unique to this run (the registries outlive a single test binary run
/// when a developer reruns the tests against them).
fn repo(name: &str) -> String {
    let (_, base) = containerd_env();
    // The process id too: a second run against the same registries finds nothing of the first.
    format!("{}-{}/{name}", base.to_lowercase(), std::process::id())
}

/// A test's own containerd namespace and state dir.
struct Place {
    namespace: String,
    state: tempfile::TempDir,
    docker_config: Option<PathBuf>,
}

/// What the test's containers left in the host (the namespace's cgroup parents, ranges) is
/// removed as `runner gc` removes it; scripts/test.sh fails on any of it left behind.
impl Drop for Place {
    fn drop(&mut self) {
        let _ = self.run(&["gc"]);
    }
}

impl Place {
    fn new(test: &str) -> Self {
        let (_, base) = containerd_env();
        Place {
            namespace: format!("{base}-reg-{test}"),
            state: tempfile::tempdir().unwrap(),
            docker_config: None,
        }
    }

    fn command(&self, args: &[&str]) -> Command {
        let (address, _) = containerd_env();
        let mut cmd = Command::new(runner_bin());
        cmd.args(args)
            .env("RUNNER_STATE_DIR", self.state.path())
            .env("CONTAINERD_ADDRESS", address)
            .env("CONTAINERD_NAMESPACE", &self.namespace)
            .env_remove("RUNNER_HOSTS_DIR")
            .env_remove("RUNNER_INSECURE_REGISTRY")
            .env_remove("HUID")
            .env_remove("HGID");
        match &self.docker_config {
            Some(dir) => cmd.env("DOCKER_CONFIG", dir),
            // No credentials unless a test gives some: the machine's own must not leak in.
            None => cmd.env("DOCKER_CONFIG", self.state.path().join("no-docker-config")),
        };
        cmd
    }

    fn run(&self, args: &[&str]) -> Output {
        self.command(args).output().expect("run runner")
    }

    fn ok(&self, args: &[&str]) -> Output {
        let out = self.run(args);
        assert!(
            out.status.success(),
            "runner {args:?} failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    /// Import test image `tar` (a file of RUNNER_TEST_IMAGES) as `local`, tagged `remote` too.
    fn import_tagged(&self, tar: &str, local: &str, remote: &str) {
        self.ok(&[
            "image",
            "import",
            image_dir().join(tar).to_str().unwrap(),
            "--name",
            local,
        ]);
        self.ok(&["image", "tag", local, remote]);
    }

    fn ctr(&self, args: &[&str]) -> String {
        let (address, _) = containerd_env();
        let out = Command::new("ctr")
            .args(["--address", address.to_str().unwrap(), "--namespace", &self.namespace])
            .args(args)
            .output()
            .expect("run ctr");
        assert!(
            out.status.success(),
            "ctr {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Nothing of a pull is left half-done: no lease, no unfinished ingest.
    fn assert_clean(&self) {
        let leases = self.ctr(&["leases", "ls", "-q"]);
        assert!(leases.trim().is_empty(), "leases left: {leases}");
        let active = self.ctr(&["content", "active"]);
        assert!(active.lines().count() <= 1, "unfinished ingests left: {active}");
    }

    fn has_blob(&self, digest: &str) -> bool {
        self.ctr(&["content", "ls", "-q"]).lines().any(|l| l.trim() == digest)
    }

    /// A one-shot job in `image` (with these Environment extras), through `runner apply`.
    fn apply(&self, name: &str, image: &str, env_extra: &str, command: &str, flags: &[&str]) -> Output {
        let manifest = format!(
            "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {{name: e}}\nspec:\n  image: {image}\n{env_extra}---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: {name}}}\nspec:\n  environment: e\n  command: {command:?}\n"
        );
        let file = self.state.path().join(format!("{name}.yaml"));
        std::fs::write(&file, manifest).unwrap();
        let mut args = flags.to_vec();
        let file = file.to_str().unwrap().to_string();
        args.extend(["apply", "-f", &file, "-o", "json"]);
        self.run(&args)
    }
}

fn sha256_hex(data: &[u8]) -> String {
    hex::encode(Sha256::digest(data))
}

/// Writes an OCI layout with one manifest per architecture, each the busybox layer plus a
/// layer of its own holding `/platform` (the architecture, or `marker`) and `random_bytes`
/// of random data (so no other test has the blob). Returns the layout's directory and the
/// digests of the per-platform layers.
fn oci_layout(dir: &Path, arches: &[&str], marker: Option<&str>, random_bytes: usize) -> Vec<String> {
    // The busybox layer, from the archive the test script built.
    let unpacked = dir.join("busybox");
    std::fs::create_dir_all(&unpacked).unwrap();
    let st = Command::new("tar")
        .arg("-xf")
        .arg(image_dir().join("busybox-oci.tar"))
        .arg("-C")
        .arg(&unpacked)
        .status()
        .unwrap();
    assert!(st.success());
    let blob = |digest: &str| unpacked.join("blobs/sha256").join(digest.trim_start_matches("sha256:"));
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(unpacked.join("index.json")).unwrap()).unwrap();
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(blob(index["manifests"][0]["digest"].as_str().unwrap())).unwrap())
            .unwrap();
    let base_layer = manifest["layers"][0].clone();
    assert_eq!(base_layer["mediaType"], "application/vnd.oci.image.layer.v1.tar");
    let base_digest = base_layer["digest"].as_str().unwrap().to_string();

    let layout = dir.join("layout");
    let blobs = layout.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).unwrap();
    std::fs::copy(
        blob(&base_digest),
        blobs.join(base_digest.trim_start_matches("sha256:")),
    )
    .unwrap();
    let put = |data: &[u8]| -> (String, usize) {
        let hex = sha256_hex(data);
        std::fs::write(blobs.join(&hex), data).unwrap();
        (format!("sha256:{hex}"), data.len())
    };
    let mut entries = Vec::new();
    let mut own_layers = Vec::new();
    for arch in arches {
        let mut random = vec![0u8; random_bytes];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut random))
            .unwrap();
        let mut builder = tar::Builder::new(Vec::new());
        for (name, data) in [("platform", marker.unwrap_or(arch).as_bytes()), ("random", &random[..])] {
            let mut header = tar::Header::new_gnu();
            header.set_size(data.len() as u64);
            header.set_mode(0o644);
            header.set_cksum();
            builder.append_data(&mut header, name, data).unwrap();
        }
        let layer = builder.into_inner().unwrap();
        let diff_id = format!("sha256:{}", sha256_hex(&layer));
        // Compressed here: skopeo would compress a plain tar on its way to the registry,
        // and the registry's digest would not be the layout's.
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&layer).unwrap();
        let (layer_digest, layer_size) = put(&gz.finish().unwrap());
        own_layers.push(layer_digest.clone());
        let config = serde_json::json!({
            "architecture": arch, "os": "linux",
            "config": {"Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]},
            "rootfs": {"type": "layers", "diff_ids": [base_digest, diff_id]},
        });
        let (config_digest, config_size) = put(&serde_json::to_vec(&config).unwrap());
        let manifest = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest, "size": config_size},
            "layers": [base_layer, {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": layer_digest, "size": layer_size}],
        });
        let (manifest_digest, manifest_size) = put(&serde_json::to_vec(&manifest).unwrap());
        entries.push(serde_json::json!({
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": manifest_digest, "size": manifest_size,
            "platform": {"architecture": arch, "os": "linux"},
        }));
    }
    let top = if arches.len() == 1 {
        let mut e = entries[0].clone();
        e.as_object_mut().unwrap().remove("platform");
        e["annotations"] = serde_json::json!({"org.opencontainers.image.ref.name": "v"});
        e
    } else {
        let index = serde_json::json!({
            "schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": entries,
        });
        let (d, n) = put(&serde_json::to_vec(&index).unwrap());
        serde_json::json!({
            "mediaType": "application/vnd.oci.image.index.v1+json", "digest": d, "size": n,
            "annotations": {"org.opencontainers.image.ref.name": "v"},
        })
    };
    std::fs::write(
        layout.join("index.json"),
        serde_json::to_vec(&serde_json::json!({"schemaVersion": 2, "manifests": [top]})).unwrap(),
    )
    .unwrap();
    std::fs::write(layout.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
    own_layers
}

/// Run skopeo (the independent client) with `args`; its stdout. A failure fails the test
/// with skopeo's own message.
fn skopeo<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Vec<u8> {
    let out = Command::new("skopeo").args(args).output().expect("run skopeo");
    assert!(
        out.status.success(),
        "skopeo {:?}: {}",
        args.iter().map(|a| a.as_ref().to_string_lossy()).collect::<Vec<_>>(),
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// The manifest digest skopeo reads for `reference` in the plain registry.
fn skopeo_digest(reference: &str) -> String {
    let inspect = skopeo(&[
        "--insecure-policy",
        "inspect",
        "--tls-verify=false",
        &format!("docker://{reference}"),
    ]);
    let info: serde_json::Value = serde_json::from_slice(&inspect).unwrap();
    info["Digest"].as_str().expect("a digest").to_string()
}

/// skopeo copies a layout to `reference` in the plain registry.
fn skopeo_push(layout: &Path, reference: &str) {
    skopeo(&[
        "--insecure-policy".to_string(),
        "copy".into(),
        "--all".into(),
        "--dest-tls-verify=false".into(),
        format!("oci:{}:v", layout.display()),
        format!("docker://{reference}"),
    ]);
}

/// Requests in the plain registry's access log for a blob, with their HTTP status.
fn blob_gets(log: &Path, digest: &str) -> Vec<u16> {
    let text = std::fs::read_to_string(log).unwrap();
    text.lines()
        .filter(|l| l.contains("\"GET /v2/") && l.contains(&format!("/blobs/{digest} ")))
        .filter_map(|l| l.split("HTTP/1.1\" ").nth(1)?.split(' ').next()?.parse().ok())
        .collect()
}

/// A loopback HTTP proxy to `upstream` that sends responses at `rate` bytes per second; its
/// `127.0.0.1:PORT`. One request per connection (it asks upstream to close), which is all a
/// registry client needs.
fn throttling_proxy(upstream: &str, rate: usize) -> String {
    use std::io::Read;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let upstream = upstream.to_string();
    std::thread::spawn(move || {
        for client in listener.incoming().flatten() {
            let upstream = upstream.clone();
            std::thread::spawn(move || {
                let mut client = client;
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") {
                    if client.read(&mut byte).unwrap_or(0) == 0 {
                        return;
                    }
                    head.push(byte[0]);
                }
                let text = String::from_utf8_lossy(&head).into_owned();
                let mut lines: Vec<String> = text
                    .split("\r\n")
                    .filter(|l| !l.is_empty() && !l.to_ascii_lowercase().starts_with("connection:"))
                    .map(str::to_string)
                    .collect();
                lines.push("Connection: close".into());
                let Ok(mut server) = std::net::TcpStream::connect(&upstream) else {
                    return;
                };
                if server
                    .write_all(format!("{}\r\n\r\n", lines.join("\r\n")).as_bytes())
                    .is_err()
                {
                    return;
                }
                let chunk = 64 << 10;
                let pause = std::time::Duration::from_secs_f64(chunk as f64 / rate as f64);
                let mut buf = vec![0u8; chunk];
                loop {
                    let n = server.read(&mut buf).unwrap_or(0);
                    if n == 0 || client.write_all(&buf[..n]).is_err() {
                        return;
                    }
                    std::thread::sleep(pause);
                }
            });
        }
    });
    address
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The job's stdout from `apply -o json`.
fn job_stdout(out: &Output) -> String {
    let v = json_of(out);
    v["status"]["result"]["stdout"]
        .as_str()
        .map(str::to_string)
        .unwrap_or_else(|| panic!("no stdout in {v}\nstderr: {}", stderr(out)))
}

#[test]
#[ignore = "needs a private containerd and the test registries: run scripts/test.sh"]
fn push_then_pull_by_tag_and_digest_and_skopeo_reads_what_we_push() {
    let reg = registries();
    let src = Place::new("push-src");
    let name = format!("{}/{}:1", reg.plain, repo("round"));
    src.import_tagged("busybox-oci.tar", "local/busybox:1.35", &name);
    // Plain HTTP is never implied.
    let refused = src.run(&["image", "push", &name]);
    assert!(!refused.status.success());
    assert!(stderr(&refused).contains(&name), "{}", stderr(&refused));
    let pushed = json_of(
        &src.ok(&["--insecure-registry", &reg.plain, "image", "push", &name, "-o", "json"])
            .stdout_last_line(),
    );
    let digest = pushed["digest"].as_str().unwrap().to_string();
    assert!(pushed["uploaded"].as_u64().unwrap() >= 1, "{pushed}");
    // A second push finds everything there.
    let again = stdout(&src.ok(&["--insecure-registry", &reg.plain, "image", "push", &name]));
    assert!(again.contains("0 blobs uploaded"), "{again}");

    // skopeo, an independent client, reads it and checks every blob it copies.
    assert_eq!(skopeo_digest(&name), digest);
    let copy_dir = src.state.path().join("skopeo-copy");
    skopeo(&[
        "--insecure-policy".to_string(),
        "copy".into(),
        "--src-tls-verify=false".into(),
        format!("docker://{name}"),
        format!("oci:{}:x", copy_dir.display()),
    ]);

    // The Python image too (171 MiB): pushed by runner, read by skopeo.
    let py = format!("{}/{}:3.11", reg.plain, repo("round-python"));
    src.import_tagged("python-oci.tar", "local/python:3.11", &py);
    let pushed_py = json_of(
        &src.ok(&["--insecure-registry", &reg.plain, "image", "push", &py, "-o", "json"])
            .stdout_last_line(),
    );
    assert_eq!(skopeo_digest(&py), pushed_py["digest"].as_str().unwrap());

    // Another namespace pulls by tag and by digest, and runs it.
    let dst = Place::new("push-dst");
    let pulled = json_of(
        &dst.ok(&["--insecure-registry", &reg.plain, "image", "pull", &name, "-o", "json"])
            .stdout_last_line(),
    );
    assert_eq!(pulled["name"], name.as_str());
    assert_eq!(pulled["digest"], digest.as_str());
    let by_digest = format!("{}/{}@{digest}", reg.plain, repo("round"));
    dst.ok(&["--insecure-registry", &reg.plain, "image", "pull", &by_digest]);
    let ls = stdout(&dst.ok(&["image", "ls"]));
    assert!(ls.contains(&name) && ls.contains(&by_digest), "{ls}");
    assert!(ls.contains("MiB"), "image ls shows sizes: {ls}");
    // A synchronous garbage collection keeps everything a pulled image needs.
    let lease = dst.ctr(&["leases", "create"]);
    let lease = lease.split_whitespace().next().unwrap().to_string();
    dst.ctr(&["leases", "delete", "--sync", &lease]);
    let out = dst.apply("after-gc", &name, "", "echo ran from the registry", &[]);
    assert_eq!(job_stdout(&out), "ran from the registry\n", "{}", stderr(&out));
    dst.assert_clean();
}

/// The last line of stdout (`-o json` prints events, then the result).
trait LastLine {
    fn stdout_last_line(self) -> Output;
}

impl LastLine for Output {
    fn stdout_last_line(mut self) -> Output {
        let text = String::from_utf8_lossy(&self.stdout).into_owned();
        self.stdout = text.lines().last().unwrap_or_default().as_bytes().to_vec();
        self
    }
}

#[test]
#[ignore = "needs a private containerd and the test registries: run scripts/test.sh"]
fn a_multi_platform_index_resolves_to_this_machine_and_platform_picks_another() {
    let reg = registries();
    let place = Place::new("multi");
    let work = tempfile::tempdir().unwrap();
    oci_layout(work.path(), &["amd64", "arm64"], None, 1024);
    let name = format!("{}/{}:v", reg.plain, repo("multi"));
    skopeo_push(&work.path().join("layout"), &name);
    let pulled = json_of(
        &place
            .ok(&["--insecure-registry", &reg.plain, "image", "pull", &name, "-o", "json"])
            .stdout_last_line(),
    );
    assert_eq!(pulled["platform"], "linux/amd64");
    let out = place.apply("multi", &name, "", "cat /platform", &[]);
    assert_eq!(job_stdout(&out), "amd64");
    // Another platform is pulled when asked for (it cannot run here).
    let arm = Place {
        namespace: format!("{}-arm", place.namespace),
        state: tempfile::tempdir().unwrap(),
        docker_config: None,
    };
    let pulled = json_of(
        &arm.ok(&[
            "--insecure-registry",
            &reg.plain,
            "image",
            "pull",
            &name,
            "--platform",
            "linux/arm64",
            "-o",
            "json",
        ])
        .stdout_last_line(),
    );
    assert_eq!(pulled["platform"], "linux/arm64");
    let missing = arm.run(&[
        "--insecure-registry",
        &reg.plain,
        "image",
        "pull",
        &name,
        "--platform",
        "linux/s390x",
    ]);
    assert!(!missing.status.success());
    assert!(
        stderr(&missing).contains("no manifest for linux/s390x"),
        "{}",
        stderr(&missing)
    );
    place.assert_clean();
}

#[test]
#[ignore = "needs a private containerd and the test registries: run scripts/test.sh"]
fn concurrent_pulls_download_each_blob_once() {
    let reg = registries();
    let place = Place::new("concurrent");
    let work = tempfile::tempdir().unwrap();
    let layers = oci_layout(work.path(), &["amd64"], None, 48 << 20);
    let name = format!("{}/{}:v", reg.plain, repo("concurrent"));
    skopeo_push(&work.path().join("layout"), &name);
    let pulls: Vec<_> = (0..3)
        .map(|_| {
            place
                .command(&["--insecure-registry", &reg.plain, "image", "pull", &name])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for p in pulls {
        let out = p.wait_with_output().unwrap();
        assert!(out.status.success(), "{}", stderr(&out));
    }
    // The registry logs a request once it has answered it: give the last line a moment.
    common::eventually(std::time::Duration::from_secs(5), || {
        !blob_gets(&reg.plain_log, &layers[0]).is_empty()
    });
    std::thread::sleep(std::time::Duration::from_millis(300));
    let gets = blob_gets(&reg.plain_log, &layers[0]);
    assert_eq!(
        gets,
        [206],
        "the 48 MiB layer was downloaded {} times: {gets:?}",
        gets.len()
    );
    let out = place.apply("concurrent", &name, "", "wc -c < /random", &[]);
    assert_eq!(job_stdout(&out).trim(), (48u64 << 20).to_string());
    place.assert_clean();
}

#[test]
#[ignore = "needs a private containerd and the test registries: run scripts/test.sh"]
fn an_interrupted_pull_resumes_where_it_stopped() {
    let reg = registries();
    let place = Place::new("resume");
    let work = tempfile::tempdir().unwrap();
    let size = 64usize << 20;
    let layers = oci_layout(work.path(), &["amd64"], None, size);
    let path = format!("{}:v", repo("resume"));
    skopeo_push(&work.path().join("layout"), &format!("{}/{path}", reg.plain));
    // Pulled through a proxy that passes ~32 MB/s: slow enough to interrupt mid-layer.
    let proxy = throttling_proxy(&reg.plain, 32 << 20);
    let name = format!("{proxy}/{path}");
    let mut pull = place
        .command(&["--insecure-registry", &proxy, "image", "pull", &name, "-o", "json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Ctrl-C once a quarter of the big layer is stored.
    let reader = std::io::BufReader::new(pull.stdout.take().unwrap());
    let mut interrupted_at = 0;
    for line in reader.lines() {
        let event: serde_json::Value = serde_json::from_str(&line.unwrap()).unwrap();
        if event["digest"] == layers[0].as_str() && event["done"].as_u64().unwrap_or(0) > (size as u64) / 4 {
            interrupted_at = event["done"].as_u64().unwrap();
            nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pull.id() as i32),
                nix::sys::signal::Signal::SIGINT,
            )
            .unwrap();
            break;
        }
    }
    let status = pull.wait().unwrap();
    assert!(
        interrupted_at > 0 && !status.success(),
        "the pull was not interrupted mid-layer"
    );
    assert!(
        !place.has_blob(&layers[0]),
        "an interrupted layer must not be committed"
    );
    let out = place.ok(&["--insecure-registry", &proxy, "image", "pull", &name, "-o", "json"]);
    let pulled = json_of(&out.stdout_last_line());
    let downloaded = pulled["downloaded"].as_u64().unwrap();
    assert!(
        downloaded < size as u64,
        "the second pull downloaded {downloaded} bytes of {size}: it did not resume"
    );
    common::eventually(std::time::Duration::from_secs(5), || {
        blob_gets(&reg.plain_log, &layers[0]).len() >= 2
    });
    let gets = blob_gets(&reg.plain_log, &layers[0]);
    assert_eq!(
        gets,
        [206, 206],
        "one interrupted download, one resumed from an offset: {gets:?}"
    );
    let run = place.apply("resumed", &name, "", "sha256sum /random | cut -c1-64", &[]);
    // The layer's content is whole: the file's hash is the one written into the layout.
    let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(
        std::fs::File::open(
            work.path()
                .join("layout/blobs/sha256")
                .join(layers[0].trim_start_matches("sha256:")),
        )
        .unwrap(),
    ));
    let mut want = String::new();
    for entry in tar.entries().unwrap() {
        let mut entry = entry.unwrap();
        if entry.path().unwrap().to_str() == Some("random") {
            let mut data = Vec::new();
            std::io::Read::read_to_end(&mut entry, &mut data).unwrap();
            want = sha256_hex(&data);
        }
    }
    assert_eq!(job_stdout(&run).trim(), want);
    // The interrupted pull's lease protected its partial layer; it expires by itself, and
    // the test drops it so the namespace ends empty.
    for lease in place.ctr(&["leases", "ls", "-q"]).lines() {
        place.ctr(&["leases", "delete", lease.trim()]);
    }
    place.assert_clean();
}

#[test]
#[ignore = "needs a private containerd and the test registries: run scripts/test.sh"]
fn a_corrupt_blob_is_refused_and_nothing_is_stored() {
    let reg = registries();
    let place = Place::new("corrupt");
    let work = tempfile::tempdir().unwrap();
    let layers = oci_layout(work.path(), &["amd64"], None, 1 << 20);
    let name = format!("{}/{}:v", reg.plain, repo("corrupt"));
    skopeo_push(&work.path().join("layout"), &name);
    // Edit the registry's storage: same size, other bytes, served under the old digest.
    let hex = layers[0].trim_start_matches("sha256:");
    let data = reg
        .plain_data
        .join("docker/registry/v2/blobs/sha256")
        .join(&hex[..2])
        .join(hex)
        .join("data");
    let mut bytes = std::fs::read(&data).unwrap();
    let n = bytes.len();
    bytes[n - 2000] ^= 0xff;
    std::fs::File::create(&data).unwrap().write_all(&bytes).unwrap();
    let out = place.run(&["--insecure-registry", &reg.plain, "image", "pull", &name]);
    assert!(!out.status.success(), "a corrupt blob was accepted");
    let err = stderr(&out);
    assert!(err.contains(&layers[0]) && err.contains("digest"), "{err}");
    assert!(!place.has_blob(&layers[0]), "the corrupt blob was stored");
    assert!(!stdout(&place.ok(&["image", "ls"])).contains(&name));
    // A later pull must not trust the bytes the failed one wrote: it fails the same way.
    let again = place.run(&["--insecure-registry", &reg.plain, "image", "pull", &name]);
    assert!(!again.status.success());
    place.assert_clean();
}

#[test]
#[ignore = "needs a private containerd and the test registries: run scripts/test.sh"]
fn a_tls_registry_with_auth_takes_a_ca_from_hosts_toml_and_docker_credentials() {
    let reg = registries();
    let mut place = Place::new("tls");
    let hosts = place.state.path().join("hosts");
    std::fs::create_dir_all(hosts.join(&reg.tls)).unwrap();
    std::fs::write(
        hosts.join(&reg.tls).join("hosts.toml"),
        format!("server = \"https://{}\"\nca = \"{}\"\n", reg.tls, reg.ca.display()),
    )
    .unwrap();
    let config = |password: &str| {
        let dir = place.state.path().join(format!("docker-{password}"));
        std::fs::create_dir_all(&dir).unwrap();
        let auth = base64_encode(format!("{}:{password}", reg.user).as_bytes());
        std::fs::write(
            dir.join("config.json"),
            format!("{{\"auths\":{{\"{}\":{{\"auth\":\"{auth}\"}}}}}}", reg.tls),
        )
        .unwrap();
        dir
    };
    let good = config(&reg.password);
    let bad = config("wrong");
    let name = format!("{}/{}:1", reg.tls, repo("tls"));
    place.import_tagged("busybox-oci.tar", "local/busybox:1.35", &name);
    let hosts_arg = hosts.to_str().unwrap();
    // Without the CA: the TLS failure, named.
    place.docker_config = Some(good.clone());
    let out = place.run(&["image", "push", &name]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("UnknownIssuer") || stderr(&out).contains("certificate"),
        "{}",
        stderr(&out)
    );
    place.ok(&["--hosts-dir", hosts_arg, "image", "push", &name]);
    // Pull into a namespace of its own: the wrong password is a clear 401.
    let mut dst = Place::new("tls-dst");
    dst.docker_config = Some(bad);
    let out = dst.run(&["--hosts-dir", hosts_arg, "image", "pull", &name]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("401") && err.contains(&name), "{err}");
    // A credential helper (`credHelpers`), as Docker runs them: `docker-credential-NAME get`
    // with the server on stdin, JSON on stdout.
    let helpers = place.state.path().join("helpers");
    std::fs::create_dir_all(&helpers).unwrap();
    let helper = helpers.join("docker-credential-runnertest");
    std::fs::write(
        &helper,
        format!(
            "#!/bin/sh\n[ \"$1\" = get ] || exit 1\nread server\n[ \"$server\" = {} ] || exit 1\nprintf '{{\"ServerURL\":\"%s\",\"Username\":\"{}\",\"Secret\":\"{}\"}}' \"$server\"\n",
            reg.tls, reg.user, reg.password
        ),
    )
    .unwrap();
    std::fs::set_permissions(&helper, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let helper_config = place.state.path().join("docker-helper");
    std::fs::create_dir_all(&helper_config).unwrap();
    std::fs::write(
        helper_config.join("config.json"),
        format!("{{\"credHelpers\":{{\"{}\":\"runnertest\"}}}}", reg.tls),
    )
    .unwrap();
    dst.docker_config = Some(helper_config);
    let path = format!("{}:{}", helpers.display(), std::env::var("PATH").unwrap_or_default());
    let out = dst
        .command(&["--hosts-dir", hosts_arg, "image", "pull", &name])
        .env("PATH", path)
        .output()
        .unwrap();
    assert!(out.status.success(), "pull with a credential helper: {}", stderr(&out));
    dst.ctr(&["images", "rm", &name]);
    dst.docker_config = Some(good);
    dst.ok(&["--hosts-dir", hosts_arg, "image", "pull", &name]);
    // Unknown tags carry the registry's own message.
    let out = dst.run(&[
        "--hosts-dir",
        hosts_arg,
        "image",
        "pull",
        &format!("{}/{}:nope", reg.tls, repo("tls")),
    ]);
    assert!(stderr(&out).contains("MANIFEST_UNKNOWN"), "{}", stderr(&out));
    // The job's supervisor pulls with the same settings (IfNotPresent: present, so none).
    let out = dst.apply("tls", &name, "", "echo over tls", &["--hosts-dir", hosts_arg]);
    assert_eq!(job_stdout(&out), "over tls\n", "{}", stderr(&out));
    dst.assert_clean();
}

#[test]
#[ignore = "needs a private containerd and the test registries: run scripts/test.sh"]
fn a_registry_that_demands_a_client_certificate_gets_one_from_hosts_toml_or_certs_d() {
    let reg = registries();
    let var = |name: &str| PathBuf::from(std::env::var(name).unwrap_or_else(|_| panic!("{name}: run scripts/test.sh")));
    let mtls = std::env::var("RUNNER_TEST_MTLS_REGISTRY").expect("RUNNER_TEST_MTLS_REGISTRY: run scripts/test.sh");
    let (cert, key) = (var("RUNNER_TEST_MTLS_CLIENT_CERT"), var("RUNNER_TEST_MTLS_CLIENT_KEY"));
    let (stranger_cert, stranger_key) = (
        var("RUNNER_TEST_MTLS_STRANGER_CERT"),
        var("RUNNER_TEST_MTLS_STRANGER_KEY"),
    );
    let mut place = Place::new("mtls");
    let docker = place.state.path().join("docker");
    std::fs::create_dir_all(&docker).unwrap();
    let auth = base64_encode(format!("{}:{}", reg.user, reg.password).as_bytes());
    std::fs::write(
        docker.join("config.json"),
        format!("{{\"auths\":{{\"{mtls}\":{{\"auth\":\"{auth}\"}}}}}}"),
    )
    .unwrap();
    place.docker_config = Some(docker.clone());
    // containerd's hosts.toml: `client` as a [certificate, key] pair.
    let hosts_toml = |dir: &str, client: (&Path, &Path)| {
        let hosts = place.state.path().join(dir);
        std::fs::create_dir_all(hosts.join(&mtls)).unwrap();
        std::fs::write(
            hosts.join(&mtls).join("hosts.toml"),
            format!(
                "server = \"https://{mtls}\"\nca = \"{}\"\nclient = [[\"{}\", \"{}\"]]\n",
                reg.ca.display(),
                client.0.display(),
                client.1.display()
            ),
        )
        .unwrap();
        hosts.to_str().unwrap().to_string()
    };
    let good = hosts_toml("hosts", (&cert, &key));
    let stranger = hosts_toml("stranger", (&stranger_cert, &stranger_key));
    let name = format!("{mtls}/{}:1", repo("mtls"));
    place.import_tagged("busybox-oci.tar", "local/busybox:1.35", &name);
    // A certificate the registry does not trust, and none at all: refused at the handshake,
    // and the error says so.
    for hosts in [
        &stranger,
        &place.state.path().join("no-hosts").to_str().unwrap().to_string(),
    ] {
        let out = place.run(&["--hosts-dir", hosts, "image", "push", &name]);
        assert!(!out.status.success());
        let err = stderr(&out);
        assert!(
            err.contains(&name) && (err.contains("certificate") || err.contains("handshake") || err.contains("alert")),
            "{err}"
        );
    }
    place.ok(&["--hosts-dir", &good, "image", "push", &name]);
    // skopeo, an independent client, reads it with Docker's certs.d layout.
    let certs_d = place.state.path().join("certs.d").join(&mtls);
    std::fs::create_dir_all(&certs_d).unwrap();
    std::fs::copy(&reg.ca, certs_d.join("ca.crt")).unwrap();
    std::fs::copy(&cert, certs_d.join("client.cert")).unwrap();
    std::fs::copy(&key, certs_d.join("client.key")).unwrap();
    skopeo(&[
        "inspect".to_string(),
        "--raw".into(),
        "--cert-dir".into(),
        certs_d.display().to_string(),
        "--creds".into(),
        format!("{}:{}", reg.user, reg.password),
        format!("docker://{name}"),
    ]);
    // Pulled back into a namespace of its own through Docker's certs.d layout (`*.crt` roots,
    // `NAME.cert` + `NAME.key`): the wrong password is still a clear 401 through the bridge.
    let certs_root = place.state.path().join("certs.d");
    let certs_arg = certs_root.to_str().unwrap();
    let mut dst = Place::new("mtls-dst");
    let wrong = dst.state.path().join("docker-wrong");
    std::fs::create_dir_all(&wrong).unwrap();
    std::fs::write(
        wrong.join("config.json"),
        format!(
            "{{\"auths\":{{\"{mtls}\":{{\"auth\":\"{}\"}}}}}}",
            base64_encode(format!("{}:wrong", reg.user).as_bytes())
        ),
    )
    .unwrap();
    dst.docker_config = Some(wrong);
    let out = dst.run(&["--hosts-dir", certs_arg, "image", "pull", &name]);
    let err = stderr(&out);
    assert!(
        !out.status.success() && err.contains("401") && err.contains(&name),
        "{err}"
    );
    dst.docker_config = Some(docker);
    dst.ok(&["--hosts-dir", certs_arg, "image", "pull", &name]);
    // A job's supervisor pulls through the same bridge (Always: it must ask the registry).
    dst.ctr(&["images", "rm", &name]);
    let out = dst.apply(
        "mtls",
        &name,
        "  imagePullPolicy: Always\n",
        "echo over mutual tls",
        &["--hosts-dir", certs_arg],
    );
    assert_eq!(job_stdout(&out), "over mutual tls\n", "{}", stderr(&out));
    dst.assert_clean();
    place.assert_clean();
}

fn base64_encode(data: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(data)
}

#[test]
#[ignore = "needs a private containerd and the test registries: run scripts/test.sh"]
fn image_pull_policy_has_kubernetes_meaning_on_apply() {
    let reg = registries();
    let place = Place::new("policy");
    let work = tempfile::tempdir().unwrap();
    let name = format!("{}/{}:1", reg.plain, repo("policy"));
    let v1 = work.path().join("v1");
    oci_layout(&v1, &["amd64"], Some("one"), 16);
    skopeo_push(&v1.join("layout"), &name);
    let insecure = ["--insecure-registry", reg.plain.as_str()];

    // Never, and absent: ErrImagePull, nothing pulled.
    let out = place.apply("never", &name, "  imagePullPolicy: Never\n", "cat /platform", &insecure);
    let v = json_of(&out);
    assert_eq!(v["status"]["reason"], "ErrImagePull", "{v}");
    assert!(v["status"]["message"].as_str().unwrap().contains("Never"), "{v}");
    // The default for a tag other than latest is IfNotPresent: pulled now, then used.
    let out = place.apply("first", &name, "", "cat /platform", &insecure);
    assert_eq!(job_stdout(&out), "one", "{}", stderr(&out));
    // The tag moves in the registry.
    let v2 = work.path().join("v2");
    oci_layout(&v2, &["amd64"], Some("two"), 16);
    skopeo_push(&v2.join("layout"), &name);
    let out = place.apply(
        "present",
        &name,
        "  imagePullPolicy: IfNotPresent\n",
        "cat /platform",
        &insecure,
    );
    assert_eq!(job_stdout(&out), "one");
    let out = place.apply(
        "never2",
        &name,
        "  imagePullPolicy: Never\n",
        "cat /platform",
        &insecure,
    );
    assert_eq!(job_stdout(&out), "one");
    let out = place.apply(
        "always",
        &name,
        "  imagePullPolicy: Always\n",
        "cat /platform",
        &insecure,
    );
    assert_eq!(job_stdout(&out), "two", "{}", stderr(&out));
    // Always with the registry unreachable fails, and says a local image exists.
    let out = place.apply("always-down", &name, "  imagePullPolicy: Always\n", "true", &[]);
    let v = json_of(&out);
    assert_eq!(v["status"]["reason"], "ErrImagePull", "{v}");
    assert!(v["status"]["message"].as_str().unwrap().contains("IfNotPresent"), "{v}");
    // A bad value is refused with its place in the file.
    let out = place.apply("bad", &name, "  imagePullPolicy: Sometimes\n", "true", &[]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("imagePullPolicy") && stderr(&out).contains(":6:"),
        "{}",
        stderr(&out)
    );
    place.assert_clean();
}

#[test]
#[ignore = "needs a private containerd and the test registries: run scripts/test.sh"]
fn a_mirror_in_hosts_toml_serves_pulls_of_its_registry() {
    let reg = registries();
    let place = Place::new("mirror");
    let work = tempfile::tempdir().unwrap();
    oci_layout(work.path(), &["amd64"], Some("mirrored"), 16);
    skopeo_push(
        &work.path().join("layout"),
        &format!("{}/{}:v", reg.plain, repo("mirrored")),
    );
    // The registry named in the reference does not exist (nothing listens on port 9).
    let upstream = "127.0.0.1:9";
    let hosts = place.state.path().join("hosts");
    std::fs::create_dir_all(hosts.join(upstream)).unwrap();
    std::fs::write(
        hosts.join(upstream).join("hosts.toml"),
        format!(
            "server = \"https://{upstream}\"\n[host.\"http://{}\"]\n  capabilities = [\"pull\", \"resolve\"]\n",
            reg.plain
        ),
    )
    .unwrap();
    let name = format!("{upstream}/{}:v", repo("mirrored"));
    let out = place.ok(&[
        "--hosts-dir",
        hosts.to_str().unwrap(),
        "image",
        "pull",
        &name,
        "-o",
        "json",
    ]);
    let pulled = json_of(&out.stdout_last_line());
    assert_eq!(pulled["name"], name.as_str());
    assert_eq!(pulled["from"], reg.plain.as_str());
    let out = place.apply("mirror", &name, "", "cat /platform", &[]);
    assert_eq!(job_stdout(&out), "mirrored");
    // Without the mirror, the registry's own failure is reported.
    let out = place.run(&["image", "pull", &name]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains(upstream), "{}", stderr(&out));
    place.assert_clean();
}

#[test]
#[ignore = "needs a private containerd and the test registries: run scripts/test.sh"]
fn sessions_over_http_pull_their_image_by_the_same_policy() {
    let reg = registries();
    let place = Place::new("session");
    let work = tempfile::tempdir().unwrap();
    oci_layout(work.path(), &["amd64"], Some("in a session"), 16);
    let name = format!("{}/{}:v", reg.plain, repo("session"));
    skopeo_push(&work.path().join("layout"), &name);
    let server = common::serve_with(place.command(&["--insecure-registry", &reg.plain]), place.state.path());
    let call = |method: &str, path: &str, body: Option<&str>| server.call(method, path, body);
    let (code, session) = call(
        "POST",
        "/v1/sessions",
        Some(&format!(r#"{{"environment": {{"image": "{name}"}}}}"#)),
    );
    assert_eq!(code, 201, "{session}");
    let id = session["id"].as_str().unwrap().to_string();
    let (code, out) = call(
        "POST",
        &format!("/v1/sessions/{id}/exec"),
        Some(r#"{"command": ["cat", "/platform"]}"#),
    );
    assert_eq!((code, out["stdout"].as_str()), (200, Some("in a session")), "{out}");
    assert_eq!(call("DELETE", &format!("/v1/sessions/{id}"), None).0, 204);
    // An image the registry does not have: the request is refused with the registry's answer.
    let missing = format!("{}/{}:v", reg.plain, repo("no-such-image"));
    let (code, err) = call(
        "POST",
        "/v1/sessions",
        Some(&format!(r#"{{"environment": {{"image": "{missing}"}}}}"#)),
    );
    assert_eq!(code, 422, "{err}");
    assert!(
        err.to_string().contains("MANIFEST_UNKNOWN") || err.to_string().contains("NAME_UNKNOWN"),
        "{err}"
    );
    drop(server);
    place.assert_clean();
}

/// Push and pull read one host configuration, whichever way the CA is named: `ca` at the top
/// of hosts.toml, `ca` in a `[host]` entry that takes pushes (pull went to the entry, push to
/// the `server` without a CA: UnknownIssuer), a Docker-style `ca.crt` with no hosts.toml, and
/// a hosts.toml without a CA beside a `ca.crt` — in the state dir's own `certs.d`.
#[test]
#[ignore = "needs the test registries: run scripts/test.sh"]
fn push_and_pull_read_one_host_configuration_whatever_names_the_ca() {
    let reg = registries();
    let ca = reg.ca.display().to_string();
    let tls = reg.tls.clone();
    let layouts: [(&str, Option<String>, bool); 4] = [
        (
            "top",
            Some(format!("server = \"https://{tls}\"\nca = \"{ca}\"\n")),
            false,
        ),
        (
            "host",
            Some(format!(
                "server = \"https://{tls}\"\n[host.\"https://{tls}\"]\n  capabilities = [\"pull\", \"resolve\", \"push\"]\n  ca = \"{ca}\"\n"
            )),
            false,
        ),
        ("docker", None, true),
        (
            "beside",
            Some(format!(
                "server = \"https://{tls}\"\n[host.\"https://{tls}\"]\n  capabilities = [\"pull\", \"resolve\", \"push\"]\n"
            )),
            true,
        ),
    ];
    for (what, hosts_toml, crt) in layouts {
        let mut place = Place::new(&format!("ca-{what}"));
        let dir = place.state.path().join("certs.d").join(&tls);
        std::fs::create_dir_all(&dir).unwrap();
        if let Some(text) = &hosts_toml {
            std::fs::write(dir.join("hosts.toml"), text).unwrap();
        }
        if crt {
            std::fs::copy(&reg.ca, dir.join("ca.crt")).unwrap();
        }
        let docker = place.state.path().join("docker");
        std::fs::create_dir_all(&docker).unwrap();
        let auth = base64_encode(format!("{}:{}", reg.user, reg.password).as_bytes());
        std::fs::write(
            docker.join("config.json"),
            format!("{{\"auths\":{{\"{tls}\":{{\"auth\":\"{auth}\"}}}}}}"),
        )
        .unwrap();
        place.docker_config = Some(docker);
        let name = format!("{tls}/{}:1", repo(&format!("ca-{what}")));
        place.import_tagged("busybox-oci.tar", "local/busybox:1.35", &name);
        let pushed = place.run(&["image", "push", &name]);
        assert!(pushed.status.success(), "{what}: push: {}", stderr(&pushed));
        place.ctr(&["images", "rm", &name]);
        let pulled = place.run(&["image", "pull", &name]);
        assert!(pulled.status.success(), "{what}: pull: {}", stderr(&pulled));
        eprintln!("ca named {what}: push and pull both went through");
    }
}

/// A misspelled local image is said to be missing first, with the local image it was likely
/// meant to be, before the registry's own failure; `validate` warns about it (exit 0).
#[test]
#[ignore = "needs the test registries: run scripts/test.sh"]
fn a_misspelled_local_image_is_named_missing_with_the_closest_local_one() {
    let place = Place::new("typo");
    // A registry on a closed loopback port: its pull fails at once, with no DNS or network.
    place.import_tagged(
        "busybox-oci.tar",
        "local/busybox:1.35",
        "127.0.0.1:9/tools/busybox:1.35",
    );
    let typo = "127.0.0.1:9/tools/busybx:1.35";
    let manifest = format!(
        "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {{name: e}}\nspec:\n  image: {typo}\n---\napiVersion: runner/v1alpha1\nkind: Job\nmetadata: {{name: typo}}\nspec:\n  environment: e\n  command: [\"true\"]\n"
    );
    let file = place.state.path().join("typo.yaml");
    std::fs::write(&file, manifest).unwrap();
    let file = file.to_str().unwrap();
    let validated = place.run(&["validate", "-f", file]);
    assert!(validated.status.success(), "{}", stderr(&validated));
    let warning = stderr(&validated);
    assert!(
        warning.contains(&format!(
            "image {typo:?} is not present locally (did you mean 127.0.0.1:9/tools/busybox:1.35?)"
        )),
        "{warning}"
    );
    let applied = place.run(&["apply", "-f", file, "-o", "json"]);
    assert_eq!(applied.status.code(), Some(1), "{}", stderr(&applied));
    let job: serde_json::Value = serde_json::from_slice(&applied.stdout).unwrap();
    let message = job["status"]["message"].as_str().unwrap_or_default();
    assert_eq!(job["status"]["reason"], "ErrImagePull", "{job}");
    assert!(
        message.starts_with(&format!(
            "image {typo:?} is not present locally (did you mean 127.0.0.1:9/tools/busybox:1.35? see `runner image ls`), and pulling it failed:"
        )),
        "{message}"
    ); // A pull's failure names the image as written, then the full name it stands for.
    let pulled = place.run(&["image", "pull", "127.0.0.1:9/tools/busybx"]);
    assert_eq!(pulled.status.code(), Some(2));
    assert!(
        stderr(&pulled)
            .contains("pulling 127.0.0.1:9/tools/busybx (127.0.0.1:9/tools/busybx:latest) from 127.0.0.1:9:"),
        "{}",
        stderr(&pulled)
    );
}
