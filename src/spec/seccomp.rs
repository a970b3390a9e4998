//! The default seccomp profile: an allowlist equivalent to containerd's and Docker's default
//! profile for a container without CAP_SYS_ADMIN, CAP_SYS_MODULE and friends. Anything not
//! listed fails with EPERM. Written as data so the golden test pins every change.

use oci_spec::runtime::{
    Arch, LinuxSeccomp, LinuxSeccompAction, LinuxSeccompArgBuilder, LinuxSeccompBuilder, LinuxSeccompOperator,
    LinuxSyscall, LinuxSyscallBuilder,
};

use super::SpecError;

/// errno for refused syscalls: EPERM, what programs expect from a denied operation.
const EPERM: u32 = 1;
/// clone3 passes its flags in a struct seccomp cannot inspect; answering ENOSYS makes libc
/// fall back to clone(2), whose flags we can filter (Docker and containerd do the same).
const ENOSYS: u32 = 38;
/// Every CLONE_NEW* flag (namespaces): NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET|NEWTIME.
const CLONE_NAMESPACE_FLAGS: u64 = 0x7E02_0080;
/// AF_VSOCK would reach the hypervisor's host when running in a VM.
const AF_VSOCK: u64 = 40;
/// personality(2) values that change nothing dangerous: PER_LINUX, PER_LINUX32,
/// UNAME26, PER_LINUX32|UNAME26, and the query value 0xffffffff.
const SAFE_PERSONALITIES: [u64; 5] = [0x0, 0x8, 0x20000, 0x20008, 0xffff_ffff];

/// Allowed unconditionally. Deliberately absent (the point of the profile): keyctl, add_key,
/// request_key, bpf, userfaultfd, io_uring_*, kexec_*, open_by_handle_at, mount, umount2,
/// pivot_root, unshare, setns, *_module, swapon/off, reboot, acct, quotactl, syslog,
/// perf_event_open, settimeofday/clock_settime, sethostname, fsopen & the new mount API, vm86.
pub const ALLOWED_SYSCALLS: &[&str] = &[
    "accept",
    "accept4",
    "access",
    "adjtimex",
    "alarm",
    "arch_prctl",
    "bind",
    "brk",
    "cachestat",
    "capget",
    "capset",
    "chdir",
    "chmod",
    "chown",
    "chown32",
    "chroot",
    "clock_adjtime",
    "clock_adjtime64",
    "clock_getres",
    "clock_getres_time64",
    "clock_gettime",
    "clock_gettime64",
    "clock_nanosleep",
    "clock_nanosleep_time64",
    "close",
    "close_range",
    "connect",
    "copy_file_range",
    "creat",
    "dup",
    "dup2",
    "dup3",
    "epoll_create",
    "epoll_create1",
    "epoll_ctl",
    "epoll_ctl_old",
    "epoll_pwait",
    "epoll_pwait2",
    "epoll_wait",
    "epoll_wait_old",
    "eventfd",
    "eventfd2",
    "execve",
    "execveat",
    "exit",
    "exit_group",
    "faccessat",
    "faccessat2",
    "fadvise64",
    "fadvise64_64",
    "fallocate",
    "fanotify_mark",
    "fchdir",
    "fchmod",
    "fchmodat",
    "fchmodat2",
    "fchown",
    "fchown32",
    "fchownat",
    "fcntl",
    "fcntl64",
    "fdatasync",
    "fgetxattr",
    "flistxattr",
    "flock",
    "fork",
    "fremovexattr",
    "fsetxattr",
    "fstat",
    "fstat64",
    "fstatat64",
    "fstatfs",
    "fstatfs64",
    "fsync",
    "ftruncate",
    "ftruncate64",
    "futex",
    "futex_requeue",
    "futex_time64",
    "futex_wait",
    "futex_waitv",
    "futex_wake",
    "futimesat",
    "get_robust_list",
    "get_thread_area",
    "getcpu",
    "getcwd",
    "getdents",
    "getdents64",
    "getegid",
    "getegid32",
    "geteuid",
    "geteuid32",
    "getgid",
    "getgid32",
    "getgroups",
    "getgroups32",
    "getitimer",
    "getpeername",
    "getpgid",
    "getpgrp",
    "getpid",
    "getppid",
    "getpriority",
    "getrandom",
    "getresgid",
    "getresgid32",
    "getresuid",
    "getresuid32",
    "getrlimit",
    "getrusage",
    "getsid",
    "getsockname",
    "getsockopt",
    "gettid",
    "gettimeofday",
    "getuid",
    "getuid32",
    "getxattr",
    "inotify_add_watch",
    "inotify_init",
    "inotify_init1",
    "inotify_rm_watch",
    "io_cancel",
    "io_destroy",
    "io_getevents",
    "io_pgetevents",
    "io_pgetevents_time64",
    "io_setup",
    "io_submit",
    "ioctl",
    "ioprio_get",
    "ioprio_set",
    "ipc",
    "kill",
    "landlock_add_rule",
    "landlock_create_ruleset",
    "landlock_restrict_self",
    "lchown",
    "lchown32",
    "lgetxattr",
    "link",
    "linkat",
    "listen",
    "listxattr",
    "llistxattr",
    "_llseek",
    "lremovexattr",
    "lseek",
    "lsetxattr",
    "lstat",
    "lstat64",
    "madvise",
    "map_shadow_stack",
    "membarrier",
    "memfd_create",
    "memfd_secret",
    "mincore",
    "mkdir",
    "mkdirat",
    "mknod",
    "mknodat",
    "mlock",
    "mlock2",
    "mlockall",
    "mmap",
    "mmap2",
    "mprotect",
    "mq_getsetattr",
    "mq_notify",
    "mq_open",
    "mq_timedreceive",
    "mq_timedreceive_time64",
    "mq_timedsend",
    "mq_timedsend_time64",
    "mq_unlink",
    "mremap",
    "msgctl",
    "msgget",
    "msgrcv",
    "msgsnd",
    "msync",
    "munlock",
    "munlockall",
    "munmap",
    "name_to_handle_at",
    "nanosleep",
    "newfstatat",
    "_newselect",
    "open",
    "openat",
    "openat2",
    "pause",
    "pidfd_getfd",
    "pidfd_open",
    "pidfd_send_signal",
    "pipe",
    "pipe2",
    "pkey_alloc",
    "pkey_free",
    "pkey_mprotect",
    "poll",
    "ppoll",
    "ppoll_time64",
    "prctl",
    "pread64",
    "preadv",
    "preadv2",
    "prlimit64",
    "process_mrelease",
    "process_vm_readv",
    "process_vm_writev",
    "pselect6",
    "pselect6_time64",
    "ptrace",
    "pwrite64",
    "pwritev",
    "pwritev2",
    "read",
    "readahead",
    "readlink",
    "readlinkat",
    "readv",
    "recv",
    "recvfrom",
    "recvmmsg",
    "recvmmsg_time64",
    "recvmsg",
    "remap_file_pages",
    "removexattr",
    "rename",
    "renameat",
    "renameat2",
    "restart_syscall",
    "rmdir",
    "rseq",
    "rt_sigaction",
    "rt_sigpending",
    "rt_sigprocmask",
    "rt_sigqueueinfo",
    "rt_sigreturn",
    "rt_sigsuspend",
    "rt_sigtimedwait",
    "rt_sigtimedwait_time64",
    "rt_tgsigqueueinfo",
    "sched_get_priority_max",
    "sched_get_priority_min",
    "sched_getaffinity",
    "sched_getattr",
    "sched_getparam",
    "sched_getscheduler",
    "sched_rr_get_interval",
    "sched_rr_get_interval_time64",
    "sched_setaffinity",
    "sched_setattr",
    "sched_setparam",
    "sched_setscheduler",
    "sched_yield",
    "seccomp",
    "select",
    "semctl",
    "semget",
    "semop",
    "semtimedop",
    "semtimedop_time64",
    "send",
    "sendfile",
    "sendfile64",
    "sendmmsg",
    "sendmsg",
    "sendto",
    "set_robust_list",
    "set_thread_area",
    "set_tid_address",
    "setfsgid",
    "setfsgid32",
    "setfsuid",
    "setfsuid32",
    "setgid",
    "setgid32",
    "setgroups",
    "setgroups32",
    "setitimer",
    "setpgid",
    "setpriority",
    "setregid",
    "setregid32",
    "setresgid",
    "setresgid32",
    "setresuid",
    "setresuid32",
    "setreuid",
    "setreuid32",
    "setrlimit",
    "setsid",
    "setsockopt",
    "setuid",
    "setuid32",
    "setxattr",
    "shmat",
    "shmctl",
    "shmdt",
    "shmget",
    "shutdown",
    "sigaltstack",
    "signalfd",
    "signalfd4",
    "sigprocmask",
    "sigreturn",
    "socketcall",
    "socketpair",
    "splice",
    "stat",
    "stat64",
    "statfs",
    "statfs64",
    "statx",
    "symlink",
    "symlinkat",
    "sync",
    "sync_file_range",
    "syncfs",
    "sysinfo",
    "tee",
    "tgkill",
    "time",
    "timer_create",
    "timer_delete",
    "timer_getoverrun",
    "timer_gettime",
    "timer_gettime64",
    "timer_settime",
    "timer_settime64",
    "timerfd_create",
    "timerfd_gettime",
    "timerfd_gettime64",
    "timerfd_settime",
    "timerfd_settime64",
    "times",
    "tkill",
    "truncate",
    "truncate64",
    "ugetrlimit",
    "umask",
    "uname",
    "unlink",
    "unlinkat",
    "utime",
    "utimensat",
    "utimensat_time64",
    "utimes",
    "vfork",
    "vmsplice",
    "wait4",
    "waitid",
    "waitpid",
    "write",
    "writev",
];

/// Syscalls the hardening predicate insists stay blocked.
pub const MUST_BLOCK: &[&str] = &[
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "kexec_load",
    "kexec_file_load",
    "open_by_handle_at",
    "mount",
    "umount2",
    "pivot_root",
    "unshare",
    "setns",
    "init_module",
    "finit_module",
    "delete_module",
    "reboot",
    "swapon",
    "perf_event_open",
];

/// The seccomp architectures the filter allows on a host of `arch`: the native ABI, and the
/// 32-bit compat one only when the Environment asks (`allow32BitSyscalls`). Syscalls of an ABI
/// not listed fail as a whole (libseccomp's bad-arch action kills the thread: SIGSYS), so
/// leaving one out never opens a bypass, and it closes the compat syscall paths, a recurring
/// source of kernel bugs, to code that never needs them.
///
/// Cost is why the compat ABI is opt-in: runc 1.1 compiles the filter in its init on every
/// create (and every `runc exec`), and each listed ABI is compiled apart; the x86 one, with
/// its socketcall/ipc multiplexers, took ~10 ms of a ~30 ms `runc run` here (measured with
/// `runc run` of runner's spec with and without it, 20 runs each, 2026-11-25). x32 is never
/// listed: almost no binary uses it, and it cost ~15 ms more.
pub fn architectures(arch: &str, compat32: bool) -> Vec<Arch> {
    let (native, compat) = match arch {
        "aarch64" => (Arch::ScmpArchAarch64, Arch::ScmpArchArm),
        _ => (Arch::ScmpArchX86_64, Arch::ScmpArchX86),
    };
    if compat32 { vec![native, compat] } else { vec![native] }
}

fn rule(names: &[&str], action: LinuxSeccompAction) -> Result<LinuxSyscallBuilder, SpecError> {
    Ok(LinuxSyscallBuilder::default()
        .names(names.iter().map(|s| s.to_string()).collect::<Vec<_>>())
        .action(action))
}

/// Build the profile for a host architecture (`std::env::consts::ARCH` spelling); `compat32`
/// admits the host's 32-bit syscall ABI too (see `architectures`).
pub fn default_profile(arch: &str, compat32: bool) -> Result<LinuxSeccomp, SpecError> {
    let allow = LinuxSeccompAction::ScmpActAllow;
    let mut syscalls: Vec<LinuxSyscall> = vec![rule(ALLOWED_SYSCALLS, allow)?.build()?];
    // clone(2) only without namespace flags (arg 0 on x86 and arm).
    syscalls.push(
        rule(&["clone"], allow)?
            .args(vec![
                LinuxSeccompArgBuilder::default()
                    .index(0usize)
                    .value(0u64)
                    .value_two(CLONE_NAMESPACE_FLAGS)
                    .op(LinuxSeccompOperator::ScmpCmpMaskedEq)
                    .build()?,
            ])
            .build()?,
    );
    syscalls.push(
        rule(&["clone3"], LinuxSeccompAction::ScmpActErrno)?
            .errno_ret(ENOSYS)
            .build()?,
    );
    syscalls.push(
        rule(&["socket"], allow)?
            .args(vec![
                LinuxSeccompArgBuilder::default()
                    .index(0usize)
                    .value(AF_VSOCK)
                    .op(LinuxSeccompOperator::ScmpCmpNe)
                    .build()?,
            ])
            .build()?,
    );
    for value in SAFE_PERSONALITIES {
        syscalls.push(
            rule(&["personality"], allow)?
                .args(vec![
                    LinuxSeccompArgBuilder::default()
                        .index(0usize)
                        .value(value)
                        .op(LinuxSeccompOperator::ScmpCmpEq)
                        .build()?,
                ])
                .build()?,
        );
    }
    Ok(LinuxSeccompBuilder::default()
        .default_action(LinuxSeccompAction::ScmpActErrno)
        .default_errno_ret(EPERM)
        .architectures(architectures(arch, compat32))
        .syscalls(syscalls)
        .build()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_32bit_abi_is_admitted_only_when_asked() {
        assert_eq!(architectures("x86_64", false), vec![Arch::ScmpArchX86_64]);
        assert_eq!(
            architectures("x86_64", true),
            vec![Arch::ScmpArchX86_64, Arch::ScmpArchX86]
        );
        assert_eq!(architectures("aarch64", false), vec![Arch::ScmpArchAarch64]);
        assert_eq!(
            architectures("aarch64", true),
            vec![Arch::ScmpArchAarch64, Arch::ScmpArchArm]
        );
        for compat32 in [false, true] {
            let profile = default_profile("x86_64", compat32).unwrap();
            let archs = profile.architectures().clone().unwrap_or_default();
            assert!(!archs.contains(&Arch::ScmpArchX32), "x32 is never admitted");
            assert_eq!(archs.contains(&Arch::ScmpArchX86), compat32);
        }
    }
}
