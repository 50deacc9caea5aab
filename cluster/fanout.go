package cluster

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// Fan-out: a version wanted by N nodes must not cost N transfers from its
// publisher. A node pulling an object serves the chunks it already has to
// other pulling nodes (it is a feeder), and the feeders form a chain in the
// order they started: each reader pulls from the feeder that started just
// before it, and the first from the holders. Every link then carries the
// object once, so N readers behind links of rate R are all done in about
// size/R plus one chunk per hop, where N pulls from the publisher take
// N·size/R.
//
// Who feeds is in the directory (Feeds: a key per feeder on its lease, in
// start order); which chunks a feeder has crosses the authenticated control
// channel (the "feed" and "have" requests), as chunks complete, so that the
// directory sees one write per pull and none per chunk. Chunks read from a
// feeder are checked against the object's checksums like any other, so a
// feeder that fails or aborts costs a failover, never wrong bytes.

// Feeds is what fan-out needs of the directory (cluster/etcddir.Directory
// implements it).
type Feeds interface {
	// AddFeeder advertises, on this node's lease, that this node is pulling
	// e's incarnation and serves the chunks it has.
	AddFeeder(ctx context.Context, e Entry) error
	// RemoveFeeder withdraws it.
	RemoveFeeder(ctx context.Context, ref Ref) error
	// Feeders lists the live feeders of ref's incarnation id in the order
	// they were added (this node included, when it is one).
	Feeders(ctx context.Context, ref Ref, id string) ([]string, error)
}

// Feeding is a node's replicas being pulled that peers may read from: the
// Puller adds them, the ControlServer serves them. Its methods are safe for
// concurrent use.
type Feeding struct {
	mu    sync.Mutex
	feeds map[Ref]*feed
}

// feed is one replica being pulled, and which of its chunks are in.
type feed struct {
	f   *Feeding
	ref Ref
	id  string
	// expose is the replica's ReplicaTraits.Expose.
	expose func() (Exposure, func(), error)

	// under f.mu
	have    []byte // bit i: chunk i is in and checked
	count   int
	n       int
	gone    bool
	changed chan struct{} // closed and replaced on every change
}

// start adds a replica, exposed by expose, as a feed of ref's incarnation
// id of n chunks.
func (fd *Feeding) start(ref Ref, id string, expose func() (Exposure, func(), error), n int) *feed {
	f := &feed{f: fd, ref: ref, id: id, expose: expose, have: make([]byte, (n+7)/8), n: n, changed: make(chan struct{})}
	fd.mu.Lock()
	if fd.feeds == nil {
		fd.feeds = map[Ref]*feed{}
	}
	if old := fd.feeds[ref]; old != nil {
		old.endLocked()
	}
	fd.feeds[ref] = f
	fd.mu.Unlock()
	return f
}

// mark records chunk i as in and checked.
func (f *feed) mark(i int) {
	if f == nil {
		return
	}
	f.f.mu.Lock()
	defer f.f.mu.Unlock()
	if f.gone || f.have[i/8]&(1<<(i%8)) != 0 {
		return
	}
	f.have[i/8] |= 1 << (i % 8)
	f.count++
	close(f.changed)
	f.changed = make(chan struct{})
}

// end withdraws the feed: later requests for it fail, waiting ones return.
// Exposures already made stay until their release.
func (f *feed) end() {
	if f == nil {
		return
	}
	f.f.mu.Lock()
	f.endLocked()
	f.f.mu.Unlock()
}

func (f *feed) endLocked() {
	if f.gone {
		return
	}
	f.gone = true
	close(f.changed)
	if f.f.feeds[f.ref] == f {
		delete(f.f.feeds, f.ref)
	}
}

func (fd *Feeding) lookup(ref Ref, id string) *feed {
	if fd == nil {
		return nil
	}
	fd.mu.Lock()
	defer fd.mu.Unlock()
	if f := fd.feeds[ref]; f != nil && f.id == id {
		return f
	}
	return nil
}

// state returns a copy of the feed's chunk map and count, whether it is
// gone, and a channel closed at its next change.
func (f *feed) state() (have []byte, count int, gone bool, changed <-chan struct{}) {
	f.f.mu.Lock()
	defer f.f.mu.Unlock()
	return append([]byte(nil), f.have...), f.count, f.gone, f.changed
}

// MaxHaveWait bounds how long a "have" request waits for a chunk beyond
// those the reader knows of before it is answered with no news.
const MaxHaveWait = time.Second

// ErrFeedGone: a feeder stopped pulling the object (it failed, or the node
// is closing) before it had every chunk.
var ErrFeedGone = errors.New("feeder stopped pulling the object")

// serveFeed answers a "feed" request: an exposure of the replica being
// pulled with the chunks it has, or of a sealed replica (every chunk),
// which the reader releases by handle like an "open".
func (s *ControlServer) serveFeed(req ctlRequest, held *exposures) ctlResponse {
	var resp ctlResponse
	if !held.reserve() {
		resp.Err = fmt.Sprintf("more than %d objects exposed on one connection", MaxExposures)
		return resp
	}
	var (
		e   Exposure
		rel func()
		err error
	)
	f := s.Feeding.lookup(req.Ref, req.ID)
	if f != nil {
		if e, rel, err = f.expose(); err == nil {
			resp.Have, resp.Chunks, _, _ = f.state()
		} else if errors.Is(err, ErrNotFound) {
			// The pull ended (its replica sealed, or aborted) after the
			// lookup, before its feed was withdrawn: the Source knows.
			f = nil
		}
	}
	if f == nil {
		if e, rel, err = s.Source.Expose(req.Ref, req.ID); err == nil {
			resp.Complete = true
		}
	}
	if err != nil {
		held.unreserve()
		resp.Err, resp.NotHeld = err.Error(), errors.Is(err, ErrNotFound)
		return resp
	}
	resp.Handle, resp.Exposure = held.add(rel), e
	return resp
}

// serveHave answers a "have" request: once the feed has more than
// req.Known chunks (or within MaxHaveWait), which chunks it has. A feed
// that finished and was sealed answers Complete; one that went before
// that answers NotHeld.
func (s *ControlServer) serveHave(req ctlRequest) ctlResponse {
	var resp ctlResponse
	f := s.Feeding.lookup(req.Ref, req.ID)
	if f == nil {
		// Sealed here meanwhile, or gone: the Source knows.
		if err := s.holds(req.Ref, req.ID); err != nil {
			resp.Err, resp.NotHeld = fmt.Sprintf("%v (%v)", ErrFeedGone, err), true
			return resp
		}
		resp.Complete = true
		return resp
	}
	timer := time.NewTimer(MaxHaveWait)
	defer timer.Stop()
	for {
		have, count, gone, changed := f.state()
		switch {
		case count == f.n:
			resp.Complete = true
			return resp
		case gone:
			return s.serveHave(req) // sealed, or really gone
		case count > req.Known:
			resp.Have, resp.Chunks = have, count
			return resp
		}
		select {
		case <-changed:
		case <-timer.C:
			resp.Have, resp.Chunks = have, count
			return resp
		}
	}
}

// ReplicaChecker is an optional interface of a Source: whether it holds a
// sealed replica, without exposing it. A "have" request whose feeder has
// finished asks it: exposing a GPU replica just to say so would stage it
// to host memory for nothing. A Source without it is asked to Expose the
// replica, which is then released at once.
type ReplicaChecker interface {
	// HoldsReplica returns nil when this node holds the sealed replica of
	// ref, incarnation id, and an error wrapping ErrNotFound when it does
	// not.
	HoldsReplica(ref Ref, id string) error
}

// holds says whether the Source holds the sealed replica of ref,
// incarnation id (nil), or why not.
func (s *ControlServer) holds(ref Ref, id string) error {
	if c, ok := s.Source.(ReplicaChecker); ok {
		return c.HoldsReplica(ref, id)
	}
	_, rel, err := s.Source.Expose(ref, id)
	if err == nil {
		rel()
	}
	return err
}

// Feed asks the node for its replica of ref, incarnation id, whether it is
// still being pulled (have says which chunks it has; complete is false) or
// sealed (complete). The node keeps the memory until Release or until
// this connection closes.
func (cc *ControlClient) Feed(ctx context.Context, ref Ref, id string) (e Exposure, handle uint64, have []byte, complete bool, err error) {
	resp, err := cc.roundTrip(ctx, ctlRequest{Op: "feed", Ref: ref, ID: id})
	if err != nil {
		return e, 0, nil, false, err
	}
	if resp.Err != "" {
		if resp.NotHeld {
			return e, 0, nil, false, fmt.Errorf("node %s: %w: %s", cc.ch.peer, ErrNotFound, resp.Err)
		}
		return e, 0, nil, false, fmt.Errorf("node %s: %s", cc.ch.peer, resp.Err)
	}
	if err := resp.Exposure.validate(); err != nil {
		return e, 0, nil, false, fmt.Errorf("node %s: %w", cc.ch.peer, err)
	}
	return resp.Exposure, resp.Handle, resp.Have, resp.Complete, nil
}

// Have waits (at most MaxHaveWait on the node's side) until the node's
// replica of ref has more than known chunks, and returns which it has, or
// complete once it has them all. It fails wrapping ErrFeedGone when the
// node stopped pulling without finishing.
func (cc *ControlClient) Have(ctx context.Context, ref Ref, id string, known int) (have []byte, count int, complete bool, err error) {
	resp, err := cc.roundTrip(ctx, ctlRequest{Op: "have", Ref: ref, ID: id, Known: known})
	if err != nil {
		return nil, 0, false, err
	}
	if resp.Err != "" {
		if resp.NotHeld {
			return nil, 0, false, fmt.Errorf("node %s: %w", cc.ch.peer, ErrFeedGone)
		}
		return nil, 0, false, fmt.Errorf("node %s: %s", cc.ch.peer, resp.Err)
	}
	return resp.Have, resp.Chunks, resp.Complete, nil
}

// chunkMap is which chunks a source has; nil means all of them.
type chunkMap []byte

func (m chunkMap) has(i int) bool { return m == nil || (i/8 < len(m) && m[i/8]&(1<<(i%8)) != 0) }

// fanout starts feeding rep and advertises it, and returns the feed and the
// node to pull from first: the feeder that started just before this one,
// or "" for the holders. Fan-out needs Feeds, Feeding and a replica that
// can be exposed (ReplicaTraits.Expose); without them it returns nothing
// and the pull reads from the holders alone.
func (p *Puller) fanout(ctx context.Context, e Entry, expose func() (Exposure, func(), error), n int) (f *feed, upstream string, stop func()) {
	if p.Feeds == nil || p.Feeding == nil || expose == nil || n <= 1 {
		return nil, "", func() {}
	}
	ref := e.Ref()
	f = p.Feeding.start(ref, e.ID, expose, n)
	stop = func() {
		f.end()
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		if err := p.Feeds.RemoveFeeder(ctx, ref); err != nil {
			p.log().Debug("cluster pull: withdrawing as a feeder failed (it goes with the lease)", "object", ref.String(), "err", err)
		}
	}
	if err := p.Feeds.AddFeeder(ctx, e); err != nil {
		p.log().Warn("cluster pull: not feeding other readers", "object", ref.String(), "err", err)
		return f, "", stop
	}
	feeders, err := p.Feeds.Feeders(ctx, ref, e.ID)
	if err != nil {
		return f, "", stop
	}
	self := p.Dir.NodeName()
	for i, node := range feeders {
		if node == self && i > 0 {
			return f, feeders[i-1], stop
		}
	}
	return f, "", stop
}

// watchFeed keeps s.have current while s is a feeder that lacks chunks,
// and drops s when it makes no progress within timeout or stops.
func (p *Puller) watchFeed(ctx context.Context, t *transfer, s *source, dead func(why string), timeout time.Duration) {
	ref := t.e.Ref()
	known := 0
	t.mu.Lock()
	for i := range len(t.e.Sums) {
		if s.have.has(i) {
			known++
		}
	}
	t.mu.Unlock()
	last := time.Now()
	for ctx.Err() == nil {
		hctx, cancel := context.WithTimeout(ctx, MaxHaveWait+timeout)
		have, count, complete, err := s.cc.Have(hctx, ref, t.e.ID, known)
		cancel()
		if err != nil {
			if ctx.Err() == nil {
				dead(oneLine(err))
			}
			return
		}
		t.mu.Lock()
		switch {
		case complete:
			s.have = nil
		case count > known:
			s.have = chunkMap(have)
		}
		t.cond.Broadcast()
		t.mu.Unlock()
		if complete {
			return
		}
		if count > known {
			known, last = count, time.Now()
		} else if time.Since(last) > timeout {
			dead(fmt.Sprintf("feeder has had %d of %d chunks for %v", known, len(t.e.Sums), timeout))
			return
		}
	}
}

// candidate is a node a pull may read from.
type candidate struct {
	node   string
	feeder bool
}

// candidates are the nodes round of a pull reads from: in the first, the
// feeder that started just before this node when there is one (a chain),
// else the holders; later, the holders and every feeder that started
// before this node (the ones after it only have chunks it had first).
func (p *Puller) candidates(ctx context.Context, e Entry, round int, upstream string) []candidate {
	if round == 0 && upstream != "" {
		return []candidate{{node: upstream, feeder: true}}
	}
	var c []candidate
	for _, h := range e.Holders {
		c = append(c, candidate{node: h})
	}
	if round == 0 || p.Feeds == nil || p.Feeding == nil {
		return c
	}
	feeders, err := p.Feeds.Feeders(ctx, e.Ref(), e.ID)
	if err != nil {
		return c
	}
	self := p.Dir.NodeName()
	for _, f := range feeders {
		if f == self {
			break
		}
		c = append(c, candidate{node: f, feeder: true})
	}
	return c
}
