//! Cleanup that still works when the process has no descriptor left.
//!
//! A `runner serve` at its open-files limit (`EMFILE`) refuses the create that finds no
//! descriptor (503, `service::exhausted`), but undoing what that create had already taken —
//! unmounting its rootfs, removing its run directory and scratch workspace, giving back its
//! user-namespace range — opens directories, `/proc/self/mountinfo` and lease files too, and
//! failed the same way: the refused create left its state behind, for `runner gc` to find
//! ten minutes or a server's life later.
//!
//! The mechanism: a thread, the janitor, with a descriptor table of its own. At its start it
//! unshares its table (`unshare(CLONE_FILES)`: a copy of the process's, for this thread only)
//! and closes every copied descriptor but stdin, stdout and stderr. The open-files limit is
//! checked per table (the lowest free number must be below it), so the janitor has the
//! whole limit to itself, whatever the sessions hold: no reserve to size, and nothing another
//! thread can take between freeing room and using it (a reserve of descriptors in the shared
//! table, closed for a cleanup, can be taken by any thread's next open before the cleanup's).
//! Closing the copies touches nothing of the rest of the process: a file's flock and its
//! pipe ends stay open while the process's own descriptor does, and POSIX record locks
//! belong to the table that took them.
//!
//! Cleanup runs where it always did and only comes here when it fails for want of a
//! descriptor ([`or_at_the_wall`]): the usual path keeps its cost and its parallelism.
//!
//! Limits of it: the kernel's table of open files (`ENFILE`, `fs.file-max`) is host-wide and
//! a table of its own does not help there (root with `CAP_SYS_ADMIN`, as runner runs, is not
//! held to it). Where `unshare` is refused (a seccomp profile such as Docker's default one
//! without `CAP_SYS_ADMIN`) there is no janitor: a cleanup at the wall then fails as it did
//! before, logged, and `runner gc` takes the rest once this process is gone.
//!
//! The one rule for what runs here: **no descriptor crosses into the janitor** — a job
//! captures paths, ids and plain data, never an `OwnedFd`, a `File`, a socket or anything
//! holding one, and returns none. A descriptor number of the process means nothing (or
//! another file) in the janitor's table: closing or writing through one here would hit the
//! wrong file. For the same reason a job neither wakes async tasks (the runtime's wakers are
//! descriptors) nor logs anywhere but stderr, which the janitor keeps (and which is where
//! runner logs): results go back through a channel that parks on a futex.

use std::error::Error;
use std::io;
use std::sync::{Mutex, OnceLock, mpsc};

use nix::errno::Errno;

/// What the janitor's table keeps of the process's: stdin, stdout, stderr.
const KEPT: libc::c_uint = 3;

type Job = Box<dyn FnOnce() + Send>;

/// The errno of the first `EMFILE`/`ENFILE` in `error`'s chain of sources, as an `io::Error`
/// (its raw errno, or the error it wraps) or a `nix` errno carries it.
pub fn out_of_files(error: &(dyn Error + 'static)) -> Option<Errno> {
    let mut next = Some(error);
    while let Some(e) = next {
        let io = e.downcast_ref::<io::Error>();
        let errno = io
            .and_then(io::Error::raw_os_error)
            .map(Errno::from_raw)
            .or_else(|| e.downcast_ref::<Errno>().copied());
        if let Some(errno @ (Errno::EMFILE | Errno::ENFILE)) = errno {
            return Some(errno);
        }
        // `io::Error::source` skips the error it wraps (`io::Error::other(e)` answers
        // `e.source()`): that one is looked at too.
        if let Some(inner) = io.and_then(io::Error::get_ref)
            && let found @ Some(_) = out_of_files(inner)
        {
            return found;
        }
        next = e.source();
    }
    None
}

/// What was being done when `source` failed; `source` stays reachable as the error's
/// source, so [`out_of_files`] still finds its errno (a message that formats the errno in
/// loses it), and an `io::Error` keeps its kind.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {source}")]
pub struct Context<E: Error + 'static> {
    what: String,
    #[source]
    source: E,
}

/// `map_err(context("removing x"))`: `Context` as an `io::Error` (of `source`'s kind when
/// it is one).
pub fn context<E: Error + Send + Sync + 'static>(what: impl Into<String>) -> impl FnOnce(E) -> io::Error {
    let what = what.into();
    move |source| {
        let kind = (&source as &(dyn Error + 'static))
            .downcast_ref::<io::Error>()
            .map_or(io::ErrorKind::Other, io::Error::kind);
        io::Error::new(kind, Context { what, source })
    }
}

/// Run `op`; should it fail for want of a descriptor, run it again on the janitor's thread,
/// whose table has room (see the module's comment: `op` must capture and return no
/// descriptor). `op` is a cleanup step that can be repeated: what its first run did counts
/// as done, and nothing the second needs is among what the first may have removed (a step
/// that reads a record and removes the directory holding it is two steps). Blocks (call it
/// on the blocking pool).
pub fn or_at_the_wall<T: Send + 'static>(op: impl Fn() -> io::Result<T> + Send + 'static) -> io::Result<T> {
    match op() {
        Err(e) if out_of_files(&e).is_some() => match run(op) {
            Ok(again) => again,
            Err(unavailable) => {
                tracing::warn!(error = %unavailable, "no janitor thread to clean up at the open-files limit");
                Err(e)
            }
        },
        done => done,
    }
}

/// [`or_at_the_wall`] on the blocking pool, for async callers.
pub async fn cleanup<T: Send + 'static>(op: impl Fn() -> io::Result<T> + Send + 'static) -> io::Result<T> {
    blocking(move || or_at_the_wall(op)).await
}

/// `work` (cleanup steps that call [`or_at_the_wall`] themselves) on the blocking pool; a
/// panic there is this caller's.
pub async fn blocking<T: Send + 'static>(work: impl FnOnce() -> io::Result<T> + Send + 'static) -> io::Result<T> {
    match tokio::task::spawn_blocking(work).await {
        Ok(done) => done,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(e) => Err(io::Error::other(format!("a cleanup task was cancelled: {e}"))),
    }
}

/// Run `job` on the janitor's thread and wait for its result (`Err`: there is no janitor, or
/// `job` panicked there). One job at a time: this is the path of cleanups that met the wall,
/// not of every cleanup.
pub fn run<T: Send + 'static>(job: impl FnOnce() -> T + Send + 'static) -> io::Result<T> {
    let janitor = janitor()?;
    let (done, result) = mpsc::sync_channel(1);
    let boxed: Job = Box::new(move || {
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
        let _ = done.send(outcome);
    });
    janitor
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .send(boxed)
        .map_err(|_| io::Error::other("the janitor thread is gone"))?;
    match result.recv() {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(_)) => Err(io::Error::other("a cleanup on the janitor thread panicked")),
        Err(_) => Err(io::Error::other("the janitor thread is gone")),
    }
}

/// The janitor's queue, its thread started on first use (a thread needs no descriptor:
/// starting it at the wall works). `Err`: it could not be started; the next call tries again.
fn janitor() -> io::Result<&'static Mutex<mpsc::Sender<Job>>> {
    static JANITOR: OnceLock<Mutex<mpsc::Sender<Job>>> = OnceLock::new();
    static STARTING: Mutex<()> = Mutex::new(());
    if let Some(j) = JANITOR.get() {
        return Ok(j);
    }
    let _one = STARTING.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(j) = JANITOR.get() {
        return Ok(j);
    }
    let sender = start()?;
    Ok(JANITOR.get_or_init(|| Mutex::new(sender)))
}

fn start() -> io::Result<mpsc::Sender<Job>> {
    let (jobs, queue) = mpsc::channel::<Job>();
    let (ready, started) = mpsc::sync_channel::<io::Result<()>>(1);
    std::thread::Builder::new()
        .name("runner-janitor".into())
        .spawn(move || {
            let table = own_table();
            let ok = table.is_ok();
            let _ = ready.send(table);
            if ok {
                for job in queue {
                    job();
                }
            }
        })?;
    started
        .recv()
        .map_err(|_| io::Error::other("the janitor thread ended at its start"))?
        .map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("giving the janitor a descriptor table of its own: {e}"),
            )
        })?;
    Ok(jobs)
}

/// Give this thread a descriptor table of its own, holding only stdin, stdout and stderr.
fn own_table() -> io::Result<()> {
    // SAFETY: unshare(CLONE_FILES) changes only the calling thread's descriptor table (a
    // copy from now on); every other thread keeps the process's.
    if unsafe { libc::unshare(libc::CLONE_FILES) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: closes descriptors of this thread's private table only (see above); nothing
    // on this thread owns them (it has run no code of ours yet).
    let closed = unsafe { libc::syscall(libc::SYS_close_range, KEPT, libc::c_uint::MAX, 0 as libc::c_uint) };
    if closed == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() != Some(libc::ENOSYS) {
        return Err(e);
    }
    // Kernels before 5.9: one at a time, up to the limit (no listing: /proc/self/fd would
    // be a descriptor, and show the thread group's table, not this thread's).
    let (soft, _) = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)?;
    for fd in KEPT as u64..soft.min(i32::MAX as u64) {
        // SAFETY: as above: this thread's private table.
        unsafe { libc::close(fd as libc::c_int) };
    }
    Ok(())
}

/// For tests: a thread at the open-files limit without taking the test process there.
#[cfg(test)]
pub(crate) mod testing {
    use std::io;
    use std::os::fd::{AsFd, OwnedFd};

    use nix::errno::Errno;

    /// Fill this thread's descriptor table to the open-files limit: the thread first takes a
    /// table of its own (as the janitor does), so the rest of the test process keeps its
    /// room. The table goes with the thread: call this on a thread of the test's own.
    pub(crate) fn fill_own_table() -> Vec<OwnedFd> {
        // SAFETY: as in `own_table`: this thread's table only.
        assert_eq!(
            unsafe { libc::unshare(libc::CLONE_FILES) },
            0,
            "{}",
            io::Error::last_os_error()
        );
        let null = OwnedFd::from(std::fs::File::open("/dev/null").unwrap());
        let mut held = Vec::new();
        loop {
            match nix::unistd::dup(null.as_fd()) {
                Ok(fd) => held.push(fd),
                Err(Errno::EMFILE) => break,
                Err(e) => panic!("filling the table: {e}"),
            }
        }
        held.push(null);
        held
    }
}

#[cfg(test)]
mod tests {
    use super::testing::fill_own_table;
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("opening the FIFOs")]
    struct Wrapper(#[source] io::Error);

    #[test]
    fn finds_emfile_and_enfile_anywhere_in_the_chain() {
        let direct = io::Error::from_raw_os_error(libc::EMFILE);
        assert_eq!(out_of_files(&direct), Some(Errno::EMFILE));
        let wrapped = Wrapper(io::Error::from_raw_os_error(libc::ENFILE));
        assert_eq!(out_of_files(&wrapped), Some(Errno::ENFILE));
        assert_eq!(out_of_files(&Errno::EMFILE), Some(Errno::EMFILE));
        let other = Wrapper(io::Error::from_raw_os_error(libc::ENOENT));
        assert_eq!(out_of_files(&other), None);
        // An io::Error wrapping another error (io::Error::other) is looked into.
        let boxed = io::Error::other(Wrapper(io::Error::from_raw_os_error(libc::EMFILE)));
        assert_eq!(out_of_files(&boxed), Some(Errno::EMFILE));
        let boxed_io = io::Error::other(io::Error::from_raw_os_error(libc::EMFILE));
        assert_eq!(out_of_files(&boxed_io), Some(Errno::EMFILE));
        assert_eq!(out_of_files(&io::Error::other("no errno")), None);
        // `context` says what was being done and keeps the errno and the kind.
        let step = context("open_tree /x")(io::Error::from_raw_os_error(libc::EMFILE));
        assert_eq!(out_of_files(&step), Some(Errno::EMFILE));
        assert!(step.to_string().starts_with("open_tree /x: "), "{step}");
        let missing = context("reading")(io::Error::from_raw_os_error(libc::ENOENT));
        assert_eq!(missing.kind(), io::ErrorKind::NotFound);
    }

    /// A removal that cannot open a directory on this thread (its table is full) is done by
    /// the janitor, whose table has room; a failure that is not the wall is not retried.
    #[test]
    fn a_cleanup_at_the_open_files_limit_is_done_by_the_janitor() {
        let tmp = tempfile::tempdir().unwrap();
        let tree = tmp.path().join("tree");
        std::fs::create_dir_all(tree.join("a/b/c")).unwrap();
        std::fs::write(tree.join("a/b/c/f"), "x").unwrap();
        let outcome = std::thread::spawn({
            let tree = tree.clone();
            move || {
                let held = fill_own_table();
                let here = crate::confined::remove_tree(&tree);
                let tries = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
                let counted = tries.clone();
                let path = tree.clone();
                let cleaned = or_at_the_wall(move || {
                    counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    crate::confined::remove_tree(&path)
                });
                // Not the wall: tried once, the error as it was.
                let missing = or_at_the_wall(|| std::fs::read("/nonexistent/runner-janitor").map(drop));
                drop(held);
                (here, cleaned, tries.load(std::sync::atomic::Ordering::SeqCst), missing)
            }
        })
        .join()
        .unwrap();
        let (here, cleaned, tries, missing) = outcome;
        let here = here.expect_err("the removal on a full table");
        assert_eq!(out_of_files(&here), Some(Errno::EMFILE), "{here}");
        cleaned.expect("the removal on the janitor");
        assert_eq!(tries, 2);
        assert!(!tree.exists());
        assert_eq!(missing.unwrap_err().kind(), io::ErrorKind::NotFound);
    }

    /// The janitor's table holds stdin, stdout and stderr only: what the rest of the process
    /// opens is not in it (and a descriptor number of the process means nothing there).
    #[test]
    fn the_janitors_table_is_its_own() {
        let file = std::fs::File::open("/dev/null").unwrap();
        let number = std::os::fd::AsRawFd::as_raw_fd(&file);
        let seen = run(move || {
            // SAFETY: F_GETFD on a number only reads the janitor's table.
            let flags = unsafe { libc::fcntl(number, libc::F_GETFD) };
            (flags, io::Error::last_os_error().raw_os_error(), unsafe {
                libc::fcntl(2, libc::F_GETFD)
            })
        })
        .unwrap();
        assert_eq!(seen.0, -1, "fd {number} of the process is open in the janitor's table");
        assert_eq!(seen.1, Some(libc::EBADF));
        assert!(seen.2 >= 0, "stderr is kept");
        // The process's descriptor is untouched.
        assert!(file.metadata().is_ok());
        // A panicking job is an error for its caller; the janitor lives on.
        assert!(run(|| -> u8 { panic!("a job that panics") }).is_err());
        assert_eq!(run(|| 7).unwrap(), 7);
    }
}
