// Package testutil holds what the module's tests share: the GPU probe with
// its skip-or-fail switch, and helper processes made by re-executing the
// test binary.
package testutil

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/internal/seeddata"
)

// EnvRequireGPU turns skips for lack of a GPU into failures. Its value is
// the number of GPUs the machine has: with CUDAIPC_REQUIRE_GPU=1 a test
// that needs one GPU fails instead of skipping, while a test that needs two
// still skips; with 2 both fail if the GPUs are missing. The GPU machine's
// test script (scripts/gpu-run.sh) sets it to the count nvidia-smi reports.
const EnvRequireGPU = "CUDAIPC_REQUIRE_GPU"

// EnvRole names the helper role a re-executed test binary plays.
const EnvRole = "CUDAIPC_TEST_ROLE"

// GPURequired reports whether EnvRequireGPU asks for at least one GPU.
func GPURequired() bool { return requiredGPUs() >= 1 }

func requiredGPUs() int {
	n, err := strconv.Atoi(os.Getenv(EnvRequireGPU))
	if err != nil {
		return 0
	}
	return n
}

// RequireGPUs returns the first n devices, or skips the test (fails it when
// EnvRequireGPU=1) when the driver or the devices are missing.
func RequireGPUs(t testing.TB, n int) []*cudaipc.Device {
	t.Helper()
	devs, err := cudaipc.Devices()
	switch {
	case err != nil:
		skipOrFail(t, n, fmt.Sprintf("no CUDA driver: %v", err))
	case len(devs) < n:
		skipOrFail(t, n, fmt.Sprintf("need %d GPU(s), have %d", n, len(devs)))
	}
	return devs[:n]
}

// RequireGPU returns device 0 or skips (fails with EnvRequireGPU=1).
func RequireGPU(t testing.TB) *cudaipc.Device {
	t.Helper()
	return RequireGPUs(t, 1)[0]
}

func skipOrFail(t testing.TB, n int, why string) {
	t.Helper()
	if req := requiredGPUs(); req >= n {
		t.Fatalf("%s (and %s=%d)", why, EnvRequireGPU, req)
	}
	t.Skip(why)
}

// RandomBytes returns n bytes of the seeddata stream of seed, so that two
// processes can make the same data from a seed they share.
func RandomBytes(seed uint64, n int) []byte { return seeddata.Bytes(seed, n) }

// Sum returns the hex SHA-256 of b.
func Sum(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

// Roles maps a role name to the function a re-executed test binary runs.
// TestMain calls RunRole before m.Run.
type Roles map[string]func(*Peer) error

// EnvMountProc, set to 1 in a helper started in new PID and mount
// namespaces (NewNamespaces), makes it mount a /proc of its own before its
// role runs, as `unshare --pid --fork --mount-proc` does: the CUDA driver
// fails to initialize (CUDA_ERROR_OPERATING_SYSTEM) when /proc shows
// another PID namespace than the process's.
const EnvMountProc = "CUDAIPC_TEST_MOUNT_PROC"

// NewNamespaces returns SpawnOptions fields for a helper in a new PID
// namespace with its own /proc, like a process in a container.
func NewNamespaces() (*syscall.SysProcAttr, string) {
	return &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWPID | syscall.CLONE_NEWNS}, EnvMountProc + "=1"
}

func mountOwnProc() error {
	// Keep our mounts out of the parent's namespace, then replace /proc.
	if err := syscall.Mount("", "/", "", syscall.MS_REC|syscall.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make mounts private: %w", err)
	}
	if err := syscall.Mount("proc", "/proc", "proc", syscall.MS_NOSUID|syscall.MS_NODEV|syscall.MS_NOEXEC, ""); err != nil {
		return fmt.Errorf("mount /proc: %w", err)
	}
	return nil
}

// MountProcIfAsked mounts a /proc of the process's own PID namespace when
// EnvMountProc asks for it (a helper started with NewNamespaces), and
// enters the sibling container EnvContainer describes (SpawnIn). RunRole
// calls it; a TestMain that dispatches roles itself calls it first.
func MountProcIfAsked() error {
	if err := EnterContainerIfAsked(); err != nil {
		return fmt.Errorf("entering the container: %w", err)
	}
	if os.Getenv(EnvMountProc) != "1" {
		return nil
	}
	return mountOwnProc()
}

// RunRole runs the role named by EnvRole, if any, and exits the process.
func RunRole(roles Roles) {
	name := os.Getenv(EnvRole)
	if name == "" {
		return
	}
	if err := MountProcIfAsked(); err != nil {
		fmt.Fprintf(os.Stderr, "role %s: %v\n", name, err)
		os.Exit(3)
	}
	f, ok := roles[name]
	if !ok {
		fmt.Fprintf(os.Stderr, "unknown test role %q\n", name)
		os.Exit(3)
	}
	p := &Peer{in: bufio.NewScanner(os.Stdin), out: os.Stdout}
	p.in.Buffer(make([]byte, 1<<20), 1<<20)
	if err := f(p); err != nil {
		fmt.Fprintf(os.Stderr, "role %s: %v\n", name, err)
		os.Exit(1)
	}
	os.Exit(0)
}

// Peer is one end of the line-oriented JSON conversation between a test and
// its helper process.
type Peer struct {
	mu  sync.Mutex
	in  *bufio.Scanner
	out io.Writer
}

// Send writes v as one JSON line.
func (p *Peer) Send(v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	_, err = p.out.Write(append(b, '\n'))
	return err
}

// Recv reads one JSON line into v.
func (p *Peer) Recv(v any) error {
	if !p.in.Scan() {
		if err := p.in.Err(); err != nil {
			return err
		}
		return io.EOF
	}
	return json.Unmarshal(p.in.Bytes(), v)
}

// Child is a helper process started by Spawn.
type Child struct {
	*Peer
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	stderr *syncWriter
	done   chan error
}

// Spawn re-executes the test binary as role, with extra environment
// variables. The child is killed when the test ends.
func Spawn(t testing.TB, role string, env ...string) *Child {
	t.Helper()
	return SpawnWith(t, role, SpawnOptions{Env: env})
}

// SpawnOptions are what SpawnWith adds to Spawn.
type SpawnOptions struct {
	// Env holds extra environment variables, "NAME=value".
	Env []string
	// ExtraFiles become the child's descriptors 3, 4, ... (exec.Cmd.ExtraFiles).
	// The caller keeps and closes its copies.
	ExtraFiles []*os.File
	// SysProcAttr, if set, is the child's exec.Cmd.SysProcAttr, e.g. to
	// start it in new namespaces.
	SysProcAttr *syscall.SysProcAttr
	// Exe, if set, is the binary to run instead of this test binary (a
	// copy of it that a child of another uid may execute).
	Exe string
}

// SpawnWith is Spawn with descriptors to pass and process attributes.
func SpawnWith(t testing.TB, role string, o SpawnOptions) *Child {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	exe := os.Args[0]
	if o.Exe != "" {
		exe = o.Exe
	}
	cmd := exec.CommandContext(ctx, exe, "-test.run=^$")
	if cpus := os.Getenv(EnvChildCPUs); cpus != "" {
		// Pinned from its first instruction (the Go runtime's threads
		// inherit it): a benchmark's two ends on CPUs of their own.
		cmd = exec.CommandContext(ctx, "taskset", "-c", cpus, exe, "-test.run=^$")
	}
	cmd.Env = append(append(os.Environ(), EnvRole+"="+role), o.Env...)
	cmd.ExtraFiles = o.ExtraFiles
	cmd.SysProcAttr = o.SysProcAttr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	stderr := &syncWriter{w: &strings.Builder{}}
	cmd.Stderr = stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	c := &Child{cmd: cmd, stdin: stdin, stderr: stderr, done: make(chan error, 1)}
	sc := bufio.NewScanner(stdout)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	c.Peer = &Peer{in: sc, out: stdin}
	go func() { c.done <- cmd.Wait() }()
	t.Cleanup(func() {
		cancel()
		<-c.done
		if s := stderr.String(); t.Failed() && s != "" {
			t.Logf("%s stderr:\n%s", role, s)
		}
	})
	return c
}

// EnvChildCPUs, when set (a taskset CPU list, e.g. "0-7"), runs every
// child SpawnWith starts on those CPUs: benchmarks whose two ends must
// share no CPU (scripts/bench/weight_sync_cluster.py --split-cpus) pin the
// parent with taskset and the child with this.
const EnvChildCPUs = "CUDAIPC_TEST_CHILD_CPUS"

// Pid returns the child's process id.
func (c *Child) Pid() int { return c.cmd.Process.Pid }

// Stderr returns what the child wrote to stderr so far.
func (c *Child) Stderr() string { return c.stderr.String() }

// CloseStdin tells the child that no more input comes.
func (c *Child) CloseStdin() error { return c.stdin.Close() }

// Wait waits for the child to exit, at most d.
func (c *Child) Wait(d time.Duration) error {
	select {
	case err := <-c.done:
		c.done <- err
		return err
	case <-time.After(d):
		return fmt.Errorf("child did not exit within %v", d)
	}
}

type syncWriter struct {
	mu sync.Mutex
	w  *strings.Builder
}

func (s *syncWriter) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.w.String()
}

func (s *syncWriter) Write(b []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.w.Write(b)
}
