//! runner: a Kubernetes-style job runner over containerd's gRPC API, with a host-process
//! backend behind the same interface for trusted runs.

pub mod api;
pub mod cli;
pub mod commands;
pub mod confined;
pub mod daemon;
pub mod fuzzing;
pub mod image;
pub mod job;
pub mod jobcmd;
pub mod manifest;
pub mod runtime;
pub mod signals;
pub mod spec;
