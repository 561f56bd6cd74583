//! How much host memory this process may still fault in: the host's `MemAvailable`, capped by
//! the room left under the limit of every memory cgroup the process is in, its own and each
//! ancestor's, cgroup v2 (`memory.max`) and v1 (`memory.limit_in_bytes`) alike. Inside a
//! container the host may have plenty while the container's limit is near: faulting a backup in
//! past that limit wakes the kernel's out-of-memory killer instead of failing.
//!
//! A cgroup's room is its limit less its usage, with the inactive file cache counted as room (the
//! kernel reclaims it before it kills anything). Anything unreadable or unlimited adds no cap.

use std::path::{Path, PathBuf};

/// Bytes of host memory this process may still use, if the kernel says (see the module).
pub(crate) fn available() -> Option<u64> {
    available_under(Path::new("/"))
}

/// [`available`] with `/proc` and the cgroup mounts read under `root` (the tests' fake trees).
fn available_under(root: &Path) -> Option<u64> {
    let host = host_available(&root.join("proc/meminfo"));
    let cgroups = cgroup_room(root);
    match (host, cgroups) {
        (Some(h), Some(c)) => Some(h.min(c)),
        (h, c) => h.or(c),
    }
}

/// `MemAvailable` of a `/proc/meminfo`.
fn host_available(meminfo: &Path) -> Option<u64> {
    let info = std::fs::read_to_string(meminfo).ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// The cgroup versions' file names.
#[derive(Clone, Copy)]
enum Version {
    V2,
    V1,
}

impl Version {
    fn limit(self) -> &'static str {
        match self {
            Version::V2 => "memory.max",
            Version::V1 => "memory.limit_in_bytes",
        }
    }

    fn usage(self) -> &'static str {
        match self {
            Version::V2 => "memory.current",
            Version::V1 => "memory.usage_in_bytes",
        }
    }

    /// The key in `memory.stat` of this cgroup's own inactive file cache.
    fn inactive_file(self) -> &'static str {
        match self {
            Version::V2 => "inactive_file",
            Version::V1 => "total_inactive_file",
        }
    }
}

/// The least room left over every memory cgroup of the process (both versions, every level).
fn cgroup_room(root: &Path) -> Option<u64> {
    let membership = std::fs::read_to_string(root.join("proc/self/cgroup")).ok()?;
    let mounts = std::fs::read_to_string(root.join("proc/self/mountinfo")).ok()?;
    let mut least: Option<u64> = None;
    for line in membership.lines() {
        let mut f = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (f.next(), f.next(), f.next()) else { continue };
        let version = if id == "0" && controllers.is_empty() {
            Version::V2
        } else if controllers.split(',').any(|c| c == "memory") {
            Version::V1
        } else {
            continue;
        };
        let Some(dir) = cgroup_dir(root, &mounts, version, path) else { continue };
        if let Some(room) = room_up_from(&dir.0, &dir.1, version) {
            least = Some(least.map_or(room, |l| l.min(room)));
        }
    }
    least
}

/// The directory of the cgroup at `path` (as `/proc/self/cgroup` names it) under the mount of
/// `version`'s memory hierarchy, and that mount's directory: (cgroup, mount point).
fn cgroup_dir(root: &Path, mounts: &str, version: Version, path: &str) -> Option<(PathBuf, PathBuf)> {
    for line in mounts.lines() {
        // `id parent major:minor root mount-point options [optional...] - type source super-options`
        let Some((left, right)) = line.split_once(" - ") else { continue };
        let left: Vec<&str> = left.split(' ').collect();
        let right: Vec<&str> = right.split(' ').collect();
        let (Some(&mount_root), Some(&mount_point), Some(&fs)) = (left.get(3), left.get(4), right.first())
        else {
            continue;
        };
        let fits = match version {
            Version::V2 => fs == "cgroup2",
            Version::V1 => {
                fs == "cgroup" && right.get(2).is_some_and(|o| o.split(',').any(|o| o == "memory"))
            }
        };
        if !fits {
            continue;
        }
        // The mount shows the hierarchy from `mount_root` (a container's own cgroup, when the
        // process sees the host's paths): the process's cgroup is below it.
        let rel = if mount_root == "/" {
            path
        } else {
            match path.strip_prefix(mount_root) {
                Some(r) if r.is_empty() || r.starts_with('/') => r,
                _ => continue,
            }
        };
        let mount = root.join(mount_point.trim_start_matches('/'));
        let dir = mount.join(rel.trim_start_matches('/'));
        return Some((dir, mount));
    }
    None
}

/// The least room under the limits from `dir` up to `mount`, both included.
fn room_up_from(dir: &Path, mount: &Path, version: Version) -> Option<u64> {
    let mut least: Option<u64> = None;
    let mut at = Some(dir);
    while let Some(d) = at {
        if let Some(room) = room_in(d, version) {
            least = Some(least.map_or(room, |l| l.min(room)));
        }
        if d == mount {
            break;
        }
        at = d.parent().filter(|p| p.starts_with(mount));
    }
    least
}

/// The room one cgroup leaves: its limit less its usage, the inactive file cache counted as room;
/// `None` when it has no limit (v1 writes a number near 2^63 for none) or says nothing.
fn room_in(dir: &Path, version: Version) -> Option<u64> {
    let read = |name: &str| std::fs::read_to_string(dir.join(name)).ok();
    let limit: u64 = read(version.limit())?.trim().parse().ok()?;
    if limit >= 1 << 62 {
        return None;
    }
    let usage: u64 = read(version.usage()).and_then(|u| u.trim().parse().ok()).unwrap_or(0);
    let reclaimable = read("memory.stat")
        .and_then(|s| {
            s.lines()
                .filter_map(|l| l.split_once(' '))
                .find(|(k, _)| *k == version.inactive_file())
                .and_then(|(_, v)| v.trim().parse::<u64>().ok())
        })
        .unwrap_or(0);
    Some(limit.saturating_sub(usage.saturating_sub(reclaimable)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake `/proc` and cgroup tree in a folder of its own, removed when dropped.
    struct Tree(PathBuf);

    impl Tree {
        fn new(name: &str) -> Tree {
            let dir = std::env::temp_dir().join(format!("cuvmm-cgroup-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            let t = Tree(dir);
            t.write("proc/meminfo", "MemTotal: 67108864 kB\nMemAvailable: 33554432 kB\n");
            t
        }

        fn write(&self, path: &str, text: &str) {
            let p = self.0.join(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }

        fn available(&self) -> Option<u64> {
            available_under(&self.0)
        }
    }

    impl Drop for Tree {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    const HOST: u64 = 32 << 30;
    const V2_MOUNT: &str = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n";

    #[test]
    fn without_cgroup_limits_the_hosts_available_memory_counts() {
        let t = Tree::new("none");
        assert_eq!(t.available(), Some(HOST));
        t.write("proc/self/cgroup", "0::/user.slice\n");
        t.write("proc/self/mountinfo", V2_MOUNT);
        t.write("sys/fs/cgroup/user.slice/memory.max", "max\n");
        t.write("sys/fs/cgroup/user.slice/memory.current", "1000\n");
        assert_eq!(t.available(), Some(HOST));
    }

    #[test]
    fn a_v2_limit_caps_it_at_limit_less_usage_with_inactive_file_cache_as_room() {
        let t = Tree::new("v2");
        t.write("proc/self/cgroup", "0::/job\n");
        t.write("proc/self/mountinfo", V2_MOUNT);
        t.write("sys/fs/cgroup/job/memory.max", "8589934592\n");
        t.write("sys/fs/cgroup/job/memory.current", "6442450944\n");
        assert_eq!(t.available(), Some(2 << 30));
        t.write("sys/fs/cgroup/job/memory.stat", "anon 5368709120\ninactive_file 1073741824\n");
        assert_eq!(t.available(), Some(3 << 30));
        // Usage above the limit (the kernel is reclaiming): no room, never a wrapped number.
        t.write("sys/fs/cgroup/job/memory.stat", "anon 9663676416\n");
        t.write("sys/fs/cgroup/job/memory.current", "9663676416\n");
        assert_eq!(t.available(), Some(0));
    }

    #[test]
    fn a_nested_v2_cgroup_takes_the_tightest_of_its_ancestors() {
        let t = Tree::new("nested");
        t.write("proc/self/cgroup", "0::/pod/container/worker\n");
        t.write("proc/self/mountinfo", V2_MOUNT);
        t.write("sys/fs/cgroup/pod/memory.max", "4294967296\n");
        t.write("sys/fs/cgroup/pod/memory.current", "3221225472\n");
        t.write("sys/fs/cgroup/pod/container/memory.max", "max\n");
        t.write("sys/fs/cgroup/pod/container/worker/memory.max", "17179869184\n");
        t.write("sys/fs/cgroup/pod/container/worker/memory.current", "1073741824\n");
        assert_eq!(t.available(), Some(1 << 30));
    }

    #[test]
    fn a_container_mount_of_its_own_cgroup_is_followed_from_its_root() {
        let t = Tree::new("container");
        // The process sees the host's path; the mount shows the container's cgroup at its root.
        t.write("proc/self/cgroup", "0::/kubepods/pod1/ctr\n");
        t.write("proc/self/mountinfo", "30 23 0:26 /kubepods/pod1 /sys/fs/cgroup ro - cgroup2 cgroup rw\n");
        t.write("sys/fs/cgroup/memory.max", "2147483648\n");
        t.write("sys/fs/cgroup/memory.current", "1073741824\n");
        t.write("sys/fs/cgroup/ctr/memory.max", "max\n");
        assert_eq!(t.available(), Some(1 << 30));
    }

    #[test]
    fn a_v1_memory_controller_counts_and_its_unlimited_value_does_not() {
        let t = Tree::new("v1");
        t.write(
            "proc/self/cgroup",
            "12:cpu,cpuacct:/docker/abc\n7:memory:/docker/abc\n1:name=systemd:/docker/abc\n",
        );
        t.write(
            "proc/self/mountinfo",
            "40 30 0:35 /docker/abc /sys/fs/cgroup/cpu,cpuacct ro - cgroup cgroup rw,cpu,cpuacct\n\
             41 30 0:36 /docker/abc /sys/fs/cgroup/memory ro - cgroup cgroup rw,memory\n",
        );
        t.write("sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n");
        t.write("sys/fs/cgroup/memory/memory.usage_in_bytes", "1073741824\n");
        assert_eq!(t.available(), Some(HOST));
        t.write("sys/fs/cgroup/memory/memory.limit_in_bytes", "4294967296\n");
        t.write("sys/fs/cgroup/memory/memory.stat", "cache 1\ntotal_inactive_file 536870912\n");
        assert_eq!(t.available(), Some((3 << 30) + (512 << 20)));
    }

    #[test]
    fn a_limit_above_the_hosts_available_memory_leaves_the_host_in_charge() {
        let t = Tree::new("roomy");
        t.write("proc/self/cgroup", "0::/\n");
        t.write("proc/self/mountinfo", V2_MOUNT);
        t.write("sys/fs/cgroup/memory.max", "137438953472\n");
        t.write("sys/fs/cgroup/memory.current", "0\n");
        assert_eq!(t.available(), Some(HOST));
    }

    #[test]
    fn this_process_gets_an_answer_no_larger_than_the_hosts() {
        let host = host_available(Path::new("/proc/meminfo"));
        if let (Some(h), Some(a)) = (host, available()) {
            assert!(a <= h);
        }
    }
}
