//! How setup commands and the job's command share one process, and how their output is told
//! apart afterwards.
//!
//! The entry is `sh -c SCRIPT runner-entry ARGV...`: SCRIPT runs the setup commands in a
//! subshell (stdin from /dev/null, stopping at the first failure), then writes `SETUP_MARKER`
//! and the setup's exit status to stdout and to stderr, and `exec`s the command with the
//! positional arguments (no quoting of the command is ever needed). Setup commands come from
//! the Environment (trusted) and run before any submission code, so the *first* marker in a
//! stream is always ours: everything before it is setup output, everything after the marker
//! line is the command's — exact to the byte, whatever either prints.

/// Written once per stream after setup: `SETUP_MARKER` + decimal exit status + `\n`.
pub const SETUP_MARKER: &[u8] = b"\x1erunner:setup-done:";
/// argv[0] of the entry shell, visible in `ps`.
const ENTRY_NAME: &str = "runner-entry";

/// The process argv for a command with (possibly empty) setup. No setup means none runs and
/// no marker is printed (`disableSetup`, or nothing to set up). `stdin`: a file in the
/// container the command reads as its stdin (setup always reads /dev/null). A task's stdin
/// cannot be a FIFO when the shim runs our output logger (containerd's binary IO connects
/// stdout and stderr only), and a file survives the runner, so a re-adopted job keeps it.
pub fn compose(setup: &[String], disable_setup: bool, stdin: Option<&str>, argv: &[String]) -> Vec<String> {
    let runs_setup = !disable_setup && !setup.is_empty();
    if !runs_setup && stdin.is_none() {
        return argv.to_vec();
    }
    let mut script = String::new();
    if runs_setup {
        script.push_str(&setup_script(setup));
        script.push_str(" </dev/null\nrunner_rc=$?\n");
        script.push_str("printf '\\036runner:setup-done:%d\\n' \"$runner_rc\"\n");
        script.push_str("printf '\\036runner:setup-done:%d\\n' \"$runner_rc\" >&2\n");
        script.push_str("[ \"$runner_rc\" -eq 0 ] || exit \"$runner_rc\"\n");
    }
    match stdin {
        Some(path) => script.push_str(&format!("exec \"$@\" <{}\n", quote(path))),
        None => script.push_str("exec \"$@\"\n"),
    }
    let mut out = vec!["/bin/sh".to_string(), "-c".to_string(), script, ENTRY_NAME.to_string()];
    out.extend(argv.iter().cloned());
    out
}

/// Single-quote a word for sh.
fn quote(word: &str) -> String {
    format!("'{}'", word.replace('\'', r"'\''"))
}

/// The setup commands as one subshell that stops at the first failure and exits with its
/// status. `{ ...\n}` keeps multi-line commands intact.
pub fn setup_script(setup: &[String]) -> String {
    let mut script = String::from("(\n");
    for command in setup {
        script.push_str("{\n");
        script.push_str(command);
        script.push_str("\n} || exit $?\n");
    }
    script.push(')');
    script
}

/// Where a byte of output belongs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    Setup,
    Command,
}

/// Splits one stream (stdout or stderr) at the first setup marker, chunk by chunk, so the
/// split happens before any output cap is applied.
#[derive(Debug)]
pub struct Splitter {
    state: State,
    /// Bytes that may be the start of the marker, held back until decided.
    pending: Vec<u8>,
    setup_status: Option<i32>,
}

#[derive(Debug, PartialEq, Eq)]
enum State {
    /// Looking for the marker; output so far is setup's.
    Setup,
    /// Marker seen; reading its status digits up to `\n`.
    Status,
    /// Everything from here on is the command's.
    Command,
}

impl Splitter {
    /// `expect_marker` is false when no setup ran: everything is the command's.
    pub fn new(expect_marker: bool) -> Self {
        Splitter {
            state: if expect_marker { State::Setup } else { State::Command },
            pending: Vec::new(),
            setup_status: None,
        }
    }

    /// The exit status setup reported, once its marker has been read.
    pub fn setup_status(&self) -> Option<i32> {
        self.setup_status
    }

    pub fn marker_seen(&self) -> bool {
        self.state == State::Command && self.setup_status.is_some()
    }

    /// Feed a chunk; `emit(part, bytes)` receives the classified bytes in order.
    pub fn feed(&mut self, chunk: &[u8], emit: &mut dyn FnMut(Part, &[u8])) {
        let mut rest = chunk;
        while !rest.is_empty() {
            match self.state {
                State::Command => {
                    emit(Part::Command, rest);
                    return;
                }
                State::Setup => {
                    self.pending.extend_from_slice(rest);
                    rest = &[];
                    match find(&self.pending, SETUP_MARKER) {
                        Some(i) => {
                            emit(Part::Setup, &self.pending[..i]);
                            let after = self.pending[i + SETUP_MARKER.len()..].to_vec();
                            self.pending.clear();
                            self.state = State::Status;
                            self.feed_status(&after, emit);
                        }
                        None => {
                            // Keep the longest tail that could still begin the marker.
                            let keep = partial_suffix(&self.pending, SETUP_MARKER);
                            let cut = self.pending.len() - keep;
                            emit(Part::Setup, &self.pending[..cut]);
                            self.pending.drain(..cut);
                        }
                    }
                }
                State::Status => {
                    let chunk = rest.to_vec();
                    rest = &[];
                    self.feed_status(&chunk, emit);
                }
            }
        }
    }

    fn feed_status(&mut self, bytes: &[u8], emit: &mut dyn FnMut(Part, &[u8])) {
        match bytes.iter().position(|&b| b == b'\n') {
            Some(nl) => {
                self.pending.extend_from_slice(&bytes[..nl]);
                let status = std::str::from_utf8(&self.pending).ok().and_then(|s| s.parse().ok());
                self.setup_status = Some(status.unwrap_or(-1));
                self.pending.clear();
                self.state = State::Command;
                if nl + 1 < bytes.len() {
                    emit(Part::Command, &bytes[nl + 1..]);
                }
            }
            None => self.pending.extend_from_slice(bytes),
        }
    }

    /// End of stream: anything held back belongs to the part we were in.
    pub fn finish(&mut self, emit: &mut dyn FnMut(Part, &[u8])) {
        if self.state == State::Setup && !self.pending.is_empty() {
            emit(Part::Setup, &self.pending);
        }
        self.pending.clear();
    }
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Length of the longest suffix of `data` that is a proper prefix of `marker`.
fn partial_suffix(data: &[u8], marker: &[u8]) -> usize {
    (1..marker.len().min(data.len() + 1))
        .rev()
        .find(|&n| data.ends_with(&marker[..n]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(chunks: &[&[u8]]) -> (Vec<u8>, Vec<u8>, Option<i32>) {
        let mut s = Splitter::new(true);
        let (mut setup, mut cmd) = (Vec::new(), Vec::new());
        let mut emit = |p: Part, b: &[u8]| match p {
            Part::Setup => setup.extend_from_slice(b),
            Part::Command => cmd.extend_from_slice(b),
        };
        for c in chunks {
            s.feed(c, &mut emit);
        }
        s.finish(&mut emit);
        (setup, cmd, s.setup_status())
    }

    #[test]
    fn splits_exactly_at_the_first_marker_even_across_chunks() {
        let stream = b"installing\nno newline\x1erunner:setup-done:0\nhello\n\x1erunner:setup-done:9\n";
        for cut in 0..stream.len() {
            let (a, b) = stream.split_at(cut);
            let (setup, cmd, status) = split(&[a, b]);
            assert_eq!(setup, b"installing\nno newline", "cut at {cut}");
            assert_eq!(cmd, b"hello\n\x1erunner:setup-done:9\n", "cut at {cut}");
            assert_eq!(status, Some(0));
        }
    }

    #[test]
    fn without_marker_everything_is_setup_output() {
        let (setup, cmd, status) = split(&[b"\x1erunner:setup", b"-do"]);
        assert_eq!(setup, b"\x1erunner:setup-do");
        assert!(cmd.is_empty());
        assert_eq!(status, None);
    }

    #[test]
    fn compose_passes_the_command_as_positional_arguments() {
        let argv = vec!["python3".to_string(), "it's \"quoted\"".to_string()];
        assert_eq!(compose(&[], false, None, &argv), argv);
        assert_eq!(compose(&["true".into()], true, None, &argv), argv);
        let full = compose(&["pip install x".into()], false, None, &argv);
        assert_eq!(&full[..2], &["/bin/sh", "-c"]);
        assert_eq!(&full[3..], &["runner-entry", "python3", "it's \"quoted\""]);
        assert!(full[2].contains("pip install x\n} || exit $?"));
        assert!(full[2].ends_with("exec \"$@\"\n"));
    }

    #[test]
    fn stdin_is_redirected_for_the_command_only() {
        let argv = vec!["cat".to_string()];
        let plain = compose(&[], false, Some("/.runner-stdin"), &argv);
        assert_eq!(plain[2], "exec \"$@\" <'/.runner-stdin'\n");
        assert_eq!(&plain[3..], &["runner-entry", "cat"]);
        let with_setup = compose(&["make".into()], false, Some("/.runner-stdin"), &argv);
        assert!(
            with_setup[2].contains(" </dev/null\nrunner_rc=$?"),
            "setup reads /dev/null"
        );
        assert!(with_setup[2].ends_with("exec \"$@\" <'/.runner-stdin'\n"));
    }
}
