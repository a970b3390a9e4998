//! runner: a Kubernetes-style job runner over containerd's gRPC API, with a host-process
//! backend behind the same interface for trusted runs.

pub mod api;
pub mod cli;
pub mod config;
pub mod confined;
pub mod containerd;
pub mod fuzzing;
pub mod image;
pub mod job;
pub mod manifest;
pub mod metrics;
pub mod net;
pub mod owner;
pub mod runtime;
pub mod service;
pub mod signals;
pub mod spec;
