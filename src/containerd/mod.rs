//! containerd: the typed gRPC facade (`client`, the only code that names containerd services or
//! tonic codes) and runner's private containerd process (`daemon`).

mod client;
pub mod daemon;

pub use client::*;
