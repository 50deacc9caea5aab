package testutil

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
)

// A sibling "container" for a helper process, as a container runtime would
// make one without hostPID, hostIPC or privileges: its own PID, mount and
// IPC namespaces, its own /proc, a private tmpfs on /dev/shm and on /tmp
// (unless the test runs from under /tmp), a
// non-root uid with no capabilities (so no ptrace and no pidfd_getfd on
// anyone), and one directory shared with the outside by bind mount: the
// store's socket directory, seen inside at ContainerShareDir. The GPU's
// device files are the host's, as the NVIDIA container toolkit would pass
// them. Making one needs root; ContainersPossible says whether this test
// can.

// ContainerShareDir is where a container sees its shared directory: on a
// private tmpfs over /mnt, so that it does not depend on /tmp, which the
// container makes private unless the test runs from under /tmp (where the
// GPU machine's checkout may lie, and the helper must still see it).
const ContainerShareDir = "/mnt/cudaipc"

// EnvContainer carries a Container's JSON to the helper, which enters it
// before its role runs (RunRole, or EnterContainerIfAsked).
const EnvContainer = "CUDAIPC_TEST_CONTAINER"

// Container describes a sibling container for a helper process.
type Container struct {
	// Share is the host directory bind-mounted at ContainerShareDir.
	Share string `json:"share"`
	// UID and GID are what the helper runs as once its mounts are made;
	// 0 keeps root (the daemon's container, say), with its capabilities.
	UID int `json:"uid"`
	GID int `json:"gid"`
}

// ContainersPossible reports why this process cannot start containers
// (it must be root: mounts, namespaces and setuid), or "" when it can.
func ContainersPossible() string {
	if os.Geteuid() != 0 {
		return "making sibling containers needs root (namespaces, mounts, setuid)"
	}
	return ""
}

// RequireContainers skips the test, or fails it when GPUs are required
// (EnvRequireGPU), when this process cannot start containers.
func RequireContainers(t testing.TB) {
	t.Helper()
	if why := ContainersPossible(); why != "" {
		skipOrFail(t, 1, why)
	}
}

// SpawnOptions returns SpawnWith's options that start a helper in c. The
// share directory is made traversable (0755) so that a non-root uid can
// reach the socket in it.
func (c Container) SpawnOptions(env ...string) (SpawnOptions, error) {
	if c.Share == "" || !filepath.IsAbs(c.Share) {
		return SpawnOptions{}, fmt.Errorf("container share %q: want an absolute path", c.Share)
	}
	if err := os.Chmod(c.Share, 0o755); err != nil {
		return SpawnOptions{}, err
	}
	b, err := json.Marshal(c)
	if err != nil {
		return SpawnOptions{}, err
	}
	return SpawnOptions{
		Env: append([]string{EnvContainer + "=" + string(b), "HOME=/tmp"}, env...),
		SysProcAttr: &syscall.SysProcAttr{
			Cloneflags: syscall.CLONE_NEWPID | syscall.CLONE_NEWNS | syscall.CLONE_NEWIPC,
			Pdeathsig:  syscall.SIGKILL,
		},
	}, nil
}

// SpawnIn starts role in a new container c, like Spawn.
func SpawnIn(t testing.TB, c Container, role string, env ...string) *Child {
	t.Helper()
	o, err := c.SpawnOptions(env...)
	if err != nil {
		t.Fatal(err)
	}
	return SpawnWith(t, role, o)
}

// EnterContainerIfAsked sets up the container EnvContainer describes, if
// any: it must run first thing in the helper, before the CUDA driver is
// loaded (the driver reads /proc and caches the uid's rights).
func EnterContainerIfAsked() error {
	s := os.Getenv(EnvContainer)
	if s == "" {
		return nil
	}
	var c Container
	if err := json.Unmarshal([]byte(s), &c); err != nil {
		return fmt.Errorf("%s: %w", EnvContainer, err)
	}
	return enterContainer(c)
}

func enterContainer(c Container) error {
	// Our mounts stay in our namespace.
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make mounts private: %w", err)
	}
	if err := unix.Mount("proc", "/proc", "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return fmt.Errorf("mount /proc: %w", err)
	}
	if err := unix.Mount("shm", "/dev/shm", "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=1777,size=64m"); err != nil {
		return fmt.Errorf("mount a private /dev/shm: %w", err)
	}
	// Hold the share open: a tmpfs mounted below may hide its path (a
	// t.TempDir under /tmp).
	share, err := unix.Open(c.Share, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open share %s: %w", c.Share, err)
	}
	defer unix.Close(share)
	if wd, _ := os.Getwd(); !strings.HasPrefix(wd+"/", "/tmp/") {
		if err := unix.Mount("tmp", "/tmp", "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=1777,size=64m"); err != nil {
			return fmt.Errorf("mount a private /tmp: %w", err)
		}
	}
	if err := os.MkdirAll("/mnt", 0o755); err != nil {
		return err
	}
	if err := unix.Mount("mnt", "/mnt", "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=0755,size=1m"); err != nil {
		return fmt.Errorf("mount a tmpfs on /mnt: %w", err)
	}
	if err := os.Mkdir(ContainerShareDir, 0o755); err != nil {
		return err
	}
	if err := unix.Mount("/proc/self/fd/"+strconv.Itoa(share), ContainerShareDir, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind the share at %s: %w", ContainerShareDir, err)
	}
	if c.UID == 0 {
		return nil
	}
	// Leaving uid 0 for good clears the permitted, effective and ambient
	// capability sets (no SECBIT_KEEP_CAPS); no_new_privs keeps an exec
	// from gaining any back.
	if err := syscall.Setgroups(nil); err != nil {
		return fmt.Errorf("setgroups: %w", err)
	}
	if err := syscall.Setresgid(c.GID, c.GID, c.GID); err != nil {
		return fmt.Errorf("setresgid: %w", err)
	}
	if err := syscall.Setresuid(c.UID, c.UID, c.UID); err != nil {
		return fmt.Errorf("setresuid: %w", err)
	}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("no_new_privs: %w", err)
	}
	return nil
}

// Isolation is what a process observes of its own confinement.
type Isolation struct {
	PID       int    `json:"pid"`        // 1 in a fresh PID namespace
	UID       int    `json:"uid"`        // the effective uid
	CapEff    string `json:"cap_eff"`    // /proc/self/status CapEff, hex
	CapPrm    string `json:"cap_prm"`    // CapPrm
	PIDNS     string `json:"pid_ns"`     // readlink /proc/self/ns/pid
	IPCNS     string `json:"ipc_ns"`     // readlink /proc/self/ns/ipc
	MountNS   string `json:"mnt_ns"`     // readlink /proc/self/ns/mnt
	ShmDevice uint64 `json:"shm_device"` // st_dev of /dev/shm: a private tmpfs has its own
	ShmMarker bool   `json:"shm_marker"` // a file another container wrote in its /dev/shm is visible here
}

// ShmMarkerName is the /dev/shm file the isolation test writes and looks for.
const ShmMarkerName = "cudaipc-container-marker"

// Observe reports this process's confinement.
func Observe() (Isolation, error) {
	var iso Isolation
	iso.PID = os.Getpid()
	iso.UID = os.Geteuid()
	st, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return iso, err
	}
	for _, line := range strings.Split(string(st), "\n") {
		k, v, _ := strings.Cut(line, ":")
		switch k {
		case "CapEff":
			iso.CapEff = strings.TrimSpace(v)
		case "CapPrm":
			iso.CapPrm = strings.TrimSpace(v)
		}
	}
	for _, ns := range []struct {
		name string
		dst  *string
	}{{"pid", &iso.PIDNS}, {"ipc", &iso.IPCNS}, {"mnt", &iso.MountNS}} {
		if *ns.dst, err = os.Readlink("/proc/self/ns/" + ns.name); err != nil {
			return iso, err
		}
	}
	var s unix.Stat_t
	if err := unix.Stat("/dev/shm", &s); err != nil {
		return iso, err
	}
	iso.ShmDevice = s.Dev
	_, err = os.Stat("/dev/shm/" + ShmMarkerName)
	iso.ShmMarker = err == nil
	return iso, nil
}
