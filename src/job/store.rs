//! The embedded state store: SQLite (through rusqlite, SQLite compiled in) under the state
//! dir, in WAL mode with a busy timeout so several `runner` processes — a foreground apply,
//! detached supervisors, `get`/`wait`/`logs` — share it safely. Every Job, its attempts and
//! events; output lives in log files beside it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use rusqlite::{Connection, OptionalExtension, params};
use serde::{Deserialize, Serialize};

/// The database file inside the state dir.
pub const DB_FILE: &str = "runner.db";
/// How long a writer waits for another process's transaction.
const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

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
    #[error("stored record of job {name:?} is unreadable: {message}")]
    Corrupt { name: String, message: String },
}

/// A Job as stored: what to run, and its current status.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct JobRecord {
    pub name: String,
    pub labels: std::collections::BTreeMap<String, String>,
    /// The manifest file's text, its directory, and `--env-dir`: enough to rebuild the plan.
    pub manifest: String,
    pub base_dir: PathBuf,
    pub file: Option<PathBuf>,
    pub env_dir: Option<PathBuf>,
    pub backend: Option<crate::manifest::Backend>,
    /// `super::JobStatus` as JSON.
    pub status: serde_json::Value,
    /// Owner id (`pid:start`) of the process supervising the job.
    pub owner: Option<String>,
    pub delete_requested: bool,
    pub created_at: String,
    /// Unix seconds when the job finished (for ttlSecondsAfterFinished).
    pub finished_at: Option<i64>,
    pub ttl_seconds: Option<u64>,
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
        conn.pragma_update(None, "journal_mode", "WAL").map_err(err)?;
        conn.pragma_update(None, "synchronous", "NORMAL").map_err(err)?;
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
        .map_err(err)?;
        Ok(Store { conn, path })
    }

    fn err(&self) -> impl Fn(rusqlite::Error) -> StoreError + '_ {
        move |source| StoreError::Sqlite {
            path: self.path.clone(),
            source,
        }
    }

    fn encode(record: &JobRecord) -> Result<String, StoreError> {
        serde_json::to_string(record).map_err(|e| StoreError::Corrupt {
            name: record.name.clone(),
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
            params![record.name, text],
        ) {
            Ok(_) => Ok(()),
            Err(rusqlite::Error::SqliteFailure(e, _)) if e.code == rusqlite::ErrorCode::ConstraintViolation => {
                Err(StoreError::Exists(record.name.clone()))
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
            out.push(Self::decode(&name, &text)?);
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
            if let Ok(e) = serde_json::from_str(&row.map_err(self.err())?) {
                out.push(e);
            }
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(name: &str) -> JobRecord {
        JobRecord {
            name: name.into(),
            labels: Default::default(),
            manifest: String::new(),
            base_dir: PathBuf::from("."),
            file: None,
            env_dir: None,
            backend: None,
            status: serde_json::json!({"phase": "Pending"}),
            owner: None,
            delete_requested: false,
            created_at: "now".into(),
            finished_at: None,
            ttl_seconds: None,
        }
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
}
