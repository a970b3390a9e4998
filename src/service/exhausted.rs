//! A failure whose cause is that a descriptor could not be had — the server's open-files
//! limit used up (`EMFILE`) or the kernel's table full (`ENFILE`) — is the host's capacity,
//! not a bug of runner's: it answers 503 (retry once sessions are gone) with the limit and
//! how to raise it, instead of 500 "internal error" (docs/guide/capacity.md).

use nix::errno::Errno;

/// The errno of the first `EMFILE`/`ENFILE` in an error's chain (the runtime's cleanup
/// asks the same question: `runtime::janitor`).
pub(crate) use crate::runtime::janitor::out_of_files;

/// What to tell the caller for `errno` while doing `context`; `limits` the process's
/// (soft, hard) open-files limits.
pub(crate) fn reason(context: &str, errno: Errno, limits: Option<(u64, u64)>) -> String {
    match errno {
        Errno::ENFILE => format!(
            "{context}: the kernel's table of open files is full (fs.file-max): raise it \
             (sysctl -w fs.file-max=N) or end sessions, then retry"
        ),
        _ => {
            let limit = limits.map_or_else(
                || "its limit".to_string(),
                |(soft, hard)| format!("its limit of {soft} (hard limit {hard})"),
            );
            format!(
                "{context}: runner serve has as many files open as {limit}: end sessions and retry, or \
                 raise the hard limit (systemd: LimitNOFILE=, else ulimit -Hn as root) and restart it \
                 (it raises its soft limit to the hard one itself; a session holds about 7 files, \
                 see docs/guide/capacity.md)"
            )
        }
    }
}

/// This process's open-files limits (soft, hard).
pub(crate) fn nofile_limits() -> Option<(u64, u64)> {
    nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_reason_names_the_limit_and_how_to_raise_it() {
        let text = reason("the shell's FIFOs", Errno::EMFILE, Some((64, 64)));
        assert!(text.starts_with("the shell's FIFOs: "), "{text}");
        assert!(text.contains("limit of 64 (hard limit 64)"), "{text}");
        assert!(text.contains("LimitNOFILE="), "{text}");
        assert!(reason("x", Errno::ENFILE, None).contains("fs.file-max"));
    }
}
