//! The embedded state store: SQLite (through rusqlite, SQLite compiled in) under the state
//! dir, in WAL mode with a busy timeout so several `runner` processes — a foreground apply,
//! detached supervisors, `get`/`wait`/`logs` — share it safely. Every Job, its attempts and
//! events; output lives in log files beside it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use rusqlite::{Connection, OptionalExtension, params};
use serde::{Deserialize, Serialize};

use super::{JobObject, JobSpecView, JobStatus, ObjectMeta};

/// The database file inside the state dir.
pub const DB_FILE: &str = crate::config::STORE_FILE;
/// How long a writer waits for another process's transaction.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);
/// `PRAGMA user_version` of the current record layout. 1: status as untyped JSON and no
/// resolved view (runner before the service layer); 2: typed status, view, output limit.
const SCHEMA_VERSION: i64 = 2;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("state store {path}: {source}")]
    Sqlite {
        path: PathBuf,
        #[source]
        source: rusqlite::Error,
    },
    #[error("creating {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("job {0:?} already exists (delete it first: runner delete job {0})")]
    Exists(String),
    #[error("job {0:?} not found")]
    NotFound(String),
    #[error("stored record of job {name:?} is unreadable: {message} (delete it: runner delete job {name})")]
    Corrupt { name: String, message: String },
    #[error("the state store's worker failed: {0}")]
    Worker(String),
}

/// A Job as stored: what to run, what it resolved to when submitted, and its status.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct JobRecord {
    pub metadata: ObjectMeta,
    /// The manifest file's text, its directory, and `--env-dir`: enough to rebuild the plan.
    pub manifest: String,
    pub base_dir: PathBuf,
    pub file: Option<PathBuf>,
    pub env_dir: Option<PathBuf>,
    /// The `--backend` override given at submit, if any.
    pub backend: Option<crate::manifest::Backend>,
    /// What the job runs, resolved at submit.
    pub view: JobSpecView,
    pub status: JobStatus,
    /// Bytes of stdout and of stderr kept per attempt (every supervisor of the job uses it).
    pub output_limit: usize,
    /// Owner id (`pid:start`) of the process supervising the job.
    pub owner: Option<String>,
    pub delete_requested: bool,
    pub created_at: String,
    /// Unix seconds when the job finished (for ttlSecondsAfterFinished).
    pub finished_at: Option<i64>,
    pub ttl_seconds: Option<u64>,
}

impl JobRecord {
    pub fn name(&self) -> &str {
        &self.metadata.name
    }

    /// The job as `get` shows it.
    pub fn object(&self) -> JobObject {
        JobObject::new(self.metadata.clone(), self.view.clone(), self.status.clone())
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct EventRecord {
    pub time: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub reason: String,
    pub message: String,
}

/// A job's name, finish time (seconds since the epoch) and ttlSecondsAfterFinished.
pub type Expiry = (String, Option<i64>, Option<u64>);

pub struct Store {
    conn: Connection,
    path: PathBuf,
}

impl Store {
    pub fn open(state_dir: &Path) -> Result<Self, StoreError> {
        std::fs::create_dir_all(state_dir).map_err(|source| StoreError::Io {
            path: state_dir.to_path_buf(),
            source,
        })?;
        let path = state_dir.join(DB_FILE);
        let err = |source| StoreError::Sqlite {
            path: path.clone(),
            source,
        };
        let conn = Connection::open(&path).map_err(err)?;
        conn.busy_timeout(BUSY_TIMEOUT).map_err(err)?;
        // When other processes open the same new store at once (a CI matrix of `runner
        // apply`s), SQLite answers the switch to WAL and the first schema writes "database is
        // locked" at once, without its busy handler (waiting could deadlock two connections
        // both upgrading their locks): those are tried again, for as long as a busy wait would.
        let deadline = std::time::Instant::now() + BUSY_TIMEOUT;
        let mut attempt = 0u32;
        loop {
            match Self::init(&conn) {
                Ok(()) => break,
                Err(e) if is_busy(&e) && std::time::Instant::now() < deadline => {
                    attempt += 1;
                    // 2..~50 ms, spread by the process so the openers do not meet again.
                    let spread = u64::from(std::process::id() % 7);
                    std::thread::sleep(Duration::from_millis((2 + spread) * u64::from(attempt.min(8))));
                }
                Err(e) => return Err(err(e)),
            }
        }
        let mut store = Store { conn, path };
        store.migrate()?;
        Ok(store)
    }

    /// WAL, and the tables (each step a no-op once done).
    fn init(conn: &Connection) -> rusqlite::Result<()> {
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS jobs (
                name TEXT PRIMARY KEY,
                record TEXT NOT NULL
             );
             CREATE TABLE IF NOT EXISTS events (
                job TEXT NOT NULL,
                seq INTEGER PRIMARY KEY AUTOINCREMENT,
                record TEXT NOT NULL
             );",
        )
    }

    /// Bring records of an older layout to the current one, once. A record whose manifest can
    /// no longer be read is left as it was: reading it then names the job as corrupt.
    fn migrate(&mut self) -> Result<(), StoreError> {
        let path = self.path.clone();
        let err = |source| StoreError::Sqlite {
            path: path.clone(),
            source,
        };
        let version: i64 = self
            .conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .map_err(err)?;
        if version >= SCHEMA_VERSION {
            return Ok(());
        }
        let tx = self
            .conn
            .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
            .map_err(err)?;
        let rows: Vec<(String, String)> = {
            let mut stmt = tx.prepare("SELECT name, record FROM jobs").map_err(err)?;
            let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?))).map_err(err)?;
            rows.collect::<Result<_, _>>().map_err(err)?
        };
        for (name, text) in rows {
            if let Some(upgraded) = upgrade_v1(&text) {
                tx.execute("UPDATE jobs SET record = ?2 WHERE name = ?1", params![name, upgraded])
                    .map_err(err)?;
            }
        }
        tx.execute_batch(&format!("PRAGMA user_version = {SCHEMA_VERSION}"))
            .map_err(err)?;
        tx.commit().map_err(err)
    }

    fn err(&self) -> impl Fn(rusqlite::Error) -> StoreError + '_ {
        move |source| StoreError::Sqlite {
            path: self.path.clone(),
            source,
        }
    }

    fn encode(record: &JobRecord) -> Result<String, StoreError> {
        serde_json::to_string(record).map_err(|e| StoreError::Corrupt {
            name: record.name().to_string(),
            message: e.to_string(),
        })
    }

    fn decode(name: &str, text: &str) -> Result<JobRecord, StoreError> {
        serde_json::from_str(text).map_err(|e| StoreError::Corrupt {
            name: name.to_string(),
            message: e.to_string(),
        })
    }

    /// Insert a new job; refuses a name in use.
    pub fn insert(&self, record: &JobRecord) -> Result<(), StoreError> {
        let text = Self::encode(record)?;
        match self.conn.execute(
            "INSERT INTO jobs (name, record) VALUES (?1, ?2)",
            params![record.name(), text],
        ) {
            Ok(_) => Ok(()),
            Err(rusqlite::Error::SqliteFailure(e, _)) if e.code == rusqlite::ErrorCode::ConstraintViolation => {
                Err(StoreError::Exists(record.name().to_string()))
            }
            Err(e) => Err(self.err()(e)),
        }
    }

    pub fn get(&self, name: &str) -> Result<Option<JobRecord>, StoreError> {
        let text: Option<String> = self
            .conn
            .query_row("SELECT record FROM jobs WHERE name = ?1", params![name], |r| r.get(0))
            .optional()
            .map_err(self.err())?;
        text.map(|t| Self::decode(name, &t)).transpose()
    }

    pub fn require(&self, name: &str) -> Result<JobRecord, StoreError> {
        self.get(name)?.ok_or_else(|| StoreError::NotFound(name.to_string()))
    }

    pub fn list(&self) -> Result<Vec<JobRecord>, StoreError> {
        let mut stmt = self
            .conn
            .prepare("SELECT name, record FROM jobs ORDER BY name")
            .map_err(self.err())?;
        let rows = stmt
            .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))
            .map_err(self.err())?;
        let mut out = Vec::new();
        for row in rows {
            let (name, text) = row.map_err(self.err())?;
            // One damaged record must not hide every other job (nor stop gc and re-adoption):
            // it is named on stderr and left out; `get`, `describe` and `delete` of it say more.
            match Self::decode(&name, &text) {
                Ok(record) => out.push(record),
                Err(e) => tracing::warn!("{e}; left out of the list"),
            }
        }
        Ok(out)
    }

    /// Every job's name, finish time and ttlSecondsAfterFinished, without decoding records
    /// (what purging expired jobs needs, on every apply).
    pub fn expiry(&self) -> Result<Vec<Expiry>, StoreError> {
        let mut stmt = self
            .conn
            .prepare(
                "SELECT name, json_extract(record, '$.finished_at'), json_extract(record, '$.ttl_seconds') FROM jobs",
            )
            .map_err(self.err())?;
        let rows = stmt
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get::<_, Option<i64>>(2)?)))
            .map_err(self.err())?;
        let mut out = Vec::new();
        for row in rows {
            let (name, finished, ttl): (String, Option<i64>, Option<i64>) = row.map_err(self.err())?;
            out.push((name, finished, ttl.and_then(|t| u64::try_from(t).ok())));
        }
        Ok(out)
    }

    /// Read-modify-write one job inside a transaction (other processes wait).
    pub fn update(&mut self, name: &str, f: impl FnOnce(&mut JobRecord)) -> Result<JobRecord, StoreError> {
        let path = self.path.clone();
        let err = |source| StoreError::Sqlite {
            path: path.clone(),
            source,
        };
        let tx = self
            .conn
            .transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)
            .map_err(err)?;
        let text: Option<String> = tx
            .query_row("SELECT record FROM jobs WHERE name = ?1", params![name], |r| r.get(0))
            .optional()
            .map_err(err)?;
        let mut record = Self::decode(name, &text.ok_or_else(|| StoreError::NotFound(name.to_string()))?)?;
        f(&mut record);
        tx.execute(
            "UPDATE jobs SET record = ?2 WHERE name = ?1",
            params![name, Self::encode(&record)?],
        )
        .map_err(err)?;
        tx.commit().map_err(err)?;
        Ok(record)
    }

    pub fn remove(&self, name: &str) -> Result<(), StoreError> {
        self.conn
            .execute("DELETE FROM jobs WHERE name = ?1", params![name])
            .map_err(self.err())?;
        self.conn
            .execute("DELETE FROM events WHERE job = ?1", params![name])
            .map_err(self.err())?;
        Ok(())
    }

    pub fn add_event(&self, job: &str, event: &EventRecord) -> Result<(), StoreError> {
        let text = serde_json::to_string(event).unwrap_or_default();
        self.conn
            .execute("INSERT INTO events (job, record) VALUES (?1, ?2)", params![job, text])
            .map_err(self.err())?;
        Ok(())
    }

    pub fn events(&self, job: &str) -> Result<Vec<EventRecord>, StoreError> {
        let mut stmt = self
            .conn
            .prepare("SELECT record FROM events WHERE job = ?1 ORDER BY seq")
            .map_err(self.err())?;
        let rows = stmt
            .query_map(params![job], |r| r.get::<_, String>(0))
            .map_err(self.err())?;
        let mut out = Vec::new();
        for row in rows {
            let text = row.map_err(self.err())?;
            out.push(serde_json::from_str(&text).map_err(|e| StoreError::Corrupt {
                name: job.to_string(),
                message: format!("event {text:?}: {e}"),
            })?);
        }
        Ok(out)
    }
}

/// A record of layout 1 in layout 2: the untyped status decoded, the view resolved by parsing
/// the stored manifest as the job was submitted (with its env dir and backend override).
/// `None` when the record is not of layout 1 or its manifest no longer holds the job.
fn upgrade_v1(text: &str) -> Option<String> {
    let mut old: serde_json::Value = serde_json::from_str(text).ok()?;
    if old.get("view").is_some() {
        return None;
    }
    let obj = old.as_object_mut()?;
    let name = obj.get("name")?.as_str()?.to_string();
    let base_dir = PathBuf::from(obj.get("base_dir")?.as_str()?);
    let file = obj.get("file").and_then(|f| f.as_str()).map(PathBuf::from);
    let env_dir = obj.get("env_dir").and_then(|f| f.as_str()).map(PathBuf::from);
    let backend: Option<crate::manifest::Backend> = serde_json::from_value(obj.get("backend")?.clone()).ok()?;
    let mut set = crate::manifest::parse_str(obj.get("manifest")?.as_str()?, &base_dir, file.as_deref()).ok()?;
    // An env dir that is gone leaves its Environments unbound (see below).
    if let Some(dir) = &env_dir {
        let _ = set.use_env_dir(dir);
    }
    let job = set.jobs.iter().find(|j| j.name == name)?;
    // An Environment that no longer binds (its env dir is gone): the backend asked for, else
    // containerd's, as layout 1 showed it.
    let resolved = set.bind(job, backend).map(|b| b.backend);
    let view = JobSpecView::of_job(
        job,
        resolved
            .ok()
            .or(backend)
            .unwrap_or(crate::manifest::Backend::Containerd),
    );
    let status: JobStatus = serde_json::from_value(obj.get("status")?.clone()).ok()?;
    let labels = obj.remove("labels").unwrap_or_default();
    obj.insert(
        "metadata".into(),
        serde_json::json!({"name": name, "labels": labels, "annotations": job.annotations}),
    );
    obj.remove("name");
    obj.insert("view".into(), serde_json::to_value(view).ok()?);
    obj.insert("status".into(), serde_json::to_value(status).ok()?);
    obj.insert(
        "output_limit".into(),
        crate::runtime::output::DEFAULT_OUTPUT_LIMIT.into(),
    );
    serde_json::to_string(&old).ok()
}

/// Whether SQLite said another connection holds the lock it needs.
fn is_busy(e: &rusqlite::Error) -> bool {
    matches!(
        e,
        rusqlite::Error::SqliteFailure(f, _)
            if matches!(f.code, rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked)
    )
}

/// The store shared by the tasks of one process: every call runs on the blocking pool (SQLite
/// waits on other processes' transactions and on the disk).
#[derive(Clone)]
pub struct SharedStore(std::sync::Arc<std::sync::Mutex<Store>>);

impl SharedStore {
    pub async fn open(state_dir: &Path) -> Result<Self, StoreError> {
        let dir = state_dir.to_path_buf();
        let store = tokio::task::spawn_blocking(move || Store::open(&dir))
            .await
            .map_err(|e| StoreError::Worker(e.to_string()))??;
        Ok(SharedStore(std::sync::Arc::new(std::sync::Mutex::new(store))))
    }

    /// Run `f` on the store, off the async workers.
    pub async fn call<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Store) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let store = self.0.clone();
        tokio::task::spawn_blocking(move || {
            let mut guard = store
                .lock()
                .map_err(|_| StoreError::Worker("a store call panicked".into()))?;
            f(&mut guard)
        })
        .await
        .map_err(|e| StoreError::Worker(e.to_string()))?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(name: &str) -> JobRecord {
        JobRecord {
            metadata: ObjectMeta {
                name: name.into(),
                labels: Default::default(),
                annotations: Default::default(),
            },
            manifest: String::new(),
            base_dir: PathBuf::from("."),
            file: None,
            env_dir: None,
            backend: None,
            // A record of the layout before the whole spec was kept reads as that.
            view: serde_json::from_str(r#"{"environment":"e","backend":"host","command":["true"]}"#).unwrap(),
            status: JobStatus::pending(),
            output_limit: 1024,
            owner: None,
            delete_requested: false,
            created_at: "now".into(),
            finished_at: None,
            ttl_seconds: None,
        }
    }

    #[test]
    fn a_corrupt_record_is_an_error_naming_the_job() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        store
            .conn
            .execute(
                "INSERT INTO jobs (name, record) VALUES ('broken', '{\"status\": 7}')",
                [],
            )
            .unwrap();
        let err = store.require("broken").unwrap_err();
        assert!(
            matches!(&err, StoreError::Corrupt { name, .. } if name == "broken"),
            "{err}"
        );
        // It hides no other job from a listing.
        store.insert(&record("fine")).unwrap();
        let listed: Vec<String> = store.list().unwrap().iter().map(|r| r.name().to_string()).collect();
        assert_eq!(listed, ["fine"]);
        // It can still be removed by name.
        store.remove("broken").unwrap();
        store.remove("fine").unwrap();
        assert!(store.list().unwrap().is_empty());
    }

    #[test]
    fn records_of_the_first_layout_are_upgraded_with_their_resolved_view() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("envs")).unwrap();
        std::fs::write(
            dir.path().join("envs/host.yaml"),
            "apiVersion: runner/v1alpha1\nkind: Environment\nmetadata: {name: trusted}\nspec:\n  backend: host\n",
        )
        .unwrap();
        let conn = Connection::open(dir.path().join(DB_FILE)).unwrap();
        conn.execute_batch("CREATE TABLE jobs (name TEXT PRIMARY KEY, record TEXT NOT NULL); CREATE TABLE events (job TEXT NOT NULL, seq INTEGER PRIMARY KEY AUTOINCREMENT, record TEXT NOT NULL);").unwrap();
        let v1 = serde_json::json!({
            "name": "old", "labels": {"a": "b"},
            "manifest": "apiVersion: runner/v1alpha1\nkind: Job\nmetadata: {name: old}\nspec:\n  environment: trusted\n  command: [\"true\"]\n",
            "base_dir": dir.path(), "file": null, "env_dir": dir.path().join("envs"), "backend": null,
            "status": {"phase": "Succeeded", "reason": "Completed"},
            "owner": null, "delete_requested": false, "created_at": "t", "finished_at": 1, "ttl_seconds": null,
        });
        conn.execute(
            "INSERT INTO jobs (name, record) VALUES ('old', ?1)",
            params![v1.to_string()],
        )
        .unwrap();
        // A second one whose env dir is gone since: upgraded all the same.
        let mut gone = v1.clone();
        gone["name"] = "gone".into();
        gone["manifest"] = v1["manifest"]
            .as_str()
            .unwrap()
            .replace("name: old", "name: gone")
            .into();
        gone["env_dir"] = dir.path().join("no-such-dir").to_string_lossy().into_owned().into();
        conn.execute(
            "INSERT INTO jobs (name, record) VALUES ('gone', ?1)",
            params![gone.to_string()],
        )
        .unwrap();
        drop(conn);
        let store = Store::open(dir.path()).unwrap();
        assert_eq!(store.list().unwrap().len(), 2);
        let r = store.require("gone").unwrap();
        assert_eq!(r.view.backend, crate::manifest::Backend::Containerd);
        assert_eq!(r.view.environment, "trusted");
        let r = store.require("old").unwrap();
        // The env-dir Environment's backend, not containerd.
        assert_eq!(r.view.backend, crate::manifest::Backend::Host);
        assert_eq!(r.view.environment, "trusted");
        assert_eq!(r.status.phase, super::super::Phase::Succeeded);
        assert_eq!(r.metadata.labels["a"], "b");
    }

    #[test]
    fn jobs_round_trip_and_names_are_unique() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = Store::open(dir.path()).unwrap();
        store.insert(&record("a")).unwrap();
        assert!(matches!(store.insert(&record("a")), Err(StoreError::Exists(_))));
        store.update("a", |r| r.owner = Some("1:2".into())).unwrap();
        // A second connection (another process) sees the write.
        let other = Store::open(dir.path()).unwrap();
        assert_eq!(other.require("a").unwrap().owner.as_deref(), Some("1:2"));
        assert_eq!(other.require("a").unwrap().view, record("a").view);
        other
            .add_event(
                "a",
                &EventRecord {
                    time: "t".into(),
                    kind: "Normal".into(),
                    reason: "Started".into(),
                    message: String::new(),
                },
            )
            .unwrap();
        assert_eq!(store.events("a").unwrap().len(), 1);
        store.remove("a").unwrap();
        assert!(store.get("a").unwrap().is_none());
    }

    /// Many processes opening one new state dir at once (a CI matrix of `runner apply`s): each
    /// opens it, none fails with "database is locked" (SQLite answers the switch to WAL and the
    /// first schema writes busy at once, without waiting, when another connection is doing the
    /// same).
    #[test]
    fn many_opening_a_new_store_at_once_all_open_it() {
        for _ in 0..20 {
            let dir = tempfile::tempdir().unwrap();
            let gate = std::sync::Arc::new(std::sync::Barrier::new(12));
            let opened: Vec<_> = (0..12)
                .map(|_| {
                    let (dir, gate) = (dir.path().to_path_buf(), gate.clone());
                    std::thread::spawn(move || {
                        gate.wait();
                        Store::open(&dir).map(|_| ())
                    })
                })
                .collect();
            for t in opened {
                if let Err(e) = t.join().unwrap() {
                    panic!("{e}");
                }
            }
        }
    }
}
