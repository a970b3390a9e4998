//! containerd: the typed gRPC facade (`client`, the only code that names containerd services or
//! tonic codes) and runner's private containerd process (`daemon`).

mod client;
mod content;
pub mod daemon;

pub use client::*;
pub use content::*;
