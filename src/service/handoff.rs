//! A foreground `runner apply` handed to the `runner serve` of its state dir, as `docker run`
//! hands its container to dockerd: the server runs the jobs with its warm connections, pools
//! and caches, and the CLI only prints. Without it each apply process paid its own runtime,
//! containerd connection, store and claim (20–24 ms of CPU, 13 threads), which capped 20
//! concurrent applies at ~70 jobs/s on 2 cores.
//!
//! The protocol, over the server's unix socket (`Config::handoff_socket`, mode 0600, the
//! server's own user only):
//! - the CLI sends one JSON line (`Request`) and then exactly `text_bytes` of manifest text;
//! - the server answers JSON lines (`Reply`): `declined` (the CLI runs the jobs itself; nothing
//!   was done), or `failed`, or `accepted` then one `done` per job as it ends and `end`;
//! - the CLI may send `{"cancel": ...}` lines (its Ctrl-C or SIGTERM): the jobs are stopped as
//!   a signalled apply stops them, and their results still come. A CLI that goes away (its
//!   connection closed) stops them the same way.
//!
//! Nothing here is HTTP or printing: `api::handoff` listens, `cli::handoff` connects.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use tokio_util::sync::CancellationToken;

use super::Context;
use super::jobs::{self, Reconcile, Submission};
use crate::job::{JobObject, JobSpecView, JobStatus, ObjectMeta};
use crate::manifest::Backend;

/// Bumped when a message changes meaning; a server of another version declines.
pub const PROTOCOL: u32 = 1;

/// The JSON line a CLI opens with (its manifest's text follows it).
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Request {
    pub protocol: u32,
    /// `Config::handoff_fingerprint` of the CLI: a server whose own differs declines.
    pub fingerprint: String,
    /// The CLI's mount namespace (`/proc/self/ns/mnt`'s inode): paths mean what they mean to
    /// the CLI only inside it (a server under systemd's PrivateTmp has another /tmp).
    pub mount_ns: u64,
    /// The file as the user named it (what errors say).
    pub file: PathBuf,
    /// The file made absolute against the CLI's working directory (where relative paths in
    /// it resolve, and what is recorded).
    pub absolute: PathBuf,
    /// `--env-dir`, absolute.
    #[serde(default)]
    pub env_dir: Option<PathBuf>,
    #[serde(default)]
    pub backend: Option<Backend>,
    #[serde(default)]
    pub replace: bool,
    /// `--max-output-bytes`, or the CLI's default.
    pub output_limit: usize,
    /// How many bytes of manifest text follow the line.
    pub text_bytes: u64,
    /// Who asks: what the jobs take from the process that runs them.
    pub caller: Caller,
}

/// What a job takes from the runner process that runs it (`spec::HostEnv`), as the CLI has it:
/// `user: host` is the CLI's user (or its `HUID`/`HGID`), `includeHostEnv` its environment.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Caller {
    pub uid: u32,
    pub gid: u32,
    pub huid: Option<u32>,
    pub hgid: Option<u32>,
    pub vars: std::collections::BTreeMap<String, String>,
}

impl Caller {
    pub fn of(host: &crate::spec::HostEnv) -> Self {
        Caller {
            uid: host.uid,
            gid: host.gid,
            huid: host.huid,
            hgid: host.hgid,
            vars: host.vars.clone(),
        }
    }

    /// The server's host facts with the caller's in place (the rest — the state dir, the
    /// architecture, the open-files limit containers get — are the server's, which runs them).
    fn onto(self, host: &mut crate::spec::HostEnv) {
        host.uid = self.uid;
        host.gid = self.gid;
        host.huid = self.huid;
        host.hgid = self.hgid;
        host.vars = self.vars;
    }
}

/// A line from the CLI after its request.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Control {
    /// Stop the jobs (the signal the CLI got, for the log).
    pub cancel: String,
}

/// A line from the server.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Reply {
    /// Run it yourself: nothing was registered or started.
    Declined { reason: String },
    /// The runner could not do its work (what the CLI prints after `runner: `, exit 2).
    Failed { message: String },
    /// Registered: these jobs will run, in this order.
    Accepted { jobs: Vec<String> },
    /// One job ended.
    Done { object: Box<Ended> },
    /// Every job ended (or the run was cancelled after the last `done`).
    End,
}

/// A Job as `done` carries it (what `apply -o json` prints).
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Ended {
    pub metadata: ObjectMeta,
    pub spec: JobSpecView,
    pub status: JobStatus,
}

impl Ended {
    pub fn of(object: &JobObject) -> Self {
        Ended {
            metadata: object.metadata.clone(),
            spec: object.spec.clone(),
            status: object.status.clone(),
        }
    }

    pub fn into_object(self) -> JobObject {
        JobObject::new(self.metadata, self.spec, self.status)
    }
}

/// How long the server's containerd may take to answer before an apply is left to the CLI.
const ANSWER_TIME: std::time::Duration = std::time::Duration::from_secs(2);

/// This process's mount namespace, as `Request::mount_ns`.
pub fn mount_namespace() -> std::io::Result<u64> {
    use std::os::unix::fs::MetadataExt;
    Ok(std::fs::metadata("/proc/self/ns/mnt")?.ino())
}

/// Why this server would not run the CLI's request as the CLI would, if it would not.
pub fn decline_reason(ctx: &Context, request: &Request) -> Option<String> {
    if request.protocol != PROTOCOL {
        return Some(format!(
            "the server speaks hand-off protocol {PROTOCOL}, the CLI {}",
            request.protocol
        ));
    }
    let ours = ctx.config.handoff_fingerprint();
    if request.fingerprint != ours {
        return Some(format!(
            "the server's configuration or binary differs from the CLI's (server: {ours}; CLI: {})",
            request.fingerprint
        ));
    }
    match mount_namespace() {
        Ok(ns) if ns == request.mount_ns => None,
        Ok(_) => Some("the server runs in another mount namespace: the CLI's paths may not be its paths".into()),
        Err(e) => Some(format!("the server cannot read its mount namespace: {e}")),
    }
}

/// Run a handed-over apply: `send` gets every reply, in order. Returns when the last reply was
/// sent; `cancel` stops the jobs (each still ends with its result, as a signalled CLI apply's).
pub async fn run(
    ctx: &Context,
    request: Request,
    text: String,
    cancel: CancellationToken,
    mut send: impl FnMut(Reply),
) {
    if let Some(reason) = decline_reason(ctx, &request) {
        return send(Reply::Declined { reason });
    }
    let Request {
        file,
        absolute,
        env_dir,
        backend,
        replace,
        output_limit,
        caller,
        ..
    } = request;
    let mut ctx = ctx.clone();
    caller.onto(&mut ctx.host);
    let ctx = &ctx;
    let parse = {
        let ctx = ctx.clone();
        Context::blocking(move || Submission::handed(&ctx, text, &file, &absolute, env_dir.as_deref(), backend))
    };
    // Whether containerd answers, asked beside the parse when it is connected already: a
    // connected client does not say that its daemon died since.
    let answered = async {
        match ctx.containerd_if_connected() {
            Some(_) => Some(ctx.containerd_answers(ANSWER_TIME).await),
            None => None,
        }
    };
    let (sub, answered) = tokio::join!(parse, answered);
    let mut sub = match sub {
        Ok(sub) => sub,
        Err(e) => return send(Reply::Failed { message: e.to_string() }),
    };
    // Pools a file makes are made by the CLI (they outlive the apply and say so on its
    // stderr); a file of pools alone runs nothing here.
    if !sub.pools.is_empty() || sub.plans.is_empty() {
        return send(Reply::Declined {
            reason: "the file makes warm pools or holds no Job".into(),
        });
    }
    // A CLI starts runner's private containerd when none answers; a server starts it at its
    // own start, and again when it died under the server (what the CLI would do next). Any
    // other containerd that does not answer: nothing was registered yet, so the CLI can still
    // do it all itself, or say why it cannot.
    if sub.plans.iter().any(|p| p.bound.backend == Backend::Containerd) {
        let mut answer = match answered {
            Some(answer) => answer,
            None => ctx.containerd_answers(ANSWER_TIME).await,
        };
        if answer.is_err() {
            answer = match ctx.revive_containerd().await {
                Some(Err(e)) => Err(e.to_string()),
                // Started again here, or by the server's watch (or another process) meanwhile.
                Some(Ok(_)) | None => ctx.containerd_answers(ANSWER_TIME).await,
            };
        }
        if let Err(e) = answer {
            return send(Reply::Declined {
                reason: format!("the server's containerd does not answer ({e})"),
            });
        }
    }
    // A server that is stopping (or a CLI already gone) starts nothing more.
    if cancel.is_cancelled() {
        return send(Reply::Declined {
            reason: "the server is stopping".into(),
        });
    }
    sub.replace = replace;
    sub.output_limit = output_limit;
    send(Reply::Accepted {
        jobs: sub.plans.iter().map(|p| p.job().name.clone()).collect(),
    });
    let ran = jobs::run_in_process(
        ctx,
        &sub,
        cancel,
        |_, object| {
            send(Reply::Done {
                object: Box::new(Ended::of(object)),
            })
        },
        Reconcile::Left,
    )
    .await;
    send(match ran {
        Ok(_) => Reply::End,
        Err(e) => Reply::Failed { message: e.to_string() },
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replies_keep_their_shape_on_the_wire() {
        let line = serde_json::to_string(&Reply::Accepted { jobs: vec!["a".into()] }).unwrap();
        assert_eq!(line, r#"{"accepted":{"jobs":["a"]}}"#);
        assert_eq!(serde_json::to_string(&Reply::End).unwrap(), r#""end""#);
        let back: Reply = serde_json::from_str(r#"{"declined":{"reason":"r"}}"#).unwrap();
        assert!(matches!(back, Reply::Declined { reason } if reason == "r"));
    }

    #[test]
    fn a_request_carries_its_caller_onto_the_server_host_facts() {
        let line = r#"{"protocol":1,"fingerprint":"f","mountNs":1,"file":"a","absolute":"/a","outputLimit":1,"textBytes":0,"caller":{"uid":1000,"gid":1001,"huid":7,"hgid":null,"vars":{"K":"v"}}}"#;
        let request: Request = serde_json::from_str(line).unwrap();
        let mut host = crate::spec::HostEnv::detect(std::path::Path::new("/state"));
        let nofile = host.nofile_hard;
        request.caller.onto(&mut host);
        assert_eq!((host.uid, host.gid, host.huid, host.hgid), (1000, 1001, Some(7), None));
        assert_eq!(host.vars.get("K").map(String::as_str), Some("v"));
        assert_eq!(host.vars.len(), 1);
        // What the server runs the containers with stays the server's.
        assert_eq!(host.state_dir, std::path::Path::new("/state"));
        assert_eq!(host.nofile_hard, nofile);
    }

    fn request(ctx: &Context) -> Request {
        Request {
            protocol: PROTOCOL,
            fingerprint: ctx.config.handoff_fingerprint(),
            mount_ns: mount_namespace().unwrap(),
            file: "job.yaml".into(),
            absolute: "/work/job.yaml".into(),
            env_dir: None,
            backend: None,
            replace: false,
            output_limit: 1,
            text_bytes: 0,
            caller: Caller::of(&ctx.host),
        }
    }

    #[test]
    fn a_server_declines_what_it_would_not_run_as_the_cli_would() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = Context::new(crate::config::Config::new(dir.path()), super::super::Connect::Existing).unwrap();
        assert_eq!(decline_reason(&ctx, &request(&ctx)), None);
        let mut other = request(&ctx);
        other.protocol += 1;
        assert!(decline_reason(&ctx, &other).unwrap().contains("protocol"));
        let mut other = request(&ctx);
        let mut config = crate::config::Config::new(dir.path());
        config.namespace = "another".into();
        other.fingerprint = config.handoff_fingerprint();
        assert!(decline_reason(&ctx, &other).unwrap().contains("configuration"));
        let mut other = request(&ctx);
        other.mount_ns += 1;
        assert!(decline_reason(&ctx, &other).unwrap().contains("mount namespace"));
    }

    #[test]
    fn a_request_with_an_unknown_field_is_refused() {
        let line = r#"{"protocol":1,"fingerprint":"f","mountNs":1,"file":"a","absolute":"/a","outputLimit":1,"textBytes":0,"caller":{"uid":0,"gid":0,"huid":null,"hgid":null,"vars":{}},"extra":1}"#;
        assert!(serde_json::from_str::<Request>(line).is_err());
    }
}
