//! The resident shell: each named shell of a containerd session is one long-lived interactive
//! shell in the sandbox (bash when the image has it, else `sh`), fed commands over a FIFO. Its
//! variables, functions, aliases, options and directory persist because nothing restarts it.
//!
//! Channels, all FIFOs in the sandbox's shared directory (`Sandbox::fifo`):
//! - `sh-NAME.in`: the shell's input (bash's stdin, another sh's script file; see `prelaunch::LAUNCH`).
//!   The host writes one call as two lines:
//!   `{ command eval '<command>'\n} </dev/null >OUT 2>&1 4>&-` then `printf N<tag>\ %d\\n $? >&4`.
//!   The command is one quoted word, so nothing it contains can break the framing; it runs in
//!   the shell itself (a group, not a subshell), without the shell's stdin or status FIFO.
//! - `sh-NAME.N.out`, one per call: everything the command writes (stdout and stderr
//!   interleaved, as on a terminal), read as bytes until the shell closes it.
//! - `sh-NAME.st` (the shell's fd 4): status lines `N<tag> <status>`, where the tag is a random
//!   nonce and the call's number: what a command prints can never end a call, and a line for
//!   an earlier call is ignored. `X<nonce> <status>` comes from an EXIT trap when the shell
//!   exits (`exit 3`); EOF means it died.
//!
//! `command` takes the special out of `eval`: an error of a special builtin in the command
//! (`set -Z`, an assignment to a readonly variable, `${unset?}` or an unset variable under
//! `set -u`) ends the command, not the rest of what the shell read. busybox's sh drops the rest
//! of its read buffer on such an error, and the status line with it when both came in one read:
//! the call then waited for its whole timeout. bash runs it as plain `eval`.
//!
//! Interactive mode is what makes a timeout recoverable: SIGINT to the shell's process group
//! (the shell leads its own session, started with `setsid`) kills the foreground command and
//! makes the shell abandon the rest of the command, loops of builtins included, and read the
//! next line — as Ctrl-C on a terminal does. Background jobs ignore SIGINT and live on. A
//! command that ignores the interrupt gets SIGTERM (an interactive shell ignores it), and if
//! the shell is still not back, the whole group is killed and the next call starts a new
//! shell: the answer says its state was lost.
//!
//! busybox's ash can hang on the interrupt itself. Its SIGINT handler jumps straight back to
//! the prompt (`longjmp`) from wherever the shell was, and after every builtin it calls
//! `clearerr(stdout)`, which takes stdio's lock. A jump out of that lock after it was taken but
//! before its owner was recorded leaves it held, and the shell waits on it for ever. A loop of
//! builtins (`while :; do :; done`) hits this about once in 300 interrupts, measured with
//! Debian's busybox 1.35. The shell is then killed like a deaf one. bash only sets a flag in its
//! handler, and a command that is not a builtin is waited for with the interrupt held back,
//! so neither can hang this way.
//!
//! An adopted shell (a pool member's, `adopt`) is sent its hello at the claim, and the
//! session's first call writes its command right behind it, then reads the hello's answer
//! and its own: the shell runs the command as soon as it has answered, without waiting for
//! the host to read the answer (the first call came 0.3–0.5 ms before the answer was read).
//! When no call comes within `HELLO_READ_AFTER`, the session reads the answer itself.
//!
//! The host treats the directory as hostile: FIFOs are made and opened by the runtime relative
//! to a directory fd and checked (`Sandbox::fifo`); status lines are bounded and parsed
//! strictly; the sandbox can at worst confuse its own results.

use std::hash::{BuildHasher, Hasher};
use std::os::fd::OwnedFd;
use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::pipe;

use super::output::ShellOutput;
use crate::runtime::containerd::prelaunch;
use crate::runtime::output::Capture;
use crate::runtime::{AdoptableShell, ExecRequest, FifoEnd, Runtime, Sandbox};
use crate::service::ServiceError;

/// How long a new shell may take to say hello.
const START_LIMIT: Duration = Duration::from_secs(15);
/// After each step of an interrupt (SIGINT, SIGTERM), how long the shell may take to be back.
const INTERRUPT_GRACE: Duration = Duration::from_millis(1500);
/// After the status, how long output may still be held open (by a background job).
const DRAIN_LIMIT: Duration = Duration::from_millis(200);
/// Longest command text sent behind a hello before its answer is read: far below a FIFO's
/// buffer (64 KiB), with the hello (~0.5 KiB) in it too.
const PIPELINED_MAX: usize = 4096;
/// Longest status line read.
const LINE_LIMIT: u64 = 200;

/// `text` without the lines an interactive bash with no terminal prints when a command of a
/// pipeline dies of a signal (`yes | head`: SIGPIPE), `bash: [PID: LEVEL (N)] tcsetattr:
/// Inappropriate ioctl for device`. bash then restores the terminal's modes; with none, the
/// call fails and bash says so into the command's output. On a terminal (where SWE-ReX's
/// shells run) it says nothing, so neither do we. Only whole lines of exactly that form go.
fn without_tty_noise(text: String) -> String {
    const NOISE: &str = " Inappropriate ioctl for device\n";
    if !text.contains(NOISE) {
        return text;
    }
    let noise = |line: &str| -> bool {
        let Some(rest) = line.strip_prefix("bash: [").and_then(|r| r.strip_suffix(NOISE)) else {
            return false;
        };
        let Some(figures) = rest
            .strip_suffix("] tcsetattr:")
            .or_else(|| rest.strip_suffix("] tcgetattr:"))
        else {
            return false;
        };
        // `PID: LEVEL (N)`
        let Some((pid, rest)) = figures.split_once(": ") else {
            return false;
        };
        let Some((level, n)) = rest.split_once(" (") else {
            return false;
        };
        let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        digits(pid) && digits(level) && n.strip_suffix(')').is_some_and(|n| digits(n.trim_start_matches('-')))
    };
    text.split_inclusive('\n').filter(|line| !noise(line)).collect()
}

fn fifo_error(e: std::io::Error) -> ServiceError {
    ServiceError::internal("the shell's FIFOs", e)
}

fn receiver(fd: OwnedFd) -> Result<pipe::Receiver, ServiceError> {
    pipe::Receiver::from_owned_fd(fd).map_err(fifo_error)
}

/// The host's ends of a shell's FIFOs at its hello. The input is read-write until the shell
/// answers either way: busybox's sh opens its input itself, from its script-file argument,
/// and a member's may not have yet (a write-only open would fail: ENXIO).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Ends {
    /// Both read-write, as the shell may not hold its own yet: reopened once it answers.
    Opening,
    /// The status read-only at once: a member's shell holds its end since the filler.
    Adopting,
}

/// One live shell.
pub(super) struct Resident {
    name: String,
    nonce: u64,
    /// Its PID inside the sandbox.
    pid: i32,
    input: pipe::Sender,
    status: BufReader<pipe::Receiver>,
    calls: u64,
    /// A write found no reader: the shell exited between calls.
    gone: bool,
    /// A hello sent whose answer is still to be read (`greeted`): an adopted shell's, which
    /// its first call reads after sending its command.
    hello: Option<Hello>,
    /// An adopted shell's PID as its filler recorded it: what is killed when its hello goes
    /// unanswered.
    adopted_pid: Option<i32>,
    /// Its hello went unanswered (`greeted` failed): it is killed, and a new one started.
    hello_failed: Option<Unanswered>,
}

/// How a hello went unanswered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Unanswered {
    /// The shell died before it answered (EOF), or the command could not be written:
    /// nothing sent behind the hello ran.
    Gone,
    /// Not within `START_LIMIT`, or another line came first: a command sent behind the
    /// hello may have started.
    Late,
}

/// A hello sent, to be answered.
#[derive(Clone, Copy)]
struct Hello {
    ends: Ends,
    /// The shell's PID when its short slice was asked for already.
    asked: Option<i32>,
}

/// A shell as a checkpoint records it: its FIFOs' names follow from `name`.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub(super) struct Saved {
    pub name: String,
    pub nonce: u64,
    pub pid: i32,
    pub calls: u64,
}

/// What a status line says.
#[derive(Debug, PartialEq, Eq)]
enum Line {
    /// The call (`N`) or the resynchronisation after an interrupt (`S`) with this number
    /// ended with this status.
    Done { sync: bool, call: u64, status: i32 },
    /// The shell said hello: its PID.
    Ready(i32),
    /// The shell exited with this status.
    Exited(i32),
}

fn parse_line(line: &str, nonce: u64) -> Option<Line> {
    let (kind, rest) = line.trim_end_matches('\n').split_at_checked(1)?;
    let (tag, value) = rest.split_once(' ')?;
    let value: i32 = value.parse().ok()?;
    let (n, call) = match tag.split_once('-') {
        Some((n, call)) => (n, Some(call.parse::<u64>().ok()?)),
        None => (tag, None),
    };
    if n.parse::<u64>().ok()? != nonce {
        return None;
    }
    match (kind, call) {
        ("N" | "S", Some(call)) => Some(Line::Done {
            sync: kind == "S",
            call,
            status: value,
        }),
        ("R", None) if value > 1 => Some(Line::Ready(value)),
        ("X", None) => Some(Line::Exited(value)),
        _ => None,
    }
}

/// The next status line that is ours; `None` at EOF (the shell is gone).
async fn next_line(status: &mut BufReader<pipe::Receiver>, nonce: u64) -> Option<Line> {
    loop {
        let mut raw = Vec::new();
        let n = (&mut *status).take(LINE_LIMIT).read_until(b'\n', &mut raw).await.ok()?;
        if n == 0 {
            return None;
        }
        if let Some(line) = std::str::from_utf8(&raw).ok().and_then(|l| parse_line(l, nonce)) {
            return Some(line);
        }
    }
}

/// Which line ends a wait.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Wait {
    /// The call's own status line.
    Call,
    /// After an interrupt: the call's status line (the shell was back before it read the
    /// resynchronising line; its status is the command's) or the resynchronising line.
    Either,
}

/// Wait for the end of call `call`. `Err(status)`: the shell exited (with the status when it
/// said so).
async fn wait_done(
    status: &mut BufReader<pipe::Receiver>,
    nonce: u64,
    call: u64,
    wait: Wait,
) -> Result<i32, Option<i32>> {
    loop {
        match next_line(status, nonce).await {
            Some(Line::Done { sync, call: c, status }) if c == call && (!sync || wait == Wait::Either) => {
                return Ok(status);
            }
            Some(Line::Exited(status)) => return Err(Some(status)),
            None => return Err(None),
            Some(_) => continue,
        }
    }
}

/// Quote for POSIX sh.
fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The lines that bring an adopted shell to the state of one started now, builtins only (no
/// fork). `cd` sets OLDPWD, which a new shell inherits (or, bash, makes an exported variable
/// without a value): it is put back. SECONDS counts from the shell's start. bash and busybox's
/// sh set HOSTNAME when they start, unless inherited: a shell that has one gets the new name.
fn adoption(shell: &AdoptableShell) -> String {
    let mut text = format!(
        "if [ -n \"${{OLDPWD+x}}\" ]; then runner_o=$OLDPWD; cd -- {cwd} && OLDPWD=$runner_o; \
         else cd -- {cwd} && unset OLDPWD && if [ -n \"${{BASH_VERSION:-}}\" ]; then export OLDPWD; fi; fi; unset runner_o\n",
        cwd = quote(&shell.cwd)
    );
    for (k, v) in &shell.env {
        text.push_str(&format!("export {k}={}\n", quote(v)));
    }
    if let Some(host) = &shell.hostname {
        text.push_str(&format!(
            "if [ -n \"${{HOSTNAME+x}}\" ]; then HOSTNAME={}; fi\n",
            quote(host)
        ));
    }
    text.push_str("if [ -n \"${SECONDS+x}\" ]; then SECONDS=0; fi\n");
    text
}

impl Resident {
    fn file(name: &str, what: &str) -> String {
        prelaunch::shell_file(name, what)
    }

    /// Start shell `name` in the sandbox.
    pub(super) async fn start(runtime: &dyn Runtime, sandbox: &dyn Sandbox, name: &str) -> Result<Self, ServiceError> {
        let (in_name, st_name) = (Self::file(name, "in"), Self::file(name, "st"));
        let input = sandbox.fifo(&in_name, FifoEnd::ReadWrite)?;
        // Read-write until the shell holds its end: the shell's open does not block, and the
        // host sees no EOF before it. Then read-only, so that EOF means the shell is gone.
        let status = sandbox.fifo(&st_name, FifoEnd::ReadWrite)?;
        let launch = runtime
            .execute(ExecRequest {
                argv: prelaunch::launch_argv(name),
                timeout: Some(START_LIMIT),
                ..Default::default()
            })
            .await?;
        if launch.exit_code != Some(0) {
            return Err(ServiceError::rejected(format!(
                "cannot start a shell: {}",
                launch.stderr.trim()
            )));
        }
        let mut shell = Self::say_hello(sandbox, name, input, status, "", Ends::Opening, None).await?;
        shell.greeted(sandbox).await?;
        Ok(shell)
    }

    /// Take over the shell the sandbox's pool member started before the claim, handing it
    /// what was bound since (its directory, the Environment's variables, the hostname) first,
    /// so that its state is a shell's started now: variables the shell's own commands change
    /// (OLDPWD through `cd`, SECONDS, HOSTNAME) are set back to what a new shell has. The
    /// hello is sent, its answer not read (`greeted`): the first call sends its command
    /// behind it (`run`).
    pub(super) async fn adopt(sandbox: &dyn Sandbox, shell: &AdoptableShell) -> Result<Self, ServiceError> {
        let (in_name, st_name) = (Self::file(&shell.name, "in"), Self::file(&shell.name, "st"));
        // The shell holds its status FIFO since the filler started it (`4<>`): the host's end
        // is the final one at once (a shell gone since gives EOF, and a new one is started).
        let input = sandbox.reopen_fifo(&in_name, FifoEnd::ReadWrite)?;
        let status = sandbox.reopen_fifo(&st_name, FifoEnd::Read)?;
        // A FIFO opened for reading while it has no writer reports no hang-up until a writer
        // has come and gone (Linux keeps EPOLLHUP from such a reader): a writer of ours, at
        // once closed, lets a shell that died before the claim read as EOF now, not after
        // `START_LIMIT`. A live shell's own end keeps it open.
        drop(sandbox.reopen_fifo(&st_name, FifoEnd::Write)?);
        let mut adopted = Self::say_hello(
            sandbox,
            &shell.name,
            input,
            status,
            &adoption(shell),
            Ends::Adopting,
            shell.pid,
        )
        .await?;
        adopted.adopted_pid = shell.pid;
        Ok(adopted)
    }

    /// Say hello (with `first`, the adoption's lines, after history is off: a new shell's
    /// history holds only the hello's first line); the answer is read by `greeted`. `asked`:
    /// the shell's PID when its short slice was asked for already.
    async fn say_hello(
        sandbox: &dyn Sandbox,
        name: &str,
        input: OwnedFd,
        status: OwnedFd,
        first: &str,
        ends: Ends,
        asked: Option<i32>,
    ) -> Result<Self, ServiceError> {
        let nonce = std::collections::hash_map::RandomState::new().build_hasher().finish();
        let st_name = Self::file(name, "st");
        let mount = sandbox.shared_mount();
        let mut shell = Resident {
            name: name.to_string(),
            nonce,
            pid: 0,
            input: pipe::Sender::from_owned_fd(input).map_err(fifo_error)?,
            status: BufReader::new(receiver(status)?),
            calls: 0,
            gone: false,
            hello: Some(Hello { ends, asked }),
            adopted_pid: None,
            hello_failed: None,
        };
        let hello = format!(
            "PS1= PS2= PROMPT_COMMAND=; unset HISTFILE MAILCHECK; if [ -n \"${{BASH_VERSION:-}}\" ]; then set +H +o history; fi\n\
             {first}trap 'printf \"X{nonce} %d\\n\" \"$?\" >{mount}/{st_name}' EXIT\n\
             printf 'R{nonce} %d\\n' $$ >&4\n"
        );
        shell.send(&hello).await?;
        Ok(shell)
    }

    /// Read the answer to the hello sent, if one is pending: the shell's PID. A shell that
    /// does not answer (gone, or not within `START_LIMIT`) is marked `hello_failed`.
    pub(super) async fn greeted(&mut self, sandbox: &dyn Sandbox) -> Result<(), ServiceError> {
        // Still pending if this is cancelled while it waits (a checkpoint's request dropped).
        let Some(hello) = self.hello else {
            return Ok(());
        };
        let answer = tokio::time::timeout(START_LIMIT, self.next_line()).await;
        self.hello = None;
        let pid = match answer {
            Ok(Some(Line::Ready(pid))) => pid,
            // EOF: it died before it answered (nothing behind the hello ran).
            Ok(None) => {
                self.hello_failed = Some(Unanswered::Gone);
                return Err(ServiceError::rejected("the shell did not start"));
            }
            // No answer in time; or a call's status or an exit before it: busybox's sh drops
            // the rest of what it read when a line errs (the hello's `printf R` with it), and
            // what was sent behind may have run.
            _ => {
                self.hello_failed = Some(Unanswered::Late);
                return Err(ServiceError::rejected("the shell did not start"));
            }
        };
        self.pid = pid;
        // The host waits on this shell at every call: a short slice lets it run as soon as it
        // wakes, even on CPUs that busy sandboxes keep full (its commands get the default).
        if hello.asked != Some(pid) {
            sandbox.prefer_latency(pid);
        }
        let ends = self.final_ends(sandbox, hello.ends);
        if ends.is_err() {
            // Answered: what was sent behind the hello runs.
            self.hello_failed = Some(Unanswered::Late);
        }
        ends
    }

    /// The host's ends of the FIFOs once the shell answered its hello.
    fn final_ends(&mut self, sandbox: &dyn Sandbox, ends: Ends) -> Result<(), ServiceError> {
        let (in_name, st_name) = (Self::file(&self.name, "in"), Self::file(&self.name, "st"));
        if ends == Ends::Opening {
            let st_ro = receiver(sandbox.reopen_fifo(&st_name, FifoEnd::Read)?)?;
            self.status = BufReader::new(st_ro);
        }
        // Write-only from now on: writing to a shell that is gone fails (EPIPE) instead of
        // filling a pipe nobody reads.
        self.input = pipe::Sender::from_owned_fd(sandbox.reopen_fifo(&in_name, FifoEnd::Write)?).map_err(fifo_error)?;
        Ok(())
    }

    /// Whether (and how) its hello went unanswered: the shell is to be killed (`stop`).
    pub(super) fn hello_failed(&self) -> Option<Unanswered> {
        self.hello_failed
    }

    /// Whether its hello's answer is still to be read.
    pub(super) fn hello_pending(&self) -> bool {
        self.hello.is_some()
    }

    /// What a checkpoint keeps of the shell, to drive its restored copy.
    pub(super) fn saved(&self) -> Saved {
        Saved {
            name: self.name.clone(),
            nonce: self.nonce,
            pid: self.pid,
            calls: self.calls,
        }
    }

    /// Drive a shell restored from a checkpoint (its FIFOs were restored with the sandbox's
    /// agent directory; the shell holds its ends open).
    pub(super) fn adopt_restored(sandbox: &dyn Sandbox, saved: &Saved) -> Result<Self, ServiceError> {
        let (in_name, st_name) = (Self::file(&saved.name, "in"), Self::file(&saved.name, "st"));
        let status = receiver(sandbox.reopen_fifo(&st_name, FifoEnd::Read)?)?;
        let input = pipe::Sender::from_owned_fd(sandbox.reopen_fifo(&in_name, FifoEnd::Write)?).map_err(fifo_error)?;
        Ok(Resident {
            name: saved.name.clone(),
            nonce: saved.nonce,
            pid: saved.pid,
            input,
            status: BufReader::new(status),
            calls: saved.calls,
            gone: false,
            hello: None,
            adopted_pid: None,
            hello_failed: None,
        })
    }

    /// Kill the shell with everything it started, and remove its FIFOs.
    pub(super) fn stop(self, sandbox: &dyn Sandbox) {
        // Before its hello is answered its PID is the one its filler recorded.
        let pid = if self.pid > 1 { Some(self.pid) } else { self.adopted_pid };
        if let Some(pid) = pid.filter(|&p| p > 1) {
            sandbox.signal_group(pid, Signal::SIGKILL);
        }
        Self::remove_files(sandbox, &self.name);
    }

    /// Remove shell `name`'s FIFOs.
    pub(super) fn remove_files(sandbox: &dyn Sandbox, name: &str) {
        for what in ["in", "st"] {
            sandbox.unlink(&Self::file(name, what));
        }
    }

    async fn send(&mut self, text: &str) -> Result<(), ServiceError> {
        let written = self.input.write_all(text.as_bytes()).await;
        if let Err(e) = &written
            && e.kind() == std::io::ErrorKind::BrokenPipe
        {
            self.gone = true;
        }
        written.map_err(|e| ServiceError::internal("writing to the shell", e))
    }

    /// Whether the shell was found gone: it exited between calls (a background job of the
    /// user's killed it, say).
    pub(super) fn gone(&self) -> bool {
        self.gone
    }

    async fn next_line(&mut self) -> Option<Line> {
        next_line(&mut self.status, self.nonce).await
    }

    /// Run one command; the second value says whether the shell is still usable.
    pub(super) async fn run(
        &mut self,
        sandbox: &dyn Sandbox,
        command: &str,
        timeout: Duration,
        output_limit: usize,
    ) -> Result<(ShellOutput, bool), ServiceError> {
        self.calls += 1;
        let call = self.calls;
        let out_name = Self::file(&self.name, &format!("{call}.out"));
        let out = receiver(sandbox.fifo(&out_name, FifoEnd::Read)?)?;
        // Shared, so that what was read is kept when a background job holds the output open
        // past the drain limit (the reader is then stopped).
        let capture = std::sync::Arc::new(std::sync::Mutex::new(Capture::new(output_limit)));
        let reader = {
            let capture = capture.clone();
            tokio::spawn(async move {
                let mut out = out;
                let mut buf = vec![0u8; 64 * 1024];
                loop {
                    match out.read(&mut buf).await {
                        Ok(0) => break,
                        Ok(n) => capture.lock().expect("capture lock").push(&buf[..n]),
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                        Err(_) => break,
                    }
                }
            })
        };
        let mount = sandbox.shared_mount();
        let tag = format!("{}-{call}", self.nonce);
        // The status line has no quote: an interrupt that lands while the shell reads it cannot
        // leave the shell waiting for a closing one.
        let text = format!(
            "{{ command eval {}\n}} </dev/null >{mount}/{out_name} 2>&1 4>&-\nprintf N{tag}\\ %d\\\\n $? >&4\n",
            quote(command)
        );
        let mut timed_out = false;
        let mut alive = true;
        let mut lost = false;
        // An adopted shell's first call sends its command right behind the hello, then reads
        // both answers: the shell runs it as soon as it has answered, instead of after the
        // host read that answer (0.3–0.8 ms). Bounded by the hello's own limit; nothing of
        // the command runs before the hello's answer, which comes first in the shell's input.
        // Only a command that fits the FIFO's buffer beside the hello (a write to a shell
        // that died would block: its input is read-write until the answer), and only to a
        // shell whose PID the filler recorded (one that answers too late is killed).
        if self.hello.is_some() && (text.len() > PIPELINED_MAX || self.adopted_pid.is_none()) {
            let greeted = self.greeted(sandbox).await;
            if let Err(e) = greeted {
                reader.abort();
                sandbox.unlink(&out_name);
                return Err(e);
            }
        }
        let pipelined = self.hello.is_some();
        if pipelined {
            // The send too: a shell that stopped reading cannot hold the call (its input is
            // read-write until the answer, so a full pipe would block, not fail).
            let sent_and_greeted = tokio::time::timeout(START_LIMIT, async {
                match self.send(&text).await {
                    Ok(()) => self.greeted(sandbox).await,
                    Err(e) => {
                        self.hello_failed = Some(Unanswered::Gone);
                        Err(e)
                    }
                }
            })
            .await;
            let greeted = sent_and_greeted.unwrap_or_else(|_| {
                self.hello_failed = Some(Unanswered::Late);
                Err(ServiceError::rejected("the shell did not start"))
            });
            if let Err(e) = greeted {
                reader.abort();
                sandbox.unlink(&out_name);
                return Err(e);
            }
        }
        // Sending is inside the limit: a shell that stopped reading cannot hold the call.
        let call_done = async {
            if !pipelined {
                self.send(&text).await?;
            }
            Ok::<_, ServiceError>(wait_done(&mut self.status, self.nonce, call, Wait::Call).await)
        };
        let exit_code = match tokio::time::timeout(timeout, call_done).await {
            Ok(Err(e)) => {
                reader.abort();
                sandbox.unlink(&out_name);
                return Err(e);
            }
            Ok(Ok(Ok(status))) => Some(status),
            Ok(Ok(Err(status))) => {
                alive = false;
                status
            }
            Err(_) => {
                timed_out = true;
                match self.interrupt(sandbox, call).await {
                    Some(Ok(status)) => Some(status),
                    Some(Err(status)) => {
                        alive = false;
                        status
                    }
                    None => {
                        alive = false;
                        lost = true;
                        None
                    }
                }
            }
        };
        let mut reader = reader;
        if tokio::time::timeout(DRAIN_LIMIT, &mut reader).await.is_err() {
            reader.abort();
        }
        sandbox.unlink(&out_name);
        let taken = std::mem::replace(&mut *capture.lock().expect("capture lock"), Capture::new(0));
        let finished = taken.finish();
        let (mut output, output_dropped_bytes) = (without_tty_noise(finished.text), finished.dropped_bytes);
        if lost {
            output.push_str(
                "\nrunner: the shell did not come back from the interrupt (the command ignored it, or the shell hung); it was killed and the next call starts a new one (its state is lost)\n",
            );
        } else if !alive {
            output.push_str("\nrunner: the shell exited; the next call starts a new one\n");
        }
        Ok((
            ShellOutput {
                output,
                exit_code,
                timed_out,
                output_dropped_bytes,
            },
            alive,
        ))
    }

    /// Stop call `call` that ran out of time: SIGINT, then SIGTERM, to the shell's process
    /// group, each followed by a resynchronising line and a grace period; then SIGKILL
    /// (`None`: the shell is gone).
    async fn interrupt(&mut self, sandbox: &dyn Sandbox, call: u64) -> Option<Result<i32, Option<i32>>> {
        let sync = format!("printf S{}-{call}\\ %d\\\\n $? >&4\n", self.nonce);
        for signal in [Signal::SIGINT, Signal::SIGTERM] {
            sandbox.signal_group(self.pid, signal);
            // A shell that takes the interrupt while reading may drop what it had read: the
            // line is sent again until answered (later copies are answered and ignored).
            let waited = tokio::time::timeout(INTERRUPT_GRACE, async {
                let mut resend = tokio::time::interval(Duration::from_millis(250));
                let done = wait_done(&mut self.status, self.nonce, call, Wait::Either);
                tokio::pin!(done);
                loop {
                    tokio::select! {
                        r = &mut done => return r,
                        _ = resend.tick() => {
                            let _ = self.input.write_all(sync.as_bytes()).await;
                        }
                    }
                }
            })
            .await;
            if let Ok(r) = waited {
                return Some(r);
            }
        }
        sandbox.signal_group(self.pid, Signal::SIGKILL);
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_bash_terminal_noise_lines_are_taken_out() {
        let noise = "bash: [18: 1 (255)] tcsetattr: Inappropriate ioctl for device\n";
        let strip = |s: &str| without_tty_noise(s.to_string());
        assert_eq!(strip(&format!("1\n2\n{noise}")), "1\n2\n");
        assert_eq!(strip(&format!("{noise}a\n{noise}b")), "a\nb");
        for kept in [
            "no noise\n",
            "bash: [x: 1 (255)] tcsetattr: Inappropriate ioctl for device\n",
            "echo: bash: [18: 1 (255)] tcsetattr: Inappropriate ioctl for device\n",
            "bash: [18: 1 (255)] tcsetattr: Inappropriate ioctl for device",
            "sh: [18: 1 (255)] tcsetattr: Inappropriate ioctl for device\n",
            "bash: [18: 1 (255)] open: Inappropriate ioctl for device\n",
        ] {
            assert_eq!(strip(kept), kept);
        }
    }

    #[test]
    fn status_lines_are_parsed_strictly() {
        assert_eq!(
            parse_line("N42-7 0\n", 42),
            Some(Line::Done {
                sync: false,
                call: 7,
                status: 0
            })
        );
        assert_eq!(
            parse_line("S42-7 130\n", 42),
            Some(Line::Done {
                sync: true,
                call: 7,
                status: 130
            })
        );
        assert_eq!(parse_line("R42 17\n", 42), Some(Line::Ready(17)));
        assert_eq!(parse_line("X42 3\n", 42), Some(Line::Exited(3)));
        for bad in [
            "N41-7 0", "N42-7", "N42 0", "R42-1 5", "R42 1", "Q42-1 0", "", "N42-x 0", "é",
        ] {
            assert_eq!(parse_line(bad, 42), None, "{bad}");
        }
    }
}
