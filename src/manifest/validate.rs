//! Raw documents (`raw`) checked field by field into the domain types, every error with its
//! field path and line:column.

use super::*;

/// A Network's name: a DNS label of at most 12 characters (its bridge, `rn-<name>`, must fit
/// in Linux's 15), none of the words `network:` means itself.
pub(super) fn valid_network_name(name: &str) -> bool {
    (1..=12).contains(&name.len())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && !name.ends_with('-')
        && !["none", "host", "bridge", "runner", "default"].contains(&name)
}

pub(super) fn validate_network(raw: raw::NetworkDoc, first_line: u64) -> Result<NetworkDef, ManifestError> {
    let at = |s: &serde_saphyr::Location| location(s, first_line);
    let bad = |path: &str, loc: &serde_saphyr::Location, m: String| {
        ManifestError::new(Origin::new(path, at(loc)), ManifestErrorKind::Yaml(m))
    };
    let name = &raw.metadata.name;
    if !valid_network_name(&name.value) {
        return Err(bad(
            "metadata.name",
            &name.referenced,
            format!(
                "{:?} is not a Network name (a DNS label of at most 12 characters, not none, host, bridge, runner or default)",
                name.value
            ),
        ));
    }
    validate_labels(&raw.metadata.labels, "labels")?;
    validate_labels(&raw.metadata.annotations, "annotations")?;
    let spec = raw.spec;
    let rule = EgressRule::parse(&spec.subnet.value)
        .ok()
        .filter(|r| r.port.is_none() && (8..=28).contains(&r.prefix))
        .ok_or_else(|| {
            bad(
                "spec.subnet",
                &spec.subnet.referenced,
                format!(
                    "{:?} is not a subnet (an IPv4 CIDR from /8 to /28, host bits zero)",
                    spec.subnet.value
                ),
            )
        })?;
    let (start, end) = (u32::from(rule.addr), u32::from(rule.addr) | (u32::MAX >> rule.prefix));
    let gateway = match &spec.gateway {
        None => std::net::Ipv4Addr::from(start + 1),
        Some(g) => {
            let addr: std::net::Ipv4Addr = g.value.parse().map_err(|_| {
                bad(
                    "spec.gateway",
                    &g.referenced,
                    format!("{:?} is not an IPv4 address", g.value),
                )
            })?;
            if !(start < u32::from(addr) && u32::from(addr) < end) {
                return Err(bad(
                    "spec.gateway",
                    &g.referenced,
                    format!("{addr} is not a host address of {}/{}", rule.addr, rule.prefix),
                ));
            }
            addr
        }
    };
    let bridge = match &spec.bridge {
        None => format!("rn-{}", name.value),
        Some(b) => {
            let ok = (1..=15).contains(&b.value.len())
                && b.value.chars().all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c))
                && !["lo", "runner0", ".", ".."].contains(&b.value.as_str());
            if !ok {
                return Err(bad(
                    "spec.bridge",
                    &b.referenced,
                    format!(
                        "{:?} is not a bridge name (1 to 15 of letters, digits, '_', '.', '-'; not runner0)",
                        b.value
                    ),
                ));
            }
            b.value.clone()
        }
    };
    let def = NetworkDef {
        name: name.value.clone(),
        subnet: rule.addr,
        prefix: rule.prefix,
        gateway,
        bridge,
    };
    let default = NetworkDef {
        name: "runner".into(),
        subnet: DEFAULT_BRIDGE_SUBNET.0,
        prefix: DEFAULT_BRIDGE_SUBNET.1,
        gateway: std::net::Ipv4Addr::new(10, 89, 0, 1),
        bridge: "runner0".into(),
    };
    if def.overlaps(&default) {
        return Err(bad(
            "spec.subnet",
            &spec.subnet.referenced,
            format!(
                "{} overlaps runner's default bridge network ({})",
                def.cidr(),
                default.cidr()
            ),
        ));
    }
    Ok(def)
}

pub(super) fn validate_pool(
    raw: raw::WarmPoolDoc,
    first_line: u64,
    file: Option<&Path>,
) -> Result<WarmPool, ManifestError> {
    let name = validate_name(&raw.metadata.name, first_line)?;
    validate_labels(&raw.metadata.labels, "labels")?;
    validate_labels(&raw.metadata.annotations, "annotations")?;
    let spec = raw.spec;
    let environment_origin = Origin::new("spec.environment", location(&spec.environment.referenced, first_line));
    if spec.environment.value.is_empty() {
        return Err(ManifestError::new(
            environment_origin,
            ManifestErrorKind::Name {
                name: String::new(),
                reason: "must name an Environment",
            },
        ));
    }
    if spec.size.value > MAX_POOL_SIZE {
        return Err(ManifestError::new(
            Origin::new("spec.size", location(&spec.size.referenced, first_line)),
            ManifestErrorKind::PoolSize {
                size: spec.size.value,
                max: MAX_POOL_SIZE,
            },
        ));
    }
    if let Some(snapshot) = &spec.snapshot
        && !is_snapshot_name(&snapshot.value)
    {
        return Err(ManifestError::new(
            Origin::new("spec.snapshot", location(&snapshot.referenced, first_line)),
            ManifestErrorKind::Name {
                name: snapshot.value.clone(),
                reason: "a snapshot's name (as `runner snapshot ls` lists it, without `snapshot:`): lowercase letters, digits, . _ -, starting with a letter or digit, at most 128",
            },
        ));
    }
    Ok(WarmPool {
        name,
        environment: spec.environment.value,
        environment_origin,
        size: spec.size.value,
        workspace: spec.workspace.unwrap_or(true),
        static_assets: spec.static_assets.unwrap_or(false),
        snapshot: spec.snapshot.map(|s| s.value),
        file: file.map(Path::to_path_buf),
    })
}

pub(super) fn validate_name(name: &Spanned<String>, first_line: u64) -> Result<String, ManifestError> {
    let err = |reason| {
        ManifestError::new(
            Origin::new("metadata.name", location(&name.referenced, first_line)),
            ManifestErrorKind::Name {
                name: name.value.clone(),
                reason,
            },
        )
    };
    let n = &name.value;
    if n.is_empty() || n.len() > 63 {
        return Err(err("must be 1 to 63 characters"));
    }
    if !n
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    {
        return Err(err(
            "only lowercase letters, digits and '-' are allowed (a DNS-1123 label)",
        ));
    }
    if n.starts_with('-') || n.ends_with('-') {
        return Err(err("must start and end with a letter or digit"));
    }
    Ok(n.clone())
}

pub(super) fn label_part_ok(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && s.as_bytes()[0].is_ascii_alphanumeric()
        && s.as_bytes()[s.len() - 1].is_ascii_alphanumeric()
}

/// A label key as Kubernetes has them: `[prefix/]name`, the name 1–63 characters of
/// `[A-Za-z0-9._-]` that begin and end alphanumeric, the prefix at most 253.
pub(crate) fn label_key_ok(key: &str) -> bool {
    let name = key.rsplit_once('/').map_or(key, |(prefix, name)| {
        if prefix.is_empty() || prefix.len() > 253 {
            ""
        } else {
            name
        }
    });
    label_part_ok(name)
}

/// A label value: empty, or as a key's name.
pub(crate) fn label_value_ok(value: &str) -> bool {
    value.is_empty() || label_part_ok(value)
}

pub(super) fn validate_labels(labels: &BTreeMap<String, String>, field: &str) -> Result<(), ManifestError> {
    for (key, value) in labels {
        let origin = || Origin::new(format!("metadata.{field}.{key}"), None);
        if let Some(prefix) = RESERVED_LABEL_PREFIXES.iter().find(|p| key.starts_with(*p)) {
            return Err(ManifestError::new(
                origin(),
                ManifestErrorKind::ReservedLabel {
                    key: key.clone(),
                    prefix,
                },
            ));
        }
        if field == "annotations" {
            continue;
        }
        if !label_key_ok(key) {
            return Err(ManifestError::new(origin(), ManifestErrorKind::LabelKey(key.clone())));
        }
        if !label_value_ok(value) {
            return Err(ManifestError::new(
                origin(),
                ManifestErrorKind::LabelValue(value.clone()),
            ));
        }
    }
    Ok(())
}

pub(super) fn parse_user(user: &Spanned<String>, first_line: u64) -> Result<UserSpec, ManifestError> {
    let origin = || Origin::new("spec.user", location(&user.referenced, first_line));
    let value = user.value.trim();
    if value == "host" {
        return Ok(UserSpec::Host);
    }
    let syntax = || {
        ManifestError::new(
            origin(),
            ManifestErrorKind::UserSyntax {
                value: user.value.clone(),
            },
        )
    };
    let (uid, gid) = value.split_once(':').ok_or_else(syntax)?;
    let id = |s: &str| -> Result<u32, ManifestError> {
        if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
            return Err(syntax());
        }
        let n: u64 = s
            .parse()
            .map_err(|_| ManifestError::new(origin(), ManifestErrorKind::IdTooLarge { id: u64::MAX }))?;
        if n > MAX_ID {
            return Err(ManifestError::new(origin(), ManifestErrorKind::IdTooLarge { id: n }));
        }
        Ok(n as u32)
    };
    Ok(UserSpec::Ids {
        uid: id(uid)?,
        gid: id(gid)?,
    })
}

/// `spec.ports`: each entry checked with its place; a (containerPort, protocol) or an explicit
/// (hostIP, hostPort, protocol) published twice is refused, as the kubelet refuses it.
pub(super) fn validate_ports(raw: &[raw::Port], bridge: bool, first_line: u64) -> Result<Vec<PortSpec>, ManifestError> {
    let at = |s: &serde_saphyr::Location| location(s, first_line);
    let mut out: Vec<PortSpec> = Vec::new();
    for (i, p) in raw.iter().enumerate() {
        let field =
            |name: &str, span: &serde_saphyr::Location| Origin::new(format!("spec.ports[{i}].{name}"), at(span));
        let bad = |origin: Origin, m: String| ManifestError::new(origin, ManifestErrorKind::Yaml(m));
        let container = field("containerPort", &p.container_port.referenced);
        if !bridge {
            return Err(bad(
                container,
                "ports need network: bridge (with none nothing can reach the container; with host its ports are the host's already)".into(),
            ));
        }
        let container_port = u16::try_from(p.container_port.value)
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| {
                bad(
                    container.clone(),
                    format!("{} is not a port (1 to 65535)", p.container_port.value),
                )
            })?;
        let host_port = match &p.host_port {
            None => None,
            Some(h) => match u16::try_from(h.value) {
                Ok(0) => None,
                Ok(n) => Some(n),
                Err(_) => {
                    return Err(bad(
                        field("hostPort", &h.referenced),
                        format!("{} is not a port (1 to 65535, or 0 for a free one)", h.value),
                    ));
                }
            },
        };
        let host_ip = match &p.host_ip {
            None => DEFAULT_HOST_IP,
            Some(h) => h.value.trim().parse::<std::net::Ipv4Addr>().map_err(|_| {
                bad(
                    field("hostIP", &h.referenced),
                    format!("{:?} is not an IPv4 address (bridge networks are IPv4)", h.value),
                )
            })?,
        };
        let protocol = match p.protocol.as_ref().map(|s| s.value.as_str()) {
            None | Some("TCP") => Protocol::Tcp,
            Some("UDP") => Protocol::Udp,
            Some(other) => {
                let span = &p.protocol.as_ref().expect("matched Some").referenced;
                let hint = match other.to_ascii_uppercase().as_str() {
                    "TCP" | "UDP" => format!(" (Kubernetes spells it {})", other.to_ascii_uppercase()),
                    _ => String::new(),
                };
                return Err(bad(
                    field("protocol", span),
                    format!("{other:?} is not a protocol: TCP or UDP{hint}"),
                ));
            }
        };
        if let Some(name) = &p.name
            && !valid_port_name(&name.value)
        {
            return Err(bad(
                field("name", &name.referenced),
                format!(
                    "{:?} is not a port name (an IANA_SVC_NAME: up to 15 lowercase letters, digits and '-', with a letter)",
                    name.value
                ),
            ));
        }
        let port = PortSpec {
            name: p.name.as_ref().map(|n| n.value.clone()),
            container_port,
            host_port,
            host_ip,
            protocol,
        };
        if let Some(prev) = out
            .iter()
            .position(|q| q.container_port == port.container_port && q.protocol == port.protocol)
        {
            return Err(bad(
                container,
                format!(
                    "containerPort {}/{} is published by spec.ports[{prev}] already",
                    port.container_port,
                    port.protocol.as_str()
                ),
            ));
        }
        if let Some(h) = port.host_port
            && let Some(prev) = out.iter().position(|q| {
                q.host_port == Some(h)
                    && q.protocol == port.protocol
                    && (q.host_ip == port.host_ip || q.host_ip.is_unspecified() || port.host_ip.is_unspecified())
            })
        {
            let span = &p.host_port.as_ref().expect("host_port is set").referenced;
            return Err(bad(
                field("hostPort", span),
                format!(
                    "hostPort {h}/{} is taken by spec.ports[{prev}] already",
                    port.protocol.as_str()
                ),
            ));
        }
        out.push(port);
    }
    Ok(out)
}

/// Kubernetes' IANA_SVC_NAME: 1-15 of [a-z0-9-], at least one letter, no leading, trailing or
/// doubled '-'.
pub(super) fn valid_port_name(name: &str) -> bool {
    (1..=15).contains(&name.len())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && name.chars().any(|c| c.is_ascii_lowercase())
        && !name.starts_with('-')
        && !name.ends_with('-')
        && !name.contains("--")
}

pub(super) fn validate_mounts(mounts: Vec<raw::Mount>, first_line: u64) -> Result<Vec<MountSpec>, ManifestError> {
    mounts
        .into_iter()
        .enumerate()
        .map(|(i, m)| {
            let source_origin = Origin::new(
                format!("spec.mounts[{i}].source"),
                location(&m.source.referenced, first_line),
            );
            let target_origin = Origin::new(
                format!("spec.mounts[{i}].target"),
                location(&m.target.referenced, first_line),
            );
            paths::check_lexical(&m.source.value).map_err(|k| ManifestError::new(source_origin.clone(), k))?;
            if m.source.value.starts_with('/')
                && let Some(reason) = paths::refused_source(&paths::normalize(&m.source.value), None)
            {
                return Err(ManifestError::new(
                    source_origin,
                    ManifestErrorKind::RefusedSource {
                        path: m.source.value.clone(),
                        reason,
                    },
                ));
            }
            paths::check_target(&m.target.value).map_err(|k| ManifestError::new(target_origin.clone(), k))?;
            Ok(MountSpec {
                source: m.source.value,
                target: paths::normalize(&m.target.value),
                read_only: m.read_only,
                source_origin,
                target_origin,
            })
        })
        .collect()
}

pub(super) fn validate_environment(
    raw: raw::EnvironmentDoc,
    first_line: u64,
    file: Option<&Path>,
) -> Result<Environment, ManifestError> {
    let name = validate_name(&raw.metadata.name, first_line)?;
    validate_labels(&raw.metadata.labels, "labels")?;
    validate_labels(&raw.metadata.annotations, "annotations")?;
    let spec = raw.spec;
    let at = |s: &serde_saphyr::Location| location(s, first_line);
    let workdir = match &spec.workdir {
        Some(w) => {
            paths::check_workdir(&w.value)
                .map_err(|k| ManifestError::new(Origin::new("spec.workdir", at(&w.referenced)), k))?;
            paths::normalize(&w.value)
        }
        None => defaults::WORKDIR.to_string(),
    };
    let user = spec.user.as_ref().map(|u| parse_user(u, first_line)).transpose()?;
    for (key, value) in &spec.env {
        let origin = || Origin::new(format!("spec.env.{key}"), None);
        let valid = key
            .bytes()
            .enumerate()
            .all(|(i, b)| b == b'_' || b.is_ascii_alphabetic() || (i > 0 && b.is_ascii_digit()));
        if key.is_empty() || !valid {
            return Err(ManifestError::new(origin(), ManifestErrorKind::EnvName(key.clone())));
        }
        if value.contains('\0') {
            return Err(ManifestError::new(
                origin(),
                ManifestErrorKind::EnvValueNul(key.clone()),
            ));
        }
    }
    let mounts = validate_mounts(spec.mounts, first_line)?;
    let mount_workspace = spec.mount_workspace.unwrap_or(true);
    if mount_workspace {
        if workdir == "/" {
            let loc = spec.workdir.as_ref().and_then(|w| at(&w.referenced));
            return Err(ManifestError::new(
                Origin::new("spec.workdir", loc),
                ManifestErrorKind::WorkspaceAtRoot,
            ));
        }
        if let Some(m) = mounts.iter().find(|m| paths::is_within(&m.target, &workdir)) {
            return Err(ManifestError::new(
                m.target_origin.clone(),
                ManifestErrorKind::TargetUnderWorkdir {
                    target: m.target.clone(),
                    workdir: workdir.clone(),
                },
            ));
        }
    }
    let backend = match spec.backend {
        Some(raw::Backend::Host) => Backend::Host,
        Some(raw::Backend::Containerd) | None => Backend::Containerd,
    };
    let pids_origin = spec
        .resources
        .as_ref()
        .and_then(|r| r.pids.as_ref())
        .map(|p| Origin::new("spec.resources.pids", at(&p.referenced)));
    let resources = validate_resources(spec.resources, first_line)?;
    if backend == Backend::Containerd && spec.image.is_none() {
        return Err(ManifestError::new(
            Origin::new("spec.image", None),
            ManifestErrorKind::ImageRequired,
        ));
    }
    let network: Option<(NetworkMode, Option<String>)> = match &spec.network {
        None => None,
        Some(n) => Some(match n.value.as_str() {
            "none" => (NetworkMode::None, None),
            "host" => (NetworkMode::Host, None),
            "bridge" => (NetworkMode::Bridge, None),
            name if valid_network_name(name) => (NetworkMode::Bridge, Some(name.to_string())),
            other => {
                return Err(ManifestError::new(
                    Origin::new("spec.network", at(&n.referenced)),
                    ManifestErrorKind::Yaml(format!(
                        "{other:?} is not a network: none, host, bridge, or the name of a Network document"
                    )),
                ));
            }
        }),
    };
    let bridge = matches!(network, Some((NetworkMode::Bridge, _)));
    let mut egress_allow = Vec::new();
    let mut egress_domains = Vec::new();
    if let Some(egress) = &spec.egress {
        for (i, entry) in egress.allow.iter().enumerate() {
            let origin = Origin::new(format!("spec.egress.allow[{i}]"), at(&entry.referenced));
            if !bridge {
                return Err(ManifestError::new(
                    origin,
                    ManifestErrorKind::Yaml(
                        "egress needs network: bridge (other networks have no way out to allow)".into(),
                    ),
                ));
            }
            match EgressEntry::parse(&entry.value)
                .map_err(|m| ManifestError::new(origin, ManifestErrorKind::Yaml(m)))?
            {
                EgressEntry::Cidr(rule) => egress_allow.push(rule),
                EgressEntry::Domain(domain) => egress_domains.push(domain),
            }
        }
    }
    let ports = validate_ports(&spec.ports, bridge, first_line)?;
    if let Some(image) = &spec.image
        && (image.value.trim().is_empty() || image.value.contains(char::is_whitespace))
    {
        return Err(ManifestError::new(
            Origin::new("spec.image", at(&image.referenced)),
            ManifestErrorKind::Yaml(format!("{:?} is not an image reference", image.value)),
        ));
    }
    Ok(Environment {
        name,
        backend,
        image: spec.image.as_ref().map(|i| i.value.clone()),
        workdir,
        mount_workspace,
        user,
        env: spec.env,
        include_host_env: spec.include_host_env.as_ref().is_some_and(|b| b.value),
        host_users: spec.host_users.as_ref().is_some_and(|b| b.value),
        allow_32bit_syscalls: spec.allow_32bit_syscalls.as_ref().is_some_and(|b| b.value),
        image_pull_policy: spec.image_pull_policy.as_ref().map(|p| p.value),
        egress_allow,
        egress_domains,
        ports,
        setup_snapshot: spec.setup.as_ref().is_some_and(|s| s.snapshot),
        setup: spec.setup.map(|s| s.commands).unwrap_or_default(),
        mounts,
        network: network.as_ref().map(|(mode, _)| *mode),
        network_name: network.and_then(|(_, name)| name),
        resources,
        origins: EnvOrigins {
            image: spec.image.as_ref().and_then(|i| at(&i.referenced)),
            include_host_env: spec.include_host_env.as_ref().and_then(|b| at(&b.referenced)),
            host_users: spec.host_users.as_ref().and_then(|b| at(&b.referenced)),
            network: spec.network.as_ref().and_then(|n| at(&n.referenced)),
            pids: pids_origin,
            user: spec.user.as_ref().and_then(|u| at(&u.referenced)),
            file: file.map(Path::to_path_buf),
        },
    })
}

pub(super) fn validate_resources(raw: Option<raw::Resources>, first_line: u64) -> Result<Resources, ManifestError> {
    let mut out = Resources::default();
    let Some(raw) = raw else { return Ok(out) };
    if let Some(m) = raw.memory {
        let origin = Origin::new("spec.resources.memory", location(&m.referenced, first_line));
        let bytes = MemoryBytes::parse(&m.value.0).map_err(|e| ManifestError::new(origin.clone(), e.into()))?;
        if bytes.0 < quantity::MIN_MEMORY_BYTES {
            return Err(ManifestError::new(
                origin,
                ManifestErrorKind::MemoryTooSmall {
                    bytes: bytes.0,
                    min: quantity::MIN_MEMORY_BYTES,
                },
            ));
        }
        out.memory = bytes;
    }
    if let Some(c) = raw.cpu {
        let origin = Origin::new("spec.resources.cpu", location(&c.referenced, first_line));
        let milli = MilliCpu::parse(&c.value.0).map_err(|e| ManifestError::new(origin.clone(), e.into()))?;
        if !(quantity::MIN_MILLI_CPU..=quantity::MAX_MILLI_CPU).contains(&milli.0) {
            return Err(ManifestError::new(
                origin,
                ManifestErrorKind::CpuOutOfRange {
                    milli: milli.0,
                    min: quantity::MIN_MILLI_CPU,
                    max: quantity::MAX_MILLI_CPU,
                },
            ));
        }
        out.cpu = milli;
    }
    if let Some(p) = raw.pids {
        if !(1..=MAX_PIDS).contains(&p.value) {
            return Err(ManifestError::new(
                Origin::new("spec.resources.pids", location(&p.referenced, first_line)),
                ManifestErrorKind::PidsOutOfRange(p.value),
            ));
        }
        out.pids = p.value as u32;
    }
    if let Some(e) = raw.ephemeral_storage {
        let origin = Origin::new("spec.resources.ephemeralStorage", location(&e.referenced, first_line));
        let bytes = StorageBytes::parse(&e.value.0).map_err(|err| ManifestError::new(origin.clone(), err.into()))?;
        if bytes.0 < quantity::MIN_STORAGE_BYTES {
            return Err(ManifestError::new(
                origin,
                ManifestErrorKind::StorageTooSmall {
                    bytes: bytes.0,
                    min: quantity::MIN_STORAGE_BYTES,
                },
            ));
        }
        out.ephemeral_storage = bytes;
    }
    Ok(out)
}

pub(super) fn seconds(value: f64) -> Option<Duration> {
    (value.is_finite() && value > 0.0 && value <= MAX_TIMEOUT_SECONDS as f64).then(|| Duration::from_secs_f64(value))
}

pub(super) fn validate_job(
    raw: raw::JobDoc,
    first_line: u64,
    base_dir: &Path,
    file: Option<&Path>,
) -> Result<Job, ManifestError> {
    let name = validate_name(&raw.metadata.name, first_line)?;
    validate_labels(&raw.metadata.labels, "labels")?;
    validate_labels(&raw.metadata.annotations, "annotations")?;
    let spec = raw.spec;
    let at = |s: &serde_saphyr::Location| location(s, first_line);
    let environment_origin = Origin::new("spec.environment", at(&spec.environment.referenced));
    if spec.environment.value.is_empty() {
        return Err(ManifestError::new(
            environment_origin,
            ManifestErrorKind::Name {
                name: String::new(),
                reason: "must name an Environment",
            },
        ));
    }
    let workspace = match &spec.workspace {
        Some(w) => {
            paths::check_lexical(&w.value)
                .map_err(|k| ManifestError::new(Origin::new("spec.workspace", at(&w.referenced)), k))?;
            Some(paths::join_clean(base_dir, &w.value))
        }
        None => None,
    };
    let workspace_origin = spec
        .workspace
        .as_ref()
        .map(|w| Origin::new("spec.workspace", at(&w.referenced)));
    let static_assets = spec
        .static_assets
        .into_iter()
        .enumerate()
        .map(|(i, a)| {
            let origin = Origin::new(format!("spec.staticAssets[{i}].source"), at(&a.source.referenced));
            paths::check_lexical(&a.source.value).map_err(|k| ManifestError::new(origin.clone(), k))?;
            paths::check_save_path(&a.save_path.value).map_err(|k| {
                ManifestError::new(
                    Origin::new(format!("spec.staticAssets[{i}].savePath"), at(&a.save_path.referenced)),
                    k,
                )
            })?;
            Ok(StaticAsset {
                source: paths::join_clean(base_dir, &a.source.value),
                save_path: paths::normalize(&a.save_path.value).trim_start_matches('/').to_string(),
                origin,
            })
        })
        .collect::<Result<Vec<_>, ManifestError>>()?;
    let mounts = validate_mounts(spec.mounts, first_line)?;
    let command_origin = || Origin::new("spec.command", at(&spec.command.referenced));
    let command = match spec.command.value {
        raw::Command::Argv(argv) => {
            if argv.is_empty() || argv[0].is_empty() {
                return Err(ManifestError::new(command_origin(), ManifestErrorKind::EmptyCommand));
            }
            if argv.iter().any(|a| a.contains('\0')) {
                return Err(ManifestError::new(command_origin(), ManifestErrorKind::Nul));
            }
            Command::Argv(argv)
        }
        raw::Command::Shell(script) => {
            if script.trim().is_empty() {
                return Err(ManifestError::new(command_origin(), ManifestErrorKind::EmptyCommand));
            }
            if script.contains('\0') {
                return Err(ManifestError::new(command_origin(), ManifestErrorKind::Nul));
            }
            Command::Shell(script)
        }
    };
    let timeout = match &spec.timeout_seconds {
        Some(t) => Some(seconds(t.value.0).ok_or_else(|| {
            ManifestError::new(
                Origin::new("spec.timeoutSeconds", at(&t.referenced)),
                ManifestErrorKind::Timeout,
            )
        })?),
        None => None,
    };
    let active_deadline = match &spec.active_deadline_seconds {
        Some(d) if d.value.0 == 0 || d.value.0 > MAX_TIMEOUT_SECONDS => {
            return Err(ManifestError::new(
                Origin::new("spec.activeDeadlineSeconds", at(&d.referenced)),
                ManifestErrorKind::Deadline,
            ));
        }
        Some(d) => Some(Duration::from_secs(d.value.0)),
        None => None,
    };
    let count = |v: &Option<Spanned<u32>>, field: &str| -> Result<u32, ManifestError> {
        match v {
            Some(c) if c.value == 0 || c.value > MAX_COMPLETIONS => Err(ManifestError::new(
                Origin::new(field, at(&c.referenced)),
                ManifestErrorKind::Count { max: MAX_COMPLETIONS },
            )),
            Some(c) => Ok(c.value),
            None => Ok(1),
        }
    };
    let completions = count(&spec.completions, "spec.completions")?;
    let parallelism = count(&spec.parallelism, "spec.parallelism")?;
    let grace = match &spec.termination_grace_period_seconds {
        Some(g) if g.value.0 > MAX_TIMEOUT_SECONDS => {
            return Err(ManifestError::new(
                Origin::new("spec.terminationGracePeriodSeconds", at(&g.referenced)),
                ManifestErrorKind::Deadline,
            ));
        }
        Some(g) => g.value.0,
        None => defaults::TERMINATION_GRACE_SECONDS,
    };
    let failure_rules = spec
        .pod_failure_policy
        .map(|p| {
            p.rules
                .into_iter()
                .map(|r| policy::FailureRule {
                    action: r.action,
                    operator: r.on_exit_codes.operator,
                    values: r.on_exit_codes.values,
                })
                .collect()
        })
        .unwrap_or_default();
    Ok(Job {
        completions,
        parallelism,
        indexed: spec.completion_mode == Some(raw::CompletionMode::Indexed),
        ttl_after_finished: spec.ttl_seconds_after_finished.map(|s| Duration::from_secs(s.0)),
        termination_grace: Duration::from_secs(grace),
        failure_rules,
        name,
        labels: raw.metadata.labels,
        annotations: raw.metadata.annotations,
        environment: spec.environment.value.clone(),
        environment_origin,
        backend: spec.backend.as_ref().map(|b| {
            let backend = match b.value {
                raw::Backend::Host => Backend::Host,
                raw::Backend::Containerd => Backend::Containerd,
            };
            (backend, Origin::new("spec.backend", at(&b.referenced)))
        }),
        workspace,
        workspace_origin,
        static_assets,
        mounts,
        command,
        stdin: spec.stdin,
        timeout,
        disable_setup: spec.disable_setup,
        backoff_limit: spec.backoff_limit.as_ref().map_or(0, |b| b.value),
        backoff_limit_origin: spec
            .backoff_limit
            .as_ref()
            .map(|b| Origin::new("spec.backoffLimit", at(&b.referenced))),
        active_deadline,
        base_dir: base_dir.to_path_buf(),
        file: file.map(Path::to_path_buf),
    })
}
