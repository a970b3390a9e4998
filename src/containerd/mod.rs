//! containerd: the typed gRPC facade (`client`, the only code that names containerd services or
//! tonic codes) and runner's private containerd process (`daemon`).

mod client;
mod content;
mod criu;
pub mod daemon;
mod state;

pub use client::*;
pub use content::*;
