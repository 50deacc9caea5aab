package client_test

// Round trips through the store's socket, against the floor measured in
// the same run: a raw SOCK_SEQPACKET ping-pong between this process and a
// helper process (blocking system calls, no protocol). The daemon is a
// separate process, so allocs/op counts the client's allocations only.
//
//	go test -run '^$' -bench RoundTrip -benchtime 2s ./client
//
// The environment variables CUDAIPC_SPIN (the client's Options.Spin) and
// DAEMON_SPIN (the daemon's serve --experimental-spin; 0 turns polling off) compare
// polling windows.
//
// Each sub-benchmark reports x-floor: its ns/op over the floor's ns/op,
// in round trips (a get+release through the socket is two).

import (
	"context"
	"crypto/rand"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/cudaipc/cudaipc/client"
)

const pingPongSize = 64

var daemonProfile = flag.String("daemon-profile", "", "BenchmarkRoundTrip: write the daemon's CPU profile to this file")

func init() {
	ownDialRoles["pingpong"] = func(context.Context, string, func(string, ...any)) error {
		// Echoes every packet on descriptor 3 until the other end shuts
		// down.
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
}

// pingPong is this process's end of a ping-pong with a helper process.
type pingPong struct {
	fd  int
	cmd *exec.Cmd
}

func startPingPong(b *testing.B) *pingPong {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		b.Fatal(err)
	}
	theirs := os.NewFile(uintptr(fds[1]), "pingpong")
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), roleEnv+"=pingpong")
	cmd.ExtraFiles = []*os.File{theirs}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	theirs.Close()
	p := &pingPong{fd: fds[0], cmd: cmd}
	b.Cleanup(func() {
		unix.Shutdown(p.fd, unix.SHUT_WR)
		unix.Close(p.fd)
		cmd.Wait()
	})
	return p
}

func (p *pingPong) once(b *testing.B, msg, buf []byte) {
	if _, err := unix.Write(p.fd, msg); err != nil {
		b.Fatal(err)
	}
	if n, err := unix.Read(p.fd, buf); err != nil || n != len(msg) {
		b.Fatalf("ping-pong: %d bytes, %v", n, err)
	}
}

// BenchmarkRoundTrip measures, against one daemon process: the floor; a
// Stat (one round trip); Get+Release with the fast path off (two round
// trips); a first Get of an object followed by its Release with the
// fast path on (one round trip and a compare-and-swap); and Get+Release
// of an object released before (two compare-and-swaps).
func BenchmarkRoundTrip(b *testing.B) {
	dir, err := os.MkdirTemp("", "cirt")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { os.RemoveAll(dir) })
	sock := filepath.Join(dir, "store.sock")
	var env []string
	if *daemonProfile != "" {
		env = append(env, "CPUPROFILE="+*daemonProfile)
	}
	if v := os.Getenv("DAEMON_SPIN"); v != "" {
		env = append(env, "DAEMON_SPIN="+v)
	}
	d := startDaemon(b, sock, env...)
	if *daemonProfile != "" {
		defer func() { // SIGTERM lets it write the profile
			d.cmd.Process.Signal(syscall.SIGTERM)
			<-d.waited
		}()
	}
	ctx := context.Background()
	admin, err := client.Dial(ctx, sock)
	if err != nil {
		b.Fatal(err)
	}
	defer admin.Close()
	const name = "rt"
	o, err := admin.Create(ctx, name, 4096, client.CreateOptions{})
	if err != nil {
		b.Fatal(err)
	}
	rand.Read(o.Bytes())
	if err := o.Seal(ctx); err != nil {
		b.Fatal(err)
	}

	var floor float64 // ns per round trip, from the floor's last run
	report := func(b *testing.B, trips float64) {
		if floor > 0 {
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/trips/floor, "x-floor/trip")
		}
	}
	b.Run("floor", func(b *testing.B) {
		p := startPingPong(b)
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		msg, buf := make([]byte, pingPongSize), make([]byte, pingPongSize)
		rand.Read(msg)
		for range 1000 { // both threads awake, caches warm
			p.once(b, msg, buf)
		}
		b.ReportAllocs()
		b.ResetTimer()
		for range b.N {
			p.once(b, msg, buf)
		}
		floor = float64(b.Elapsed().Nanoseconds()) / float64(b.N)
	})
	dialBench := func(b *testing.B, opts client.Options) *client.Client {
		c, err := client.DialOptions(ctx, sock, opts)
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { c.Close() })
		return c
	}
	getRelease := func(b *testing.B, c *client.Client) {
		l, err := c.Get(ctx, name)
		if err != nil {
			b.Fatal(err)
		}
		if err := l.Release(); err != nil {
			b.Fatal(err)
		}
	}
	b.Run("stat", func(b *testing.B) {
		c := dialBench(b, client.Options{NoFastPath: true})
		b.ReportAllocs()
		b.ResetTimer()
		for range b.N {
			if _, err := c.Stat(ctx, name); err != nil {
				b.Fatal(err)
			}
		}
		report(b, 1)
	})
	b.Run("get-release-socket", func(b *testing.B) {
		c := dialBench(b, client.Options{NoFastPath: true})
		getRelease(b, c) // map the arena
		b.ReportAllocs()
		b.ResetTimer()
		for range b.N {
			getRelease(b, c)
		}
		report(b, 2)
	})
	b.Run("get-release-first", func(b *testing.B) {
		// A first Get of each object goes through the socket and its
		// Release through the lease table. Objects are created (and
		// clients dialed) off the clock, a batch at a time.
		const batch = 512
		names := make([]string, batch)
		for i := range names {
			names[i] = fmt.Sprintf("first-%d", i)
			o, err := admin.Create(ctx, names[i], 4096, client.CreateOptions{})
			if err != nil {
				b.Fatal(err)
			}
			rand.Read(o.Bytes())
			if err := o.Seal(ctx); err != nil {
				b.Fatal(err)
			}
		}
		b.Cleanup(func() {
			for _, n := range names {
				admin.Delete(ctx, n)
			}
		})
		var c *client.Client
		b.ReportAllocs()
		b.ResetTimer()
		for i := range b.N {
			if i%batch == 0 {
				b.StopTimer()
				if c != nil {
					c.Close()
				}
				c = dialBench(b, client.Options{})
				getRelease(b, c) // map the arena
				b.StartTimer()
			}
			l, err := c.Get(ctx, names[i%batch])
			if err != nil {
				b.Fatal(err)
			}
			if err := l.Release(); err != nil {
				b.Fatal(err)
			}
		}
		report(b, 1)
	})
	b.Run("get-release-fast", func(b *testing.B) {
		c := dialBench(b, client.Options{})
		getRelease(b, c)
		b.ReportAllocs()
		b.ResetTimer()
		for range b.N {
			getRelease(b, c)
		}
	})
}
