package ucx_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/internal/testutil"
	"github.com/cudaipc/cudaipc/transport/ucx"
)

// streamRun is what one GetStream did: which reads it was handed, which
// were done and how, and whether next's wait matched the reads in flight.
type streamRun struct {
	mu       sync.Mutex
	reads    []ucx.Read
	given    int
	inflight int
	done     map[int]error // by Tag
	twice    []int
	badWait  []string
	asked    int
}

// run streams reads (each Tag its index) on p's endpoint with o; none
// says which calls of next (by count) answer "none now".
func (s *streamRun) run(ctx context.Context, p *peer, o ucx.StreamOptions, none func(call int) bool) error {
	s.done = map[int]error{}
	return ucx.GetStream(ctx, p.ep, p.key, o, func(wait bool) (ucx.Read, bool) {
		s.mu.Lock()
		defer s.mu.Unlock()
		s.asked++
		if wait != (s.inflight == 0) {
			s.badWait = append(s.badWait, "wait with reads in flight, or none without")
		}
		if s.inflight >= max(o.Depth, 1) {
			s.badWait = append(s.badWait, "asked beyond the depth")
		}
		if s.given == len(s.reads) || (!wait && none != nil && none(s.asked)) {
			return ucx.Read{}, false
		}
		r := s.reads[s.given]
		s.given++
		s.inflight++
		return r, true
	}, func(r ucx.Read, err error) {
		s.mu.Lock()
		defer s.mu.Unlock()
		if _, ok := s.done[r.Tag]; ok {
			s.twice = append(s.twice, r.Tag)
		}
		s.done[r.Tag] = err
		s.inflight--
	})
}

// check fails t unless every read handed out was done exactly once and
// next's wait was right.
func (s *streamRun) check(t *testing.T) {
	t.Helper()
	if len(s.twice) > 0 || len(s.badWait) > 0 {
		t.Fatalf("done twice for reads %v; next: %v", s.twice, s.badWait)
	}
	if len(s.done) != s.given || s.inflight != 0 {
		t.Fatalf("%d reads handed out, %d done, %d in flight", s.given, len(s.done), s.inflight)
	}
}

// TestGetStream reads 400 ranges of random sizes at random offsets of a
// 32 MiB region, 6 in flight, next answering "none now" now and then:
// every read is done once with its bytes, and next is asked with wait
// exactly when no read is in flight.
func TestGetStream(t *testing.T) {
	const size = 32 << 20
	p := startServer(t, 1830, size)
	base := p.key.Key().Addr
	rng := rand.New(rand.NewPCG(1830, 2))
	s := &streamRun{}
	for i := range 400 {
		n := 1 + rng.IntN(1<<20)
		if i%50 == 0 {
			n = 0
		}
		off := rng.IntN(size - n + 1)
		s.reads = append(s.reads, ucx.Read{Addr: base + uint64(off), Dst: make([]byte, n), Tag: i})
	}
	err := s.run(timeout(t, time.Minute), p, ucx.StreamOptions{Depth: 6, Timeout: 30 * time.Second}, func(call int) bool { return call%3 == 0 })
	if err != nil {
		t.Fatal(err)
	}
	s.check(t)
	for i, r := range s.reads {
		if err := s.done[i]; err != nil {
			t.Fatalf("read %d: %v", i, err)
		}
		off := r.Addr - base
		if string(r.Dst) != string(p.data[off:off+uint64(len(r.Dst))]) {
			t.Fatalf("read %d of %d bytes at %d: bytes differ", i, len(r.Dst), off)
		}
	}
}

// TestGetStreamBadRead: a read outside the region fails alone, stops the
// stream (nothing more is asked of next), and the reads in flight beside
// it complete with their bytes.
func TestGetStreamBadRead(t *testing.T) {
	const size = 8 << 20
	p := startServer(t, 1831, size)
	base := p.key.Key().Addr
	s := &streamRun{}
	for i := range 40 {
		s.reads = append(s.reads, ucx.Read{Addr: base + uint64(i)*(size/40), Dst: make([]byte, size/40), Tag: i})
	}
	s.reads[10].Addr = base + size - 8 // runs past the end
	err := s.run(timeout(t, time.Minute), p, ucx.StreamOptions{Depth: 4}, nil)
	if !errors.Is(err, ucx.ErrOutOfBounds) {
		t.Fatalf("stream with a read outside the region: %v, want ErrOutOfBounds", err)
	}
	s.check(t)
	if !errors.Is(s.done[10], ucx.ErrOutOfBounds) {
		t.Fatalf("the bad read: %v", s.done[10])
	}
	if s.given > 10+4 {
		t.Fatalf("%d reads handed out: the stream went on after the bad one", s.given)
	}
	for i := range s.given {
		if i == 10 || s.done[i] != nil {
			continue
		}
		r := s.reads[i]
		off := r.Addr - base
		if string(r.Dst) != string(p.data[off:off+uint64(len(r.Dst))]) {
			t.Fatalf("read %d: bytes differ", i)
		}
	}
}

// TestGetStreamStalledPeer: a peer that stops (SIGSTOP) makes the reads in
// flight pass StreamOptions.Timeout: the stream ends soon after with an
// error matching ErrReadTimeout and context.DeadlineExceeded, every read
// done with an error, and nothing writes into their memory afterwards.
func TestGetStreamStalledPeer(t *testing.T) {
	const size = 16 << 20
	p := startServer(t, 1832, size)
	base := p.key.Key().Addr
	if err := ucx.Get(timeout(t, 10*time.Second), p.ep, p.key, base, make([]byte, 8)); err != nil {
		t.Fatal(err)
	}
	testutil.Stop(t, p.info.Pid)
	s := &streamRun{}
	for i := range 16 {
		s.reads = append(s.reads, ucx.Read{Addr: base + uint64(i)<<20, Dst: make([]byte, 1<<20), Tag: i})
	}
	start := time.Now()
	err := s.run(timeout(t, time.Minute), p, ucx.StreamOptions{Depth: 4, Timeout: 300 * time.Millisecond}, nil)
	if !errors.Is(err, ucx.ErrReadTimeout) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("stream from a stopped peer: %v, want ErrReadTimeout", err)
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Fatalf("stream returned after %v", d)
	}
	s.check(t)
	if s.given != 4 {
		t.Fatalf("%d reads handed out to a stopped peer, want the depth (4)", s.given)
	}
	for i := range s.given {
		if !errors.Is(s.done[i], ucx.ErrReadTimeout) {
			t.Fatalf("read %d: %v, want ErrReadTimeout", i, s.done[i])
		}
		for j := range s.reads[i].Dst {
			s.reads[i].Dst[j] = 0xa5
		}
	}
	if err := syscall.Kill(p.info.Pid, syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(300 * time.Millisecond); time.Now().Before(deadline); {
		if _, err := p.w.Progress(); err != nil {
			t.Fatal(err)
		}
	}
	for i := range s.given {
		for j, c := range s.reads[i].Dst {
			if c != 0xa5 {
				t.Fatalf("byte %d of read %d changed after the stream returned", j, i)
			}
		}
	}
}

// TestGetStreamCanceled: the end of the context stops a stream from a live
// peer mid-way: it returns the context's error, every read handed out is
// done once, those done without error hold their bytes.
func TestGetStreamCanceled(t *testing.T) {
	const size = 64 << 20
	p := startServer(t, 1833, size)
	base := p.key.Key().Addr
	s := &streamRun{}
	for i := range 256 {
		s.reads = append(s.reads, ucx.Read{Addr: base + uint64(i)*(256<<10), Dst: make([]byte, 256<<10), Tag: i})
	}
	ctx, cancel := context.WithCancel(context.Background())
	go func() { time.Sleep(5 * time.Millisecond); cancel() }()
	err := s.run(ctx, p, ucx.StreamOptions{Depth: 8}, nil)
	if err == nil {
		t.Skip("the whole stream finished before the cancellation")
	}
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("canceled stream: %v", err)
	}
	s.check(t)
	for i := range s.given {
		r := s.reads[i]
		off := r.Addr - base
		switch err := s.done[i]; {
		case err == nil && string(r.Dst) != string(p.data[off:off+uint64(len(r.Dst))]):
			t.Fatalf("read %d: done without error, bytes differ", i)
		case err != nil && !errors.Is(err, context.Canceled):
			t.Fatalf("read %d: %v", i, err)
		}
	}
}

// TestGetStreamPeerKilled: a peer killed (SIGKILL) mid-stream ends the
// stream in bounded time with an error IsPeerFailure recognizes, every
// read done once.
func TestGetStreamPeerKilled(t *testing.T) {
	const size = 64 << 20
	p := startServer(t, 1834, size)
	base := p.key.Key().Addr
	if err := ucx.Get(timeout(t, 10*time.Second), p.ep, p.key, base, make([]byte, 8)); err != nil {
		t.Fatal(err)
	}
	s := &streamRun{}
	for i := range 4096 {
		off := uint64(i%256) * (256 << 10)
		s.reads = append(s.reads, ucx.Read{Addr: base + off, Dst: make([]byte, 256<<10), Tag: i})
	}
	go func() {
		time.Sleep(5 * time.Millisecond)
		syscall.Kill(p.info.Pid, syscall.SIGKILL)
	}()
	err := s.run(timeout(t, time.Minute), p, ucx.StreamOptions{Depth: 8, Timeout: 30 * time.Second}, nil)
	if err == nil {
		t.Skip("1 GiB was read before the kill landed")
	}
	if !ucx.IsPeerFailure(err) {
		t.Fatalf("stream from a killed peer: %v, which IsPeerFailure does not recognize", err)
	}
	s.check(t)
}
