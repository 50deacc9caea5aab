package ucx_test

import (
	"bytes"
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/internal/testutil"
	"github.com/cudaipc/cudaipc/transport/ucx"
)

// serveInProcess is a holder in this process: a context of o, a worker
// served until the test ends (then the context closes) and mem registered.
func serveInProcess(t *testing.T, o ucx.ContextOptions, mem []byte) (*ucx.Context, *ucx.Worker, *ucx.MemRegion) {
	t.Helper()
	c := newContext(t, o)
	w, err := c.NewWorker(ucx.WorkerOptions{})
	if err != nil {
		t.Fatal(err)
	}
	r, err := c.Register(mem)
	if err != nil {
		t.Fatal(err)
	}
	ctx, stop := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- w.Serve(ctx) }()
	t.Cleanup(func() {
		stop()
		if err := testutil.Next(t, served, 20*time.Second); err != nil {
			t.Errorf("serve: %v", err)
		}
	})
	return c, w, r
}

// fillingHolder is an in-process holder: a served worker and a region of
// size bytes, zeros until the test fills it, and a reader's endpoint and
// key for it.
type fillingHolder struct {
	mem []byte
	r   *ucx.MemRegion
	ep  *ucx.Endpoint
	key *ucx.RemoteKey
	c   *ucx.Context
}

func startFillingHolder(t *testing.T, size int) *fillingHolder {
	t.Helper()
	requireUCX(t)
	mem := make([]byte, size)
	hc, hw, r := serveInProcess(t, ucx.ContextOptions{Name: "test-filling-holder", NoRMA: true}, mem)
	rc := newContext(t, ucx.ContextOptions{Name: "test-filling-reader", NoRMA: true})
	ep, key := connectReader(t, rc, hw, r.Key())
	return &fillingHolder{mem: mem, r: r, ep: ep, key: key, c: hc}
}

// connectReader makes a worker of rc, connects it to the holder's worker
// and unpacks the holder's region key on the new endpoint.
func connectReader(tb testing.TB, rc *ucx.Context, holder *ucx.Worker, key ucx.RegionKey) (*ucx.Endpoint, *ucx.RemoteKey) {
	tb.Helper()
	rw, err := rc.NewWorker(ucx.WorkerOptions{})
	if err != nil {
		tb.Fatal(err)
	}
	ep, err := rw.Connect(holder.Address())
	if err != nil {
		tb.Fatal(err)
	}
	k, err := ep.Unpack(key)
	if err != nil {
		tb.Fatal(err)
	}
	return ep, k
}

// TestFillingWindow: fetches of a FillingWindow's bytes wait until Ready
// covers them and then read the bytes written before it, while the holder
// fills the region slice by slice behind the readers (whole-window
// fetches, and random ranges from several goroutines); bytes already ready
// are answered at once; a window closed while fetches wait refuses them;
// Ready beyond the window or backwards changes nothing.
func TestFillingWindow(t *testing.T) {
	const size, slice = 24 << 20, 1 << 20
	h := startFillingHolder(t, size)
	data := testutil.RandomBytes(1907, size)
	win, err := h.r.FillingWindow(0, size)
	if err != nil {
		t.Fatal(err)
	}
	base := h.r.Key().Addr
	opt := ucx.FetchOptions{Chunk: 512 << 10, Depth: 8, Token: win.Token()}

	// Readers start before any byte is ready.
	type result struct {
		off, n int
		got    []byte
		err    error
		at     time.Time
	}
	results := make(chan result, 16)
	var wg sync.WaitGroup
	ranges := [][2]int{{0, size}, {size - 4096, 4096}, {5<<20 + 3, 7<<20 + 11}, {0, 1}}
	for _, rg := range ranges {
		wg.Go(func() {
			dst := make([]byte, rg[1])
			err := ucx.Fetch(timeout(t, 30*time.Second), h.ep, h.key, base+uint64(rg[0]), dst, opt)
			results <- result{rg[0], rg[1], dst, err, time.Now()}
		})
	}
	time.Sleep(50 * time.Millisecond)
	select {
	case r := <-results:
		t.Fatalf("a fetch of [%d, +%d) returned before any byte was ready: %v", r.off, r.n, r.err)
	default:
	}
	filled := make([]time.Time, 0, size/slice)
	for off := 0; off < size; off += slice {
		copy(h.mem[off:off+slice], data[off:off+slice])
		filled = append(filled, time.Now()) // before Ready: no fetch of the slice can end before it
		win.Ready(uint64(off + slice))
		time.Sleep(2 * time.Millisecond)
	}
	wg.Wait()
	close(results)
	for r := range results {
		if r.err != nil {
			t.Fatalf("fetch of [%d, +%d): %v", r.off, r.n, r.err)
		}
		if !bytes.Equal(r.got, data[r.off:r.off+r.n]) {
			t.Fatalf("fetch of [%d, +%d): bytes differ from those filled", r.off, r.n)
		}
		if last := (r.off + r.n - 1) / slice; r.at.Before(filled[last]) {
			t.Fatalf("fetch of [%d, +%d) returned before its last slice was ready", r.off, r.n)
		}
	}

	// Ready bytes are answered at once; Ready never goes back or past.
	win.Ready(1)
	win.Ready(size + 1)
	dst := make([]byte, 4096)
	if err := ucx.Fetch(timeout(t, 5*time.Second), h.ep, h.key, base+size-4096, dst, opt); err != nil || !bytes.Equal(dst, data[size-4096:]) {
		t.Fatalf("a fetch of ready bytes: %v", err)
	}

	// A second window, closed while a fetch waits: the fetch is refused.
	win2, err := h.r.FillingWindow(8<<20, 8<<20)
	if err != nil {
		t.Fatal(err)
	}
	win2.Ready(1 << 20)
	errc := make(chan error, 1)
	go func() {
		errc <- ucx.Fetch(timeout(t, 30*time.Second), h.ep, h.key, base+8<<20, make([]byte, 4<<20),
			ucx.FetchOptions{Token: win2.Token()})
	}()
	time.Sleep(50 * time.Millisecond)
	win2.Close()
	if err := testutil.Next(t, errc, 20*time.Second); !errors.Is(err, ucx.ErrRefused) {
		t.Fatalf("a fetch waiting when its window closed: %v, want ErrRefused", err)
	}
	if s := h.c.FetchStats(); s.Refused == 0 || s.Sent == 0 || s.Deferred == 0 {
		t.Fatalf("holder's answers: %+v", s)
	}
}

// BenchmarkWindowReady times Window.Ready, what a holder staging an
// object calls after every slice, in two ways in one run: idle, with its
// context's workers served and nothing to do (they sleep), and busy, with
// every worker answering a stream of fetches from a reader of its own (its
// Serve spins, taking the worker's lock again at once). Ready took a lock
// of each worker, so the busy case once cost about a millisecond a worker
// (issue 19); compare busy's ns/op with idle's.
func BenchmarkWindowReady(b *testing.B) {
	requireUCX(b)
	const workers, size = 4, 8 << 20
	mem := testutil.RandomBytes(4271, 2*size)
	c := newContext(b, ucx.ContextOptions{Name: "bench-ready-holder", NoRMA: true})
	r, err := c.Register(mem)
	if err != nil {
		b.Fatal(err)
	}
	rc := newContext(b, ucx.ContextOptions{Name: "bench-ready-reader", NoRMA: true})
	ctx, stop := context.WithTimeout(context.Background(), 10*time.Minute)
	defer stop()
	var served sync.WaitGroup
	defer served.Wait()
	defer stop()
	type reader struct {
		ep  *ucx.Endpoint
		key *ucx.RemoteKey
	}
	var readers []reader
	for range workers {
		hw, err := c.NewWorker(ucx.WorkerOptions{})
		if err != nil {
			b.Fatal(err)
		}
		served.Go(func() { _ = hw.Serve(ctx) })
		ep, key := connectReader(b, rc, hw, r.Key())
		readers = append(readers, reader{ep, key})
	}
	ready, err := r.Window(0, size) // what the readers stream
	if err != nil {
		b.Fatal(err)
	}
	run := func(b *testing.B) {
		filling, err := r.FillingWindow(size, size)
		if err != nil {
			b.Fatal(err)
		}
		defer filling.Close()
		k := uint64(0)
		for b.Loop() {
			k = k%size + 1 // Ready never goes back: a fresh window when it is full
			if k == size {
				filling.Close()
				if filling, err = r.FillingWindow(size, size); err != nil {
					b.Fatal(err)
				}
				k = 1
			}
			filling.Ready(k)
		}
	}
	b.Run("idle", run)
	// Each reader fetches the ready window over and over until the busy
	// case ends (or 10 minutes pass, or a fetch fails).
	busy, done := context.WithCancel(ctx)
	var streams sync.WaitGroup
	var fetched sync.Map
	for i, rd := range readers {
		streams.Go(func() {
			dst := make([]byte, size)
			for n := 0; busy.Err() == nil; n++ {
				if err := ucx.Fetch(busy, rd.ep, rd.key, r.Key().Addr, dst, ucx.FetchOptions{Token: ready.Token(), Chunk: 1 << 20, Depth: 4}); err != nil {
					if busy.Err() == nil {
						fetched.Store(i, err)
					}
					return
				}
				fetched.Store(i, n+1)
			}
		})
	}
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(time.Millisecond) {
		n := 0
		fetched.Range(func(_, v any) bool {
			if _, ok := v.(int); ok {
				n++
			}
			return true
		})
		if n == workers || time.Now().After(deadline) {
			break
		}
	}
	b.Run("busy", run)
	done()
	streams.Wait()
	fetched.Range(func(i, v any) bool {
		if err, ok := v.(error); ok {
			b.Errorf("reader %v: %v", i, err)
		}
		return true
	})
}
