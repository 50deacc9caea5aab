package store

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/cudaipc/cudaipc/protocol"
)

// helperEnv names the role a re-executed test binary plays.
const helperEnv = "CUDAIPC_STORE_TEST_HELPER"

func TestMain(m *testing.M) {
	switch os.Getenv(helperEnv) {
	case "":
		os.Exit(m.Run())
	case "reopen":
		os.Exit(reopenHelper())
	case "dial":
		os.Exit(dialHelper())
	case "flood":
		os.Exit(floodHelper())
	case "arena-reader":
		os.Exit(arenaReaderHelper())
	case "hostile-daemon":
		os.Exit(hostileDaemonHelper())
	case "hostile":
		os.Exit(hostileHelper())
	default:
		fmt.Fprintf(os.Stderr, "unknown helper role %q\n", os.Getenv(helperEnv))
		os.Exit(2)
	}
}

// dropRoot makes the process a plain user: uid and gid 65534 (nobody).
func dropRoot() error {
	if err := syscall.Setgroups(nil); err != nil {
		return err
	}
	if err := syscall.Setresgid(65534, 65534, 65534); err != nil {
		return err
	}
	return syscall.Setresuid(65534, 65534, 65534)
}

// dialHelper connects to the store at $CUDAIPC_STORE_TEST_SOCKET as uid
// 65534 and reports the handshake's outcome by its exit code: 0 admitted,
// 3 refused with PERMISSION, 4 unable to connect at all.
func dialHelper() int {
	if err := dropRoot(); err != nil {
		fmt.Fprintln(os.Stderr, "dropping root:", err)
		return 2
	}
	c, err := protocol.Dial(context.Background(), os.Getenv("CUDAIPC_STORE_TEST_SOCKET"))
	if err != nil {
		fmt.Fprintln(os.Stderr, "dial:", err)
		return 4
	}
	defer c.Close()
	_, err = protocol.ClientHello(context.Background(), c, "other-uid")
	switch {
	case err == nil:
		return 0
	case errors.Is(err, protocol.ErrPermission):
		return 3
	}
	fmt.Fprintln(os.Stderr, "hello:", err)
	return 1
}

// reopenHelper runs as a reader of another uid would: it drops root, then
// tries to turn the read-only arena fd 3 into a writable one. Fd 4 is a
// plain memfd, the control: reopening it must work, or the check proves
// nothing.
func reopenHelper() int {
	if err := dropRoot(); err != nil {
		fmt.Fprintln(os.Stderr, "dropping root:", err)
		return 2
	}
	if fd, err := unix.Open("/proc/self/fd/4", unix.O_RDWR, 0); err != nil {
		fmt.Fprintln(os.Stderr, "control: reopening a plain memfd read-write failed:", err)
		return 2
	} else {
		unix.Close(fd)
	}
	if fd, err := unix.Open("/proc/self/fd/3", unix.O_RDWR, 0); err == nil {
		unix.Close(fd)
		fmt.Fprintln(os.Stderr, "reopened the read-only arena fd read-write")
		return 1
	} else if !errors.Is(err, unix.EACCES) {
		fmt.Fprintln(os.Stderr, "reopen: unexpected error:", err)
		return 1
	}
	if m, err := unix.Mmap(3, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED); err == nil {
		unix.Munmap(m)
		fmt.Fprintln(os.Stderr, "mapped the read-only arena fd writable")
		return 1
	}
	m, err := unix.Mmap(3, 0, 4096, unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		fmt.Fprintln(os.Stderr, "mapping the arena read-only failed:", err)
		return 1
	}
	unix.Munmap(m)
	return 0
}

// TestReopenAsOtherUID checks that a reader cannot upgrade its read-only
// arena fd through /proc/self/fd, which a memfd's default mode 0777 would
// allow. It needs root, to start the reader as another uid.
func TestReopenAsOtherUID(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to run a reader as another uid")
	}
	s := newTestStore(t, Config{})
	w, r := connect(t, s, 1000), connect(t, s, 65534)
	w.put("x", 4096, true)
	p, err := r.ss.getName(context.Background(), "x", false)
	if err != nil {
		t.Fatal(err)
	}
	defer p.closeShare()
	cfd, err := unix.MemfdCreate("control", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	control := os.NewFile(uintptr(cfd), "control")
	defer control.Close()

	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), helperEnv+"=reopen")
	cmd.ExtraFiles = []*os.File{p.share.file, control}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("reader helper: %v\n%s", err, out)
	}
}
