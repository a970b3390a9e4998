//! Live sessions: a sandbox that stays up for many calls — commands, a stateful shell, a
//! persistent Python interpreter, files in its workspace. `SessionManager` owns them; a call
//! holds a `Lease`, and a leased session is never reaped as idle.

mod checkpoint;
mod files;
mod output;
mod pause;
mod python;
mod resident;
mod scratch;
mod shell;
pub mod swerex;
pub mod terminal;
pub mod usage;
pub mod watch;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::Value;
use tokio::sync::mpsc;

pub use checkpoint::{CheckpointView, Forked, collect as collect_checkpoints};
pub use files::Download;
pub use output::ShellOutput;
pub use pause::{Hold, PausePolicy, SessionState};
pub use scratch::{SCRATCH_PREFIX, scratch_abandoned};
pub use shell::{Check, SHELL_GONE, ShellRequest};

use super::{Context, ServiceError};
use crate::confined::Owner;
use crate::manifest::{self, Backend};
use crate::runtime::host::HostRuntime;
use crate::runtime::{ExecRequest, ExecResult, Runtime, RuntimeEvent};
use crate::spec;
use scratch::{Scratch, ScratchDir};

/// The default name of a session's inline Environment.
const INLINE_ENV: &str = "session-env";

/// The Environment a session runs in.
#[derive(Clone, Debug)]
pub enum EnvironmentRef {
    /// One of the config's env dir.
    Name(String),
    /// An Environment's `spec` object.
    Spec(serde_json::Map<String, Value>),
    /// A whole Environment document (apiVersion, kind, metadata, spec), as in a manifest.
    Document(serde_json::Map<String, Value>),
}

impl EnvironmentRef {
    /// From JSON: a name, a whole document (it has `kind` or `apiVersion`), or a spec object.
    pub fn from_json(value: Value) -> Result<Self, ServiceError> {
        match value {
            Value::String(name) => Ok(EnvironmentRef::Name(name)),
            Value::Object(doc) if doc.contains_key("kind") || doc.contains_key("apiVersion") => {
                Ok(EnvironmentRef::Document(doc))
            }
            Value::Object(spec) => Ok(EnvironmentRef::Spec(spec)),
            _ => Err(ServiceError::field(
                "environment",
                "an Environment (a whole document, or its spec object) or the name of one",
            )),
        }
    }

    /// The Environment's name and, unless it is named, its document.
    fn document(&self) -> Result<(String, Option<Value>), ServiceError> {
        match self {
            EnvironmentRef::Name(name) => Ok((name.clone(), None)),
            EnvironmentRef::Spec(spec) => Ok((
                INLINE_ENV.to_string(),
                Some(serde_json::json!({
                    "apiVersion": manifest::API_VERSION, "kind": "Environment",
                    "metadata": {"name": INLINE_ENV}, "spec": spec,
                })),
            )),
            EnvironmentRef::Document(doc) => environment_document(doc),
        }
    }
}

/// A whole Environment document, checked for what the manifest parser cannot see here (its
/// kind and version), with errors named `environment.*`.
fn environment_document(doc: &serde_json::Map<String, Value>) -> Result<(String, Option<Value>), ServiceError> {
    const FIELDS: [&str; 4] = ["apiVersion", "kind", "metadata", "spec"];
    let got = |v: Option<&Value>| v.map_or("nothing".to_string(), |v| v.to_string());
    if let Some(unknown) = doc.keys().find(|k| !FIELDS.contains(&k.as_str())) {
        return Err(ServiceError::field(
            format!("environment.{unknown}"),
            "unknown field (an Environment document has apiVersion, kind, metadata, spec)",
        ));
    }
    match doc.get("apiVersion") {
        Some(Value::String(v)) if v == manifest::API_VERSION => {}
        other => {
            return Err(ServiceError::field(
                "environment.apiVersion",
                format!("expected {:?}, got {}", manifest::API_VERSION, got(other)),
            ));
        }
    }
    match doc.get("kind") {
        Some(Value::String(k)) if k == "Environment" => {}
        other => {
            return Err(ServiceError::field(
                "environment.kind",
                format!("expected \"Environment\", got {}", got(other)),
            ));
        }
    }
    if !doc.get("spec").is_some_and(Value::is_object) {
        return Err(ServiceError::field("environment.spec", "an object is required"));
    }
    let name = match doc.get("metadata") {
        None => INLINE_ENV.to_string(),
        Some(Value::Object(meta)) => match meta.get("name") {
            None => INLINE_ENV.to_string(),
            Some(Value::String(n)) => n.clone(),
            Some(other) => {
                return Err(ServiceError::field(
                    "environment.metadata.name",
                    format!("a string is required, got {other}"),
                ));
            }
        },
        Some(other) => {
            return Err(ServiceError::field(
                "environment.metadata",
                format!("an object is required, got {other}"),
            ));
        }
    };
    let mut doc = Value::Object(doc.clone());
    doc["metadata"]["name"] = name.clone().into();
    Ok((name, Some(doc)))
}

/// A manifest error in a document the session built from the request, as an error of the
/// request's field: `spec.` (the document's) becomes `prefix`.
fn request_field(e: manifest::ManifestError, spec: &str, prefix: &str) -> ServiceError {
    let path = &e.origin.path;
    let field = match path.strip_prefix(spec) {
        Some(rest) => format!("{prefix}{rest}"),
        None if path.is_empty() => prefix.trim_end_matches('.').to_string(),
        None => format!("{}{path}", prefix.trim_end_matches("spec.")),
    };
    let field = if field.is_empty() { "request".to_string() } else { field };
    ServiceError::field(field, e.kind.to_string())
}

/// The programs every containerd session's sandbox gets (pool members carry them too).
pub fn tools() -> Vec<crate::runtime::Tool> {
    vec![python::DRIVER]
}

/// What a new session needs.
#[derive(Clone, Debug)]
pub struct NewSession {
    pub environment: EnvironmentRef,
    /// A host directory to work in (default: a fresh scratch directory, removed with the
    /// session).
    pub workspace: Option<String>,
    /// As a Job's `staticAssets` and `mounts` (manifest syntax).
    pub static_assets: Vec<Value>,
    pub mounts: Vec<Value>,
    /// Run on this backend instead of the Environment's.
    pub backend: Option<Backend>,
    /// Claim a warm pool's member when one fits (`false`: a sandbox of its own, which can be
    /// checkpointed).
    pub use_pool: bool,
    /// How it pauses and resumes.
    pub pause: PausePolicy,
}

impl NewSession {
    pub fn new(environment: EnvironmentRef) -> Self {
        NewSession {
            environment,
            workspace: None,
            static_assets: Vec::new(),
            mounts: Vec::new(),
            backend: None,
            use_pool: true,
            pause: PausePolicy::default(),
        }
    }
}

/// A session as callers see it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SessionView {
    pub id: String,
    pub backend: Backend,
    pub workspace: PathBuf,
    pub created: String,
    pub idle_seconds: u64,
    /// Calls in progress.
    pub active_calls: usize,
    /// The warm pool whose member the sandbox is (absent: a container made for it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// Its address and published ports (`network: bridge`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<crate::runtime::NetworkStatus>,
    /// Running, or paused (its processes frozen).
    pub state: SessionState,
    /// When it was paused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused_since: Option<String>,
    /// A call to it while paused resumes it first.
    pub auto_resume: bool,
    /// It pauses itself once idle this long.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_pause_seconds: Option<u64>,
}

/// One live sandbox and what lives in it between calls.
pub struct Session {
    pub id: String,
    /// What made it (a checkpoint of it is restored from the same request).
    request: NewSession,
    runtime: Arc<dyn Runtime>,
    workspace: PathBuf,
    /// Who owns what the file operations create in the workspace: the sandbox's user.
    owner: Option<Owner>,
    _scratch: Option<ScratchDir>,
    /// A host session's private directory for its shells' state.
    host_shell_dir: Option<tempfile::TempDir>,
    backend: Backend,
    created: String,
    last_used: Mutex<Instant>,
    /// Calls holding a lease on the session.
    in_use: AtomicUsize,
    python: tokio::sync::Mutex<Option<python::Driver>>,
    /// The shell interpreter of the image (bash when present), found on first use (host
    /// sessions, whose shells run per call).
    shell_bin: tokio::sync::OnceCell<String>,
    /// A sandbox's resident shells by name: `default` from the start, the others on first use.
    shells: Mutex<HashMap<String, Arc<tokio::sync::Mutex<Option<resident::Resident>>>>>,
    /// Bytes of output kept per shell call.
    output_limit: usize,
    /// What SWE-ReX's protocol keeps of this session (its bash sessions, its last answer).
    swerex: swerex::Swerex,
    /// Whether it is paused, and how it pauses and resumes.
    pause: pause::PauseState,
    /// Terminals open now (see `terminal`).
    terminals: Arc<AtomicUsize>,
    /// Watches of the workspace open now (see `watch`).
    watchers: Arc<AtomicUsize>,
}

impl Session {
    fn view(&self) -> SessionView {
        SessionView {
            id: self.id.clone(),
            backend: self.backend,
            workspace: self.workspace.clone(),
            created: self.created.clone(),
            idle_seconds: self.idle().as_secs(),
            active_calls: self.in_use.load(Ordering::SeqCst).saturating_sub(self.pause.held()),
            pool: self.runtime.pool().map(String::from),
            network: self.runtime.network().cloned(),
            state: if self.runtime.ended() {
                pause::SessionState::Ended
            } else {
                self.pause.state()
            },
            paused_since: self.pause.since(),
            auto_resume: self.pause.policy.auto_resume,
            idle_pause_seconds: self.pause.policy.idle_pause.map(|d| d.as_secs()),
        }
    }

    fn idle(&self) -> Duration {
        if self.in_use.load(Ordering::SeqCst) > 0 {
            return Duration::ZERO;
        }
        self.last_used.lock().expect("session lock").elapsed()
    }

    fn shell_dir(&self) -> String {
        match &self.host_shell_dir {
            Some(dir) => dir.path().to_string_lossy().into_owned(),
            None => shell::SANDBOX_SHELL_DIR.to_string(),
        }
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    pub fn workspace(&self) -> &Path {
        &self.workspace
    }

    /// What SWE-ReX's protocol keeps of this session.
    pub fn swerex(&self) -> &swerex::Swerex {
        &self.swerex
    }

    /// Run a command to its end (or its timeout).
    pub async fn exec(&self, request: ExecRequest) -> Result<ExecResult, ServiceError> {
        check_request(&request)?;
        Ok(self.runtime.execute(request).await?)
    }

    /// Stop the running command (and its process tree), if one runs.
    pub async fn kill(&self) -> Result<(), ServiceError> {
        Ok(self.runtime.kill().await?)
    }

    /// Start a command; its output as it happens, `Exit` last. Streams take no stdin.
    pub async fn stream(&self, request: ExecRequest) -> Result<mpsc::Receiver<RuntimeEvent>, ServiceError> {
        check_request(&request)?;
        if request.stdin.is_some() {
            return Err(ServiceError::field("stdin", "streaming takes no stdin (use exec)"));
        }
        if !request.env.is_empty() {
            return Err(ServiceError::field("env", "streaming takes no env (use exec)"));
        }
        if request.cwd.is_some() {
            return Err(ServiceError::field("cwd", "streaming takes no cwd (use exec)"));
        }
        Ok(self.runtime.stream(request.argv, request.timeout).await?)
    }
}

impl Session {
    /// Replace the session's egress (`egress.allow`, checked as a manifest's is): at once,
    /// and what is no longer allowed is cut, established connections included. Only for a
    /// session on a bridge network.
    pub async fn set_egress(&self, allow: &[String]) -> Result<SessionView, ServiceError> {
        let egress = parse_egress(allow)?;
        if self.runtime.network().is_none() {
            return Err(ServiceError::Conflict(format!(
                "session {} is on no bridge network: egress is for Environments with network: bridge or a named network",
                self.id
            )));
        }
        self.runtime.set_egress(egress).await?;
        Ok(self.view())
    }
}

/// `egress.allow` entries as the manifest reads them (addresses or CIDRs with an optional port,
/// domains), each error with its place.
pub fn parse_egress(allow: &[String]) -> Result<crate::net::Egress, ServiceError> {
    let mut egress = crate::net::Egress::default();
    for (i, text) in allow.iter().enumerate() {
        match crate::manifest::EgressEntry::parse(text) {
            Ok(crate::manifest::EgressEntry::Cidr(rule)) => egress.cidrs.push(rule),
            Ok(crate::manifest::EgressEntry::Domain(domain)) => egress.domains.push(domain),
            Err(message) => return Err(ServiceError::field(format!("egress.allow[{i}]"), message)),
        }
    }
    Ok(egress)
}

fn check_request(request: &ExecRequest) -> Result<(), ServiceError> {
    if request.argv.is_empty() || request.argv[0].is_empty() {
        return Err(ServiceError::field("command", "must not be empty"));
    }
    if let Some(cwd) = &request.cwd {
        manifest::paths::check_lexical(cwd).map_err(|e| ServiceError::field("cwd", e.to_string()))?;
    }
    Ok(())
}

/// A session held by a call: while any lease lives, the session is not idle.
pub struct Lease(Arc<Session>);

impl std::ops::Deref for Lease {
    type Target = Session;
    fn deref(&self) -> &Session {
        &self.0
    }
}

impl Clone for Lease {
    fn clone(&self) -> Self {
        self.0.in_use.fetch_add(1, Ordering::SeqCst);
        Lease(self.0.clone())
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        // Idle time counts from the end of the last call.
        *self.0.last_used.lock().expect("session lock") = Instant::now();
        self.0.in_use.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Every session of a process (`runner serve`, or a library user).
pub struct SessionManager {
    ctx: Context,
    sessions: Mutex<HashMap<String, Arc<Session>>>,
    idle_ttl: Duration,
    /// What relative paths in a session's mounts and assets resolve against.
    base_dir: PathBuf,
    /// The image each named Environment had when a session last used it: a hint for reading
    /// its image record ahead of the claim (`ImageRead`). Bounded; a stale hint costs a read.
    image_hints: Mutex<HashMap<String, String>>,
    /// The scratch workspaces of sessions created without a workspace.
    scratch: Arc<Scratch>,
}

/// Named Environments whose image hint is kept (past it the hints start over).
const IMAGE_HINTS: usize = 256;

impl SessionManager {
    pub fn new(ctx: Context, idle_ttl: Duration) -> Self {
        SessionManager {
            ctx,
            sessions: Mutex::new(HashMap::new()),
            idle_ttl,
            base_dir: std::env::current_dir().unwrap_or_else(|_| PathBuf::from("/")),
            image_hints: Mutex::default(),
            scratch: Arc::default(),
        }
    }

    /// Start a sandbox; its setup must succeed.
    pub async fn create(&self, request: NewSession) -> Result<SessionView, ServiceError> {
        self.create_or_restore(request, None).await
    }

    /// `create`, or with `restoring`, a sandbox restored from a checkpoint (no setup runs; its
    /// workspace is a copy of the checkpoint's, its processes the checkpoint's).
    async fn create_or_restore(
        &self,
        request: NewSession,
        restoring: Option<checkpoint::Restoring>,
    ) -> Result<SessionView, ServiceError> {
        let t0 = Instant::now();
        let id = format!("s-{}", crate::owner::unique_tag());
        let mut options = self.ctx.runtime_options();
        let image_read = match restoring {
            None if request.use_pool && options.use_pools && !options.pools.is_empty() => {
                self.read_image_ahead(&request)
            }
            _ => None,
        };
        let (env_name, env_doc) = request.environment.document()?;
        let scratch_reserved = request.workspace.is_none().then(|| self.scratch.reserve());
        let workspace = match (&request.workspace, &scratch_reserved) {
            (Some(w), _) => w.clone(),
            (None, Some(t)) => t.path().to_string_lossy().into_owned(),
            (None, None) => unreachable!("a scratch workspace is named when none is given"),
        };
        // One trip to the blocking pool, started now: the scratch workspace made unless it
        // was made ahead (filled from the checkpoint when restoring) and the env dir read
        // while the request's documents are parsed here (they need only the workspace's
        // name); then, given the parsed documents, the Job bound and its plan resolved (which
        // opens the workspace). A request refused here drops the sender: the closure then
        // ends, and drops the scratch workspace it made.
        let (parsed_tx, parsed_rx) = tokio::sync::oneshot::channel::<manifest::ManifestSet>();
        let planned = {
            let (ctx, backend) = (self.ctx.clone(), request.backend);
            let filler = restoring.as_ref().map(checkpoint::Restoring::workspace_filler);
            tokio::task::spawn_blocking(move || {
                shell::claim_phase("manifest: blocking", t0);
                let scratch = match scratch_reserved {
                    Some(reserved) => {
                        let dir = reserved.make()?;
                        if let Some(filler) = &filler {
                            filler.fill(dir.path())?;
                        }
                        Some(dir)
                    }
                    None => None,
                };
                shell::claim_phase("manifest: workspace", t0);
                let env_dir = match &ctx.config.env_dir {
                    Some(dir) => Some((dir.clone(), manifest::load_env_dir_all(dir)?)),
                    None => None,
                };
                shell::claim_phase("manifest: env dir", t0);
                let Ok(mut set) = parsed_rx.blocking_recv() else {
                    return Err(ServiceError::internal(
                        "a session",
                        "its request was refused while it was planned",
                    ));
                };
                if let Some((dir, loaded)) = env_dir {
                    set.use_loaded_env_dir(&dir, loaded);
                }
                let job = set
                    .jobs
                    .first()
                    .cloned()
                    .ok_or_else(|| ServiceError::internal("a session", "its job document vanished"))?;
                let bound = set.bind(&job, backend).map_err(|e| request_field(e, "spec.", ""))?;
                shell::claim_phase("manifest: bound", t0);
                Ok((scratch, spec::resolve(&bound, &ctx.host)?))
            })
        };
        let job_doc = serde_json::json!({
            "apiVersion": manifest::API_VERSION, "kind": "Job",
            "metadata": {"name": id},
            "spec": {
                "environment": env_name, "workspace": workspace,
                "staticAssets": request.static_assets, "mounts": request.mounts, "command": "true",
            },
        });
        // Each document is checked alone first, so an error names the request's own field
        // (`environment.resources.memory`, `staticAssets[0].path`), not a position in text
        // the caller never wrote.
        let env_prefix = match &request.environment {
            EnvironmentRef::Spec(_) => Some("environment."),
            EnvironmentRef::Document(_) => Some("environment.spec."),
            EnvironmentRef::Name(_) => None,
        };
        // The two documents make the session's manifest as they are: not parsed again
        // together (Environments are looked up at bind time, so the Job parses alone).
        let mut set = match (&env_doc, env_prefix) {
            (Some(env), Some(prefix)) => manifest::parse_str(&format!("{env}\n"), &self.base_dir, None)
                .map_err(|e| request_field(e, "spec.", prefix))?,
            _ => manifest::ManifestSet::default(),
        };
        let job = manifest::parse_job_value(&job_doc, &self.base_dir).map_err(|e| request_field(e, "spec.", ""))?;
        set.jobs = vec![job];
        shell::claim_phase("manifest: parsed", t0);
        // A send fails only when the closure ended early: its error is then its answer.
        let _ = parsed_tx.send(set);
        let planned = planned.await.map_err(|e| ServiceError::internal("a worker thread", e));
        if request.workspace.is_none() {
            self.scratch.refill();
        }
        let (scratch, plan) = planned??;
        let mut plan = plan;
        plan.restore = restoring.as_ref().map(|r| r.dir.clone());
        shell::claim_phase("manifest", t0);
        let backend = plan.bound.backend;
        if backend == Backend::Host && request.pause != PausePolicy::default() {
            return Err(ServiceError::field(
                if request.pause.auto_resume {
                    "autoResume"
                } else {
                    "idlePauseSeconds"
                },
                "host sessions cannot be paused (pausing needs the containerd backend)",
            ));
        }
        // Who owns what the file API makes in the workspace. In a user namespace the sandbox
        // sees the workspace through a view that maps only the workspace's owner: the files
        // must be that owner's (anything else would be read-only inside).
        let owner = match (backend, spec::container_user(plan.env(), &self.ctx.host)) {
            (Backend::Containerd, _) if !plan.env().host_users => {
                let (uid, gid) = crate::runtime::containerd::remap::workspace_owner(Path::new(&workspace))
                    .map_err(|e| ServiceError::internal("reading the workspace's owner", e))?;
                Some(Owner { uid, gid })
            }
            (Backend::Containerd, (uid, gid)) if (uid, gid) != (0, 0) => Some(Owner { uid, gid }),
            _ => None,
        };
        if let (EnvironmentRef::Name(name), Backend::Containerd, Some(image)) =
            (&request.environment, backend, &plan.env().image)
        {
            let mut hints = self.image_hints.lock().expect("image hints");
            if hints.len() >= IMAGE_HINTS && !hints.contains_key(name) {
                hints.clear();
            }
            hints.insert(name.clone(), image.clone());
        }
        options.tools = tools();
        options.image_read = image_read;
        if !request.use_pool {
            options.use_pools = false;
        }
        let output_limit = options.output_limit;
        let t1 = Instant::now();
        let runtime: Arc<dyn Runtime> = match backend {
            Backend::Containerd if restoring.is_some() => {
                Arc::new(self.ctx.engine(options).await?.restore_live(&plan).await?)
            }
            Backend::Containerd => {
                let engine = self.ctx.engine(options).await?;
                Arc::new(engine.spawn_live(&plan).await?)
            }
            Backend::Host => Arc::new(HostRuntime::spawn(&plan, &self.ctx.host, &options).await?),
        };
        shell::claim_phase("sandbox", t1);
        if let Some(setup) = runtime.setup().filter(|s| !s.succeeded()) {
            let detail = serde_json::to_string(setup).unwrap_or_default();
            if let Err(e) = runtime.cleanup().await {
                tracing::warn!(session = id, error = %e, "cleaning up after a failed setup");
            }
            return Err(ServiceError::rejected(format!("setup failed: {detail}")));
        }
        let host_shell_dir = match backend {
            Backend::Host => Some(
                tempfile::Builder::new()
                    .prefix("runner-shell-")
                    .tempdir()
                    .map_err(|e| ServiceError::internal("creating the shell state directory", e))?,
            ),
            Backend::Containerd => None,
        };
        let session = Arc::new(Session {
            id: id.clone(),
            request: request.clone(),
            runtime,
            workspace: PathBuf::from(&workspace),
            owner,
            _scratch: scratch,
            host_shell_dir,
            backend,
            created: crate::job::rfc3339(std::time::SystemTime::now()),
            last_used: Mutex::new(Instant::now()),
            in_use: AtomicUsize::new(0),
            python: tokio::sync::Mutex::new(None),
            shell_bin: tokio::sync::OnceCell::new(),
            shells: Mutex::new(HashMap::new()),
            output_limit,
            swerex: swerex::Swerex::default(),
            pause: pause::PauseState::new(request.pause),
            terminals: Arc::default(),
            watchers: Arc::default(),
        });
        match &restoring {
            Some(restoring) => {
                if let Err(e) = restoring.adopt(&session).await {
                    if let Err(c) = session.runtime.cleanup().await {
                        tracing::warn!(session = id, error = %c, "cleaning up after a failed restore");
                    }
                    return Err(e);
                }
            }
            None => session.prestart_shell(),
        }
        let view = session.view();
        self.sessions.lock().expect("sessions lock").insert(id, session);
        shell::claim_phase("session create", t0);
        Ok(view)
    }

    /// The image record this request's claim will check, read from now on (see `ImageRead`):
    /// the image an inline Environment names, or the one a named Environment had last time.
    /// Only with containerd already connected (a hint never connects) and an Environment
    /// that does not say it runs on the host.
    fn read_image_ahead(&self, request: &NewSession) -> Option<crate::runtime::containerd::pool::ImageRead> {
        if request.backend == Some(Backend::Host) {
            return None;
        }
        let of_spec = |spec: Option<&serde_json::Map<String, Value>>| {
            let spec = spec?;
            if spec
                .get("backend")
                .and_then(Value::as_str)
                .is_some_and(|b| b != "containerd")
            {
                return None;
            }
            spec.get("image").and_then(Value::as_str).map(str::to_string)
        };
        let image = match &request.environment {
            EnvironmentRef::Name(name) => self.image_hints.lock().expect("image hints").get(name).cloned(),
            EnvironmentRef::Spec(spec) => of_spec(Some(spec)),
            EnvironmentRef::Document(doc) => of_spec(doc.get("spec").and_then(Value::as_object)),
        }?;
        let client = self.ctx.containerd_if_connected()?;
        Some(crate::runtime::containerd::pool::ImageRead::start(&client, &image))
    }

    /// Every session, by id.
    pub fn list(&self) -> Vec<SessionView> {
        let mut out: Vec<SessionView> = self
            .sessions
            .lock()
            .expect("sessions lock")
            .values()
            .map(|s| s.view())
            .collect();
        out.sort_by(|a, b| a.id.cmp(&b.id));
        out
    }

    pub fn get(&self, id: &str) -> Result<SessionView, ServiceError> {
        Ok(self.find(id)?.view())
    }

    fn find(&self, id: &str) -> Result<Arc<Session>, ServiceError> {
        self.sessions
            .lock()
            .expect("sessions lock")
            .get(id)
            .cloned()
            .ok_or_else(|| ServiceError::NotFound {
                kind: "session",
                name: id.to_string(),
            })
    }

    /// Hold a session for a call: it is not reaped while the lease lives.
    pub fn lease(&self, id: &str) -> Result<Lease, ServiceError> {
        // Taken under the map's lock, so the reaper (which removes under it) sees the lease.
        let sessions = self.sessions.lock().expect("sessions lock");
        let session = sessions.get(id).cloned().ok_or_else(|| ServiceError::NotFound {
            kind: "session",
            name: id.to_string(),
        })?;
        session.in_use.fetch_add(1, Ordering::SeqCst);
        Ok(Lease(session))
    }

    /// End a session and remove everything it owned.
    pub async fn delete(&self, id: &str) -> Result<(), ServiceError> {
        let session =
            self.sessions
                .lock()
                .expect("sessions lock")
                .remove(id)
                .ok_or_else(|| ServiceError::NotFound {
                    kind: "session",
                    name: id.to_string(),
                })?;
        Ok(session.runtime.cleanup().await?)
    }

    /// End the sessions idle for longer than the TTL (none with a call in progress); their ids.
    pub async fn reap_idle(&self) -> Vec<String> {
        let expired: Vec<Arc<Session>> = {
            let mut sessions = self.sessions.lock().expect("sessions lock");
            let ids: Vec<String> = sessions
                .iter()
                .filter(|(_, s)| {
                    s.in_use.load(Ordering::SeqCst) == 0 && !s.pause.is_paused() && s.idle() > self.idle_ttl
                })
                .map(|(id, _)| id.clone())
                .collect();
            ids.iter().filter_map(|id| sessions.remove(id)).collect()
        };
        let mut ended = Vec::new();
        for s in expired {
            tracing::info!(session = s.id, "idle session expired");
            if let Err(e) = s.runtime.cleanup().await {
                tracing::warn!(session = s.id, error = %e, "cleaning up an idle session");
            }
            ended.push(s.id.clone());
        }
        ended
    }

    /// End every session (shutdown).
    pub async fn close_all(&self) {
        let all: Vec<Arc<Session>> = self
            .sessions
            .lock()
            .expect("sessions lock")
            .drain()
            .map(|(_, s)| s)
            .collect();
        // All at once: a server stopping has a deadline, and each teardown mostly waits on
        // containerd.
        futures::future::join_all(all.into_iter().map(|s| async move {
            if let Err(e) = s.runtime.cleanup().await {
                tracing::warn!(session = s.id, error = %e, "cleaning up a session at shutdown");
            }
        }))
        .await;
        // The sessions' workspaces are being removed on the blocking pool: the process
        // must not exit before (a deep tree takes a while), nor before their directory goes.
        let scratch = self.scratch.clone();
        if let Err(e) = tokio::task::spawn_blocking(move || scratch.remove()).await {
            tracing::warn!(error = %e, "removing the scratch workspaces made ahead");
        }
        self.scratch.removed().await;
    }
}
