package ucx_test

import (
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"math/rand/v2"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/internal/testutil"
	"github.com/cudaipc/cudaipc/transport/ucx"
)

// TestFetchWholeRegion fetches a 64 MiB region of random bytes from
// another process, in the default chunks and in small ones, then 500
// fetches of 1 byte to 256 KiB at random offsets.
func TestFetchWholeRegion(t *testing.T) {
	const size = 64 << 20
	p := startServer(t, 1901, size)
	base := p.key.Key().Addr
	for _, o := range []ucx.FetchOptions{{Token: p.token}, {Chunk: 256 << 10, Depth: 3, Token: p.token}, {Chunk: 1<<20 + 7, Depth: 1, Token: p.token}} {
		dst := make([]byte, size)
		if err := ucx.Fetch(timeout(t, 60*time.Second), p.ep, p.key, base, dst, o); err != nil {
			t.Fatalf("%+v: %v", o, err)
		}
		if !bytes.Equal(dst, p.data) {
			t.Fatalf("%+v: the fetched bytes differ", o)
		}
	}
	rng := rand.New(rand.NewPCG(1901, 2))
	for i := range 500 {
		n := 1 + rng.IntN(256<<10)
		off := rng.IntN(size - n + 1)
		dst := make([]byte, n)
		if err := ucx.Fetch(timeout(t, 10*time.Second), p.ep, p.key, base+uint64(off), dst, ucx.FetchOptions{Chunk: 64 << 10, Token: p.token}); err != nil {
			t.Fatalf("fetch %d [%d, +%d): %v", i, off, n, err)
		}
		if !bytes.Equal(dst, p.data[off:off+n]) {
			t.Fatalf("fetch %d [%d, +%d): bytes differ", i, off, n)
		}
	}
}

// TestFetchRefused: bytes past the holder's window are refused by the
// holder (with a key claiming a longer region), as are a token it never
// made; a read outside the key is refused before anything is sent; the
// endpoint still works afterwards.
func TestFetchRefused(t *testing.T) {
	const size = 1 << 20
	p := startServer(t, 1902, size)
	k := p.key.Key()
	long := ucx.RegionKey{Addr: k.Addr, Len: k.Len + 1<<20, Rkey: k.Rkey}
	lk, err := p.ep.Unpack(long)
	if err != nil {
		t.Fatal(err)
	}
	dst := make([]byte, 4096)
	err = ucx.Fetch(timeout(t, 10*time.Second), p.ep, lk, k.Addr+size-100, dst, ucx.FetchOptions{Token: p.token})
	if !errors.Is(err, ucx.ErrRefused) {
		t.Fatalf("fetch past the holder's window: %v, want ErrRefused", err)
	}
	t.Logf("refused: %v", err)
	bad := p.token
	bad[3] ^= 1
	for _, tok := range []ucx.Token{bad, {}} {
		err := ucx.Fetch(timeout(t, 10*time.Second), p.ep, p.key, k.Addr, dst, ucx.FetchOptions{Token: tok})
		if !errors.Is(err, ucx.ErrRefused) {
			t.Fatalf("fetch with token %v: %v, want ErrRefused", tok, err)
		}
	}
	if err := ucx.Fetch(timeout(t, 10*time.Second), p.ep, p.key, k.Addr+size-100, dst, ucx.FetchOptions{Token: p.token}); !errors.Is(err, ucx.ErrOutOfBounds) {
		t.Fatalf("fetch outside the key: %v, want ErrOutOfBounds", err)
	}
	if err := ucx.Fetch(timeout(t, 10*time.Second), p.ep, p.key, k.Addr+size-4096, dst, ucx.FetchOptions{Token: p.token}); err != nil {
		t.Fatalf("fetch after the refusals: %v", err)
	}
	if !bytes.Equal(dst, p.data[size-4096:]) {
		t.Fatal("bytes differ after the refusals")
	}
}

// TestFetchCanceledMidTransfer: a fetch canceled mid-transfer returns the
// context's error, and the endpoint serves a later fetch right.
func TestFetchCanceledMidTransfer(t *testing.T) {
	const size = 64 << 20
	p := startServer(t, 1903, size)
	base := p.key.Key().Addr
	ctx, cancel := context.WithCancel(context.Background())
	go func() { time.Sleep(3 * time.Millisecond); cancel() }()
	dst := make([]byte, size)
	err := ucx.Fetch(ctx, p.ep, p.key, base, dst, ucx.FetchOptions{Chunk: 256 << 10, Token: p.token})
	if err == nil {
		t.Skip("the whole fetch finished before the cancellation")
	}
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("canceled Fetch: %v", err)
	}
	small := make([]byte, 4096)
	if err := ucx.Fetch(timeout(t, 10*time.Second), p.ep, p.key, base+8192, small, ucx.FetchOptions{Token: p.token}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(small, p.data[8192:8192+4096]) {
		t.Fatal("bytes differ after a canceled fetch")
	}
}

// TestFetchHolderKilled: a holder killed with SIGKILL mid-transfer makes
// Fetch fail in bounded time with an error IsPeerFailure recognizes.
func TestFetchHolderKilled(t *testing.T) {
	const size = 64 << 20
	p := startServer(t, 1904, size)
	base := p.key.Key().Addr
	if err := ucx.Fetch(timeout(t, 10*time.Second), p.ep, p.key, base, make([]byte, 8), ucx.FetchOptions{Token: p.token}); err != nil {
		t.Fatal(err)
	}
	go func() {
		time.Sleep(2 * time.Millisecond)
		syscall.Kill(p.info.Pid, syscall.SIGKILL)
	}()
	dst := make([]byte, size)
	var err error
	start := time.Now()
	for i := 0; i < 20 && err == nil; i++ { // until the kill lands in a fetch
		err = ucx.Fetch(timeout(t, 30*time.Second), p.ep, p.key, base, dst, ucx.FetchOptions{Chunk: 256 << 10, Token: p.token})
	}
	if err == nil {
		t.Fatal("every fetch succeeded from a killed holder")
	}
	t.Logf("fetch from a killed holder after %v: %v", time.Since(start), err)
	if !ucx.IsPeerFailure(err) {
		t.Fatalf("fetch from a killed holder: %v, which IsPeerFailure does not recognize", err)
	}
}

// fetcherRole fetches $KEY's region from the worker at $ADDR (both base64
// envelopes) through the window of $TOKEN over and over, saying "fetching" after the first, until it is
// killed or 60 s pass.
func fetcherRole(p *testutil.Peer) error {
	dec := func(s string) []byte {
		b, _ := base64.StdEncoding.DecodeString(s)
		return b
	}
	var addr ucx.WorkerAddress
	if err := addr.UnmarshalBinary(dec(os.Getenv("ADDR"))); err != nil {
		return err
	}
	var rk ucx.RegionKey
	if err := rk.UnmarshalBinary(dec(os.Getenv("KEY"))); err != nil {
		return err
	}
	c, err := ucx.NewContext(ucx.ContextOptions{Name: "test-fetcher"})
	if err != nil {
		return err
	}
	defer c.Close()
	w, err := c.NewWorker(ucx.WorkerOptions{})
	if err != nil {
		return err
	}
	ep, err := w.Connect(addr)
	if err != nil {
		return err
	}
	k, err := ep.Unpack(rk)
	if err != nil {
		return err
	}
	dst := make([]byte, rk.Len)
	tok := ucx.Token(dec(os.Getenv("TOKEN")))
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for i := 0; ctx.Err() == nil; i++ {
		if err := ucx.Fetch(ctx, ep, k, rk.Addr, dst, ucx.FetchOptions{Chunk: 1 << 20, Depth: 16, Token: tok}); err != nil {
			return err
		}
		if i == 0 {
			if err := p.Send("fetching"); err != nil {
				return err
			}
		}
	}
	return nil
}

// TestFetchReaderKilled: readers killed with SIGKILL in the middle of
// fetches leave the holder serving: another reader then fetches every byte
// right, and the holder's region closes promptly (no reply left under way).
// This is the failure that aborts a holder serving UCX's emulated GET over
// tcp (see fetch.go).
func TestFetchReaderKilled(t *testing.T) {
	requireUCX(t)
	const size = 32 << 20
	data := testutil.RandomBytes(1905, size)
	c, err := ucx.NewContext(ucx.ContextOptions{Name: "test-holder"})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	hw, err := c.NewWorker(ucx.WorkerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	r, err := c.Register(data)
	if err != nil {
		t.Fatal(err)
	}
	ctx, stop := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- hw.Serve(ctx) }()
	defer func() {
		stop()
		if err := testutil.Next(t, served, 20*time.Second); err != nil {
			t.Errorf("serve: %v", err)
		}
	}()
	addr, err := hw.Address().MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	key, err := r.Key().MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	win, err := r.Window(0, size)
	if err != nil {
		t.Fatal(err)
	}
	tok := win.Token()
	env := []string{"ADDR=" + base64.StdEncoding.EncodeToString(addr), "KEY=" + base64.StdEncoding.EncodeToString(key),
		"TOKEN=" + base64.StdEncoding.EncodeToString(tok[:])}
	for i := range 3 {
		child := testutil.Spawn(t, "fetcher", env...)
		var msg string
		if err := child.Recv(&msg); err != nil || msg != "fetching" {
			t.Fatalf("fetcher %d: %q, %v\n%s", i, msg, err, child.Stderr())
		}
		time.Sleep(time.Duration(1+i*3) * time.Millisecond)
		if err := syscall.Kill(child.Pid(), syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		_ = child.Wait(10 * time.Second)
	}

	rc, err := ucx.NewContext(ucx.ContextOptions{Name: "test-reader"})
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	rw, err := rc.NewWorker(ucx.WorkerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ep, err := rw.Connect(hw.Address())
	if err != nil {
		t.Fatal(err)
	}
	k, err := ep.Unpack(r.Key())
	if err != nil {
		t.Fatal(err)
	}
	dst := make([]byte, size)
	if err := ucx.Fetch(timeout(t, 30*time.Second), ep, k, r.Key().Addr, dst, ucx.FetchOptions{Token: tok}); err != nil {
		t.Fatalf("fetch after the readers were killed: %v", err)
	}
	if !bytes.Equal(dst, data) {
		t.Fatal("bytes differ after the readers were killed")
	}
	start := time.Now()
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d > time.Second {
		t.Errorf("closing the region took %v: replies to dead readers were left under way", d)
	}
}

// FuzzFetchRequest: any bytes a peer sends as a fetch request are decoded
// or refused with ErrMalformed, never a panic; what decodes re-encodes to
// the same bytes.
func FuzzFetchRequest(f *testing.F) {
	a := ucx.MakeWorkerAddress([]byte{0x01, 0x02, 0x03, 0x04})
	f.Add(ucx.MakeFetchRequest(0xC1DB<<48|7, 0x1000, 4096, ucx.Token{1, 2, 3}, a))
	f.Add(ucx.MakeFetchRequest(0xC1DB<<48|1<<47, 0, 1, ucx.Token{}, a))
	f.Add([]byte("ucFR"))
	f.Fuzz(func(t *testing.T, b []byte) {
		back, err := ucx.ParseFetchRequest(b)
		if err != nil {
			if !errors.Is(err, ucx.ErrMalformed) {
				t.Fatalf("error %v does not match ErrMalformed", err)
			}
			return
		}
		if !bytes.Equal(back, b) {
			t.Fatalf("decoded and re-encoded to %x, from %x", back, b)
		}
	})
}

// TestFetchNoRMA: contexts without the RMA feature fetch from each other;
// a GET from a reader with RMA at such a holder fails (bounded by its
// context) and leaves the holder serving.
func TestFetchNoRMA(t *testing.T) {
	const size = 8 << 20
	p := startServerWith(t, 1906, size, ucx.ContextOptions{NoRMA: true})
	base := p.key.Key().Addr
	dst := make([]byte, size)
	if err := ucx.Fetch(timeout(t, 20*time.Second), p.ep, p.key, base, dst, ucx.FetchOptions{Token: p.token}); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dst, p.data) {
		t.Fatal("bytes differ")
	}
	if err := ucx.Get(timeout(t, 5*time.Second), p.ep, p.key, base, dst[:4096]); !errors.Is(err, ucx.ErrNoRMA) {
		t.Fatalf("Get on a context without RMA: %v, want ErrNoRMA", err)
	}
	g := startServerWith(t, 1906, size, ucx.ContextOptions{NoRMA: true})
	c, err := ucx.NewContext(ucx.ContextOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	w, err := c.NewWorker(ucx.WorkerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var addr ucx.WorkerAddress
	if err := addr.UnmarshalBinary(b64(t, g.info.Addr)); err != nil {
		t.Fatal(err)
	}
	ep, err := w.Connect(addr)
	if err != nil {
		t.Fatal(err)
	}
	k, err := ep.Unpack(g.key.Key())
	if err != nil {
		t.Fatal(err)
	}
	gbase := g.key.Key().Addr
	err = ucx.Get(timeout(t, 3*time.Second), ep, k, gbase, dst[:4096])
	t.Logf("GET at a holder without RMA: %v", err)
	if err == nil {
		t.Fatal("a holder without RMA answered a GET")
	}
	if err := ucx.Fetch(timeout(t, 20*time.Second), g.ep, g.key, gbase, dst, ucx.FetchOptions{Token: g.token}); err != nil {
		t.Fatalf("fetch after a refused GET: %v", err)
	}
	if !bytes.Equal(dst, g.data) {
		t.Fatal("bytes differ after a refused GET")
	}
}

// TestConcurrentFetches: eight fetches at once on one endpoint (one polls
// the worker, the others wait on its rounds), one of them canceled early,
// and every other reads its bytes right.
func TestConcurrentFetches(t *testing.T) {
	const size = 32 << 20
	p := startServer(t, 1907, size)
	base := p.key.Key().Addr
	const n = 8
	part := size / n
	errs := make([]error, n)
	dsts := make([][]byte, n)
	done := make(chan struct{})
	for i := range n {
		dsts[i] = make([]byte, part)
		go func() {
			defer func() { done <- struct{}{} }()
			ctx := timeout(t, 30*time.Second)
			if i == 3 {
				c, cancel := context.WithCancel(ctx)
				time.AfterFunc(time.Millisecond, cancel)
				ctx = c
			}
			errs[i] = ucx.Fetch(ctx, p.ep, p.key, base+uint64(i*part), dsts[i], ucx.FetchOptions{Chunk: 256 << 10, Depth: 4, Token: p.token})
		}()
	}
	for range n {
		testutil.Next(t, done, 60*time.Second)
	}
	for i := range n {
		switch {
		case i == 3 && errs[i] != nil && !errors.Is(errs[i], context.Canceled):
			t.Errorf("the canceled fetch: %v", errs[i])
		case i != 3 && errs[i] != nil:
			t.Errorf("fetch %d: %v", i, errs[i])
		case i != 3 && !bytes.Equal(dsts[i], p.data[i*part:(i+1)*part]):
			t.Errorf("fetch %d: bytes differ", i)
		}
	}
}
