//! The command line (kubectl habits): arguments, one file per verb group, output formatting.
//! The only place that prints or picks exit codes: 0 succeeded, 1 the job failed, 2 the
//! runner could not do its work (every `ServiceError`, mapped in `run`). `serve` is handed
//! back to `main`, which runs the HTTP face.

mod args;
mod daemon;
pub mod handoff;
mod images;
mod jobs;
mod kube;
mod output;
mod pools;
mod session_state;
mod snapshot;
mod terminal;
mod top;

pub use args::*;

use output::out;

use std::path::PathBuf;

use clap::Args;

use crate::config::{Config, ServeConfig};
use crate::service::{Connect, Context, ServiceError};

impl Cli {
    /// Start logging to stderr with the filter and format asked for.
    pub fn init_logging(&self) {
        if matches!(self.command, Verb::Resolver(_)) {
            // Its own log: a capped, rotated, rate-limited file (`net::resolver::log`).
            return;
        }
        let default = match self.command {
            // rustls' verifier logs each failed handshake as an error of its own; the pull's
            // error already says it (with the reference), once.
            Verb::Serve { .. } => "warn,runner::access=info,rustls_platform_verifier=off",
            _ => "warn,rustls_platform_verifier=off",
        };
        let filter = self.global.log.as_deref().unwrap_or(default);
        let filter = tracing_subscriber::EnvFilter::try_new(filter).unwrap_or_else(|e| {
            eprintln!("runner: --log {filter:?}: {e}; logging warnings only");
            tracing_subscriber::EnvFilter::new("warn")
        });
        use std::io::IsTerminal;
        let builder = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_ansi(std::io::stderr().is_terminal())
            .with_writer(std::io::stderr);
        match self.global.log_format {
            LogFormat::Text => builder.init(),
            LogFormat::Json => builder.json().init(),
        }
    }
}

/// What every verb's help ends with: the global options are listed once, by `runner
/// options` (as `kubectl options`), not in each verb's help.
const GLOBAL_OPTIONS_FOOTER: &str = "Every verb also takes the global options (--state-dir, --address, --namespace, registries, logging...): runner options";

/// The command line, parsed; each verb's help ends with where the global options are.
pub fn parse() -> Cli {
    use clap::{CommandFactory, FromArgMatches};
    fn footer(command: clap::Command) -> clap::Command {
        command.after_help(GLOBAL_OPTIONS_FOOTER).mut_subcommands(footer)
    }
    let matches = footer(Cli::command()).get_matches();
    Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit())
}

/// `runner options`: the global options, grouped, with their environment variables.
fn global_options_help() -> String {
    let command = <Global as Args>::augment_args(clap::Command::new("runner"))
        .override_usage("runner [GLOBAL OPTIONS] <VERB> [ARGS]  (before or after the verb)")
        .about("The options every verb takes:")
        .mut_args(|arg| {
            if arg.get_id() == "runner_exe" {
                arg
            } else {
                arg.hide(false)
            }
        })
        .disable_help_flag(true);
    command.clone().render_long_help().to_string()
}

/// What `main` does after the command line was handled.
pub enum Outcome {
    /// Exit with this code.
    Exit(i32),
    /// Serve the HTTP API with this configuration.
    Serve(Box<ServeConfig>),
}

impl Cli {
    /// Run the verb (all but `serve`, which is returned to `main`).
    pub async fn run(self) -> Outcome {
        match self.dispatch().await {
            Ok(outcome) => outcome,
            Err(e) => Outcome::Exit(fail(&e)),
        }
    }

    async fn dispatch(self) -> Result<Outcome, ServiceError> {
        let g = &self.global;
        let code = match self.command {
            Verb::Validate(file) => jobs::validate(&context(g, file.env_dir.clone())?, &file).await?,
            Verb::Spec { file, job } => jobs::spec(&context(g, file.env_dir.clone())?, &file, job).await?,
            Verb::Export(args) => kube::export(&context(g, args.file.env_dir.clone())?, *args).await?,
            Verb::Apply {
                file,
                output,
                kube: true,
                kube_context,
                kube_flags,
                ..
            } => {
                kube::apply(
                    &context(g, file.env_dir.clone())?,
                    file,
                    output,
                    kube_context,
                    kube_flags,
                )
                .await?
            }
            Verb::Apply {
                file,
                output,
                backend,
                max_output_bytes,
                detach,
                replace,
                index,
                ..
            } => {
                // `local` or not: an apply the server of this state dir took never gets here
                // (`handoff::apply`, before the async runtime).
                let mut config = g.config();
                config.env_dir = file.env_dir.clone();
                config.output_limit = max_output_bytes;
                let how = jobs::ApplyHow {
                    format: output,
                    backend,
                    detach,
                    replace,
                    index,
                };
                jobs::apply(&cli_context(config)?, &file, how).await?
            }
            Verb::Get {
                what:
                    GetWhat::Jobs {
                        name,
                        selector,
                        output,
                        watch,
                    },
            } => {
                let how = jobs::GetHow {
                    name,
                    selector,
                    format: output,
                    watch,
                };
                jobs::get(&context(g, None)?, how).await?
            }
            Verb::Get {
                what: GetWhat::Pools { name, output },
            } => pools::get(&context(g, None)?, name.as_deref(), output).await?,
            Verb::Describe {
                what: OneJob::Job { name },
            } => jobs::describe(&context(g, None)?, &name).await?,
            Verb::Logs {
                name,
                follow,
                attempt,
                index,
                prefix,
                tail,
                setup,
            } => {
                let options = crate::service::logs::LogOptions {
                    follow,
                    attempt,
                    index,
                    tail,
                    setup,
                };
                jobs::logs(&context(g, None)?, &name, options, prefix).await?
            }
            Verb::Wait { name, timeout } => jobs::wait(&context(g, None)?, &name, timeout).await?,
            Verb::Delete {
                what:
                    DeleteWhat::Job {
                        name,
                        kube: true,
                        kube_context,
                        kube_namespace,
                        ..
                    },
            } => {
                let name = name.ok_or_else(|| ServiceError::field("NAME", "delete job NAME --kube"))?;
                kube::delete(&name, kube_context, kube_namespace).await?
            }
            Verb::Delete {
                what: DeleteWhat::Job {
                    name, all, selector, ..
                },
            } => {
                let which = match (name, all, selector) {
                    (Some(name), false, None) => jobs::Which::Name(name),
                    (None, true, None) => jobs::Which::All,
                    (None, false, Some(selector)) => jobs::Which::Selector(selector),
                    _ => {
                        return Err(ServiceError::field(
                            "NAME",
                            "name one job, or pass --all, or -l key=value (one of them)",
                        ));
                    }
                };
                jobs::delete(&context(g, None)?, which).await?
            }
            Verb::Exec {
                interactive,
                tty,
                server,
                session,
                command,
            } => {
                if !tty {
                    return Err(ServiceError::field(
                        "-t",
                        "exec connects a terminal: pass -t (and -i for keys); run commands without one through the HTTP API's /exec",
                    ));
                }
                let open = terminal::Open {
                    session,
                    command,
                    interactive,
                };
                terminal::run(&server, open).await?
            }
            Verb::Top { job, output } => top::top(&context(g, None)?, job.as_deref(), output).await?,
            Verb::Pause {
                server,
                session,
                output,
            } => session_state::run(&server, &session, "pause", output).await?,
            Verb::Resume {
                server,
                session,
                output,
            } => session_state::run(&server, &session, "resume", output).await?,
            Verb::Attach { server, session } => {
                let open = terminal::Open {
                    session,
                    command: Vec::new(),
                    interactive: true,
                };
                terminal::run(&server, open).await?
            }
            Verb::Version { output } => daemon::version(&g.config(), output).await?,
            Verb::Options => {
                out!("{}", global_options_help());
                0
            }
            Verb::Completion { shell } => {
                let mut command = <Cli as clap::CommandFactory>::command();
                let mut out = Vec::new();
                clap_complete::generate(shell, &mut command, "runner", &mut out);
                out!("{}", String::from_utf8_lossy(&out));
                0
            }
            Verb::Supervise { name, adopt } => jobs::supervise(&context(g, None)?, &name, adopt).await?,
            Verb::Resolver(args) => {
                let mut config = g.config();
                args.apply(&mut config.resolver);
                crate::net::resolver::log::init(&config, g.log.as_deref());
                crate::net::resolver::run(config.net, config.resolver)
                    .await
                    .map_err(|e| ServiceError::Internal {
                        context: "the resolver".into(),
                        source: Box::new(e),
                    })?;
                0
            }
            Verb::Serve {
                listen,
                socket,
                token_file,
                env_dir,
                session_ttl,
                metrics_listen,
                pools,
                expect_sessions,
                sessions_per_shim,
                warm_shims,
            } => {
                let mut config = g.config();
                config.env_dir = env_dir;
                if let Some(message) = config.namespace_error() {
                    return Err(ServiceError::field("namespace", message));
                }
                return Ok(Outcome::Serve(Box::new(ServeConfig {
                    config,
                    listen,
                    socket,
                    token_file,
                    session_ttl,
                    metrics_listen,
                    pools,
                    expect_sessions,
                    sessions_per_shim: sessions_per_shim as usize,
                    warm_shims: warm_shims as usize,
                })));
            }
            Verb::Image { verb } => images::run(&context(g, None)?, verb).await?,
            Verb::Pool { verb } => {
                let env_dir = match &verb {
                    PoolVerb::Create { file, .. } => file.env_dir.clone(),
                    _ => None,
                };
                pools::run(&context(g, env_dir)?, verb).await?
            }
            Verb::Snapshot { verb } => snapshot::run(&context(g, None)?, verb).await?,
            Verb::Daemon { verb } => daemon::run(&g.config(), verb).await?,
            Verb::Gc => daemon::gc(&context(g, None)?).await?,
        };
        Ok(Outcome::Exit(code))
    }
}

/// A context for one CLI call: it may start the private containerd, and says so.
fn context(global: &Global, env_dir: Option<PathBuf>) -> Result<Context, ServiceError> {
    let mut config = global.config();
    config.env_dir = env_dir;
    cli_context(config)
}

fn cli_context(config: Config) -> Result<Context, ServiceError> {
    Ok(
        Context::new(config, Connect::StartIfNeeded)?.on_daemon_start(std::sync::Arc::new(|started| {
            eprintln!(
                "runner: no containerd at {}; started a private one (pid {}, socket {}; `runner daemon stop` stops it)",
                crate::config::DEFAULT_ADDRESS,
                started.pid,
                started.socket.display()
            );
        })),
    )
}

/// Report a failure of the runner itself on stderr; its exit code (always 2).
pub fn fail(e: &ServiceError) -> i32 {
    fail_message(&e.to_string())
}

/// As `fail`, for a failure another process (the server of a handed-over apply) described.
fn fail_message(message: &str) -> i32 {
    eprintln!("runner: {message}");
    2
}

/// What `runner serve` tells its operator: the address on stdout (scripts read it), the
/// rest on stderr.
pub fn serve_event(event: crate::config::ServeEvent) {
    match event {
        crate::config::ServeEvent::Listening(address) => {
            println!("listening on {address}");
            let _ = std::io::Write::flush(&mut std::io::stdout());
        }
        crate::config::ServeEvent::Metrics(address) => eprintln!("runner: metrics on {address}"),
        crate::config::ServeEvent::StartedContainerd { pid, socket } => {
            eprintln!(
                "runner: no containerd at {}; started a private one (pid {pid}, socket {}; `runner daemon stop` stops it)",
                crate::config::DEFAULT_ADDRESS,
                socket.display()
            );
        }
        crate::config::ServeEvent::ContainerdUnavailable(reason) => {
            eprintln!("runner: containerd is not available ({reason}); only host-backend sessions and jobs will work");
        }
        crate::config::ServeEvent::OpenFiles { before, now } if before < now => {
            eprintln!("runner: open files limit raised from {before} to {now}");
        }
        crate::config::ServeEvent::OpenFiles { now, .. } => eprintln!("runner: open files limit {now}"),
        crate::config::ServeEvent::HostLimit(message) => eprintln!("runner: host limit: {message}"),
    }
}
