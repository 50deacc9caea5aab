package store

import (
	"context"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

func TestSocketPermissions(t *testing.T) {
	for _, tc := range []struct {
		name              string
		cfg               Config
		dirMode, sockMode os.FileMode
	}{
		{"private", Config{}, 0o700, 0o600},
		{"others admitted", Config{AllowUIDs: []uint32{4242}}, 0o755, 0o666},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := newTestStore(t, tc.cfg)
			path := filepath.Join(shortTempDir(t), "sub", "store.sock")
			l, cleanup, err := s.listen(path)
			if err != nil {
				t.Fatal(err)
			}
			defer cleanup()
			defer l.Close()
			for p, want := range map[string]os.FileMode{filepath.Dir(path): tc.dirMode, path: tc.sockMode} {
				fi, err := os.Stat(p)
				if err != nil {
					t.Fatal(err)
				}
				if got := fi.Mode().Perm(); got != want {
					t.Errorf("%s: mode %v, want %v", p, got, want)
				}
			}
		})
	}
}

func TestSecondDaemonDetected(t *testing.T) {
	_, path, _ := serve(t, Config{})
	s2 := newTestStore(t, Config{})
	err := s2.ListenAndServe(context.Background(), path)
	if !errors.Is(err, ErrDaemonRunning) {
		t.Fatalf("second daemon: %v, want ErrDaemonRunning", err)
	}
	// The first one still serves.
	dialRaw(t, path).put("x", 10, false)
}

func TestLiveDaemonWithoutLockDetected(t *testing.T) {
	dir := shortTempDir(t)
	path := filepath.Join(dir, "store.sock")
	l, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	s := newTestStore(t, Config{})
	if _, _, err := s.listen(path); !errors.Is(err, ErrDaemonRunning) {
		t.Fatalf("listen over a live socket: %v, want ErrDaemonRunning", err)
	}
}

func TestStaleSocketReplaced(t *testing.T) {
	dir := shortTempDir(t)
	path := filepath.Join(dir, "store.sock")
	// A daemon that died without cleaning up leaves its socket behind.
	l, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: path, Net: "unixpacket"})
	if err != nil {
		t.Fatal(err)
	}
	l.SetUnlinkOnClose(false)
	l.Close()
	if _, err := os.Lstat(path); err != nil {
		t.Fatal(err)
	}
	s := newTestStore(t, Config{})
	ctx, cancel := context.WithCancel(context.Background())
	l2, cleanup, err := s.listen(path)
	if err != nil {
		t.Fatalf("listen over a stale socket: %v", err)
	}
	done := make(chan error)
	go func() {
		err := s.Serve(ctx, l2)
		cleanup()
		done <- err
	}()
	dialRaw(t, path).put("x", 10, false)
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

func TestUnsafeSocketPlacesRefused(t *testing.T) {
	dir := shortTempDir(t)
	s := newTestStore(t, Config{})

	file := filepath.Join(dir, "not-a-socket")
	if err := os.WriteFile(file, []byte("keep me"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, _, err := s.listen(file); err == nil {
		t.Fatal("listen replaced a regular file")
	}
	if b, _ := os.ReadFile(file); string(b) != "keep me" {
		t.Fatal("regular file clobbered")
	}

	open := filepath.Join(dir, "open")
	if err := os.Mkdir(open, 0o777); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(open, 0o777); err != nil {
		t.Fatal(err)
	}
	if _, _, err := s.listen(filepath.Join(open, "store.sock")); err == nil {
		t.Fatal("listen in a world-writable, non-sticky directory")
	}
}

// TestOtherUIDRefused runs a client as another uid, in its own process,
// against a store that admits it (by uid) and one that does not.
func TestOtherUIDRefused(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to run a client as another uid")
	}
	for _, tc := range []struct {
		name string
		cfg  Config
		want int
	}{
		{"refused", Config{AllowUIDs: []uint32{4242}}, 3},
		{"admitted by uid", Config{AllowUIDs: []uint32{65534}}, 0},
		{"admitted by gid", Config{AllowGIDs: []uint32{65534}}, 0},
		// Without AllowUIDs/AllowGIDs the socket is 0600 in a 0700
		// directory: the client cannot even connect.
		{"private socket", Config{}, 4},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, path, _ := serve(t, tc.cfg)
			// The socket's directory (made by os.MkdirTemp) is 0700; let
			// the client in.
			if err := os.Chmod(filepath.Dir(path), 0o755); err != nil {
				t.Fatal(err)
			}
			if tc.want == 4 {
				if err := os.Chmod(filepath.Dir(path), 0o700); err != nil {
					t.Fatal(err)
				}
			}
			cmd := exec.Command(os.Args[0], "-test.run=^$")
			cmd.Env = append(os.Environ(), helperEnv+"=dial", "CUDAIPC_STORE_TEST_SOCKET="+path)
			out, err := cmd.CombinedOutput()
			code := 0
			var ee *exec.ExitError
			if errors.As(err, &ee) {
				code = ee.ExitCode()
			} else if err != nil {
				t.Fatal(err)
			}
			if code != tc.want {
				t.Fatalf("client of uid 65534: exit %d, want %d\n%s", code, tc.want, out)
			}
		})
	}
}
