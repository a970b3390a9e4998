//! `runner`: parse the command line, set up logging, run the verb, map the outcome to the
//! exit code (0 succeeded, 1 the job failed, 2 the runner could not do its work).

use clap::Parser;

use runner::cli::{Cli, GetWhat, OneJob, Verb};
use runner::{commands, jobcmd};

fn main() {
    // The shim runs us as a task's output logger with its own argument convention.
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args
        .iter()
        .any(|a| a == runner::runtime::containerd::logger::LOGGER_DIR_FLAG)
    {
        std::process::exit(runner::runtime::containerd::logger::run(&args));
    }
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_new(&cli.global.log).unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("runner: cannot start the async runtime: {e}");
            std::process::exit(2);
        }
    };
    let outcome = runtime.block_on(async {
        match &cli.command {
            Verb::Validate(file) => commands::validate(&cli.global, file),
            Verb::Spec { file, job } => commands::print_spec(&cli.global, file, job.as_deref()),
            Verb::Apply {
                file,
                output,
                backend,
                max_output_bytes,
                detach,
            } => commands::apply(&cli.global, file, *output, *backend, *max_output_bytes, *detach).await,
            Verb::Get {
                what: GetWhat::Jobs { name, selector, output },
            } => match name {
                Some(name) => jobcmd::get_job(&cli.global, name, *output).await,
                None => jobcmd::get_jobs(&cli.global, selector.as_deref(), *output).await,
            },
            Verb::Describe {
                what: OneJob::Job { name },
            } => jobcmd::describe_job(&cli.global, name).await,
            Verb::Logs {
                name,
                follow,
                attempt,
                index,
            } => jobcmd::logs(&cli.global, name, *follow, *attempt, *index).await,
            Verb::Wait { name, timeout } => jobcmd::wait(&cli.global, name, *timeout).await,
            Verb::Delete {
                what: OneJob::Job { name },
            } => jobcmd::delete_job(&cli.global, name).await,
            Verb::Supervise {
                name,
                max_output_bytes,
                adopt,
            } => jobcmd::supervise_cmd(&cli.global, name, *max_output_bytes, *adopt).await,
            Verb::Serve {
                listen,
                socket,
                token_file,
                env_dir,
                session_ttl,
            } => {
                commands::serve(
                    &cli.global,
                    *listen,
                    socket.as_deref(),
                    token_file,
                    env_dir.as_deref(),
                    *session_ttl,
                )
                .await
            }
            Verb::Image { verb } => commands::image_cmd(&cli.global, verb).await,
            Verb::Daemon { verb } => commands::daemon_cmd(&cli.global, verb).await,
            Verb::Gc => commands::gc(&cli.global).await,
        }
    });
    let code = match outcome {
        Ok(code) => code,
        Err(e) => {
            eprintln!("runner: {e}");
            2
        }
    };
    std::process::exit(code);
}
