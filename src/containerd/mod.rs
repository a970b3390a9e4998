//! containerd: the typed gRPC facade (`client`, the only code that names containerd services or
//! tonic codes) and runner's private containerd process (`daemon`).

mod client;
mod content;
mod content_follow;
mod criu;
pub use content_follow::BlobEnd;
pub mod daemon;
mod state;

pub use client::*;
pub use content::*;
