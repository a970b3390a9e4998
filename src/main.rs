//! `runner`: parse the command line, set up logging, run the verb (or serve the HTTP API),
//! exit with the code the CLI picked.

use runner::cli::{self, Outcome};

fn main() {
    // The shim runs us as a task's output logger with its own argument convention.
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args
        .iter()
        .any(|a| a == runner::runtime::containerd::logger::LOGGER_DIR_FLAG)
    {
        std::process::exit(runner::runtime::containerd::logger::run(&args));
    }
    let cli = cli::parse();
    cli.init_logging();
    // A foreground apply the server of its state dir takes needs no runtime of its own.
    if let Some(code) = cli::handoff::apply(&cli) {
        std::process::exit(code);
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("runner: cannot start the async runtime: {e}");
            std::process::exit(2);
        }
    };
    let code = runtime.block_on(async {
        match cli.run().await {
            Outcome::Exit(code) => code,
            Outcome::Serve(config) => match runner::api::serve(*config, cli::serve_event).await {
                Ok(()) => 0,
                Err(e) => cli::fail(&e),
            },
        }
    });
    std::process::exit(code);
}
