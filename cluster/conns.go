package cluster

import (
	"bytes"
	"context"
	"errors"
	"sync"
)

// DefaultMaxPeers is how many holder nodes a Puller keeps connections to
// between pulls when MaxPeers is 0.
const DefaultMaxPeers = 64

// peer is a connection to one holder node kept across pulls: the node's
// record as it was when dialled, the authenticated control channel and
// the UCX endpoint to the worker the node exposes through it. It is used
// by any number of pulls at once (ControlClient and Endpoint are safe for
// concurrent use); refs counts them, and a peer dropped from the pool is
// closed when the last one lets go.
type peer struct {
	node   string
	rec    Node
	cc     *ControlClient
	mu     sync.Mutex // guards ep, worker
	ep     Endpoint
	worker []byte
	refs   int  // under peers.mu
	gone   bool // under peers.mu: no longer in the pool
	used   uint64
}

// endpoint returns the endpoint to worker, connecting (again) when the
// node exposes a worker other than the one connected to: a restarted node
// has a new worker address.
func (pe *peer) endpoint(ctx context.Context, tr Transport, worker []byte) (Endpoint, error) {
	pe.mu.Lock()
	defer pe.mu.Unlock()
	if pe.ep != nil && bytes.Equal(pe.worker, worker) {
		return pe.ep, nil
	}
	ep, err := tr.Connect(ctx, worker)
	if err != nil {
		return nil, err
	}
	if pe.ep != nil {
		pe.ep.Close()
	}
	pe.ep, pe.worker = ep, bytes.Clone(worker)
	return ep, nil
}

func (pe *peer) close() {
	pe.cc.Close()
	pe.mu.Lock()
	if pe.ep != nil {
		pe.ep.Close()
		pe.ep = nil
	}
	pe.mu.Unlock()
}

// peers is a Puller's bounded pool of connections to holder nodes.
type peers struct {
	mu    sync.Mutex
	m     map[string]*peer
	clock uint64
	dials uint64
	// dialling holds the dial under way to each node: the pulls that
	// need that node meanwhile wait for it rather than dial too, so that
	// a burst of pulls from one holder costs it one handshake, never
	// more connections than its bound per source address.
	dialling map[string]*dial
}

// dial is a control channel being dialled; done closes once err is set
// or the peer is in the pool.
type dial struct {
	done      chan struct{}
	err       error
	abandoned bool // err came with the dialling pull's context's end
}

// acquire returns a peer for node, from the pool or dialled now (after
// reading the node's record), counting one more user.
func (p *Puller) acquire(ctx context.Context, node string) (*peer, error) {
	ps := &p.peers
	for {
		ps.mu.Lock()
		if pe := ps.m[node]; pe != nil {
			pe.refs++
			ps.clock++
			pe.used = ps.clock
			ps.mu.Unlock()
			return pe, nil
		}
		d := ps.dialling[node]
		if d == nil {
			break // ps.mu held: this pull dials
		}
		ps.mu.Unlock()
		select {
		case <-d.done:
			// A dial given up with its own pull (whose context ended) is
			// tried again by this one.
			if d.err != nil && !d.abandoned {
				return nil, d.err
			}
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	d := &dial{done: make(chan struct{})}
	if ps.dialling == nil {
		ps.dialling = map[string]*dial{}
	}
	ps.dialling[node] = d
	ps.mu.Unlock()
	pe, err := p.dialPeer(ctx, node)
	ps.mu.Lock()
	defer ps.mu.Unlock()
	delete(ps.dialling, node)
	d.err, d.abandoned = err, err != nil && ctx.Err() != nil
	close(d.done)
	if err != nil {
		return nil, err
	}
	ps.dials++
	if ps.m == nil {
		ps.m = map[string]*peer{}
	}
	ps.clock++
	pe.used = ps.clock
	ps.m[node] = pe
	p.evictLocked()
	return pe, nil
}

// dialPeer reads node's record and dials its control channel.
func (p *Puller) dialPeer(ctx context.Context, node string) (*peer, error) {
	rec, err := p.liveNode(ctx, node)
	if err != nil {
		return nil, err
	}
	cc, err := DialControl(ctx, p.Secret, p.Dir.NodeName(), node, rec.Control)
	if err != nil {
		return nil, err
	}
	return &peer{node: node, rec: rec, cc: cc, refs: 1}, nil
}

// evictLocked drops the least recently used peers beyond the bound.
func (p *Puller) evictLocked() {
	ps := &p.peers
	limit := p.MaxPeers
	if limit <= 0 {
		limit = DefaultMaxPeers
	}
	for len(ps.m) > limit {
		var lru *peer
		for _, pe := range ps.m {
			if lru == nil || pe.used < lru.used {
				lru = pe
			}
		}
		p.forgetLocked(lru)
	}
}

// forgetLocked takes pe out of the pool; it closes once unused.
func (p *Puller) forgetLocked(pe *peer) {
	ps := &p.peers
	if ps.m[pe.node] == pe {
		delete(ps.m, pe.node)
	}
	if !pe.gone {
		pe.gone = true
		if pe.refs == 0 {
			p.bg.Go(pe.close)
		}
	}
}

// release lets go of pe; broken drops it from the pool (a failed request
// or GET: the next pull dials the node afresh, reading its record again).
func (p *Puller) release(pe *peer, broken bool) {
	ps := &p.peers
	ps.mu.Lock()
	defer ps.mu.Unlock()
	pe.refs--
	if broken && !pe.gone {
		p.forgetLocked(pe)
		return
	}
	if pe.gone && pe.refs == 0 {
		p.bg.Go(pe.close)
	}
}

// ForgetNode drops the pooled connection to node, if any: its record went
// from the directory (the node died or left), or it restarted. Pulls using
// it finish with it.
func (p *Puller) ForgetNode(node string) {
	ps := &p.peers
	ps.mu.Lock()
	defer ps.mu.Unlock()
	if pe := ps.m[node]; pe != nil {
		p.forgetLocked(pe)
	}
}

// Close closes the pooled connections and waits for exposures and pins
// being released in the background. Pulls still using a connection
// finish with it; it closes after them. Call it before closing the
// Transport.
func (p *Puller) Close() error {
	ps := &p.peers
	ps.mu.Lock()
	for _, pe := range ps.m {
		p.forgetLocked(pe)
	}
	ps.mu.Unlock()
	p.bg.Wait()
	return nil
}

// Dials counts the control channels the puller dialled (a pooled one is
// dialled once): for tests and diagnostics.
func (p *Puller) Dials() uint64 {
	p.peers.mu.Lock()
	defer p.peers.mu.Unlock()
	return p.peers.dials
}

// openPooled opens ref's incarnation id on holder over a pooled control
// channel. A pooled channel that fails at the transport level (the node
// restarted or died since) is dropped and the node dialled once more, so
// a stale channel is replaced, never reused. The exposure is released by
// the returned release; the peer is let go with it.
func (p *Puller) openPooled(ctx context.Context, e Entry, holder string) (pe *peer, exp Exposure, handle uint64, err error) {
	ref := e.Ref()
	for attempt := 0; ; attempt++ {
		pe, err = p.acquire(ctx, holder)
		if err != nil {
			return nil, exp, 0, err
		}
		exp, handle, err = pe.cc.Open(ctx, ref, e.ID)
		if err == nil {
			return pe, exp, handle, nil
		}
		stale := errors.Is(err, errChannel) // no answer: the channel is broken
		p.release(pe, stale)
		if !stale || attempt > 0 || ctx.Err() != nil {
			return nil, exp, 0, err
		}
		p.log().Debug("cluster pull: a pooled control channel failed, dialling again", "node", holder, "err", err)
	}
}
