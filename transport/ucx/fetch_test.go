package ucx_test

import (
	"bytes"
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
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
	_, hw, r := serveInProcess(t, ucx.ContextOptions{Name: "test-holder"}, data)
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

	rc := newContext(t, ucx.ContextOptions{Name: "test-reader"})
	ep, k := connectReader(t, rc, hw, r.Key())
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
	c := newContext(t, ucx.ContextOptions{})
	w, err := c.NewWorker(ucx.WorkerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ep, k := g.info.dial(t, w)
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

// localPair is a holder and a reader in this process, on contexts of
// their own: the holder serves a region of random bytes through a window
// of token tok, and the reader has an endpoint ep to it with the region's
// key k.
type localPair struct {
	data   []byte
	hc, rc *ucx.Context
	hw, rw *ucx.Worker
	ep     *ucx.Endpoint
	k      *ucx.RemoteKey
	tok    ucx.Token
	base   uint64
}

func newLocalPair(t *testing.T, seed uint64, size int) *localPair {
	t.Helper()
	requireUCX(t)
	p := &localPair{data: testutil.RandomBytes(seed, size)}
	newWorker := func(name string) (*ucx.Context, *ucx.Worker) {
		c, err := ucx.NewContext(ucx.ContextOptions{Name: name})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if err := c.Close(); err != nil {
				t.Errorf("closing %s: %v", name, err)
			}
		})
		w, err := c.NewWorker(ucx.WorkerOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return c, w
	}
	p.hc, p.hw = newWorker("test-holder")
	r, err := p.hc.Register(p.data)
	if err != nil {
		t.Fatal(err)
	}
	win, err := r.Window(0, uint64(size))
	if err != nil {
		t.Fatal(err)
	}
	p.tok, p.base = win.Token(), r.Key().Addr
	serve(t, p.hw)
	p.rc, p.rw = newWorker("test-reader")
	if p.ep, err = p.rw.Connect(p.hw.Address()); err != nil {
		t.Fatal(err)
	}
	if p.k, err = p.ep.Unpack(r.Key()); err != nil {
		t.Fatal(err)
	}
	return p
}

// serve runs w.Serve until the test ends.
func serve(t *testing.T, w *ucx.Worker) {
	ctx, stop := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- w.Serve(ctx) }()
	t.Cleanup(func() {
		stop()
		if err := testutil.Next(t, served, 20*time.Second); err != nil {
			t.Errorf("serve: %v", err)
		}
	})
}

// connect connects the reader's worker to the holder again and unpacks
// the holder's key on the new endpoint.
func (p *localPair) connect(t *testing.T) (*ucx.Endpoint, *ucx.RemoteKey) {
	t.Helper()
	ep, err := p.rw.Connect(p.hw.Address())
	if err != nil {
		t.Fatal(err)
	}
	k, err := ep.Unpack(p.k.Key())
	if err != nil {
		t.Fatal(err)
	}
	return ep, k
}

// check fetches n bytes at off with chunk and compares them.
func (p *localPair) check(t *testing.T, off, n, chunk int) {
	t.Helper()
	dst := make([]byte, n)
	if err := ucx.Fetch(timeout(t, 20*time.Second), p.ep, p.k, p.base+uint64(off), dst, ucx.FetchOptions{Chunk: chunk, Token: p.tok}); err != nil {
		t.Fatalf("fetch [%d, +%d): %v", off, n, err)
	}
	if !bytes.Equal(dst, p.data[off:off+n]) {
		t.Fatalf("fetch [%d, +%d): bytes differ", off, n)
	}
}

// cancelAtHeldHolder runs fetches while the holder's worker is held (its
// requests wait unread), so that each ends by its context with every
// receive canceled before a reply, and returns how many requests they
// sent. The holder stays held: the caller releases it.
func (p *localPair) cancelAtHeldHolder(t *testing.T, fetches []canceledFetch) (requests int) {
	t.Helper()
	for _, f := range fetches {
		// Canceled once all of its requests are out (a deadline could
		// end it before it posts them all on a loaded machine).
		want := (f.n + f.chunk - 1) / f.chunk
		from := p.rw.FetchRequests()
		ctx, cancel := context.WithCancel(context.Background())
		posted := make(chan uint64, 1)
		go func() {
			defer cancel()
			deadline := time.Now().Add(5 * time.Second)
			for p.rw.FetchRequests()-from < uint64(want) && time.Now().Before(deadline) {
				time.Sleep(time.Millisecond)
			}
			posted <- p.rw.FetchRequests() - from
		}()
		dst := make([]byte, f.n)
		start := time.Now()
		err := ucx.Fetch(ctx, p.ep, p.k, p.base+uint64(f.off), dst, ucx.FetchOptions{Chunk: f.chunk, Depth: 64, Token: f.tok})
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("fetch [%d, +%d) at a held holder: %v, want it canceled", f.off, f.n, err)
		}
		if n := <-posted; n != uint64(want) {
			t.Fatalf("fetch [%d, +%d) at a held holder posted %d requests within 5 s, want %d", f.off, f.n, n, want)
		}
		if d := time.Since(start); d > 10*time.Second {
			t.Fatalf("a fetch at a held holder took %v to end", d)
		}
		requests += want
	}
	return requests
}

type canceledFetch struct {
	off, n, chunk int
	tok           ucx.Token
}

// TestFetchCanceledRepliesDrained: fetches canceled before the holder
// answered them (rendezvous replies of 4 MiB, eager ones of 1 KiB, 40 KiB
// ones and a refusal) are answered once the holder runs again; the
// reader's worker drains every reply, so that the holder's replies all
// complete without any endpoint closing, and later fetches on the same
// endpoint read right bytes. The reader's worker is progressed by
// Progress in the first round and by Serve, with fetches running, in the
// second.
func TestFetchCanceledRepliesDrained(t *testing.T) {
	const size = 48 << 20
	p := newLocalPair(t, 1908, size)
	p.check(t, 0, 64<<10, 16<<10) // connects both ways
	bad := p.tok
	bad[0] ^= 1
	fetches := []canceledFetch{
		{off: 0, n: 16 << 20, chunk: 4 << 20, tok: p.tok},
		{off: 16 << 20, n: 8 << 10, chunk: 1 << 10, tok: p.tok},
		{off: 17 << 20, n: 3 * 40 << 10, chunk: 40 << 10, tok: p.tok},
		{off: 18 << 20, n: 4 << 10, chunk: 4 << 10, tok: bad},
	}
	var wantDone uint64
	for round := range 2 {
		before := p.hc.FetchStats()
		release := p.hw.Hold()
		n := p.cancelAtHeldHolder(t, fetches)
		pending, done, dropped := p.rw.FetchDrains()
		if pending != n || done != wantDone || dropped != 0 {
			release()
			t.Fatalf("round %d: %d requests canceled unanswered; drains %d pending, %d done, %d dropped", round, n, pending, done, dropped)
		}
		release()
		wantDone += uint64(n)
		if round == 1 {
			serve(t, p.rw)
			for i := range 4 {
				p.check(t, 20<<20+i*(5<<20), 5<<20, 1<<20)
			}
		}
		testutil.Eventually(t, 20*time.Second, func() error {
			if round == 0 {
				if _, err := p.rw.Progress(); err != nil {
					return err
				}
			}
			s := p.hc.FetchStats()
			answered := s.Sent + s.Refused - before.Sent - before.Refused
			if round == 1 {
				answered -= 4 * 5 // the checks' chunks
			}
			pending, done, dropped := p.rw.FetchDrains()
			if h := p.hw.PendingFetchReplies(); answered != uint64(n) || h != 0 || pending != 0 || done != wantDone || dropped != 0 {
				return fmt.Errorf("holder answered %d of %d requests, %d replies pending; reader's drains: %d pending, %d done (want %d), %d dropped",
					answered, n, h, pending, done, wantDone, dropped)
			}
			return nil
		})
		if s := p.hc.FetchStats(); s.Refused-before.Refused != 1 {
			t.Errorf("round %d: the holder refused %d requests, want 1", round, s.Refused-before.Refused)
		}
		if err := p.ep.Err(); err != nil {
			t.Fatalf("round %d: the endpoint failed: %v", round, err)
		}
		p.check(t, 0, size, 0)
		p.check(t, 16<<20+1, 8<<10, 1<<10)
	}
}

// TestFetchDrainsBounded: a worker keeps at most 128 drains (beyond, the
// oldest are dropped), and closing the endpoint drops those still waiting
// for replies; the holder's replies complete and it serves another
// reader right.
func TestFetchDrainsBounded(t *testing.T) {
	const size = 1 << 20
	p := newLocalPair(t, 1909, size)
	p.check(t, 0, 64<<10, 16<<10)
	release := p.hw.Hold()
	held := true
	defer func() {
		if held {
			release()
		}
	}()
	n := p.cancelAtHeldHolder(t, []canceledFetch{
		{off: 0, n: 64 << 10, chunk: 1 << 10, tok: p.tok},
		{off: 64 << 10, n: 64 << 10, chunk: 1 << 10, tok: p.tok},
		{off: 128 << 10, n: 64 << 10, chunk: 1 << 10, tok: p.tok},
	})
	if pending, done, dropped := p.rw.FetchDrains(); n != 192 || pending != 128 || done != 0 || dropped != 64 {
		t.Fatalf("%d requests canceled unanswered; drains %d pending, %d done, %d dropped; want 192, 128, 0, 64", n, pending, done, dropped)
	}
	if err := p.ep.Close(); err != nil {
		t.Fatal(err)
	}
	if pending, done, dropped := p.rw.FetchDrains(); pending != 0 || done != 0 || dropped != 192 {
		t.Fatalf("after the endpoint closed, drains %d pending, %d done, %d dropped; want 0, 0, 192", pending, done, dropped)
	}
	release()
	held = false
	testutil.Eventually(t, 10*time.Second, func() error {
		if s := p.hc.FetchStats(); s.Sent < 192 {
			return fmt.Errorf("the holder answered %d requests", s.Sent)
		}
		if h := p.hw.PendingFetchReplies(); h != 0 {
			return fmt.Errorf("%d eager replies pending at the holder", h)
		}
		return nil
	})
	// From the same worker: the close could not flush while the holder was
	// held, so it closed the endpoint forcibly, and the holder replies on
	// its endpoint paired with the new one (TestFetchAfterForcedClose).
	p.ep, p.k = p.connect(t)
	p.check(t, 0, size, 64<<10)
}

// TestFetchAfterReconnect: a reader worker that closes its endpoint to a
// holder gracefully and connects again from the same worker fetches
// rendezvous-size replies (4 MiB chunks) of random bytes right; so does
// one that opens a second endpoint to the holder and then closes the
// first. Every reply the holder sent completes.
func TestFetchAfterReconnect(t *testing.T) {
	const size = 24 << 20
	p := newLocalPair(t, 1910, size)
	p.check(t, 0, size, 4<<20)
	for round := range 4 {
		var ep *ucx.Endpoint
		var k *ucx.RemoteKey
		if round%2 == 1 {
			ep, k = p.connect(t)
		}
		if err := p.ep.Close(); err != nil {
			t.Fatalf("round %d: close: %v", round, err)
		}
		if round%2 == 0 {
			ep, k = p.connect(t)
		}
		p.ep, p.k = ep, k
		p.check(t, round<<20, size-(round<<20), 4<<20)
	}
	testutil.Eventually(t, 10*time.Second, func() error {
		if n := p.hw.PendingFetchReplies(); n != 0 {
			return fmt.Errorf("%d replies pending at the holder", n)
		}
		return nil
	})
}

// TestFetchAfterForcedClose: a reader worker that closes its endpoint to
// a live holder forcibly (as a stopped Get, a failed flush or too many
// kept endpoints do) and connects again reads rendezvous-size replies
// right at once, and so does its other endpoint to the same holder, over
// three such rounds. Before the holder replied on the endpoint UCX paired
// with the one the request came on, every fetch after the first forced
// close failed UCS_ERR_CANCELED for as long as the holder lived (5 s and
// more here), and after the second, those of the new endpoint did.
func TestFetchAfterForcedClose(t *testing.T) {
	const size = 24 << 20
	p := newLocalPair(t, 1920, size)
	p.check(t, 0, size, 4<<20)
	other, otherKey := p.connect(t)
	fetchOn := func(ep *ucx.Endpoint, k *ucx.RemoteKey, off int) error {
		dst := make([]byte, 8<<20)
		if err := ucx.Fetch(timeout(t, 10*time.Second), ep, k, p.base+uint64(off), dst, ucx.FetchOptions{Chunk: 4 << 20, Token: p.tok}); err != nil {
			return err
		}
		if !bytes.Equal(dst, p.data[off:off+len(dst)]) {
			return errors.New("the bytes fetched differ from the holder's")
		}
		return nil
	}
	if err := fetchOn(other, otherKey, 4096); err != nil {
		t.Fatal(err)
	}
	for round := range 3 {
		if err := p.ep.ForceClose(); err != nil {
			t.Fatalf("round %d: forced close: %v", round, err)
		}
		p.ep, p.k = p.connect(t)
		if err := fetchOn(p.ep, p.k, round<<20); err != nil {
			t.Fatalf("round %d: the new endpoint: %v", round, err)
		}
		if err := fetchOn(other, otherKey, (round+1)<<20); err != nil {
			t.Fatalf("round %d: the other endpoint: %v", round, err)
		}
	}
	// One endpoint back for each of the reader's five, at most.
	if n := p.hw.FetchPeers(); n > 5 {
		t.Fatalf("the holder keeps %d endpoints back to one reader worker of 5", n)
	}
	testutil.Eventually(t, 10*time.Second, func() error {
		if n := p.hw.PendingFetchReplies(); n != 0 {
			return fmt.Errorf("%d replies pending at the holder", n)
		}
		return nil
	})
}

// TestFetchReplyTags: a reply tag carries the reader's connection
// sequence number, or none, and stays a fetch reply tag (what holders of
// before check) for every count and number.
func TestFetchReplyTags(t *testing.T) {
	for _, c := range []struct {
		seq uint64
		sn  int
	}{{1, 0}, {1, -1}, {1<<30 - 1, 65534}, {1 << 30, 7}, {^uint64(0), 12345}, {5, -1}} {
		tag := ucx.ReplyTag(c.seq, c.sn)
		if got := ucx.ReplySN(tag); got != c.sn {
			t.Errorf("seq %d sn %d: tag %#x carries sn %d", c.seq, c.sn, tag, got)
		}
		req := ucx.MakeFetchRequest(tag, 4096, 64, ucx.Token{}, ucx.MakeWorkerAddress(make([]byte, 64)))
		if _, err := ucx.ParseFetchRequest(req); err != nil && strings.Contains(err.Error(), "reply tag") {
			t.Errorf("seq %d sn %d: tag %#x refused: %v", c.seq, c.sn, tag, err)
		}
	}
	if a, b := ucx.ReplyTag(1, 3), ucx.ReplyTag(2, 3); a == b {
		t.Fatal("two requests of one endpoint share a reply tag")
	}
}

// TestFetchHostileSequenceNumber: a request that names no open window and
// claims a connection sequence number far ahead makes the holder create
// no endpoints to catch up (anyone who reaches the worker can send one):
// it is refused over one endpoint, and fetches go on right.
func TestFetchHostileSequenceNumber(t *testing.T) {
	const size = 4 << 20
	p := newLocalPair(t, 1930, size)
	p.check(t, 0, size, 1<<20)
	before, peers := p.hc.FetchStats(), p.hw.FetchPeers()
	for i := range 4 {
		msg := ucx.MakeFetchRequest(ucx.ReplyTag(uint64(1000+i), 60+i), p.base, 4096, ucx.Token{9, byte(i)}, p.rw.Address())
		if err := p.ep.SendFetchRequest(msg); err != nil {
			t.Fatal(err)
		}
	}
	testutil.Eventually(t, 10*time.Second, func() error {
		if s := p.hc.FetchStats(); s.Refused < before.Refused+4 {
			return fmt.Errorf("%d requests refused, want 4", s.Refused-before.Refused)
		}
		return nil
	})
	if n := p.hw.FetchPeers(); n > peers+1 {
		t.Fatalf("the holder keeps %d endpoints back to the reader after the hostile requests, %d before", n, peers)
	}
	p.check(t, 4096, size-4096, 1<<20)
}
