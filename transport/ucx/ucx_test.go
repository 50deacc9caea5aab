package ucx_test

import (
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/internal/testutil"
	"github.com/cudaipc/cudaipc/transport/ucx"
	"golang.org/x/sys/unix"
)

// EnvRequireUCX turns the skips of tests that need libucp into failures
// (set on CI machines, which install libucx0).
const EnvRequireUCX = "CUDAIPC_REQUIRE_UCX"

// EnvPeerLibrary, when set, is the libucp the serving helper processes
// load, so that a reader of one UCX version is tested against a holder of
// another (CUDAIPC_LIBUCP sets the reader's).
const EnvPeerLibrary = "CUDAIPC_TEST_PEER_LIBUCP"

func TestMain(m *testing.M) {
	testutil.SetUCXLoopbackEnv()
	testutil.RunRole(testutil.Roles{"server": serveRole, "fetcher": fetcherRole})
	os.Exit(m.Run())
}

func requireUCX(t testing.TB) {
	t.Helper()
	if err := ucx.Available(); err != nil {
		if os.Getenv(EnvRequireUCX) == "1" {
			t.Fatalf("%v (and %s=1)", err, EnvRequireUCX)
		}
		t.Skipf("%v", err)
	}
}

// serverInfo is what the server role tells the test: its worker address
// and region key in their binary encodings, and its pid.
type serverInfo struct {
	Addr  string `json:"addr"`
	Key   string `json:"key"`
	Token string `json:"token"` // of a Window on the whole region
	Pid   int    `json:"pid"`
}

// serveRole registers $SEED's random bytes ($SIZE of them) and serves them
// until stdin closes.
func serveRole(p *testutil.Peer) error {
	seed, _ := strconv.ParseUint(os.Getenv("SEED"), 10, 64)
	size, _ := strconv.Atoi(os.Getenv("SIZE"))
	c, err := ucx.NewContext(ucx.ContextOptions{Name: "test-server", NoRMA: os.Getenv("NORMA") == "1"})
	if err != nil {
		return err
	}
	defer c.Close()
	w, err := c.NewWorker(ucx.WorkerOptions{})
	if err != nil {
		return err
	}
	mem := testutil.RandomBytes(seed, size)
	r, err := c.Register(mem)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	served := make(chan error, 1)
	go func() { served <- w.Serve(ctx) }()
	addr, err := w.Address().MarshalBinary()
	if err != nil {
		return err
	}
	key, err := r.Key().MarshalBinary()
	if err != nil {
		return err
	}
	win, err := r.Window(0, uint64(size))
	if err != nil {
		return err
	}
	tok := win.Token()
	if err := p.Send(serverInfo{Addr: base64.StdEncoding.EncodeToString(addr), Key: base64.StdEncoding.EncodeToString(key),
		Token: base64.StdEncoding.EncodeToString(tok[:]), Pid: os.Getpid()}); err != nil {
		return err
	}
	var v any
	for p.Recv(&v) == nil {
	}
	cancel()
	if err := <-served; err != nil {
		return fmt.Errorf("serve: %w", err)
	}
	return c.Close()
}

// peer is a connected reader of a server process's region.
type peer struct {
	child *testutil.Child
	info  serverInfo
	ctx   *ucx.Context
	w     *ucx.Worker
	ep    *ucx.Endpoint
	key   *ucx.RemoteKey
	token ucx.Token // of the server's window on its whole region
	data  []byte    // what the server registered
}

func startServer(t *testing.T, seed uint64, size int) *peer {
	t.Helper()
	return startServerWith(t, seed, size, ucx.ContextOptions{})
}

// startServerWith is startServer with the server's and this side's
// context options: NoRMA is passed to the server as $NORMA.
func startServerWith(t *testing.T, seed uint64, size int, o ucx.ContextOptions) *peer {
	t.Helper()
	requireUCX(t)
	env := []string{"SEED=" + strconv.FormatUint(seed, 10), "SIZE=" + strconv.Itoa(size)}
	if o.NoRMA {
		env = append(env, "NORMA=1")
	}
	if lib := os.Getenv(EnvPeerLibrary); lib != "" {
		env = append(env, "CUDAIPC_LIBUCP="+lib)
	}
	child := testutil.Spawn(t, "server", env...)
	var info serverInfo
	if err := child.Recv(&info); err != nil {
		t.Fatalf("server: %v\n%s", err, child.Stderr())
	}
	c, err := ucx.NewContext(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := c.Close(); err != nil {
			t.Errorf("closing the context: %v", err)
		}
	})
	w, err := c.NewWorker(ucx.WorkerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ep, key := info.dial(t, w)
	if key.Key().Len != uint64(size) {
		t.Fatalf("region of %d bytes, want %d", key.Key().Len, size)
	}
	return &peer{child: child, info: info, ctx: c, w: w, ep: ep, key: key, token: ucx.Token(b64(t, info.Token)), data: testutil.RandomBytes(seed, size)}
}

// target decodes the server's worker address and region key.
func (info serverInfo) target(t testing.TB) (ucx.WorkerAddress, ucx.RegionKey) {
	t.Helper()
	var addr ucx.WorkerAddress
	if err := addr.UnmarshalBinary(b64(t, info.Addr)); err != nil {
		t.Fatal(err)
	}
	var rk ucx.RegionKey
	if err := rk.UnmarshalBinary(b64(t, info.Key)); err != nil {
		t.Fatal(err)
	}
	return addr, rk
}

// newContext makes a context with o, closed when the test ends.
func newContext(tb testing.TB, o ucx.ContextOptions) *ucx.Context {
	tb.Helper()
	c, err := ucx.NewContext(o)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { c.Close() })
	return c
}

// dial connects w to the server's worker and unpacks its region's key.
func (info serverInfo) dial(t testing.TB, w *ucx.Worker) (*ucx.Endpoint, *ucx.RemoteKey) {
	t.Helper()
	addr, rk := info.target(t)
	ep, err := w.Connect(addr)
	if err != nil {
		t.Fatal(err)
	}
	key, err := ep.Unpack(rk)
	if err != nil {
		t.Fatal(err)
	}
	return ep, key
}

func b64(t testing.TB, s string) []byte {
	t.Helper()
	b, err := base64.StdEncoding.DecodeString(s)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func timeout(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// TestGetWholeRegion reads a 64 MiB region of random bytes from another
// process in pipelined chunks, then 2,000 4 KiB reads at random offsets.
func TestGetWholeRegion(t *testing.T) {
	const size = 64 << 20
	p := startServer(t, 1801, size)
	base := p.key.Key().Addr
	dst := make([]byte, size)
	if err := ucx.Get(timeout(t, time.Minute), p.ep, p.key, base, dst); err != nil {
		t.Fatal(err)
	}
	if got, want := testutil.Sum(dst), testutil.Sum(p.data); got != want {
		t.Fatalf("sha256 of what was read %s, of what was registered %s", got, want)
	}

	rng := rand.New(rand.NewPCG(18, 1))
	small := make([]byte, 4096)
	for i := range 2000 {
		off := rng.IntN(size - len(small) + 1)
		clear(small)
		if err := ucx.Get(timeout(t, 10*time.Second), p.ep, p.key, base+uint64(off), small); err != nil {
			t.Fatalf("read %d at %d: %v", i, off, err)
		}
		if string(small) != string(p.data[off:off+len(small)]) {
			t.Fatalf("read %d at %d: bytes differ", i, off)
		}
	}
}

// TestGetChunkings reads a region with odd chunk sizes and depths, so that
// the last chunk is short and depth 1 serializes.
func TestGetChunkings(t *testing.T) {
	const size = 3<<20 + 12345
	p := startServer(t, 1802, size)
	base := p.key.Key().Addr
	for _, o := range []ucx.GetOptions{{Chunk: 1}, {Chunk: 4097, Depth: 1}, {Chunk: 65536, Depth: 64}, {Chunk: size * 2}} {
		n := size
		if o.Chunk == 1 {
			n = 3000 // one request per byte: keep it short
		}
		dst := make([]byte, n)
		if err := ucx.GetWith(timeout(t, time.Minute), p.ep, p.key, base+uint64(size-n), dst, o); err != nil {
			t.Fatalf("%+v: %v", o, err)
		}
		if testutil.Sum(dst) != testutil.Sum(p.data[size-n:]) {
			t.Fatalf("%+v: bytes differ", o)
		}
	}
}

// TestGetOutOfBounds: reads that leave the region are refused before UCX
// sees them.
func TestGetOutOfBounds(t *testing.T) {
	p := startServer(t, 1803, 1<<20)
	k := p.key.Key()
	for _, c := range []struct {
		addr uint64
		n    int
	}{{k.Addr - 1, 1}, {k.Addr, 1<<20 + 1}, {k.Addr + 1<<20, 1}, {k.Addr + 1<<20 - 4, 8}, {^uint64(0) - 2, 8}} {
		err := ucx.Get(timeout(t, 10*time.Second), p.ep, p.key, c.addr, make([]byte, c.n))
		if !errors.Is(err, ucx.ErrOutOfBounds) {
			t.Errorf("read of %d at %#x: %v, want ErrOutOfBounds", c.n, c.addr, err)
		}
	}
	// The edges themselves are readable.
	if err := ucx.Get(timeout(t, 10*time.Second), p.ep, p.key, k.Addr+1<<20-8, make([]byte, 8)); err != nil {
		t.Fatal(err)
	}
}

// TestGetCanceledStalledPeer: a peer that stops progressing (SIGSTOP) never
// answers a tcp GET; a Get bounded by a context returns soon after it ends,
// having closed the endpoint to end the reads in flight.
func TestGetCanceledStalledPeer(t *testing.T) {
	p := startServer(t, 1804, 8<<20)
	base := p.key.Key().Addr
	// Connect first, so that the stall hits reads, not the wireup.
	if err := ucx.Get(timeout(t, 10*time.Second), p.ep, p.key, base, make([]byte, 8)); err != nil {
		t.Fatal(err)
	}
	testutil.Stop(t, p.info.Pid)
	dst := make([]byte, 8<<20)
	start := time.Now()
	err := ucx.Get(timeout(t, 300*time.Millisecond), p.ep, p.key, base, dst)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Get from a stopped peer: %v, want context.DeadlineExceeded", err)
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Fatalf("Get returned %v after its context ended", d)
	}
	if err := ucx.Get(timeout(t, time.Second), p.ep, p.key, base, dst[:8]); !errors.Is(err, ucx.ErrClosed) {
		t.Fatalf("Get on the endpoint closed by the cancellation: %v, want ErrClosed", err)
	}
	// Nothing writes into dst once Get has returned, even when the peer
	// wakes up and answers the abandoned reads.
	for i := range dst {
		dst[i] = 0xa5
	}
	if err := syscall.Kill(p.info.Pid, syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(300 * time.Millisecond)
	for time.Now().Before(deadline) {
		if _, err := p.w.Progress(); err != nil {
			t.Fatal(err)
		}
	}
	for i, c := range dst {
		if c != 0xa5 {
			t.Fatalf("byte %d of dst changed to %#x after Get returned", i, c)
		}
	}
}

// TestConcurrentGets: goroutines read disjoint parts of one region at once,
// on one endpoint and on endpoints of two workers.
func TestConcurrentGets(t *testing.T) {
	const size = 16 << 20
	p := startServer(t, 1810, size)
	w2, err := p.ctx.NewWorker(ucx.WorkerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ep2, key2 := p.info.dial(t, w2)
	const parts = 8
	dst := make([]byte, size)
	errs := make(chan error, parts)
	for i := range parts {
		ep, key := p.ep, p.key
		if i%2 == 1 {
			ep, key = ep2, key2
		}
		go func() {
			part := dst[i*size/parts : (i+1)*size/parts]
			errs <- ucx.GetWith(timeout(t, time.Minute), ep, key, key.Key().Addr+uint64(i*size/parts), part, ucx.GetOptions{Chunk: 64 << 10, Depth: 4})
		}()
	}
	for range parts {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	if testutil.Sum(dst) != testutil.Sum(p.data) {
		t.Fatal("bytes read concurrently differ")
	}
}

// TestGetCanceledMidTransfer: canceling a large read from a live peer
// returns the context's error, and the endpoint still works afterwards (or
// says it was closed).
func TestGetCanceledMidTransfer(t *testing.T) {
	const size = 64 << 20
	p := startServer(t, 1805, size)
	base := p.key.Key().Addr
	ctx, cancel := context.WithCancel(context.Background())
	go func() { time.Sleep(5 * time.Millisecond); cancel() }()
	dst := make([]byte, size)
	err := ucx.GetWith(ctx, p.ep, p.key, base, dst, ucx.GetOptions{Chunk: 256 << 10})
	if err == nil {
		t.Skip("the whole read finished before the cancellation")
	}
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("canceled Get: %v", err)
	}
	small := make([]byte, 4096)
	switch err := ucx.Get(timeout(t, 10*time.Second), p.ep, p.key, base+4096, small); {
	case errors.Is(err, ucx.ErrClosed):
	case err != nil:
		t.Fatal(err)
	case string(small) != string(p.data[4096:8192]):
		t.Fatal("bytes differ after a canceled read")
	}
}

// TestPeerKilled: a holder killed with SIGKILL mid-transfer makes Get fail
// in bounded time with an error IsPeerFailure recognizes.
func TestPeerKilled(t *testing.T) {
	const size = 64 << 20
	p := startServer(t, 1806, size)
	base := p.key.Key().Addr
	if err := ucx.Get(timeout(t, 10*time.Second), p.ep, p.key, base, make([]byte, 8)); err != nil {
		t.Fatal(err)
	}
	go func() {
		time.Sleep(2 * time.Millisecond)
		syscall.Kill(p.info.Pid, syscall.SIGKILL)
	}()
	dst := make([]byte, size)
	var err error
	for i := 0; i < 20 && err == nil; i++ { // until the kill lands in a read
		err = ucx.GetWith(timeout(t, 30*time.Second), p.ep, p.key, base, dst, ucx.GetOptions{Chunk: 256 << 10})
	}
	if err == nil {
		t.Fatal("every read succeeded from a killed peer")
	}
	t.Logf("read from a killed peer: %v", err)
	if !ucx.IsPeerFailure(err) {
		t.Fatalf("read from a killed peer: %v, which IsPeerFailure does not recognize", err)
	}
	if err := p.ep.Err(); !ucx.IsPeerFailure(err) {
		t.Errorf("Endpoint.Err after the peer died: %v", err)
	}
	if err := p.ep.Close(); err != nil {
		t.Logf("closing the endpoint to the dead peer: %v", err)
	}
}

// TestMalformedPeerData: corrupt, truncated or nonsensical addresses and
// keys are ErrMalformed before UCX sees them.
func TestMalformedPeerData(t *testing.T) {
	p := startServer(t, 1807, 1<<20)
	good := b64(t, p.info.Addr)
	for i := range good {
		bad := append([]byte(nil), good...)
		bad[i] ^= 0x40
		var a ucx.WorkerAddress
		if err := a.UnmarshalBinary(bad); !errors.Is(err, ucx.ErrMalformed) {
			t.Fatalf("address with byte %d flipped: %v", i, err)
		}
	}
	for n := 0; n < len(good); n++ {
		var a ucx.WorkerAddress
		if err := a.UnmarshalBinary(good[:n]); !errors.Is(err, ucx.ErrMalformed) {
			t.Fatalf("address cut to %d bytes: %v", n, err)
		}
	}
	if _, err := p.w.Connect(ucx.WorkerAddress{}); !errors.Is(err, ucx.ErrMalformed) {
		t.Fatalf("Connect to an empty address: %v", err)
	}
	k := p.key.Key()
	for _, c := range []struct {
		name string
		key  ucx.RegionKey
	}{
		{"no rkey", ucx.RegionKey{Addr: k.Addr, Len: k.Len}},
		{"empty region", ucx.RegionKey{Addr: k.Addr, Rkey: k.Rkey}},
		{"wrapping region", ucx.RegionKey{Addr: ^uint64(0) - 10, Len: 100, Rkey: k.Rkey}},
		{"truncated rkey", ucx.RegionKey{Addr: k.Addr, Len: k.Len, Rkey: k.Rkey[:len(k.Rkey)-1]}},
		{"rkey with a tail", ucx.RegionKey{Addr: k.Addr, Len: k.Len, Rkey: append(append([]byte(nil), k.Rkey...), 0xff)}},
		{"zero domain map", ucx.RegionKey{Addr: k.Addr, Len: k.Len, Rkey: append(make([]byte, 8), k.Rkey[8:]...)}},
	} {
		if _, err := p.ep.Unpack(c.key); !errors.Is(err, ucx.ErrMalformed) {
			t.Errorf("%s: Unpack: %v, want ErrMalformed", c.name, err)
		}
		if _, err := c.key.MarshalBinary(); !errors.Is(err, ucx.ErrMalformed) {
			t.Errorf("%s: MarshalBinary: %v, want ErrMalformed", c.name, err)
		}
	}
}

// TestClose: every Close is idempotent, closing a parent closes its
// children, and calls on closed objects return ErrClosed.
func TestClose(t *testing.T) {
	p := startServer(t, 1808, 1<<20)
	r, err := p.ctx.Register(make([]byte, 1<<16))
	if err != nil {
		t.Fatal(err)
	}
	if err := p.key.Close(); err != nil {
		t.Fatal(err)
	}
	if err := p.key.Close(); err != nil {
		t.Fatal(err)
	}
	if err := ucx.Get(timeout(t, time.Second), p.ep, p.key, p.key.Key().Addr, make([]byte, 8)); !errors.Is(err, ucx.ErrClosed) {
		t.Fatalf("Get with a closed key: %v", err)
	}
	key, err := p.ep.Unpack(p.key.Key())
	if err != nil {
		t.Fatal(err)
	}
	if err := p.w.Close(); err != nil {
		t.Fatal(err)
	}
	if err := p.w.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := p.w.Progress(); !errors.Is(err, ucx.ErrClosed) {
		t.Fatalf("Progress on a closed worker: %v", err)
	}
	if err := ucx.Get(timeout(t, time.Second), p.ep, key, key.Key().Addr, make([]byte, 8)); !errors.Is(err, ucx.ErrClosed) {
		t.Fatalf("Get on an endpoint of a closed worker: %v", err)
	}
	if err := p.w.Serve(context.Background()); !errors.Is(err, ucx.ErrClosed) {
		t.Fatalf("Serve on a closed worker: %v", err)
	}
	if err := p.ctx.Close(); err != nil {
		t.Fatal(err)
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := p.ctx.NewWorker(ucx.WorkerOptions{}); !errors.Is(err, ucx.ErrClosed) {
		t.Fatalf("NewWorker on a closed context: %v", err)
	}
}

// TestServeStops: Serve returns when its context ends and when its worker
// is closed, and refuses a second concurrent Serve.
func TestServeStops(t *testing.T) {
	requireUCX(t)
	c := newContext(t, ucx.ContextOptions{})
	if !c.Supports(ucx.MemoryHost) {
		t.Fatalf("host memory not among %v", c.MemoryTypes())
	}
	w, err := c.NewWorker(ucx.WorkerOptions{Name: "serve-stops"})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Serve(ctx) }()
	testutil.Eventually(t, testutil.Wait, func() error {
		select {
		case err := <-done:
			t.Fatalf("Serve returned early: %v", err)
		default:
		}
		if !w.Serving() {
			return errors.New("the first Serve is not running yet")
		}
		return nil
	})
	if err := w.Serve(context.Background()); err == nil {
		t.Fatal("a second concurrent Serve was accepted")
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Serve did not return after its context ended")
	}
	go func() { done <- w.Serve(context.Background()) }()
	time.Sleep(10 * time.Millisecond) // let it reach its sleep; Close must wake it either way
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil && !errors.Is(err, ucx.ErrClosed) {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Serve did not return after its worker closed")
	}
}

// TestGoSignalHandlersKept: with libucp loaded, a nil dereference is still
// a Go panic, not a UCX crash handler (UCX_ERROR_SIGNALS).
func TestGoSignalHandlersKept(t *testing.T) {
	requireUCX(t)
	newContext(t, ucx.ContextOptions{}) // loads libucp
	recovered := func() (r any) {
		defer func() { r = recover() }()
		var p *int
		return *p
	}()
	if recovered == nil {
		t.Fatal("a nil dereference did not panic")
	}
}

// TestGetIntoRegisteredMemory reads into a registered memfd mapping (as a
// daemon pulls into its own arena) with its registration passed along.
func TestGetIntoRegisteredMemory(t *testing.T) {
	const size = 8 << 20
	p := startServer(t, 1809, size)
	fd, err := unix.MemfdCreate("ucx-test-arena", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	if err := unix.Ftruncate(fd, size+4096); err != nil {
		t.Fatal(err)
	}
	arena, err := unix.Mmap(fd, 0, size+4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(arena)
	local, err := p.ctx.Register(arena)
	if err != nil {
		t.Fatal(err)
	}
	defer local.Close()
	dst := arena[4096:]
	o := ucx.GetOptions{Local: local, Chunk: 1 << 20}
	if err := ucx.GetWith(timeout(t, time.Minute), p.ep, p.key, p.key.Key().Addr, dst, o); err != nil {
		t.Fatal(err)
	}
	if testutil.Sum(dst) != testutil.Sum(p.data) {
		t.Fatal("bytes read into the registered arena differ")
	}
	if err := ucx.GetWith(timeout(t, time.Minute), p.ep, p.key, p.key.Key().Addr, make([]byte, 8), o); err == nil {
		t.Fatal("GetWith accepted a dst outside GetOptions.Local")
	}
}

// TestResourcesAndMemoryTypes: the context lists what UCX_TLS and
// UCX_NET_DEVICES leave (tcp on lo here) and refuses memory types it does
// not support before asking UCX.
func TestResourcesAndMemoryTypes(t *testing.T) {
	requireUCX(t)
	c := newContext(t, ucx.ContextOptions{})
	rs, err := c.Resources()
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(rs, ucx.Resource{Transport: "tcp", Device: "lo"}) {
		info, _ := c.Info()
		t.Fatalf("tcp/lo not among %v with UCX_TLS=%s UCX_NET_DEVICES=%s:\n%s", rs, os.Getenv("UCX_TLS"), os.Getenv("UCX_NET_DEVICES"), info)
	}
	if !c.Supports(ucx.MemoryHost) {
		t.Fatalf("host memory not among %v", c.MemoryTypes())
	}
	if !c.Supports(ucx.MemoryCUDA) {
		if _, err := c.RegisterMemory(1<<32, 4096, ucx.MemoryCUDA); err == nil || !strings.Contains(err.Error(), "cannot register cuda memory") {
			t.Fatalf("RegisterMemory of cuda memory without CUDA support: %v", err)
		}
	}
	for _, bad := range []struct{ addr, n uint64 }{{4096, 0}, {^uint64(0) - 10, 4096}} {
		if _, err := c.RegisterMemory(bad.addr, bad.n, ucx.MemoryHost); err == nil {
			t.Fatalf("RegisterMemory(%#x, %d) succeeded", bad.addr, bad.n)
		}
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Resources(); !errors.Is(err, ucx.ErrClosed) {
		t.Fatalf("Resources on a closed context: %v", err)
	}
}

// TestRegisterMemoryByAddress registers an arena by address (as a GPU arena
// would be) and reads into it with its registration passed along.
func TestRegisterMemoryByAddress(t *testing.T) {
	const size = 4 << 20
	p := startServer(t, 1811, size)
	arena, err := unix.Mmap(-1, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(arena)
	whole, err := p.ctx.Register(arena) // to learn the arena's address
	if err != nil {
		t.Fatal(err)
	}
	addr := whole.Key().Addr
	if err := whole.Close(); err != nil {
		t.Fatal(err)
	}
	local, err := p.ctx.RegisterMemory(addr, size, ucx.MemoryHost)
	if err != nil {
		t.Fatal(err)
	}
	defer local.Close()
	if local.Bytes() != nil || local.Key().Addr != addr || local.Key().Len != size {
		t.Fatalf("region by address: key %+v", local.Key())
	}
	if err := ucx.GetWith(timeout(t, time.Minute), p.ep, p.key, p.key.Key().Addr, arena, ucx.GetOptions{Local: local}); err != nil {
		t.Fatal(err)
	}
	if testutil.Sum(arena) != testutil.Sum(p.data) {
		t.Fatal("bytes read into the arena registered by address differ")
	}

	// GetInto reads by offset into the region, with no []byte for it.
	clear(arena)
	const off, n = 4096, size - 3*4096
	if err := ucx.GetInto(timeout(t, time.Minute), p.ep, p.key, p.key.Key().Addr+8192, local, off, n, ucx.GetOptions{Chunk: 256 << 10}); err != nil {
		t.Fatal(err)
	}
	if testutil.Sum(arena[off:off+n]) != testutil.Sum(p.data[8192:8192+n]) {
		t.Fatal("bytes read with GetInto differ")
	}
	for _, c := range [][]byte{arena[:off], arena[off+n:]} {
		if slices.ContainsFunc(c, func(b byte) bool { return b != 0 }) {
			t.Fatal("GetInto wrote outside its range")
		}
	}
	for _, bad := range []struct{ off, n uint64 }{{size - 10, 11}, {size + 1, 0}, {1, ^uint64(0)}} {
		if err := ucx.GetInto(timeout(t, time.Minute), p.ep, p.key, p.key.Key().Addr, local, bad.off, bad.n, ucx.GetOptions{}); err == nil {
			t.Fatalf("GetInto(off %d, n %d) into a %d-byte region succeeded", bad.off, bad.n, size)
		}
	}
}

// TestLeakedContextReleased: a Context dropped without Close, with a worker
// and a region on it, is released by its cleanup once unreachable; a closed
// one is not released twice.
func TestLeakedContextReleased(t *testing.T) {
	requireUCX(t)
	before := ucx.LeakedContexts()
	func() {
		c, err := ucx.NewContext(ucx.ContextOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := c.NewWorker(ucx.WorkerOptions{}); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Register(make([]byte, 1<<16)); err != nil {
			t.Fatal(err)
		}
		closed, err := ucx.NewContext(ucx.ContextOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if err := closed.Close(); err != nil {
			t.Fatal(err)
		}
	}()
	awaitLeakedReleased(t, before)
}

// awaitLeakedReleased waits until the cleanup backstop has released one
// Context more than before.
func awaitLeakedReleased(t *testing.T, before int64) {
	t.Helper()
	testutil.Eventually(t, testutil.Wait, func() error {
		runtime.GC()
		if n := ucx.LeakedContexts() - before; n != 1 {
			return fmt.Errorf("%d contexts released by the cleanup, want 1", n)
		}
		return nil
	})
}

// TestLeakedContextWithEndpointsReleased: a Context dropped without Close
// whose worker has an open endpoint and one that Close kept (parked) for
// the next Connect is released by its cleanup too: nothing global (the
// endpoints' error-handler table) keeps it reachable.
func TestLeakedContextWithEndpointsReleased(t *testing.T) {
	const size = 4 << 20
	p := startServer(t, 1811, size)
	before := ucx.LeakedContexts()
	func() {
		c, err := ucx.NewContext(ucx.ContextOptions{})
		if err != nil {
			t.Fatal(err)
		}
		w, err := c.NewWorker(ucx.WorkerOptions{})
		if err != nil {
			t.Fatal(err)
		}
		addr, rk := p.info.target(t)
		var eps []*ucx.Endpoint
		for range 2 {
			ep, err := w.Connect(addr)
			if err != nil {
				t.Fatal(err)
			}
			key, err := ep.Unpack(rk)
			if err != nil {
				t.Fatal(err)
			}
			dst := make([]byte, size)
			if err := ucx.Get(timeout(t, time.Minute), ep, key, rk.Addr, dst); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(dst, p.data) {
				t.Fatal("the bytes read differ from the server's")
			}
			eps = append(eps, ep)
		}
		if err := eps[0].Close(); err != nil { // kept for the next Connect
			t.Fatal(err)
		}
	}()
	awaitLeakedReleased(t, before)
}

// TestProbe: on a machine with UCX, Probe names the version, the tcp/lo
// resource and host memory; with a library that does not exist (in a child
// process: the library loads once per process) it says UCX is not found.
func TestProbe(t *testing.T) {
	if os.Getenv("UCX_PROBE_CHILD") == "1" {
		r := ucx.Probe()
		if !errors.Is(r.Err, ucx.ErrNotFound) || r.Library != "/nonexistent/libucp.so.0" || r.Version != "" {
			t.Fatalf("Probe without UCX: %+v", r)
		}
		return
	}
	requireUCX(t)
	r := ucx.Probe()
	if r.Err != nil {
		t.Fatal(r.Err)
	}
	if r.Version == "" || !slices.Contains(r.Resources, ucx.Resource{Transport: "tcp", Device: "lo"}) || !slices.Contains(r.MemoryTypes, ucx.MemoryHost) {
		t.Fatalf("Probe: %+v", r)
	}
	t.Logf("UCX %s from %s: %v, memory %v, CUDA registration %v", r.Version, r.Library, r.Resources, r.MemoryTypes, r.CanRegisterCUDA())
	cmd := exec.Command(os.Args[0], "-test.run=^TestProbe$", "-test.v")
	cmd.Env = append(os.Environ(), "UCX_PROBE_CHILD=1", "CUDAIPC_LIBUCP=/nonexistent/libucp.so.0")
	if out, err := cmd.CombinedOutput(); err != nil || !strings.Contains(string(out), "--- PASS: TestProbe") {
		t.Fatalf("child without UCX: %v\n%s", err, out)
	}
}

// TestCloseUnderGet: closing the endpoint, then the worker, while a Get
// runs on another goroutine ends that Get with ErrClosed (or success, had it
// finished), and nothing writes into its dst afterwards.
func TestCloseUnderGet(t *testing.T) {
	const size = 16 << 20
	for _, which := range []string{"endpoint", "worker"} {
		t.Run(which, func(t *testing.T) {
			p := startServer(t, 1812, size)
			dst := make([]byte, size)
			done := make(chan error, 1)
			go func() {
				done <- ucx.GetWith(timeout(t, time.Minute), p.ep, p.key, p.key.Key().Addr, dst, ucx.GetOptions{Chunk: 64 << 10, Depth: 4})
			}()
			time.Sleep(2 * time.Millisecond) // somewhere in the transfer; either outcome is checked
			var err error
			closeStart := time.Now()
			if which == "endpoint" {
				err = p.ep.Close()
			} else {
				err = p.w.Close()
			}
			t.Logf("closing the %s took %v", which, time.Since(closeStart))
			if err != nil {
				t.Fatal(err)
			}
			var getErr error
			select {
			case getErr = <-done:
			case <-time.After(testutil.Wait):
				t.Fatal("Get did not return after its " + which + " was closed")
			}
			t.Logf("the Get returned %v", getErr)
			if getErr != nil && !errors.Is(getErr, ucx.ErrClosed) {
				t.Fatalf("Get under a closing %s: %v", which, getErr)
			}
			if getErr == nil && testutil.Sum(dst) != testutil.Sum(p.data) {
				t.Fatal("a Get that succeeded read wrong bytes")
			}
			for i := range dst {
				dst[i] = 0x5a
			}
			if which == "endpoint" {
				for deadline := time.Now().Add(200 * time.Millisecond); time.Now().Before(deadline); {
					if _, err := p.w.Progress(); err != nil {
						t.Fatal(err)
					}
				}
			} else {
				time.Sleep(200 * time.Millisecond)
			}
			if i := slices.IndexFunc(dst, func(b byte) bool { return b != 0x5a }); i >= 0 {
				t.Fatalf("byte %d of dst changed after Get returned", i)
			}
		})
	}
}
