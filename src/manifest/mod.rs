//! Manifests: multi-document YAML → validated `Environment` and `Job` values.
//!
//! This module is the only caller of the YAML crate (`serde-saphyr`; see docs/design/layout.md's design
//! notes). Raw structs (`raw`) never leave it: once code holds a `Job`, the job is valid.

pub mod error;
mod load;
pub mod paths;
pub mod policy;
pub mod quantity;
mod raw;
mod types;
mod validate;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde_saphyr::Spanned;

pub use error::{Location, ManifestError, ManifestErrorKind, Origin};
pub use load::*;
pub use quantity::{MemoryBytes, MilliCpu, StorageBytes};
pub use types::*;
use validate::*;
pub(crate) use validate::{label_key_ok, label_value_ok};
