// Package etcdtest runs a real etcd server (Debian's etcd-server, or any
// etcd on PATH or at $CUDAIPC_ETCD) for tests, on free loopback ports with
// a temporary data directory.
package etcdtest

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// EnvRequire, when set to 1, turns the skip of a test that finds no etcd
// into a failure (CI has etcd: a skip there would hide the tests).
const EnvRequire = "CUDAIPC_REQUIRE_CLUSTER"

// Binary returns the etcd binary's path, or "" when there is none.
func Binary() string {
	if p := os.Getenv("CUDAIPC_ETCD"); p != "" {
		return p
	}
	p, _ := exec.LookPath("etcd")
	return p
}

// Require skips the test (or fails it under EnvRequire=1) without an etcd
// binary.
func Require(t testing.TB) string {
	t.Helper()
	p := Binary()
	if p == "" {
		msg := "no etcd binary (apt-get install etcd-server, or set CUDAIPC_ETCD)"
		if os.Getenv(EnvRequire) == "1" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	return p
}

// Server is one etcd member on loopback.
type Server struct {
	t          testing.TB
	bin, dir   string
	Host       string // the address it listens on
	ClientPort int
	peerPort   int
	cmd        *exec.Cmd
	exited     chan struct{}
	logf       *os.File
}

// Start runs etcd on 127.0.0.1 with free ports and stops it when the test
// ends.
func Start(t testing.TB) *Server {
	t.Helper()
	s := &Server{t: t, bin: Require(t), dir: tmpfsDir(t), Host: "127.0.0.1"}
	s.ClientPort, s.peerPort = freePort(t), freePort(t)
	var err error
	for attempt := 0; attempt < 3; attempt++ {
		if err = s.start(); err == nil {
			break
		}
		s.ClientPort, s.peerPort = freePort(t), freePort(t)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		s.Kill()
		if t.Failed() {
			t.Logf("etcd's log:\n%s", s.tail())
		}
	})
	return s
}

// Endpoint is the client URL.
func (s *Server) Endpoint() string {
	return fmt.Sprintf("http://%s:%d", s.Host, s.ClientPort)
}

// HostPort is host:port of the client URL, for etcd://HOST:PORT.
func (s *Server) HostPort() string { return fmt.Sprintf("%s:%d", s.Host, s.ClientPort) }

func (s *Server) start() error {
	peer := fmt.Sprintf("http://%s:%d", s.Host, s.peerPort)
	args := []string{s.bin,
		"--name", "t", "--data-dir", filepath.Join(s.dir, "data"),
		"--listen-client-urls", s.Endpoint(), "--advertise-client-urls", s.Endpoint(),
		"--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
		"--initial-cluster", "t=" + peer,
		"--log-level", "warn",
	}
	cmd := exec.Command(args[0], args[1:]...)
	f, err := os.OpenFile(filepath.Join(s.dir, "etcd.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		f.Close()
		return fmt.Errorf("start etcd: %w", err)
	}
	s.cmd, s.logf, s.exited = cmd, f, make(chan struct{})
	go func(c *exec.Cmd, ch chan struct{}) { _ = c.Wait(); close(ch) }(cmd, s.exited)
	deadline := time.Now().Add(15 * time.Second)
	for time.Now().Before(deadline) {
		select {
		case <-s.exited:
			return fmt.Errorf("etcd exited at start: %s", s.tail())
		default:
		}
		if s.healthy() {
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	s.Kill()
	return fmt.Errorf("etcd not healthy within 15s: %s", s.tail())
}

func (s *Server) healthy() bool {
	c := http.Client{Timeout: time.Second}
	r, err := c.Get(s.Endpoint() + "/health")
	if err != nil {
		return false
	}
	defer r.Body.Close()
	b, _ := io.ReadAll(r.Body)
	return r.StatusCode == 200 && strings.Contains(string(b), "true")
}

func (s *Server) tail() string {
	b, _ := os.ReadFile(filepath.Join(s.dir, "etcd.log"))
	if len(b) > 2000 {
		b = b[len(b)-2000:]
	}
	return string(b)
}

// Kill stops etcd with SIGKILL and waits for it (bounded).
func (s *Server) Kill() {
	if s.cmd == nil {
		return
	}
	_ = s.cmd.Process.Kill()
	select {
	case <-s.exited:
	case <-time.After(10 * time.Second):
		s.t.Errorf("etcd pid %d did not exit within 10s of SIGKILL", s.cmd.Process.Pid)
	}
	s.logf.Close()
	s.cmd = nil
}

// Restart starts etcd again on the same ports and data.
func (s *Server) Restart() {
	s.t.Helper()
	if err := s.start(); err != nil {
		s.t.Fatal(err)
	}
}

func freePort(t testing.TB) int {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// tmpfsDir is a temporary directory on /dev/shm where there is one: etcd
// fsyncs every commit, which on a loaded disk takes seconds.
func tmpfsDir(t testing.TB) string {
	d, err := os.MkdirTemp("/dev/shm", "cudaipc-etcd-")
	if err != nil {
		return t.TempDir()
	}
	t.Cleanup(func() { os.RemoveAll(d) })
	return d
}
