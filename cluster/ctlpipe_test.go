package cluster

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/internal/testutil"
)

// pipeSource serves staged KV reads ("kvread") and exposures ("kvopen")
// of a space of blocks of random bytes, one block a read: a read of a
// block in held waits until hold is closed, of a block in missing fails
// with ErrNoSpace. It counts the gathers under way (and their peak) and
// the exposures released.
type pipeSource struct {
	oneObject
	blocks   [][]byte
	held     map[int]bool
	missing  map[int]bool
	hold     chan struct{}
	holdAll  atomic.Bool
	active   atomic.Int64
	peak     atomic.Int64
	exposed  atomic.Int64
	released atomic.Int64
}

func newPipeSource(n, size int) *pipeSource {
	s := &pipeSource{held: map[int]bool{}, missing: map[int]bool{}, hold: make(chan struct{})}
	for i := range n {
		s.blocks = append(s.blocks, testutil.RandomBytes(uint64(i+1), size))
	}
	return s
}

func (s *pipeSource) wait(block int) error {
	n := s.active.Add(1)
	defer s.active.Add(-1)
	for {
		p := s.peak.Load()
		if n <= p || s.peak.CompareAndSwap(p, n) {
			break
		}
	}
	if s.held[block] || s.holdAll.Load() {
		<-s.hold
	}
	if s.missing[block] {
		return fmt.Errorf("%w: block %d", ErrNoSpace, block)
	}
	return nil
}

func (s *pipeSource) GatherSpace(reader uint32, desc []byte, regions []int, stage *SpaceStage, max int64, dst []byte) ([]byte, error) {
	b := stage.Blocks[0]
	if err := s.wait(b); err != nil {
		return nil, err
	}
	return append(dst, s.blocks[b]...), nil
}

func (s *pipeSource) ExposeSpace(reader uint32, desc []byte, regions []int, stage *SpaceStage) (SpaceExposure, func(), error) {
	if err := s.wait(stage.Blocks[0]); err != nil {
		return SpaceExposure{}, nil, err
	}
	s.exposed.Add(1)
	var once sync.Once
	return SpaceExposure{Worker: []byte("w"), Regions: []SpaceRegion{{RKey: []byte("k"), Addr: 0x1000, Size: 10}}},
		func() { once.Do(func() { s.released.Add(1) }) }, nil
}

// gather reads block b over cc and checks its bytes.
func (s *pipeSource) gather(ctx context.Context, cc *ControlClient, b int) error {
	got, err := cc.GatherSpace(ctx, 0, []byte("d"), []int{0}, &SpaceStage{Blocks: []int{b}, Count: 1}, int64(len(s.blocks[b])))
	if err != nil {
		return err
	}
	if !bytes.Equal(got, s.blocks[b]) {
		return fmt.Errorf("block %d: other bytes came back", b)
	}
	return nil
}

// Many reads in flight on one channel are answered as they are done,
// each with its own bytes: one the node holds back does not hold up the
// others, and one that fails fails alone.
func TestControlPipelined(t *testing.T) {
	const n = 600 // more than MaxInFlight: the rest wait for places
	src := newPipeSource(n, 4096)
	src.held[7] = true
	for b := 1; b < n; b += 10 {
		src.missing[b] = true
	}
	ctx, cc := dialServed(t, src)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for b := range n {
		if b == 7 {
			continue
		}
		wg.Go(func() { errs[b] = src.gather(ctx, cc, b) })
	}
	slow := make(chan error, 1)
	go func() { slow <- src.gather(ctx, cc, 7) }()
	wg.Wait() // all but block 7's, which the node still holds
	for b, err := range errs {
		switch {
		case b == 7:
		case src.missing[b]:
			if !errors.Is(err, ErrNoSpace) || errors.Is(err, errChannel) {
				t.Errorf("block %d: %v, want ErrNoSpace", b, err)
			}
		case err != nil:
			t.Errorf("block %d: %v", b, err)
		}
	}
	select {
	case err := <-slow:
		t.Fatalf("the held read ended before the node answered it: %v", err)
	default:
	}
	close(src.hold)
	if err := <-slow; err != nil {
		t.Fatal(err)
	}
	if p := src.peak.Load(); p > MaxInFlight {
		t.Errorf("%d reads served at once on one channel, at most %d", p, MaxInFlight)
	}
}

// Requests under way on one channel are bounded: the node serves at most
// MaxInFlight at once, the client sends no more, and those beyond wait
// for a place (their context bounds the wait, and ends them without
// breaking the channel).
func TestControlInFlightBound(t *testing.T) {
	src := newPipeSource(1, 64)
	src.holdAll.Store(true)
	ctx, cc := dialServed(t, src)
	var wg sync.WaitGroup
	errs := make(chan error, MaxInFlight)
	for range MaxInFlight {
		wg.Go(func() { errs <- src.gather(ctx, cc, 0) })
	}
	testutil.Eventually(t, 10*time.Second, func() error {
		if a := src.active.Load(); a != MaxInFlight {
			return fmt.Errorf("%d reads at the node", a)
		}
		return nil
	})
	// One more waits for a place, not at the node, and gives up with its
	// context: the channel is not to blame.
	wctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	start := time.Now()
	err := src.gather(wctx, cc, 0)
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) || errors.Is(err, errChannel) {
		t.Fatalf("a read beyond the bound: %v", err)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Fatalf("a read waiting for a place gave up after %v", took)
	}
	if a := src.active.Load(); a != MaxInFlight {
		t.Fatalf("%d reads at the node, want %d", a, MaxInFlight)
	}
	close(src.hold)
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if err := src.gather(ctx, cc, 0); err != nil {
		t.Fatalf("the channel after the burst: %v", err)
	}
}

// A request canceled while the node serves it ends at once; the channel
// goes on serving the others, and an exposure the node makes after the
// caller gave up is released, not left held with the channel.
func TestControlCanceledInFlight(t *testing.T) {
	src := newPipeSource(4, 64)
	src.held[1] = true
	ctx, cc := dialServed(t, src)
	cctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		_, _, err := cc.OpenSpace(cctx, 0, []byte("d"), []int{0}, &SpaceStage{Blocks: []int{1}, Count: 1})
		done <- err
	}()
	testutil.Eventually(t, 10*time.Second, func() error {
		if src.active.Load() != 1 {
			return errors.New("the open is not at the node yet")
		}
		return nil
	})
	cancel()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) || errors.Is(err, errChannel) {
			t.Fatalf("canceled open: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a canceled open did not end")
	}
	if err := src.gather(ctx, cc, 2); err != nil {
		t.Fatalf("a read after the cancel: %v", err)
	}
	close(src.hold) // the node makes the exposure nobody waits for
	testutil.Eventually(t, 10*time.Second, func() error {
		if e, r := src.exposed.Load(), src.released.Load(); e != 1 || r != 1 {
			return fmt.Errorf("%d exposed, %d released", e, r)
		}
		return nil
	})
	if err := src.gather(ctx, cc, 3); err != nil {
		t.Fatalf("a read after the late answer: %v", err)
	}
}

// A request whose deadline passes before the node answers ends within
// about its deadline, marked as a channel without answer (the caller
// drops it); the node's later answer is let go.
func TestControlDeadlineInFlight(t *testing.T) {
	src := newPipeSource(2, 64)
	src.held[0] = true
	ctx, cc := dialServed(t, src)
	dctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	err := src.gather(dctx, cc, 0)
	if !errors.Is(err, errChannel) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a read past its deadline: %v", err)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Fatalf("a read with a deadline of 300ms ended after %v", took)
	}
	close(src.hold)
	if err := src.gather(ctx, cc, 1); err != nil {
		t.Fatalf("a read after the late answer: %v", err)
	}
}

// The channel breaking fails every request under way at once, and the
// next at once too.
func TestControlBrokenInFlight(t *testing.T) {
	src := newPipeSource(1, 64)
	src.holdAll.Store(true)
	defer close(src.hold)
	ctx, cc := dialServed(t, src)
	const n = 20
	errs := make(chan error, n)
	for range n {
		go func() { errs <- src.gather(ctx, cc, 0) }()
	}
	testutil.Eventually(t, 10*time.Second, func() error {
		if a := src.active.Load(); a != n {
			return fmt.Errorf("%d reads at the node", a)
		}
		return nil
	})
	cc.ch.c.Close()
	for range n {
		select {
		case err := <-errs:
			if !errors.Is(err, errChannel) {
				t.Fatalf("a read on a closed channel: %v", err)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("reads under way did not fail with the channel")
		}
	}
	if err := src.gather(ctx, cc, 0); !errors.Is(err, errChannel) {
		t.Fatalf("a read after the channel broke: %v", err)
	}
}

// A peer of the first protocol version (no tags, one request at a time)
// is served as before: answers without tags, in order.
func TestControlSerialPeer(t *testing.T) {
	ref := Ref{Owner: 1, Name: "x"}
	id := NewID()
	addr := serveControl(t, testSecret, oneObject{ref, id})
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	ch, err := clientHandshakeProto(c, testSecret, "cli", "srv", controlProtoSerial)
	if err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if err := ch.send(&ctlRequest{Op: "open", Ref: ref, ID: id}, nil, time.Time{}); err != nil {
			t.Fatal(err)
		}
		p, err := ch.readRaw()
		if err != nil {
			t.Fatal(err)
		}
		var m map[string]json.RawMessage
		if err := json.Unmarshal(p, &m); err != nil {
			t.Fatal(err)
		}
		if _, ok := m["tag"]; ok {
			t.Fatalf("an answer to a serial peer carries a tag: %s", p)
		}
		var resp ctlResponse
		if err := decodeStrict(p, &resp); err != nil || resp.Err != "" || resp.Handle == 0 {
			t.Fatalf("open: %+v %v", resp, err)
		}
	}
}

// BenchmarkControlGather is one small staged read ("kvread") of 4 KiB
// over a control channel, the node's gather left out: one at a time, then
// from 500 goroutines a CPU at once.
//
//	go test -run '^$' -bench ControlGather ./cluster/
func BenchmarkControlGather(b *testing.B) {
	src := newPipeSource(64, 4096)
	addr := func() string {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			b.Fatal(err)
		}
		cs := &ControlServer{Node: "srv", Secret: testSecret, Source: src}
		go cs.Serve(ln)
		b.Cleanup(func() { ln.Close() })
		return ln.Addr().String()
	}()
	ctx := context.Background()
	cc, err := DialControl(ctx, testSecret, "cli", "srv", addr)
	if err != nil {
		b.Fatal(err)
	}
	defer cc.Close()
	b.Run("serial", func(b *testing.B) {
		for i := range b.N {
			if err := src.gather(ctx, cc, i%64); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("concurrent", func(b *testing.B) {
		var next atomic.Int64
		b.SetParallelism(500)
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				if err := src.gather(ctx, cc, int(next.Add(1))%64); err != nil {
					b.Error(err)
					return
				}
			}
		})
	})
}

// oneNodeDir is a directory of one node, srv at addr, for a Puller's
// small reads.
type oneNodeDir struct{ addr string }

func (d oneNodeDir) NodeName() string { return "cli" }
func (d oneNodeDir) Node(ctx context.Context, name string) (Node, error) {
	if name != "srv" {
		return Node{}, fmt.Errorf("%w: node %s", ErrNotFound, name)
	}
	return Node{Name: "srv", Control: d.addr}, nil
}
func (d oneNodeDir) Lookup(context.Context, Ref) (Entry, error) { return Entry{}, ErrNotFound }
func (d oneNodeDir) AddHolder(context.Context, Entry) error     { return ErrNotFound }
func (d oneNodeDir) Pin(context.Context, string, Ref, string) (func(), error) {
	return nil, ErrNotFound
}

// pullerTo is a Puller whose directory holds the node srv at addr.
func pullerTo(t *testing.T, addr string) *Puller {
	p := &Puller{Dir: oneNodeDir{addr}, Secret: testSecret}
	t.Cleanup(func() { p.Close() })
	return p
}

// gatherRead is a small read of block b of src through p.
func (s *pipeSource) gatherRead(ctx context.Context, p *Puller, b int) error {
	got, err := p.GatherSpace(ctx, SpaceRead{Node: "srv", Desc: []byte("d"), Regions: []int{0}, Sizes: []int64{int64(len(s.blocks[b]))},
		Stage: &SpaceStage{Blocks: []int{b}, Count: 1}})
	if err != nil {
		return err
	}
	if !bytes.Equal(got, s.blocks[b]) {
		return fmt.Errorf("block %d: other bytes came back", b)
	}
	return nil
}

// Small reads to one node beyond the lanes under way wait and go together
// ("kvreads") once a lane frees: each gets its own bytes, one the node
// does not have fails alone, and one whose context ends leaves the others
// be.
func TestGatherBatched(t *testing.T) {
	const n = 300
	src := newPipeSource(n, 4096)
	src.holdAll.Store(true)
	for b := 5; b < n; b += 17 {
		src.missing[b] = true
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	cs := &ControlServer{Node: "srv", Secret: testSecret, Source: src}
	go cs.Serve(ln)
	t.Cleanup(func() { ln.Close() })
	p := pullerTo(t, ln.Addr().String())
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	errs := make([]error, n)
	var wg sync.WaitGroup
	for b := range gatherLanes {
		wg.Go(func() { errs[b] = src.gatherRead(ctx, p, b) })
	}
	testutil.Eventually(t, 10*time.Second, func() error {
		if a := src.active.Load(); a != gatherLanes {
			return fmt.Errorf("%d reads at the node", a)
		}
		return nil
	})
	for b := gatherLanes; b < n; b++ {
		wg.Go(func() { errs[b] = src.gatherRead(ctx, p, b) })
	}
	// One more, given up while it waits.
	wctx, wcancel := context.WithTimeout(ctx, 100*time.Millisecond)
	if err := src.gatherRead(wctx, p, 1); !errors.Is(err, ErrSpaceUnreachable) || wctx.Err() == nil {
		t.Fatalf("a read given up while waiting: %v", err)
	}
	wcancel()
	testutil.Eventually(t, 10*time.Second, func() error {
		p.gathers.mu.Lock()
		defer p.gathers.mu.Unlock()
		if q := p.gathers.q["srv"]; q == nil || len(q.waiting) != n-gatherLanes {
			return errors.New("the reads beyond the lanes are not all waiting")
		}
		return nil
	})
	if a := src.active.Load(); a != gatherLanes {
		t.Fatalf("%d reads at the node while %d lanes are busy", a, gatherLanes)
	}
	close(src.hold)
	wg.Wait()
	for b, err := range errs {
		switch {
		case src.missing[b]:
			if !errors.Is(err, ErrNoSpace) {
				t.Errorf("block %d: %v, want ErrNoSpace", b, err)
			}
		case err != nil:
			t.Errorf("block %d: %v", b, err)
		}
	}
	p.gathers.mu.Lock()
	left := len(p.gathers.q)
	p.gathers.mu.Unlock()
	if left != 0 {
		t.Fatalf("%d queues left after the reads", left)
	}
	// 296 reads of 4 KiB waited: at most 64 a batch (256 KiB).
	if b := cs.Stats().KVBatches; b < (n-gatherLanes)/64 || b > n-gatherLanes {
		t.Fatalf("%d batches for %d reads that waited", b, n-gatherLanes)
	}
}

// A node that answers no "kvreads" (an older daemon) gets the reads that
// waited one a request.
func TestGatherBatchRefused(t *testing.T) {
	src := newPipeSource(40, 512)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	var served, refused atomic.Int64
	release := make(chan struct{})
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				ch, err := serverHandshake(c, testSecret, "srv")
				if err != nil {
					return
				}
				for {
					var req ctlRequest
					if ch.read(&req) != nil {
						return
					}
					go func() {
						if req.Op == "kvreads" {
							refused.Add(1)
							ch.send(&ctlResponse{Tag: req.Tag, Err: fmt.Sprintf("%s %q", unknownOp, req.Op)}, nil, time.Time{})
							return
						}
						if served.Add(1) <= gatherLanes {
							<-release
						}
						b := src.blocks[req.Stage.Blocks[0]]
						ch.send(&ctlResponse{Tag: req.Tag, Inline: int64(len(b))}, b, time.Time{})
					}()
				}
			}()
		}
	}()
	p := pullerTo(t, ln.Addr().String())
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	errs := make(chan error, len(src.blocks))
	for b := range src.blocks {
		go func() { errs <- src.gatherRead(ctx, p, b) }()
	}
	testutil.Eventually(t, 10*time.Second, func() error {
		p.gathers.mu.Lock()
		defer p.gathers.mu.Unlock()
		if q := p.gathers.q["srv"]; q == nil || len(q.waiting) != len(src.blocks)-gatherLanes {
			return errors.New("the reads beyond the lanes are not all waiting")
		}
		return nil
	})
	close(release)
	for range src.blocks {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	if refused.Load() == 0 || served.Load() != int64(len(src.blocks)) {
		t.Fatalf("%d kvreads refused, %d kvread served of %d", refused.Load(), served.Load(), len(src.blocks))
	}
}
