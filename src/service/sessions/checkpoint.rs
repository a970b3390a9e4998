//! Checkpoints of live sessions (CRIU), restores and forks.
//!
//! A checkpoint is a directory `STATE/checkpoints/NAME/`: the container's part
//! (`runtime::containerd::checkpoint`: CRIU's images, copies of its writable layer and agent
//! directory), a copy of the session's workspace, and `session.json` (`Record`): the request
//! that made the session and what the host needs to drive its restored copies — each resident
//! shell's FIFO names, nonce, PID and call count, and whether a Python interpreter waits to be
//! connected again.
//!
//! While a checkpoint is taken no call runs in the session (one in progress: 409), its
//! interpreter lets go of its socket (CRIU cannot take a connection to the host along), and the
//! sandbox is frozen from before its files are copied until CRIU is done. A fork is a
//! checkpoint restored `count` times, then removed.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::resident::{Resident, Saved};
use super::{EnvironmentRef, NewSession, PausePolicy, Session, SessionManager, SessionView};
use crate::manifest::Backend;
use crate::runtime::containerd::checkpoint::restore_phase;
use crate::runtime::copytree::{self, Limits, Shift};
use crate::service::{Context, ServiceError};

/// Where checkpoints live, in the state dir.
pub const CHECKPOINTS_DIR: &str = "checkpoints";
const RECORD_FILE: &str = "session.json";
const WORKSPACE_DIR: &str = "workspace";
/// Prefix of a checkpoint being written (renamed to its name when complete) and of a fork's.
pub const PARTIAL_PREFIX: &str = ".partial-";
/// Most copies one fork makes (E2B's limit per call).
pub const FORK_LIMIT: usize = 100;
/// Restores of one fork at once: each is a container start and a CRIU restore; more at once
/// only queue on 2 cores and on containerd.
const FORK_PARALLEL: usize = 4;
/// How long `criu check` may take (it answers in about 50 ms).
const CRIU_CHECK_LIMIT: std::time::Duration = std::time::Duration::from_secs(30);
/// A workspace in a checkpoint (apparent sizes).
const WORKSPACE_LIMITS: Limits = Limits {
    bytes: 10 << 30,
    entries: 2_000_000,
};

/// What `session.json` holds.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Record {
    name: String,
    created: String,
    /// The session it was taken of.
    source: String,
    environment: Value,
    static_assets: Vec<Value>,
    mounts: Vec<Value>,
    shells: Vec<Saved>,
    /// An interpreter waits to be connected again.
    python: bool,
    bytes: u64,
    frozen_ms: u64,
    took_ms: u64,
}

/// A checkpoint as callers see it.
#[derive(Clone, Debug, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CheckpointView {
    pub name: String,
    pub created: String,
    /// The session it was taken of.
    pub source: String,
    /// Bytes on disk: CRIU's images (the processes' memory), the files and the workspace.
    pub bytes: u64,
    /// How long the sandbox was frozen for it, and how long it took.
    pub frozen_ms: u64,
    pub took_ms: u64,
}

/// What a fork made.
#[derive(Clone, Debug, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Forked {
    pub sessions: Vec<SessionView>,
    /// How long the checkpoint of the source took, and the whole fork.
    pub checkpoint_ms: u64,
    pub took_ms: u64,
}

impl From<&Record> for CheckpointView {
    fn from(r: &Record) -> Self {
        CheckpointView {
            name: r.name.clone(),
            created: r.created.clone(),
            source: r.source.clone(),
            bytes: r.bytes,
            frozen_ms: r.frozen_ms,
            took_ms: r.took_ms,
        }
    }
}

fn environment_json(e: &EnvironmentRef) -> Value {
    match e {
        EnvironmentRef::Name(n) => Value::String(n.clone()),
        EnvironmentRef::Spec(m) | EnvironmentRef::Document(m) => Value::Object(m.clone()),
    }
}

/// A checkpoint's name: what a Kubernetes object may be called.
fn check_name(name: &str) -> Result<(), ServiceError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name.as_bytes()[name.len() - 1].is_ascii_alphanumeric();
    if ok {
        Ok(())
    } else {
        Err(ServiceError::field(
            "name",
            format!(
                "{name:?}: a checkpoint's name is 1-63 lowercase letters, digits, '-' or '.', starting and ending with a letter or digit"
            ),
        ))
    }
}

fn checkpoints_dir(ctx: &Context) -> PathBuf {
    ctx.config.state_dir.join(CHECKPOINTS_DIR)
}

/// The bytes of every file under `dir` (no links followed).
fn disk_bytes(dir: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            match entry.file_type() {
                Ok(t) if t.is_dir() => stack.push(entry.path()),
                Ok(t) if t.is_file() => total += entry.metadata().map(|m| m.len()).unwrap_or(0),
                _ => {}
            }
        }
    }
    total
}

fn read_record(dir: &Path) -> Result<Record, ServiceError> {
    let text = crate::runtime::containerd::checkpoint::read_capped(
        &dir.join(RECORD_FILE),
        crate::runtime::containerd::checkpoint::RECORD_LIMIT,
    )
    .map_err(|e| ServiceError::internal("reading a checkpoint", e))?;
    serde_json::from_slice(&text).map_err(|e| ServiceError::internal("reading a checkpoint", e))
}

/// Whether CRIU can run here: runc runs the `criu` it finds on its PATH, which is this
/// process's (the shims inherit containerd's, which `runner daemon start` inherits).
async fn check_criu() -> Result<(), ServiceError> {
    static CHECKED: tokio::sync::OnceCell<Result<(), String>> = tokio::sync::OnceCell::const_new();
    let checked = CHECKED
        .get_or_init(|| async {
            let run = tokio::process::Command::new("criu")
                .arg("check")
                .kill_on_drop(true)
                .output();
            let out = match tokio::time::timeout(CRIU_CHECK_LIMIT, run).await {
                Ok(out) => out,
                Err(_) => return Err(format!("`criu check` did not answer within {CRIU_CHECK_LIMIT:?}")),
            };
            match out {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    Err("CRIU is not installed (no `criu` on PATH); see docs/guide/snapshots.md".to_string())
                }
                Err(e) => Err(format!("cannot run criu: {e}")),
                Ok(o) if o.status.success() => Ok(()),
                Ok(o) => {
                    let text = String::from_utf8_lossy(&o.stderr);
                    let text: String = text.lines().rev().take(3).collect::<Vec<_>>().join("; ");
                    Err(format!("`criu check` fails on this host: {text}"))
                }
            }
        })
        .await;
    checked.clone().map_err(|e| ServiceError::Unavailable {
        what: "checkpointing",
        reason: e,
    })
}

/// A checkpoint a session is being restored from.
pub(super) struct Restoring {
    pub(super) dir: PathBuf,
    record: Record,
}

impl Restoring {
    /// What fills a new session's scratch workspace with the checkpoint's.
    pub(super) fn workspace_filler(&self) -> WorkspaceFiller {
        WorkspaceFiller(self.dir.join(WORKSPACE_DIR))
    }

    /// Drive what was restored: the shells, the interpreter.
    pub(super) async fn adopt(&self, session: &Session) -> Result<(), ServiceError> {
        let t0 = Instant::now();
        let sandbox = session.sandbox()?;
        for saved in &self.record.shells {
            let shell = Resident::adopt_restored(sandbox, saved)?;
            *session.shell_slot(&saved.name).lock().await = Some(shell);
        }
        session.runtime.release_restore_holds();
        restore_phase("shells adopted", t0);
        if self.record.python {
            let t0 = Instant::now();
            let driver = session.python_reattach().await?;
            *session.python.lock().await = Some(driver);
            restore_phase("python reattached", t0);
        }
        Ok(())
    }
}

impl SessionManager {
    /// Checkpoint session `id` as `name` (`POST /v1/sessions/{id}/checkpoint`).
    pub async fn checkpoint(&self, id: &str, name: &str, replace: bool) -> Result<CheckpointView, ServiceError> {
        check_name(name)?;
        let session = self.find(id)?;
        let root = checkpoints_dir(&self.ctx);
        let dir = root.join(name);
        if dir.exists() && !replace {
            return Err(ServiceError::Conflict(format!(
                "checkpoint {name:?} exists (replace: true replaces it)"
            )));
        }
        let partial = self.take_checkpoint(&session, name).await?;
        Context::blocking(move || {
            if dir.exists() {
                copytree::remove(&dir).map_err(|e| ServiceError::internal("replacing the checkpoint", e))?;
            }
            std::fs::rename(&partial, &dir).map_err(|e| ServiceError::internal("saving the checkpoint", e))?;
            Ok(())
        })
        .await?;
        let record = read_record(&root.join(name))?;
        Ok(CheckpointView::from(&record))
    }

    /// Take a checkpoint of `session` into a new partial directory; its path.
    async fn take_checkpoint(&self, session: &Arc<Session>, name: &str) -> Result<PathBuf, ServiceError> {
        let began = Instant::now();
        if session.backend == Backend::Host {
            return Err(ServiceError::field(
                "id",
                format!(
                    "session {} runs on the host backend: only containerd sessions can be checkpointed",
                    session.id
                ),
            ));
        }
        check_criu().await?;
        if session.terminals.load(Ordering::SeqCst) > 0 {
            return Err(ServiceError::Conflict(
                "the session has a terminal open: close it first (a terminal's host end cannot be checkpointed)".into(),
            ));
        }
        // No call may run meanwhile: the pause transition and every shell's and the
        // interpreter's slot are held to the end, and a call already in progress refuses it.
        let _transition = session.pause.transition.lock().await;
        let calls = session
            .in_use
            .load(Ordering::SeqCst)
            .saturating_sub(session.pause.held());
        if calls > 0 {
            return Err(ServiceError::Conflict(format!(
                "{calls} call(s) in progress in session {}: a checkpoint waits for none",
                session.id
            )));
        }
        if session.pause.is_paused() {
            return Err(ServiceError::Conflict(format!(
                "session {} is paused: resume it first (its interpreter must let go of its socket)",
                session.id
            )));
        }
        let slots: Vec<_> = {
            let shells = session.shells.lock().expect("shells lock");
            shells.values().cloned().collect()
        };
        let mut held = Vec::new();
        for slot in slots {
            held.push(slot.lock_owned().await);
        }
        // An adopted shell whose hello is still to be read: its PID is what the record keeps.
        if let Some(sandbox) = session.runtime.sandbox() {
            for shell in held.iter_mut() {
                let unanswered = match shell.as_mut() {
                    Some(s) => s.greeted(sandbox).await.is_err(),
                    None => false,
                };
                if unanswered && let Some(dead) = shell.take() {
                    dead.stop(sandbox);
                }
            }
        }
        let shells: Vec<Saved> = held.iter().filter_map(|s| s.as_ref()).map(|s| s.saved()).collect();
        let mut python = session.python.lock().await;
        let detached = session.python_detach(&mut python).await?;
        let root = checkpoints_dir(&self.ctx);
        // Named by this process: `collect` removes those of a runner that died writing one.
        let partial = root.join(format!(
            "{PARTIAL_PREFIX}{}-{}",
            crate::owner::owner_id().replace(':', "_"),
            crate::owner::unique_tag()
        ));
        let made = async {
            {
                let (root, partial) = (root.clone(), partial.clone());
                Context::blocking(move || {
                    use std::os::unix::fs::DirBuilderExt;
                    std::fs::DirBuilder::new()
                        .recursive(true)
                        .mode(0o700)
                        .create(&root)
                        .and_then(|()| std::fs::DirBuilder::new().mode(0o700).create(&partial))
                        .and_then(|()| std::fs::create_dir(partial.join(WORKSPACE_DIR)))
                        .map_err(|e| ServiceError::internal("making the checkpoint's directory", e))
                })
                .await?;
            }
            // The workspace is copied while the sandbox is frozen (see `Runtime::checkpoint`)?
            // It is copied first, the sandbox idle (no call runs): what a background process
            // writes to it between this copy and the freeze is the one thing not of one moment.
            {
                let (from, to) = (session.workspace.clone(), partial.join(WORKSPACE_DIR));
                Context::blocking(move || {
                    copytree::copy(&from, &to, Shift::NONE, WORKSPACE_LIMITS, &[])
                        .map(|_| ())
                        .map_err(|e| ServiceError::rejected(format!("the workspace: {e}")))
                })
                .await?;
            }
            let dumped = session.runtime.checkpoint(&partial).await?;
            let record = Record {
                name: name.to_string(),
                created: crate::job::rfc3339(std::time::SystemTime::now()),
                source: session.id.clone(),
                environment: environment_json(&session.request.environment),
                static_assets: session.request.static_assets.clone(),
                mounts: session.request.mounts.clone(),
                shells,
                python: detached,
                bytes: 0,
                frozen_ms: dumped.frozen_ms,
                took_ms: began.elapsed().as_millis() as u64,
            };
            let partial2 = partial.clone();
            Context::blocking(move || {
                let mut record = record;
                record.bytes = disk_bytes(&partial2);
                let json = serde_json::to_vec_pretty(&record).map_err(|e| ServiceError::internal("a checkpoint", e))?;
                std::fs::write(partial2.join(RECORD_FILE), json)
                    .map_err(|e| ServiceError::internal("writing the checkpoint", e))
            })
            .await
        }
        .await;
        // The interpreter comes back whatever happened (it waits for its socket).
        if detached {
            match session.python_reattach().await {
                Ok(driver) => *python = Some(driver),
                Err(e) => {
                    tracing::warn!(session = session.id, error = %e, "the interpreter did not come back after a checkpoint")
                }
            }
        }
        drop(python);
        drop(held);
        *session.last_used.lock().expect("session lock") = Instant::now();
        if let Err(e) = made {
            let p = partial.clone();
            let _ = Context::blocking(move || copytree::remove(&p).map_err(|e| ServiceError::internal("", e))).await;
            return Err(e);
        }
        Ok(partial)
    }

    /// A new session restored from checkpoint `name` (`POST /v1/sessions` with
    /// `fromCheckpoint`).
    pub async fn restore(&self, name: &str, pause: PausePolicy) -> Result<SessionView, ServiceError> {
        check_name(name)
            .map_err(|_| ServiceError::field("fromCheckpoint", format!("{name:?} is not a checkpoint's name")))?;
        let dir = checkpoints_dir(&self.ctx).join(name);
        if !dir.join(RECORD_FILE).exists() {
            return Err(ServiceError::NotFound {
                kind: "checkpoint",
                name: name.to_string(),
            });
        }
        self.restore_from(&dir, pause).await
    }

    async fn restore_from(&self, dir: &Path, pause: PausePolicy) -> Result<SessionView, ServiceError> {
        let t0 = Instant::now();
        check_criu().await?;
        let record = read_record(dir)?;
        restore_phase("checkpoint read", t0);
        let request = NewSession {
            environment: EnvironmentRef::from_json(record.environment.clone())?,
            workspace: None,
            static_assets: record.static_assets.clone(),
            mounts: record.mounts.clone(),
            backend: Some(Backend::Containerd),
            // A restore makes its own container (never a pool's member).
            use_pool: false,
            pause,
        };
        let restoring = Restoring {
            dir: dir.to_path_buf(),
            record,
        };
        let made = self.create_or_restore(request, Some(restoring)).await;
        restore_phase("session restored", t0);
        made
    }

    /// `count` new sessions, each a copy of session `id` as it is now
    /// (`POST /v1/sessions/{id}/fork`).
    pub async fn fork(&self, id: &str, count: usize) -> Result<Forked, ServiceError> {
        if count == 0 || count > FORK_LIMIT {
            return Err(ServiceError::field("count", format!("from 1 to {FORK_LIMIT}")));
        }
        let began = Instant::now();
        let session = self.find(id)?;
        let partial = self.take_checkpoint(&session, "fork").await?;
        let checkpoint_ms = began.elapsed().as_millis() as u64;
        let policy = session.request.pause;
        let restores = futures::stream::iter(0..count)
            .map(|_| self.restore_from(&partial, policy))
            .buffer_unordered(FORK_PARALLEL);
        let results: Vec<Result<SessionView, ServiceError>> = futures::StreamExt::collect(restores).await;
        let p = partial.clone();
        let _ = Context::blocking(move || copytree::remove(&p).map_err(|e| ServiceError::internal("", e))).await;
        let mut sessions = Vec::new();
        let mut failure = None;
        for r in results {
            match r {
                Ok(v) => sessions.push(v),
                Err(e) => failure = Some(e),
            }
        }
        if let Some(e) = failure {
            // All or nothing: the copies made are ended.
            for s in &sessions {
                let _ = self.delete(&s.id).await;
            }
            return Err(e);
        }
        sessions.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(Forked {
            sessions,
            checkpoint_ms,
            took_ms: began.elapsed().as_millis() as u64,
        })
    }

    /// Every checkpoint (`GET /v1/checkpoints`).
    pub async fn checkpoints(&self) -> Result<Vec<CheckpointView>, ServiceError> {
        let root = checkpoints_dir(&self.ctx);
        Context::blocking(move || {
            let mut out = Vec::new();
            for entry in std::fs::read_dir(&root).into_iter().flatten().flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                if name.starts_with('.') {
                    continue;
                }
                if let Ok(record) = read_record(&entry.path()) {
                    out.push(CheckpointView::from(&record));
                }
            }
            out.sort_by(|a, b| a.name.cmp(&b.name));
            Ok(out)
        })
        .await
    }

    /// Remove checkpoint `name` (`DELETE /v1/checkpoints/{name}`).
    pub async fn remove_checkpoint(&self, name: &str) -> Result<(), ServiceError> {
        check_name(name)?;
        let dir = checkpoints_dir(&self.ctx).join(name);
        if !dir.exists() {
            return Err(ServiceError::NotFound {
                kind: "checkpoint",
                name: name.to_string(),
            });
        }
        Context::blocking(move || {
            copytree::remove(&dir).map_err(|e| ServiceError::internal("removing the checkpoint", e))
        })
        .await
    }
}

use futures::StreamExt as _;

/// What `runner gc` found of checkpoints.
#[derive(Debug, Default)]
pub struct Collected {
    pub kept: usize,
    pub kept_bytes: u64,
    /// Partial checkpoints (and forks' temporary ones) of runners that died writing them.
    pub removed: Vec<String>,
}

/// Count the checkpoints of state dir `state_dir` and remove the partial ones no live runner
/// is writing (blocking).
pub fn collect(state_dir: &Path) -> Collected {
    let mut out = Collected::default();
    let root = state_dir.join(CHECKPOINTS_DIR);
    for entry in std::fs::read_dir(&root).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        match name.strip_prefix(PARTIAL_PREFIX) {
            Some(rest) => {
                let owner = rest.split_once('-').map(|(o, _)| o.replacen('_', ":", 1));
                if owner.is_none_or(|o| !crate::owner::owner_alive(&o)) {
                    match copytree::remove(&entry.path()) {
                        Ok(()) => out.removed.push(name),
                        Err(e) => {
                            tracing::warn!(checkpoint = name, error = %e, "gc could not remove a partial checkpoint")
                        }
                    }
                }
            }
            None if entry.path().join(RECORD_FILE).exists() => {
                out.kept += 1;
                out.kept_bytes += disk_bytes(&entry.path());
            }
            None => {}
        }
    }
    out
}

/// Fills a restored session's scratch workspace with its checkpoint's copy, on the blocking
/// pool (where the session's scratch workspace is made).
pub(super) struct WorkspaceFiller(PathBuf);

impl WorkspaceFiller {
    pub(super) fn fill(&self, scratch: &Path) -> Result<(), ServiceError> {
        let t0 = Instant::now();
        copytree::copy(&self.0, scratch, Shift::NONE, WORKSPACE_LIMITS, &[])
            .map_err(|e| ServiceError::internal("restoring the workspace", e))?;
        restore_phase("workspace filled", t0);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gc_counts_checkpoints_and_removes_partial_ones_of_dead_runners() {
        let state = tempfile::tempdir().unwrap();
        let root = state.path().join(CHECKPOINTS_DIR);
        std::fs::create_dir_all(root.join("kept")).unwrap();
        std::fs::write(root.join("kept").join(RECORD_FILE), b"{}").unwrap();
        let me = crate::owner::owner_id().replace(':', "_");
        for d in [
            format!("{PARTIAL_PREFIX}1_1-dead"),
            format!("{PARTIAL_PREFIX}{me}-mine"),
        ] {
            std::fs::create_dir_all(root.join(d).join("criu")).unwrap();
        }
        let c = collect(state.path());
        assert_eq!((c.kept, c.kept_bytes), (1, 2));
        assert_eq!(c.removed, vec![format!("{PARTIAL_PREFIX}1_1-dead")]);
        assert!(root.join(format!("{PARTIAL_PREFIX}{me}-mine")).exists());
    }

    #[test]
    fn names_are_checked() {
        for ok in ["a", "fork-1", "x.y", "a0"] {
            assert!(check_name(ok).is_ok(), "{ok}");
        }
        for bad in ["", "-a", "a-", "A", "a/b", "..", ".partial-x", &"a".repeat(64)] {
            assert!(check_name(bad).is_err(), "{bad}");
        }
    }
}
