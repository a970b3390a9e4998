//! Which containerd runner talks to, and runner's private one: the connect-or-start policy.

use std::path::{Path, PathBuf};

use super::{Connect, ServiceError};
use crate::config::{Config, DEFAULT_ADDRESS};
use crate::containerd::Containerd;
use crate::containerd::daemon::{self, DaemonError, DaemonPaths};

/// The private containerd a call started.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Started {
    pub pid: u32,
    pub socket: PathBuf,
}

impl From<DaemonError> for ServiceError {
    fn from(e: DaemonError) -> Self {
        match e {
            e @ (DaemonError::NotInstalled | DaemonError::NoAnswer { .. }) => ServiceError::Unavailable {
                what: "containerd",
                reason: e.to_string(),
            },
            e @ DaemonError::Io { .. } => ServiceError::internal("the private containerd", e),
        }
    }
}

/// Connect to containerd: the address given, else the system daemon at the default address,
/// else runner's private daemon under the state dir — started when the policy allows it.
pub async fn connect(config: &Config, policy: Connect) -> Result<(Containerd, Option<Started>), ServiceError> {
    if let Some(address) = &config.address {
        return Ok((Containerd::connect(address, &config.namespace).await?, None));
    }
    let system = Containerd::connect(Path::new(DEFAULT_ADDRESS), &config.namespace).await;
    let system_error = match system {
        Ok(client) => return Ok((client, None)),
        Err(e) => e,
    };
    let paths = DaemonPaths::new(&config.state_dir);
    let mut started = None;
    if daemon::running(&paths).is_none() {
        if policy == Connect::Existing || !daemon::installed() {
            return Err(system_error.into());
        }
        let pid = daemon::start(&paths).await?;
        started = Some(Started {
            pid,
            socket: paths.socket.clone(),
        });
    }
    Ok((Containerd::connect(&paths.socket, &config.namespace).await?, started))
}

/// Start runner's private daemon of this state dir again when `client` talks to it and it
/// died (`daemon::died`: not stopped by `runner daemon stop`). `None`: nothing to do, or
/// another process started it meanwhile.
pub async fn revive(config: &Config, client: &Containerd) -> Option<Result<Started, ServiceError>> {
    let paths = DaemonPaths::new(&config.state_dir);
    if client.address() != paths.socket {
        return None;
    }
    match daemon::revive(&paths).await {
        Ok(None) => None,
        Ok(Some(pid)) => Some(Ok(Started {
            pid,
            socket: paths.socket,
        })),
        Err(e) => Some(Err(e.into())),
    }
}

/// Start the private daemon (or find it running); its PID and socket.
pub async fn start(config: &Config) -> Result<Started, ServiceError> {
    let paths = DaemonPaths::new(&config.state_dir);
    let pid = daemon::start(&paths).await?;
    Ok(Started {
        pid,
        socket: paths.socket,
    })
}

/// Stop the private daemon runner started (only that process); its PID if one ran.
pub async fn stop(config: &Config) -> Result<Option<u32>, ServiceError> {
    Ok(daemon::stop(&DaemonPaths::new(&config.state_dir)).await?)
}

/// The PID of the private daemon if it died (was not stopped by `stop`), and its log.
pub fn died(config: &Config) -> Option<(u32, PathBuf)> {
    let paths = DaemonPaths::new(&config.state_dir);
    daemon::died(&paths).map(|pid| (pid, paths.log))
}

/// The private daemon, if it runs.
pub fn status(config: &Config) -> Option<Started> {
    let paths = DaemonPaths::new(&config.state_dir);
    daemon::running(&paths).map(|pid| Started {
        pid,
        socket: paths.socket,
    })
}
