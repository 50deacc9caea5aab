package diag

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"time"

	"golang.org/x/sys/unix"
)

// The floor of a store round trip: a 64-byte SOCK_SEQPACKET ping-pong
// between this process and a helper process (bench-pingpong), with
// blocking system calls on both sides and no protocol at all.

const pingPongSize = 64

// pingPongFloor measures round trips for d and returns their latencies.
func pingPongFloor(ctx context.Context, d time.Duration) ([]time.Duration, error) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("bench store: socketpair: %w", err)
	}
	mine := fds[0]
	defer unix.Close(mine)
	theirs := os.NewFile(uintptr(fds[1]), "pingpong")
	h, err := startHelper(ctx, "bench-pingpong", struct{}{}, []*os.File{theirs})
	theirs.Close()
	if err != nil {
		return nil, err
	}
	defer h.wait(10 * time.Second)
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	msg := make([]byte, pingPongSize)
	buf := make([]byte, pingPongSize)
	once := func() error {
		if _, err := unix.Write(mine, msg); err != nil {
			return err
		}
		n, err := unix.Read(mine, buf)
		if err == nil && n != len(msg) {
			err = fmt.Errorf("short echo: %d bytes", n)
		}
		return err
	}
	for range 1000 { // warm up: both threads awake, caches hot
		if err := once(); err != nil {
			return nil, fmt.Errorf("bench store: ping-pong: %w%s", err, h.why())
		}
	}
	lat := make([]time.Duration, 0, 1<<16)
	end := time.Now().Add(d)
	for ctx.Err() == nil {
		t := time.Now()
		if !t.Before(end) {
			break
		}
		if err := once(); err != nil {
			return nil, fmt.Errorf("bench store: ping-pong: %w", err)
		}
		lat = append(lat, time.Since(t))
	}
	unix.Shutdown(mine, unix.SHUT_WR)
	return lat, ctx.Err()
}

// benchPingPong is the helper's side: it echoes every packet on
// descriptor 3 until the other end shuts down.
func benchPingPong(_ *Env, _ []byte) error {
	runtime.LockOSThread()
	buf := make([]byte, pingPongSize)
	for {
		n, err := unix.Read(3, buf)
		if err != nil {
			return fmt.Errorf("ping-pong: %w", err)
		}
		if n == 0 {
			return nil
		}
		if _, err := unix.Write(3, buf[:n]); err != nil {
			return fmt.Errorf("ping-pong: %w", err)
		}
	}
}
