//! The resolver process: its sockets (DNS over UDP and TCP, the control socket), its policies
//! in memory, and the answer to one query. Every query passes the limits before any work.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use hickory_proto::op::ResponseCode;
use hickory_proto::rr::RecordType;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};

use super::cache::Cache;
use super::control::{MAX_LINE, Message, Reply};
use super::limits::{Admit, Limits};
use super::ranges::{self, HostNets};
use super::sets::{self, Request, Sets};
use super::{MAX_TTL, MIN_TTL, Policy, wire};
use crate::config::{NetPaths, ResolverLimits};

/// How long the resolver lives with no container to serve.
const IDLE_EXIT: Duration = Duration::from_secs(60);
/// How often the host's addresses are read again.
const HOST_REFRESH: Duration = Duration::from_secs(2);
/// The TTL of the network's own names.
const LOCAL_TTL: u32 = 5;
/// A UDP answer's size without EDNS (RFC 1035): past it, a truncated answer sends the client
/// to TCP.
const UDP_PLAIN: usize = 512;
/// How long an answer may wait for its addresses to reach the kernel.
const SET_TIMEOUT: Duration = Duration::from_secs(3);

struct State {
    paths: NetPaths,
    limits: Arc<Limits>,
    policies: RwLock<HashMap<Ipv4Addr, Policy>>,
    /// (network, name) → address: every container's job name and id.
    names: RwLock<HashMap<(String, String), Ipv4Addr>>,
    /// `None`: unreadable (every domain answer is refused).
    host: RwLock<Option<HostNets>>,
    host_upstream: RwLock<Vec<SocketAddr>>,
    cache: Mutex<Cache>,
    sets: mpsc::Sender<Request>,
    /// Over the memory budget: no upstream work until it is back under.
    pressure: AtomicBool,
    /// How the host's addresses are read (`HostNets::read`; tests give another).
    read_host: HostReader,
}

type HostReader = Box<dyn Fn(&std::path::Path) -> io::Result<HostNets> + Send + Sync>;

impl State {
    fn reindex(&self) {
        let policies = self.policies.read().expect("policies");
        let mut names = HashMap::new();
        for p in policies.values() {
            for n in [&p.name, &p.id] {
                if !n.is_empty() {
                    names.insert((p.network.clone(), n.to_ascii_lowercase()), p.ip);
                }
            }
        }
        *self.names.write().expect("names") = names;
    }

    fn refresh_host(&self) {
        let read = (self.read_host)(&self.paths.sys_class_net);
        if let Err(e) = &read {
            tracing::warn!(error = %e, "the host's addresses could not be read: domain answers are refused until they can");
        }
        *self.host.write().expect("host") = read.ok();
        let text = std::fs::read_to_string(&self.paths.host_resolv_conf).unwrap_or_default();
        *self.host_upstream.write().expect("upstream") = super::host_resolvers(&text);
    }
}

/// `runner resolver`: serve the bridges' DNS until no container needs it. Prints `ready
/// <port>` on stdout once it listens, or `running <port>` when another one runs already.
pub async fn run(paths: NetPaths, limits: ResolverLimits) -> io::Result<()> {
    std::fs::create_dir_all(&paths.dir)?;
    let lock_file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(paths.resolver_lock())?;
    let _held = match nix::fcntl::Flock::lock(lock_file, nix::fcntl::FlockArg::LockExclusiveNonblock) {
        Ok(l) => l,
        Err(_) => {
            println!(
                "running {}",
                std::fs::read_to_string(paths.resolver_port())
                    .unwrap_or_default()
                    .trim()
            );
            return Ok(());
        }
    };
    raise_nofile();
    let (udp, tcp) = bind().await?;
    let port = udp.local_addr()?.port();
    let sets_tx = Sets::new(Arc::new(sets::Kernel), limits.elements_per_container).spawn();
    let state = Arc::new(State {
        limits: Arc::new(Limits::new(limits.clone())),
        policies: RwLock::new(HashMap::new()),
        names: RwLock::new(HashMap::new()),
        host: RwLock::new(None),
        host_upstream: RwLock::new(Vec::new()),
        cache: Mutex::new(Cache::new(limits.cache_entries)),
        sets: sets_tx,
        pressure: AtomicBool::new(false),
        read_host: Box::new(HostNets::read),
        paths: paths.clone(),
    });
    state.refresh_host();
    for p in super::load_policies(&paths) {
        let _ = state
            .sets
            .send(Request::Attach {
                ip: p.ip,
                id: p.id.clone(),
                complete: false,
            })
            .await;
        state.policies.write().expect("policies").insert(p.ip, p);
    }
    state.reindex();
    let control = bind_control(&paths)?;
    std::fs::write(paths.resolver_pid(), std::process::id().to_string())?;
    std::fs::write(paths.resolver_port(), port.to_string())?;
    println!("ready {port}");
    use std::io::Write;
    let _ = std::io::stdout().flush();
    // Whoever started it stops reading: nothing more goes to that pipe.
    if let Ok(null) = std::fs::OpenOptions::new().write(true).open("/dev/null") {
        let _ = nix::unistd::dup2_stdout(&null);
    }
    tracing::info!(port, "listening");
    tokio::spawn(serve_udp(state.clone(), Arc::new(udp)));
    tokio::spawn(serve_tcp(state.clone(), tcp));
    tokio::spawn(serve_control(state.clone(), control));
    tokio::spawn(housekeeping(state.clone()));
    idle_exit(&state).await
}

/// RLIMIT_NOFILE up to its hard limit: every TCP connection and upstream query is a
/// descriptor, and running out would refuse bystanders' queries too.
fn raise_nofile() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((_, hard)) = getrlimit(Resource::RLIMIT_NOFILE)
        && let Err(e) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard)
    {
        tracing::warn!(error = %e, "could not raise the descriptor limit");
    }
}

async fn bind() -> io::Result<(tokio::net::UdpSocket, tokio::net::TcpListener)> {
    // Every address (each network's gateway is one); the wall lets only the networks reach
    // the port.
    let any = Ipv4Addr::UNSPECIFIED;
    let mut tries = 0;
    loop {
        let udp = std::net::UdpSocket::bind((any, 0))?;
        udp.set_nonblocking(true)?;
        // A deep receive buffer: a burst from one container must not push out another's
        // queries before the loop reads them (root may exceed rmem_max).
        let size: libc::c_int = 4 << 20;
        // SAFETY: setsockopt with an int of the size given, on a socket this function owns.
        unsafe {
            libc::setsockopt(
                std::os::fd::AsRawFd::as_raw_fd(&udp),
                libc::SOL_SOCKET,
                libc::SO_RCVBUFFORCE,
                (&size as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
        let udp = tokio::net::UdpSocket::from_std(udp)?;
        let port = udp.local_addr()?.port();
        match tokio::net::TcpListener::bind((any, port)).await {
            Ok(tcp) => return Ok((udp, tcp)),
            Err(e) if tries < 16 => {
                tries += 1;
                tracing::debug!(port, error = %e, "the TCP side of a port is taken; another port");
            }
            Err(e) => return Err(e),
        }
    }
}

fn bind_control(paths: &NetPaths) -> io::Result<tokio::net::UnixListener> {
    use std::os::unix::fs::PermissionsExt;
    let path = paths.resolver_socket();
    let _ = std::fs::remove_file(&path);
    // Made under a 0077 umask so it is never open to others, even for a moment.
    let old = nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o077));
    let bound = tokio::net::UnixListener::bind(&path);
    nix::sys::stat::umask(old);
    let listener = bound?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

async fn serve_udp(state: Arc<State>, udp: Arc<tokio::net::UdpSocket>) {
    let mut buf = vec![0u8; 4096];
    loop {
        let (n, peer) = match udp.recv_from(&mut buf).await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(error = %e, "receiving a query failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let msg = &buf[..n];
        match state.limits.admit(peer.ip()) {
            Admit::Drop => continue,
            Admit::Refuse => {
                refuse_now(&udp, msg, peer);
                continue;
            }
            Admit::Yes => {}
        }
        let Ok(permit) = state.limits.tasks.clone().try_acquire_owned() else {
            refuse_now(&udp, msg, peer);
            continue;
        };
        let (state, udp, msg) = (state.clone(), udp.clone(), msg.to_vec());
        tokio::spawn(async move {
            let _permit = permit;
            if let Some(mut out) = answer(&state, &msg, peer.ip()).await {
                if out.len() > UDP_PLAIN
                    && let Ok(q) = wire::question(&msg)
                    && !has_edns(&msg)
                {
                    out = wire::truncated(&q);
                }
                let _ = udp.send_to(&out, peer).await;
            }
        });
    }
}

/// Whether a query carries an EDNS OPT record (then its answer may exceed 512 bytes).
fn has_edns(msg: &[u8]) -> bool {
    msg.len() >= 12 && u16::from_be_bytes([msg[10], msg[11]]) > 0
}

/// REFUSED at once, without waiting for the socket (a full buffer drops it).
fn refuse_now(udp: &tokio::net::UdpSocket, msg: &[u8], peer: SocketAddr) {
    if let Ok(q) = wire::question(msg) {
        let _ = udp.try_send_to(&wire::empty(&q, ResponseCode::Refused), peer);
    }
}

async fn serve_tcp(state: Arc<State>, tcp: tokio::net::TcpListener) {
    loop {
        let (stream, peer) = match tcp.accept().await {
            Ok(x) => x,
            Err(e) => {
                // Out of descriptors, say: back off instead of spinning on the error.
                tracing::warn!(error = %e, "accepting a connection failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Some(slot) = state.limits.open_tcp(peer.ip()) else {
            // Over its cap: closed at once.
            continue;
        };
        let state = state.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let _ = tcp_connection(&state, stream, peer.ip()).await;
        });
    }
}

async fn tcp_connection(state: &State, mut stream: tokio::net::TcpStream, peer: IpAddr) -> io::Result<()> {
    let idle = state.limits.config.tcp_idle;
    loop {
        // The whole query within the idle time: a silent or trickling client is cut.
        let msg = tokio::time::timeout(idle, async {
            let len = stream.read_u16().await? as usize;
            let mut msg = vec![0u8; len];
            stream.read_exact(&mut msg).await?;
            Ok::<_, io::Error>(msg)
        })
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "idle"))??;
        let out = match state.limits.admit(peer) {
            Admit::Drop => return Ok(()),
            Admit::Refuse => wire::question(&msg)
                .ok()
                .map(|q| wire::empty(&q, ResponseCode::Refused)),
            Admit::Yes => match state.limits.tasks.clone().try_acquire_owned() {
                Ok(_permit) => answer(state, &msg, peer).await,
                Err(_) => wire::question(&msg)
                    .ok()
                    .map(|q| wire::empty(&q, ResponseCode::Refused)),
            },
        };
        let Some(out) = out else { return Ok(()) };
        let mut framed = (out.len() as u16).to_be_bytes().to_vec();
        framed.extend_from_slice(&out);
        tokio::time::timeout(idle, stream.write_all(&framed))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "a client that does not read"))??;
    }
}

/// What the resolver answers one message from `from`; `None`: nothing.
async fn answer(state: &State, msg: &[u8], from: IpAddr) -> Option<Vec<u8>> {
    let q = match wire::question(msg) {
        Ok(q) => q,
        Err(u) => return wire::formerr(&u),
    };
    let IpAddr::V4(ip) = from else {
        return Some(wire::empty(&q, ResponseCode::Refused));
    };
    let Some(policy) = state.policies.read().expect("policies").get(&ip).cloned() else {
        return Some(wire::empty(&q, ResponseCode::Refused));
    };
    if q.class_in
        && let Some(addr) = state
            .names
            .read()
            .expect("names")
            .get(&(policy.network.clone(), q.name.clone()))
            .copied()
    {
        return Some(wire::local(&q, (q.qtype == RecordType::A).then_some(addr), LOCAL_TTL));
    }
    let rules: Vec<_> = policy.domains.iter().filter(|d| d.matches(&q.name)).cloned().collect();
    if rules.is_empty() {
        tracing::info!(container = policy.id, name = q.name, "refused: no egress rule names it");
        return Some(wire::empty(&q, ResponseCode::NXDomain));
    }
    if !q.class_in || !matches!(q.qtype, RecordType::A | RecordType::AAAA) {
        // Allowed names have addresses, nothing else.
        return Some(wire::empty(&q, ResponseCode::NoError));
    }
    let Some(host) = state.host.read().expect("host").clone() else {
        // Fail closed: what the host keeps to itself cannot be told apart.
        return Some(wire::empty(&q, ResponseCode::Refused));
    };
    let servers = if policy.upstream.is_empty() {
        state.host_upstream.read().expect("upstream").clone()
    } else {
        policy.upstream.clone()
    };
    let cached = state
        .cache
        .lock()
        .expect("cache")
        .get(&servers, &q.name, q.qtype, Instant::now());
    let (resolved, left) = match cached {
        Some(hit) => hit,
        None => {
            if state.pressure.load(Ordering::Relaxed) {
                return Some(wire::empty(&q, ResponseCode::Refused));
            }
            let Some(_upstream) = state.limits.upstream(from) else {
                return Some(wire::empty(&q, ResponseCode::Refused));
            };
            let Some(r) = ask_upstream(&servers, &q.name, q.qtype, state.limits.config.upstream_timeout).await else {
                return Some(wire::empty(&q, ResponseCode::ServFail));
            };
            let ttl = r.ttl();
            state
                .cache
                .lock()
                .expect("cache")
                .put(&servers, &q.name, q.qtype, r.clone(), Instant::now());
            (r, ttl.max(1))
        }
    };
    let mut forms = Vec::new();
    for (addr, _) in &resolved.addrs {
        if let Some(why) = ranges::closed(*addr, &host) {
            tracing::warn!(container = policy.id, name = q.name, %addr, why, "an answer's address stays closed");
            continue;
        }
        if let IpAddr::V4(a) = addr {
            for r in &rules {
                if !forms.contains(&(*a, r.port)) {
                    forms.push((*a, r.port));
                }
            }
        }
    }
    if !forms.is_empty() {
        let timeout = Duration::from_secs(u64::from(left.clamp(MIN_TTL, MAX_TTL)));
        let (reply, rx) = oneshot::channel();
        let sent = state
            .sets
            .send(Request::Allow {
                ip,
                id: policy.id.clone(),
                name: q.name.clone(),
                forms,
                timeout,
                reply,
            })
            .await;
        let done = match sent {
            Ok(()) => tokio::time::timeout(SET_TIMEOUT, rx).await.ok().and_then(Result::ok),
            Err(_) => None,
        };
        if let Some(Err(e)) = &done {
            tracing::warn!(container = policy.id, error = %e, "the answer's addresses could not be allowed");
        }
        if !matches!(done, Some(Ok(()))) {
            return Some(wire::empty(&q, ResponseCode::ServFail));
        }
    }
    Some(wire::answer(&q, &resolved, left))
}

/// Ask the upstreams in turn (UDP, then TCP when truncated): the first usable answer.
async fn ask_upstream(
    servers: &[SocketAddr],
    name: &str,
    qtype: RecordType,
    limit: Duration,
) -> Option<wire::Resolved> {
    for server in servers {
        let (id, query) = wire::upstream_query(name, qtype)?;
        let mut got = exchange_udp(*server, &query, id, limit).await;
        if let Ok(bytes) = &got
            && wire::resolved(bytes, id, name, qtype) == Err(wire::BadAnswer::Truncated)
        {
            got = exchange_tcp(*server, &query, limit).await;
        }
        match got.map(|b| wire::resolved(&b, id, name, qtype)) {
            Ok(Ok(r)) => return Some(r),
            Ok(Err(e)) => tracing::warn!(%server, error = %e, "an upstream's answer was not used"),
            Err(e) => tracing::warn!(%server, error = %e, "upstream resolver failed"),
        }
    }
    None
}

async fn exchange_udp(server: SocketAddr, msg: &[u8], id: u16, limit: Duration) -> io::Result<Vec<u8>> {
    let bind: SocketAddr = if server.is_ipv4() {
        (Ipv4Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let sock = tokio::net::UdpSocket::bind(bind).await?;
    sock.connect(server).await?;
    sock.send(msg).await?;
    // Our queries carry no EDNS: an answer over 512 bytes comes truncated (then over TCP).
    let mut buf = vec![0u8; 4096];
    tokio::time::timeout(limit, async {
        loop {
            let n = sock.recv(&mut buf).await?;
            // An answer to another id is not ours (a late one, or a spoof): wait on.
            if n >= 2 && u16::from_be_bytes([buf[0], buf[1]]) == id {
                return Ok(buf[..n].to_vec());
            }
        }
    })
    .await
    .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "no answer"))?
}

async fn exchange_tcp(server: SocketAddr, msg: &[u8], limit: Duration) -> io::Result<Vec<u8>> {
    let work = async {
        let mut s = tokio::net::TcpStream::connect(server).await?;
        let mut framed = (msg.len() as u16).to_be_bytes().to_vec();
        framed.extend_from_slice(msg);
        s.write_all(&framed).await?;
        let len = s.read_u16().await? as usize;
        let mut buf = vec![0u8; len];
        s.read_exact(&mut buf).await?;
        Ok(buf)
    };
    tokio::time::timeout(limit, work)
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "no answer"))?
}

async fn serve_control(state: Arc<State>, listener: tokio::net::UnixListener) {
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        // Root only: the socket is 0600 in a root directory; the peer's credentials say so.
        if stream.peer_cred().map(|c| c.uid()).ok() != Some(nix::unistd::geteuid().as_raw()) {
            continue;
        }
        let state = state.clone();
        tokio::spawn(async move {
            let (read, mut write) = stream.into_split();
            let mut line = String::new();
            let read = tokio::time::timeout(
                Duration::from_secs(5),
                tokio::io::BufReader::new(read.take(MAX_LINE)).read_line(&mut line),
            )
            .await;
            if !matches!(read, Ok(Ok(n)) if n > 0) {
                return;
            }
            let reply = match serde_json::from_str::<Message>(&line) {
                Ok(msg) => control(&state, msg).await,
                Err(e) => Reply {
                    ok: false,
                    known: false,
                    error: Some(format!("unreadable message: {e}")),
                },
            };
            let mut out = serde_json::to_vec(&reply).unwrap_or_default();
            out.push(b'\n');
            let _ = write.write_all(&out).await;
        });
    }
}

async fn control(state: &State, msg: Message) -> Reply {
    let ok = |known| Reply {
        ok: true,
        known,
        error: None,
    };
    match msg {
        Message::Attach(p) => {
            let _ = state
                .sets
                .send(Request::Attach {
                    ip: p.ip,
                    id: p.id.clone(),
                    complete: true,
                })
                .await;
            state.policies.write().expect("policies").insert(p.ip, p);
            state.reindex();
            // A new network's bridge is a new host subnet to keep closed.
            state.refresh_host();
            ok(true)
        }
        Message::Detach { ip, id } => {
            {
                let mut policies = state.policies.write().expect("policies");
                if policies.get(&ip).is_some_and(|p| p.id == id) {
                    policies.remove(&ip);
                }
            }
            state.reindex();
            let (reply, rx) = oneshot::channel();
            let known = state.sets.send(Request::Detach { ip, id, reply }).await.is_ok() && rx.await.unwrap_or(false);
            ok(known)
        }
        Message::Patch(p) => {
            let same = state
                .policies
                .read()
                .expect("policies")
                .get(&p.ip)
                .is_some_and(|o| o.id == p.id);
            if !same {
                return Reply {
                    ok: false,
                    known: false,
                    error: Some(format!("no container {} at {}", p.id, p.ip)),
                };
            }
            let (ip, id, domains) = (p.ip, p.id.clone(), p.domains.clone());
            state.policies.write().expect("policies").insert(p.ip, p);
            state.reindex();
            let (reply, rx) = oneshot::channel();
            let known =
                state.sets.send(Request::Patch { ip, id, domains, reply }).await.is_ok() && rx.await.unwrap_or(false);
            ok(known)
        }
    }
}

/// The host's addresses again, old sources forgotten, and the memory budget kept.
async fn housekeeping(state: Arc<State>) {
    let mut tick = tokio::time::interval(HOST_REFRESH);
    loop {
        tick.tick().await;
        state.refresh_host();
        state.limits.sweep();
        let rss = resident_bytes();
        let over = rss > state.limits.config.memory_bytes;
        if over && !state.pressure.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                rss,
                "over the memory budget: the cache is emptied and upstream queries wait"
            );
            state.cache.lock().expect("cache").clear();
        } else if !over {
            state.pressure.store(false, Ordering::Relaxed);
        }
    }
}

/// This process's resident set (`/proc/self/statm`, pages).
pub fn resident_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|t| t.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |pages| pages * 4096)
}

/// Exit once no container has had a policy for `IDLE_EXIT`. Decided under the network lock:
/// an attach (which holds it) either sees this resolver gone, or its policy is seen here.
async fn idle_exit(state: &Arc<State>) -> io::Result<()> {
    let mut idle_since: Option<Instant> = None;
    loop {
        tokio::time::sleep(Duration::from_secs(5)).await;
        if !state.policies.read().expect("policies").is_empty() {
            idle_since = None;
            continue;
        }
        let since = *idle_since.get_or_insert_with(Instant::now);
        if since.elapsed() < IDLE_EXIT {
            continue;
        }
        let lock_path = state.paths.lock_file();
        let held = tokio::task::spawn_blocking(move || {
            let f = std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(lock_path)?;
            nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusive).map_err(|(_, e)| io::Error::from(e))
        })
        .await
        .map_err(io::Error::other)??;
        if state.policies.read().expect("policies").is_empty() && !super::any_policy(&state.paths) {
            for f in [
                state.paths.resolver_pid(),
                state.paths.resolver_port(),
                state.paths.resolver_socket(),
            ] {
                let _ = std::fs::remove_file(f);
            }
            tracing::info!("no container to serve; exiting");
            drop(held);
            return Ok(());
        }
        drop(held);
        idle_since = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::{EgressDomain, EgressEntry};

    fn domain(t: &str) -> EgressDomain {
        match EgressEntry::parse(t).unwrap() {
            EgressEntry::Domain(d) => d,
            _ => panic!("{t}"),
        }
    }

    fn state(host: Option<HostNets>) -> (Arc<State>, Arc<sets::Recorder>) {
        let rec = Arc::new(sets::Recorder::default());
        let tx = Sets::new(rec.clone(), 100).spawn();
        let limits = ResolverLimits::default();
        let st = Arc::new(State {
            paths: NetPaths::default(),
            limits: Arc::new(Limits::new(limits.clone())),
            policies: RwLock::new(HashMap::new()),
            names: RwLock::new(HashMap::new()),
            host: RwLock::new(host.clone()),
            host_upstream: RwLock::new(Vec::new()),
            cache: Mutex::new(Cache::new(limits.cache_entries)),
            sets: tx,
            pressure: AtomicBool::new(false),
            read_host: Box::new(move |_| {
                host.clone()
                    .ok_or_else(|| io::Error::other("unreadable, as the test asks"))
            }),
        });
        (st, rec)
    }

    /// An upstream on loopback that answers every A query with `addrs` (CNAME-free), TTL 60,
    /// counting the queries it got.
    async fn upstream(addrs: Vec<Ipv4Addr>) -> (SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
        use hickory_proto::op::{Message, MessageType};
        use hickory_proto::rr::{RData, Record, rdata::A};
        let sock = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = sock.local_addr().unwrap();
        let count = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let c = count.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 512];
            while let Ok((n, peer)) = sock.recv_from(&mut buf).await {
                c.fetch_add(1, Ordering::SeqCst);
                let Ok(q) = Message::from_vec(&buf[..n]) else { continue };
                let mut m = q.clone();
                m.metadata.message_type = MessageType::Response;
                for a in &addrs {
                    m.add_answer(Record::from_rdata(q.queries[0].name().clone(), 60, RData::A(A(*a))));
                }
                let _ = sock.send_to(&m.to_vec().unwrap(), peer).await;
            }
        });
        (addr, count)
    }

    fn query(name: &str) -> Vec<u8> {
        wire::upstream_query(name, RecordType::A).unwrap().1
    }

    fn rcode(bytes: &[u8]) -> u8 {
        bytes[3] & 0xF
    }

    #[tokio::test]
    async fn answers_follow_the_policy_and_closed_ranges_never_reach_the_sets() {
        let public = Ipv4Addr::new(198, 51, 100, 7);
        let private = Ipv4Addr::new(10, 1, 2, 3);
        let (up, count) = upstream(vec![public, private]).await;
        let (st, rec) = state(Some(HostNets::read(std::path::Path::new("/sys/class/net")).unwrap()));
        let me = Ipv4Addr::new(10, 89, 0, 2);
        let p = Policy {
            id: "c1".into(),
            ip: me,
            name: "web".into(),
            network: "runner".into(),
            domains: vec![domain("*.allowed.test"), domain("port.test:443")],
            upstream: vec![up],
        };
        control(&st, Message::Attach(p)).await;
        let from = IpAddr::V4(me);
        // Unknown source: REFUSED. Unallowed name: NXDOMAIN. Own network's name: answered.
        assert_eq!(
            rcode(
                &answer(&st, &query("a.allowed.test"), "10.89.0.99".parse().unwrap())
                    .await
                    .unwrap()
            ),
            5
        );
        assert_eq!(rcode(&answer(&st, &query("denied.test"), from).await.unwrap()), 3);
        let own = answer(&st, &query("web"), from).await.unwrap();
        assert!(own.ends_with(&me.octets()), "{own:?}");
        // Allowed: the public address goes in (any port), the private one never does.
        let a = answer(&st, &query("a.allowed.test"), from).await.unwrap();
        assert_eq!(rcode(&a), 0);
        let batches = rec.batches.lock().unwrap().clone();
        assert_eq!(batches.len(), 1);
        let text = format!("{:?}", batches[0]);
        assert!(text.contains("198.51.100.7") && !text.contains("10.1.2.3"), "{text}");
        assert!(batches[0].iter().all(|c| matches!(c, crate::net::netlink::Change::Add { set, timeout, .. } if set == "dom" && *timeout == Duration::from_secs(60))));
        // Asked again: from the cache, and no kernel work.
        answer(&st, &query("a.allowed.test"), from).await.unwrap();
        assert_eq!(count.load(Ordering::SeqCst), 1);
        assert_eq!(rec.batches.lock().unwrap().len(), 1);
        // A port rule's form.
        answer(&st, &query("port.test"), from).await.unwrap();
        assert!(format!("{:?}", rec.batches.lock().unwrap().last().unwrap()).contains("port: Some(443)"));
    }

    /// Runners with different upstreams share the host's one resolver: each container gets
    /// its own upstream's answer for the same name, never the other's cached one.
    #[tokio::test]
    async fn containers_with_different_upstreams_get_their_own_answers() {
        let (one, two) = (Ipv4Addr::new(198, 51, 100, 1), Ipv4Addr::new(198, 51, 100, 2));
        let (up1, count1) = upstream(vec![one]).await;
        let (up2, count2) = upstream(vec![two]).await;
        let (st, _rec) = state(Some(HostNets::read(std::path::Path::new("/sys/class/net")).unwrap()));
        let (me1, me2) = (Ipv4Addr::new(10, 89, 0, 2), Ipv4Addr::new(10, 89, 0, 3));
        for (id, ip, up) in [("c1", me1, up1), ("c2", me2, up2)] {
            let p = Policy {
                id: id.into(),
                ip,
                name: String::new(),
                network: "runner".into(),
                domains: vec![domain("same.test")],
                upstream: vec![up],
            };
            control(&st, Message::Attach(p)).await;
        }
        for _ in 0..2 {
            let a = answer(&st, &query("same.test"), IpAddr::V4(me1)).await.unwrap();
            assert!(a.ends_with(&one.octets()), "{a:?}");
            let b = answer(&st, &query("same.test"), IpAddr::V4(me2)).await.unwrap();
            assert!(b.ends_with(&two.octets()), "{b:?}");
        }
        // Each upstream was asked once: the cache still serves repeats.
        assert_eq!(count1.load(Ordering::SeqCst), 1);
        assert_eq!(count2.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn without_the_hosts_addresses_domain_answers_are_refused() {
        let (up, count) = upstream(vec![Ipv4Addr::new(198, 51, 100, 7)]).await;
        let (st, rec) = state(None);
        let me = Ipv4Addr::new(10, 89, 0, 2);
        let p = Policy {
            id: "c1".into(),
            ip: me,
            name: String::new(),
            network: "runner".into(),
            domains: vec![domain("allowed.test")],
            upstream: vec![up],
        };
        control(&st, Message::Attach(p)).await;
        let a = answer(&st, &query("allowed.test"), IpAddr::V4(me)).await.unwrap();
        assert_eq!(rcode(&a), 5);
        assert_eq!(count.load(Ordering::SeqCst), 0);
        assert!(rec.batches.lock().unwrap().is_empty());
    }
}
