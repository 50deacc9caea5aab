package store

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// ListenAndServe serves the store on a Unix socket at socketPath until ctx
// is done, then removes the socket and returns nil.
//
// The socket's directory is created 0700 (0755 when Config.AllowUIDs or
// AllowGIDs admit others) if missing; an existing directory must belong to
// the daemon's uid or root and must not be writable by others unless it is
// sticky, like /tmp. The socket is 0600 (0666 when others are admitted:
// SO_PEERCRED then decides who may talk). A lock file next to the socket
// (socketPath + ".lock") makes a second daemon fail with ErrDaemonRunning,
// as does a live daemon answering on the socket; a socket nobody answers
// on is stale and replaced.
func (s *Store) ListenAndServe(ctx context.Context, socketPath string) error {
	l, cleanup, err := s.listen(socketPath)
	if err != nil {
		return err
	}
	defer cleanup()
	return s.serve(ctx, l, socketPath)
}

func (s *Store) listen(path string) (_ *net.UnixListener, cleanup func(), err error) {
	if path == "" {
		return nil, nil, invalidf("empty socket path")
	}
	// sun_path holds 108 bytes with the terminating NUL; the temporary
	// name below is longer than path by up to 12.
	if len(path)+12 > 107 {
		return nil, nil, invalidf("socket path %q is too long (at most %d bytes)", path, 107-12)
	}
	others := len(s.cfg.AllowUIDs) > 0 || len(s.cfg.AllowGIDs) > 0
	dirMode, sockMode := fs.FileMode(0o700), fs.FileMode(0o600)
	if others {
		dirMode, sockMode = 0o755, 0o666
	}
	dir := filepath.Dir(path)
	if err := s.ensureDir(dir, dirMode); err != nil {
		return nil, nil, err
	}

	lock, err := lockFile(path + ".lock")
	if err != nil {
		return nil, nil, err
	}
	defer func() {
		if err != nil {
			lock.Close()
		}
	}()

	switch fi, err := os.Lstat(path); {
	case errors.Is(err, fs.ErrNotExist):
	case err != nil:
		return nil, nil, fmt.Errorf("store: %w", err)
	case fi.Mode().Type() != fs.ModeSocket:
		return nil, nil, fmt.Errorf("store: %s exists and is not a socket; not replacing it", path)
	default:
		// We hold the lock, so a daemon answering here does not use it: an
		// older one, or one started with another lock path.
		if live(path) {
			return nil, nil, fmt.Errorf("store: %s: %w (it answers on the socket)", path, ErrDaemonRunning)
		}
		s.log.Info("replacing stale socket", "path", path)
	}

	// Bind under a temporary name, set the mode, then rename over path:
	// the socket never exists at path with looser permissions, and the
	// rename replaces a stale socket atomically.
	tmp := path + ".tmp" + strconv.Itoa(os.Getpid())
	os.Remove(tmp)
	l, err := net.ListenUnix("unixpacket", &net.UnixAddr{Name: tmp, Net: "unixpacket"})
	if err != nil {
		return nil, nil, fmt.Errorf("store: listen: %w", err)
	}
	l.SetUnlinkOnClose(false)
	fail := func(err error) (*net.UnixListener, func(), error) {
		l.Close()
		os.Remove(tmp)
		return nil, nil, fmt.Errorf("store: %w", err)
	}
	if err := os.Chmod(tmp, sockMode); err != nil {
		return fail(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fail(err)
	}
	ours, err := os.Stat(path)
	if err != nil {
		return fail(err)
	}
	s.log.Info("listening", "path", path, "mode", sockMode.String())
	return l, func() {
		l.Close()
		// Remove the socket only if it is still ours.
		if fi, err := os.Stat(path); err == nil && os.SameFile(fi, ours) {
			os.Remove(path)
		}
		// The lock file stays: removing it would let two later daemons
		// lock two different files of the same name.
		lock.Close()
	}, nil
}

// ensureDir makes sure dir exists and only trusted users can plant a
// socket in it.
func (s *Store) ensureDir(dir string, mode fs.FileMode) error {
	fi, err := os.Lstat(dir)
	if errors.Is(err, fs.ErrNotExist) {
		if err := os.MkdirAll(dir, mode); err != nil {
			return fmt.Errorf("store: %w", err)
		}
		// MkdirAll's mode is filtered by the umask.
		if err := os.Chmod(dir, mode); err != nil {
			return fmt.Errorf("store: %w", err)
		}
		return nil
	}
	if err != nil {
		return fmt.Errorf("store: %w", err)
	}
	if !fi.IsDir() {
		return fmt.Errorf("store: %s is not a directory", dir)
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return fmt.Errorf("store: cannot tell the owner of %s", dir)
	}
	if st.Uid != s.uid && st.Uid != 0 {
		return fmt.Errorf("store: %s belongs to uid %d, not to this daemon's uid %d or root; choose another socket path", dir, st.Uid, s.uid)
	}
	if fi.Mode().Perm()&0o022 != 0 && fi.Mode()&fs.ModeSticky == 0 {
		return fmt.Errorf("store: %s is writable by others (mode %s); choose another socket path or fix its mode", dir, fi.Mode().Perm())
	}
	if mode&0o055 != 0 && fi.Mode().Perm()&0o011 == 0 {
		s.log.Warn("admitted users cannot reach the socket: its directory is not searchable by them", "dir", dir, "mode", fi.Mode().Perm().String())
	}
	return nil
}

// lockFile takes an exclusive lock on path, failing with ErrDaemonRunning
// when another process holds it. The lock lasts until the file is closed,
// or the process dies.
func lockFile(path string) (*os.File, error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("store: lock: %w", err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, fmt.Errorf("store: %s is locked: %w", path, ErrDaemonRunning)
		}
		return nil, fmt.Errorf("store: lock %s: %w", path, err)
	}
	return f, nil
}

// live reports whether a process accepts connections on the socket path.
func live(path string) bool {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	var d net.Dialer
	c, err := d.DialContext(ctx, "unixpacket", path)
	if err != nil {
		return false
	}
	c.Close()
	return true
}
