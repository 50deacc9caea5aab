package cluster

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Directory is what the puller needs of the cluster directory
// (cluster/etcddir.Directory implements it).
type Directory interface {
	// NodeName is this node's name.
	NodeName() string
	// Node returns a live node's record.
	Node(ctx context.Context, name string) (Node, error)
	// Lookup returns an object's record and live holders.
	Lookup(ctx context.Context, ref Ref) (Entry, error)
	// AddHolder advertises this node's replica of e; it fails with
	// ErrNotFound when the name was deleted or replaced meanwhile.
	AddHolder(ctx context.Context, e Entry) error
	// Pin pins holder's replica of ref for the length of a pull.
	Pin(ctx context.Context, holder string, ref Ref, id string) (unpin func(), err error)
}

// Sink makes local replicas: the local store as the puller sees it.
type Sink interface {
	// Create makes an unsealed local object for a replica of o, with its
	// name, owner, sharing, size, version and shard, invisible to readers
	// until sealed.
	Create(ctx context.Context, o Object) (Replica, error)
}

// Replica is a local object being filled by a pull: the one interface
// the puller knows a replica by. What differs between replicas (a landing
// area in front of GPU memory, peers' reads while it is pulled) is data,
// its Traits.
type Replica interface {
	// Bytes is where the pull writes the object's chunks: the object's
	// memory, or a landing area in front of it (Traits.Land).
	Bytes() []byte
	// Traits says what else the replica does, once for the pull.
	Traits() ReplicaTraits
	// Seal makes it visible, as an ordinary sealed local object.
	Seal() error
	// Abort removes it, sealed or not.
	Abort()
}

// ReplicaTraits is what a replica does besides being written in place;
// each field is nil where it does not. The puller calls Land, LandSum
// and Expose from the pull's goroutines (different chunks at once).
type ReplicaTraits struct {
	// Land: Bytes is a landing area (pinned host memory in front of GPU
	// memory, its pages present: the puller does not map them in
	// beforehand as it does a fresh replica's), and Land moves the chunk
	// at off on (host→device) once it is in Bytes and checked. An error
	// fails the pull.
	Land func(off int64, b []byte) error
	// LandSum, where Land is set, lands the chunk at off as Land does and
	// returns the Checksum of the bytes landed (a GPU replica's device
	// computes it): the puller then checks each chunk as it landed, a
	// check that covers the landing too, and the host reads no chunk for
	// its checksum.
	LandSum func(off int64, b []byte) (uint32, error)
	// Expose makes the replica's memory readable by peers while it is
	// pulled (fan-out), whatever bytes it holds yet, and keeps that
	// memory from being reused until release is called, sealed, aborted
	// or not. Once the pull is over it fails wrapping ErrNotFound.
	Expose func() (e Exposure, release func(), err error)
}

// Defaults for the zero values of Puller's fields.
const (
	DefaultChunkTimeout     = 30 * time.Second
	DefaultStreamsPerHolder = 8
	// maxRounds bounds how often a pull looks for new holders after all
	// of its sources failed.
	maxRounds = 2
	// maxBadChunk is how many checksum failures of one chunk, from any
	// sources, fail the pull.
	maxBadChunk = 3
)

// PullStats are a Puller's counters.
type PullStats struct {
	// Pulls and Failed count finished pulls.
	Pulls, Failed uint64
	// InFlight counts pulls under way.
	InFlight int64
	// Bytes counts bytes pulled (and checked).
	Bytes uint64
	// Failovers counts holders dropped mid-pull whose remaining chunks
	// went to other holders.
	Failovers uint64
	// FedBytes counts the bytes of Bytes read from feeders (other nodes
	// still pulling the object) rather than from holders.
	FedBytes uint64
	// PartialBytes counts the bytes partial reads (PullRanges) read:
	// the chunks their ranges touch.
	PartialBytes uint64
	// Inline counts the pulls whose object came whole in a holder's
	// answer on the control channel (MaxInline).
	Inline uint64
}

// Puller makes local replicas of objects other nodes hold: it finds the
// holders in the directory, pins them, authenticates to each over the
// control channel, reads chunks from all of them at once (striped), checks
// every chunk's checksum, seals the replica and advertises it. Its methods
// are safe for concurrent use; concurrent pulls of one object share one
// transfer.
type Puller struct {
	Dir       Directory
	Transport Transport
	Secret    Secret
	Sink      Sink
	// ChunkTimeout bounds each read from its issue (behind the others in
	// flight from the same holder): a holder that does not deliver a read
	// within it is dropped. 0 means DefaultChunkTimeout.
	ChunkTimeout time.Duration
	// StreamsPerHolder is how many reads from one holder are in flight at
	// once; 0 means DefaultStreamsPerHolder.
	StreamsPerHolder int
	// ReadBytes bounds one read of a whole object: consecutive chunks a
	// holder has are read together, up to ReadBytes, and each is checked
	// on its own. 0 (or less than two chunks) reads one chunk at a time.
	ReadBytes int64
	// Logger receives failovers and failures; nil discards them.
	Logger *slog.Logger
	// Feeds and Feeding, when both are set, make pulls fan out
	// (fanout.go): a pull serves the chunks it has to other pulling nodes
	// and reads from the one that started before it. Feeding is shared
	// with this node's ControlServer.
	Feeds   Feeds
	Feeding *Feeding
	// MaxPeers bounds the holder nodes whose connections (control
	// channel, UCX endpoint) are kept between pulls; 0 means
	// DefaultMaxPeers. Close closes them.
	MaxPeers int

	peers    peers
	gathers  gatherBatches  // small KV reads waiting to go together (kvbatch.go)
	bg       sync.WaitGroup // releases and unpins after pulls, closes of peers
	mu       sync.Mutex
	inflight map[Ref]*pullCall

	pulls, failed, bytes, failovers, fed, partial, inline atomic.Uint64
	inFlight                                              atomic.Int64
}

type pullCall struct {
	done chan struct{}
	e    Entry
	err  error
}

// Stats returns the puller's counters.
func (p *Puller) Stats() PullStats {
	return PullStats{Pulls: p.pulls.Load(), Failed: p.failed.Load(), InFlight: p.inFlight.Load(),
		Bytes: p.bytes.Load(), Failovers: p.failovers.Load(), FedBytes: p.fed.Load(), PartialBytes: p.partial.Load(),
		Inline: p.inline.Load()}
}

func (p *Puller) log() *slog.Logger {
	if p.Logger == nil {
		return slog.New(slog.DiscardHandler)
	}
	return p.Logger
}

// Pull makes a sealed local replica of ref and advertises it (a pull
// without fan-out after it returns, in the background: see advertise),
// returning
// the object's entry. It fails with one line naming the holders that
// failed, wrapping ErrNoHolder when no live node holds the object,
// ErrNotFound when it is not recorded (or went during the pull),
// ErrChecksum when chunks kept arriving corrupt, ErrAuth when holders
// refused this node, ErrUnavailable when the directory is away.
func (p *Puller) Pull(ctx context.Context, ref Ref) (Entry, error) {
	return p.pullOnce(ctx, ref, nil)
}

// PullEntry is Pull of e's object with e as the directory's answer, just
// read by the caller (Directory.Lookup), so the pull does not read it
// again. A holder list gone stale is handled as in Pull: the pull looks
// the object up again when every holder failed.
func (p *Puller) PullEntry(ctx context.Context, e Entry) (Entry, error) {
	return p.pullOnce(ctx, e.Ref(), &e)
}

func (p *Puller) pullOnce(ctx context.Context, ref Ref, known *Entry) (Entry, error) {
	p.mu.Lock()
	if c, ok := p.inflight[ref]; ok {
		p.mu.Unlock()
		select {
		case <-c.done:
			return c.e, c.err
		case <-ctx.Done():
			return Entry{}, ctx.Err()
		}
	}
	c := &pullCall{done: make(chan struct{})}
	if p.inflight == nil {
		p.inflight = map[Ref]*pullCall{}
	}
	p.inflight[ref] = c
	p.mu.Unlock()

	p.inFlight.Add(1)
	c.e, c.err = p.pull(ctx, ref, known)
	p.inFlight.Add(-1)
	if c.err != nil {
		p.failed.Add(1)
		p.log().Warn("cluster pull failed", "object", ref.String(), "err", c.err)
	} else {
		p.pulls.Add(1)
	}
	p.mu.Lock()
	delete(p.inflight, ref)
	p.mu.Unlock()
	close(c.done)
	return c.e, c.err
}

// openFirst opens t's object at the first of its holders (not tried yet)
// that answers, marking each in tried and why it failed in t. It fails as
// a pull whose every holder failed does (transfer.failure), or wrapping
// ErrUnavailable when the directory is away.
func (p *Puller) openFirst(ctx context.Context, t *transfer, tried map[string]bool) (*source, error) {
	e := t.e
	for _, h := range e.Holders {
		if tried[h] {
			continue
		}
		tried[h] = true
		s, err := p.open(ctx, e, h, false)
		if err == nil {
			return s, nil
		}
		t.holderFailed(h, err)
		if errors.Is(err, ErrUnavailable) {
			return nil, fmt.Errorf("pull %s: %w", e.Ref(), err)
		}
	}
	return nil, t.failure(e.Ref())
}

// source is one holder a pull reads from.
type source struct {
	node   string
	cc     *ControlClient
	ep     Endpoint
	exp    Exposure
	handle uint64
	unpin  func()
	// pe, when set, is the pooled connection cc and ep belong to (a
	// holder); p is the puller that pooled it. A feeder's connection is
	// its own.
	pe *peer
	p  *Puller
	// bad: a GET from it failed; its pooled connection is not reused.
	bad atomic.Bool
	// feeder: the node is still pulling the object itself; have is which
	// chunks it has (under transfer.mu; nil once it has them all), kept
	// current by a watchFeed goroutine counted in watch.
	feeder bool
	have   chunkMap
	watch  sync.WaitGroup
	fed    int64
}

// close ends the source. A pooled connection's exposure is released and
// the pin removed after close returns (off the get's path): the holder
// keeps the replica a little longer, never shorter.
func (s *source) close() {
	if s.pe != nil {
		pe, p, h, bad, unpin := s.pe, s.p, s.handle, s.bad.Load(), s.unpin
		p.bg.Go(func() {
			if h != 0 {
				ctx, cancel := context.WithTimeout(context.Background(), HandshakeTimeout)
				if err := pe.cc.Release(ctx, h); err != nil {
					bad = true
				}
				cancel()
			}
			p.release(pe, bad)
			if unpin != nil {
				unpin()
			}
		})
		return
	}
	if s.ep != nil {
		s.ep.Close()
	}
	if s.cc != nil {
		s.cc.Close() // releases the exposure, ends a watchFeed's request
	}
	s.watch.Wait()
	if s.unpin != nil {
		s.unpin()
	}
}

// open pins holder's replica, authenticates to it and connects to its
// worker. A holder is reached over the puller's pooled connection to it.
// Its replica is held before any byte is read by the exposure: the holder
// leases the replica (store.Replicas.Lease) before it answers Open and
// keeps it until Release or the channel's end. The pin record in etcd
// (which the holder's watch turns into a second lease) is written
// alongside, off the get's path, and removed after the pull. A feeder (a node still pulling the object) is not
// pinned: its exposure keeps the memory; it gets a connection of its own,
// which its watchFeed request ends by closing.
func (p *Puller) open(ctx context.Context, e Entry, holder string, feeder bool) (*source, error) {
	if !feeder {
		return p.openHolder(ctx, e, holder)
	}
	ref := e.Ref()
	s := &source{node: holder}
	n, err := p.liveNode(ctx, holder)
	if err != nil {
		return nil, err
	}
	if s.cc, err = DialControl(ctx, p.Secret, p.Dir.NodeName(), holder, n.Control); err != nil {
		s.close()
		return nil, err
	}
	var have []byte
	var complete bool
	s.exp, s.handle, have, complete, err = s.cc.Feed(ctx, ref, e.ID)
	if err == nil && !complete {
		s.feeder, s.have = true, make(chunkMap, (len(e.Sums)+7)/8)
		copy(s.have, have)
	}
	if err != nil {
		s.close()
		return nil, err
	}
	if s.exp.Size != e.Size {
		s.close()
		return nil, fmt.Errorf("node %s exposes %d bytes of %s, the record says %d", holder, s.exp.Size, ref, e.Size)
	}
	if s.ep, err = p.Transport.Connect(ctx, s.exp.Worker); err != nil {
		s.close()
		return nil, fmt.Errorf("node %s: connect to its worker: %w", holder, err)
	}
	return s, nil
}

func (p *Puller) openHolder(ctx context.Context, e Entry, holder string) (*source, error) {
	ref := e.Ref()
	// The pin is recorded in the background: the holder answers Open only
	// once its exposure holds the replica, which is what keeps it until the
	// pull ends. The pin record lets the holder keep it too (its watch) and
	// is removed after the pin is written, in close.
	pc := make(chan func(), 1)
	pctx := context.WithoutCancel(ctx)
	p.bg.Go(func() {
		u, err := p.Dir.Pin(pctx, holder, ref, e.ID)
		if err != nil {
			p.log().Debug("cluster pull: pin not recorded (the exposure holds the replica)", "object", ref.String(), "node", holder, "err", err)
		}
		pc <- u
	})
	s := &source{node: holder, p: p, unpin: func() {
		if u := <-pc; u != nil {
			u()
		}
	}}
	pe, exp, handle, err := p.openPooled(ctx, e, holder)
	if err == nil {
		s.pe, s.cc, s.exp, s.handle = pe, pe.cc, exp, handle
	}
	fail := func(err error) (*source, error) {
		if s.pe != nil {
			s.close()
		} else {
			p.bg.Go(s.unpin)
		}
		return nil, err
	}
	if err != nil {
		return fail(err)
	}
	if s.exp.Size != e.Size {
		return fail(fmt.Errorf("node %s exposes %d bytes of %s, the record says %d", holder, s.exp.Size, ref, e.Size))
	}
	if s.ep, err = pe.endpoint(ctx, p.Transport, s.exp.Worker); err != nil {
		s.bad.Store(true)
		return fail(fmt.Errorf("node %s: connect to its worker: %w", holder, err))
	}
	return s, nil
}

// transfer is the shared state of one pull's chunks.
type transfer struct {
	e   Entry
	dst []byte
	// slots, when set, hold the chunks of a partial pull (PullRanges)
	// instead of dst; want is how many chunks the pull reads.
	slots   map[int][]byte
	want    int
	mu      sync.Mutex
	cond    *sync.Cond
	pending []int
	done    int
	bad     map[int]int
	fatal   error
	failed  map[string]string // node → why, for the final error
	// reachedFailed: a holder that is live, as far as this node can tell,
	// failed (refused, dropped out, stalled); without one, the holders
	// that failed hold nothing any more (see holderFailed).
	reachedFailed bool
	// corrupt: the holders that failed with bytes that do not match the
	// record's checksums.
	corrupt map[string]bool
	start   time.Time
	feed    *feed // this node's feed of the replica, nil without fan-out
	// traits: what the replica does besides being written in place.
	traits ReplicaTraits
}

func (p *Puller) pull(ctx context.Context, ref Ref, known *Entry) (Entry, error) {
	begin := time.Now()
	pl := &pulling{ref: ref}
	// The replica's creation may evict objects to make room: it comes only
	// once a live holder has answered for the object (sent it whole, or
	// opened it for this pull), so that a pull with no one to read from
	// evicts nothing.
	data, err := p.startPull(ctx, pl, known)
	defer func() {
		if pl.first != nil {
			pl.first.close()
		}
	}()
	if err != nil {
		return pl.e, err
	}
	e, t := pl.e, pl.t
	rep, stopFault, err := p.makeReplica(ctx, ref, t)
	if err != nil {
		return e, err
	}
	ok := false
	defer func() {
		if !ok {
			rep.Abort()
		}
	}()
	// Stopped before the replica is sealed or aborted (both unmap dst):
	// this defer runs before the Abort above.
	defer stopFault()
	var stopFeed func()
	t.feed, pl.upstream, stopFeed = p.fanout(ctx, e, t.traits.Expose, t.want)
	// Before the Abort above, so that peers stop reading first.
	defer stopFeed()
	defer func() {
		for _, s := range pl.sources {
			s.close()
		}
	}()
	if data != nil {
		t.whole(data)
		p.inline.Add(1)
	} else if err := p.readFromHolders(ctx, pl); err != nil {
		return pl.e, err
	}
	stopFault()
	s0 := time.Now()
	if err := rep.Seal(); err != nil {
		return pl.e, fmt.Errorf("pull %s: seal the local replica: %w", ref, err)
	}
	seal := time.Since(s0)
	ok = true
	if err := p.announce(ctx, ref, pl.e, rep, t.feed != nil); err != nil {
		ok = false
		return pl.e, err
	}
	p.bytes.Add(uint64(e.Size))
	for _, s := range pl.sources {
		p.fed.Add(uint64(s.fed))
	}
	// The phases, for profiling a pull: the lookup and the replica's
	// creation, the reads (opening the sources is the rest), the seal.
	p.log().Debug("cluster pull done", "object", ref.String(), "bytes", e.Size, "sources", len(pl.sources), "took", time.Since(begin),
		"setup", t.start.Sub(begin), "transfer", pl.transfer, "seal", seal)
	return pl.e, nil
}

// pulling is one pull under way: what its steps share.
type pulling struct {
	ref Ref
	e   Entry // the directory's record; its holders are read again when all failed
	t   *transfer
	// tried: the holders opened for this pull, or not to open (this node).
	tried map[string]bool
	// first: the holder that answered, until the pull reads from it.
	first *source
	// upstream: the feeder ahead that serves this pull (fanout.go), if any.
	upstream string
	// sources: every source the pull read from, closed when it ends.
	sources []*source
	// transfer: the time spent reading (in Puller.run).
	transfer time.Duration
}

// startPull looks ref up (known: the caller did) and finds a live holder:
// one that sends the object whole when it is small (returned; inline.go),
// or one that opens it for this pull (pl.first).
func (p *Puller) startPull(ctx context.Context, pl *pulling, known *Entry) ([]byte, error) {
	self := p.Dir.NodeName()
	if known != nil {
		pl.e = *known
	} else {
		e, err := p.Dir.Lookup(ctx, pl.ref)
		if err != nil {
			return nil, fmt.Errorf("pull %s: %w", pl.ref, err)
		}
		pl.e = e
	}
	e := pl.e
	pl.tried = map[string]bool{self: true}
	n := int((e.Size + e.ChunkSize - 1) / e.ChunkSize)
	pl.t = &transfer{e: e, want: n, bad: map[int]int{}, failed: map[string]string{}, start: time.Now()}
	if !slices.ContainsFunc(e.Holders, func(h string) bool { return h != self }) {
		return nil, fmt.Errorf("pull %s: %w (holders in the directory: %s)", pl.ref, ErrNoHolder, holderList(e.Holders))
	}
	if inline(e) {
		data, err := p.readInline(ctx, pl.t, pl.tried)
		if err != nil || data != nil {
			return data, err
		}
	}
	var err error
	pl.first, err = p.openFirst(ctx, pl.t, pl.tried)
	return nil, err
}

// makeReplica creates the local replica of t's object and makes t write
// into it; stopFault stops prefaulting its memory (a landing area, pinned
// memory kept between pulls, is mapped in already).
func (p *Puller) makeReplica(ctx context.Context, ref Ref, t *transfer) (rep Replica, stopFault func(), err error) {
	rep, err = p.Sink.Create(ctx, t.e.Object)
	if err != nil {
		return nil, nil, fmt.Errorf("pull %s: make the local replica: %w", ref, err)
	}
	dst := rep.Bytes()
	if int64(len(dst)) != t.e.Size {
		rep.Abort()
		return nil, nil, fmt.Errorf("pull %s: local replica of %d bytes for %d", ref, len(dst), t.e.Size)
	}
	t.traits = rep.Traits()
	if t.traits.Land == nil {
		t.traits.LandSum = nil
	}
	stopFault = func() {}
	if t.traits.Land == nil {
		stopFault = prefault(dst)
	}
	t.dst = dst
	t.cond = sync.NewCond(&t.mu)
	for i := range t.want {
		t.pending = append(t.pending, i)
	}
	return rep, stopFault, nil
}

// whole takes a small object that came whole in a holder's answer
// (inline.go): every chunk is in.
func (t *transfer) whole(data []byte) {
	copy(t.dst, data)
	for i := range t.want {
		t.feed.mark(i)
	}
	t.done = t.want
}

// readFromHolders reads every chunk of pl's transfer, in rounds: each opens
// the candidates not tried yet (the feeder ahead, holders, pl.first) and
// reads from them until the chunks are in or every source failed; a later
// round looks the holders up again (a replica made meanwhile). It fails
// as transfer.failure says once no candidate is left or maxRounds passed.
func (p *Puller) readFromHolders(ctx context.Context, pl *pulling) error {
	t, ref := pl.t, pl.ref
	if pl.upstream != "" && pl.first != nil {
		// A feeder ahead serves this pull, and the holder is left to it
		// (fanout.go); the holder stays a candidate if the feeder fails.
		pl.first.close()
		pl.tried[pl.first.node] = false
		pl.first = nil
	}
	for round := 0; ; round++ {
		if round > 0 {
			if e2, err := p.Dir.Lookup(ctx, ref); err == nil && e2.ID == pl.e.ID {
				pl.e.Holders = e2.Holders
			}
		}
		fresh, err := p.openCandidates(ctx, pl, round)
		if err != nil {
			return err
		}
		if len(fresh) == 0 {
			if round == 0 && len(t.failed) == 0 {
				return fmt.Errorf("pull %s: %w (holders in the directory: %s)", ref, ErrNoHolder, holderList(pl.e.Holders))
			}
			return t.failure(ref)
		}
		if round > 0 {
			p.log().Info("cluster pull: moving to other holders", "object", ref.String(), "holders", len(fresh))
		}
		r0 := time.Now()
		p.run(ctx, t, fresh)
		pl.transfer += time.Since(r0)
		switch {
		case t.done == t.want:
			return nil
		case t.fatal != nil:
			return t.fatal
		case ctx.Err() != nil:
			return fmt.Errorf("pull %s: %w after %d of %d chunks (%s)", ref, ctx.Err(), t.done, t.want, t.why())
		case round+1 >= maxRounds:
			return t.failure(ref)
		}
	}
}

// openCandidates opens the sources of a round: pl.first, then the
// candidates not tried yet, each added to pl.sources. It fails wrapping
// ErrUnavailable when the directory is away.
func (p *Puller) openCandidates(ctx context.Context, pl *pulling, round int) ([]*source, error) {
	var fresh []*source
	if pl.first != nil {
		fresh = append(fresh, pl.first)
		pl.sources = append(pl.sources, pl.first)
		pl.first = nil
	}
	cands := p.candidates(ctx, pl.e, round, pl.upstream)
	for ci := 0; ci < len(cands); ci++ {
		h := cands[ci]
		if pl.tried[h.node] {
			continue
		}
		pl.tried[h.node] = true
		s, err := p.open(ctx, pl.e, h.node, h.feeder)
		if err != nil && round == 0 && h.node == pl.upstream {
			// The feeder before this one is gone already: the holders.
			for _, hh := range pl.e.Holders {
				cands = append(cands, candidate{node: hh})
			}
		}
		if err != nil {
			pl.t.holderFailed(h.node, err)
			if errors.Is(err, ErrUnavailable) {
				return nil, fmt.Errorf("pull %s: %w", pl.ref, err)
			}
			continue
		}
		fresh = append(fresh, s)
		pl.sources = append(pl.sources, s)
	}
	return fresh, nil
}

// announce makes a sealed replica of ref a holder of e. A fanned-out pull's
// replica is recorded before the pull returns: readers behind this node
// move from its feed to its replica, so it is a holder before the feed
// ends. A name deleted or replaced meanwhile fails the pull (ErrNotFound:
// the replica is dropped); any other failure (the directory away) leaves
// it local and unadvertised, as advertise does: readers behind move to the
// holders they know. Dropping it then failed a get whose bytes were all in
// and checked. The write outlives the get's context: a get that ends
// meanwhile (another shard's seal completed its version) must not leave
// this replica unadvertised for good. Without fan-out the replica is
// advertised in the background (advertise).
func (p *Puller) announce(ctx context.Context, ref Ref, e Entry, rep Replica, fannedOut bool) error {
	if !fannedOut {
		p.advertise(ctx, e, rep)
		return nil
	}
	actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), AdvertiseTimeout)
	err := p.Dir.AddHolder(actx, e)
	cancel()
	if errors.Is(err, ErrNotFound) {
		return fmt.Errorf("pull %s: %w", ref, err)
	} else if err != nil {
		p.log().Warn("cluster pull: replica not advertised", "object", ref.String(), "err", err)
	}
	return nil
}

// AdvertiseTimeout bounds the directory write that advertises a new
// replica.
const AdvertiseTimeout = 10 * time.Second

// advertise records this node as a holder of e's sealed replica rep, after
// the get has its answer (off its path), within AdvertiseTimeout. A name
// deleted or replaced meanwhile (ErrNotFound) drops the replica; other
// failures are logged and leave the replica local and unadvertised (other
// nodes read from the holders they know). Close waits for it.
func (p *Puller) advertise(ctx context.Context, e Entry, rep Replica) {
	actx := context.WithoutCancel(ctx)
	p.bg.Go(func() {
		ctx, cancel := context.WithTimeout(actx, AdvertiseTimeout)
		defer cancel()
		err := p.Dir.AddHolder(ctx, e)
		switch {
		case errors.Is(err, ErrNotFound):
			p.log().Info("cluster pull: the name went during the pull; its replica is dropped", "object", e.Ref().String())
			rep.Abort()
		case err != nil:
			p.log().Warn("cluster pull: replica not advertised", "object", e.Ref().String(), "err", err)
		}
	})
}

// run reads chunks from sources until all are done, the pull fails, or
// every source failed. Each source has StreamsPerHolder reads in flight
// (readChunks); a chunk read goes to the checkers, which check it against
// its checksum and land it, so that a source's reads never wait for a
// check.
func (p *Puller) run(ctx context.Context, t *transfer, sources []*source) {
	depth := p.StreamsPerHolder
	if depth <= 0 {
		depth = DefaultStreamsPerHolder
	}
	timeout := p.ChunkTimeout
	if timeout <= 0 {
		timeout = DefaultChunkTimeout
	}
	rctx, cancel := context.WithCancel(ctx)
	defer cancel() // ends watchFeed goroutines at their next answer
	check := make(chan readChunk, depth*len(sources))
	var checkers sync.WaitGroup
	// Checkers enough that a holder's reads rarely wait for one: a check
	// (CRC-32C, and a host→device copy for a GPU replica) takes a few
	// tenths of the time a chunk takes on the wire.
	for range min(runtime.GOMAXPROCS(0), max(2, depth/2)*len(sources)) {
		checkers.Go(func() {
			for c := range check {
				p.check(t, c)
			}
		})
	}
	var wg sync.WaitGroup
	for _, s := range sources {
		var dead atomic.Bool
		if s.feeder {
			s.watch.Go(func() {
				p.watchFeed(rctx, t, s, func(why string) {
					t.mu.Lock()
					p.drop(t, s, &dead, why)
					t.cond.Broadcast()
					t.mu.Unlock()
				}, timeout)
			})
		}
		wg.Go(func() { p.stream(ctx, t, s, &dead, depth, timeout, check) })
	}
	// Wake waiters when ctx ends.
	stop := context.AfterFunc(ctx, func() {
		t.mu.Lock()
		t.cond.Broadcast()
		t.mu.Unlock()
	})
	wg.Wait()
	close(check)
	checkers.Wait()
	stop()
}

// readChunk is a chunk read from a source, to be checked.
type readChunk struct {
	s *source
	i int
}

// stream reads chunks from one source, depth at a time, handing each
// read to check, until there is nothing left or the source fails: a
// failed read gives its chunk back and drops the source.
func (p *Puller) stream(ctx context.Context, t *transfer, s *source, dead *atomic.Bool, depth int, timeout time.Duration, check chan<- readChunk) {
	readBytes := p.ReadBytes
	next := func() (chunkRead, bool) {
		t.mu.Lock()
		defer t.mu.Unlock()
		for t.fatal == nil && !dead.Load() && ctx.Err() == nil {
			if k := t.pick(s); k >= 0 {
				i, m := t.pending[k], 1
				// Whole objects: the chunks after it too, while they
				// are pending, s has them and the read stays in bounds.
				for t.slots == nil && k+m < len(t.pending) && t.pending[k+m] == i+m && s.have.has(i+m) &&
					int64(m+1)*t.e.ChunkSize <= readBytes {
					m++
				}
				t.pending = slices.Delete(t.pending, k, k+m)
				off := int64(i) * t.e.ChunkSize
				dst := t.chunk(i)
				if m > 1 {
					dst = t.dst[off:min(off+int64(m)*t.e.ChunkSize, t.e.Size)]
				}
				return chunkRead{addr: s.exp.Addr + uint64(off), dst: dst, first: i}, true
			}
			if len(t.pending) == 0 && t.done >= t.want {
				break
			}
			t.cond.Wait() // for a chunk given back, or one the feeder s gets
		}
		return chunkRead{}, false
	}
	// chunks are the chunks of read r.
	chunks := func(r chunkRead) int { return int((int64(len(r.dst)) + t.e.ChunkSize - 1) / t.e.ChunkSize) }
	done := func(r chunkRead, err error) {
		n := max(chunks(r), 1)
		if err != nil {
			t.mu.Lock()
			for i := range n {
				t.pending = append(t.pending, r.first+i)
			}
			if ctx.Err() == nil {
				why := oneLine(err)
				if errors.Is(err, context.DeadlineExceeded) {
					why = fmt.Sprintf("no chunk within %v", timeout)
				}
				p.drop(t, s, dead, why)
			}
			t.cond.Broadcast()
			t.mu.Unlock()
			return
		}
		for i := range n {
			check <- readChunk{s: s, i: r.first + i}
		}
	}
	if err := readChunks(ctx, s.ep, s.exp.RKey, depth, timeout, next, done); err != nil && ctx.Err() == nil {
		t.mu.Lock()
		p.drop(t, s, dead, oneLine(err))
		t.cond.Broadcast()
		t.mu.Unlock()
	}
}

// check checks chunk c.i, just read, against its checksum and lands it
// (a summing replica lands it first and checksums it where it landed): it
// is done, or given back (a bad checksum, maxBadChunk times fatal), or the
// pull fails (a landing that failed).
func (p *Puller) check(t *transfer, c readChunk) {
	i := c.i
	chunk := t.chunk(i)
	off := int64(i) * t.e.ChunkSize
	var err, landErr error
	switch {
	case t.traits.LandSum != nil:
		var sum uint32
		if sum, landErr = t.traits.LandSum(off, chunk); landErr == nil && sum != t.e.Sums[i] {
			err = fmt.Errorf("%w: chunk %d", ErrChecksum, i)
		}
	case Checksum(chunk) != t.e.Sums[i]:
		err = fmt.Errorf("%w: chunk %d", ErrChecksum, i)
	case t.traits.Land != nil:
		landErr = t.traits.Land(off, chunk)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	defer t.cond.Broadcast()
	switch {
	case landErr != nil:
		if t.fatal == nil {
			t.fatal = fmt.Errorf("pull %s: %w", t.e.Ref(), landErr)
		}
	case err == nil:
		t.done++
		t.feed.mark(i)
		if c.s.feeder {
			c.s.fed += int64(len(chunk))
		}
	default:
		t.bad[i]++
		t.pending = append(t.pending, i)
		if t.bad[i] >= maxBadChunk && t.fatal == nil {
			t.fatal = fmt.Errorf("pull %s: %w: chunk %d (bytes %d-%d) failed its check %d times (last from node %s)",
				t.e.Ref(), ErrChecksum, i, off, off+int64(len(chunk)), t.bad[i], c.s.node)
		}
		p.log().Warn("cluster pull: chunk failed its checksum", "object", t.e.Ref().String(), "node", c.s.node, "chunk", i)
	}
}

// pick returns the index in t.pending of the first chunk s has, or -1.
// Called with t.mu held.
func (t *transfer) pick(s *source) int {
	for k, i := range t.pending {
		if s.have.has(i) {
			return k
		}
	}
	return -1
}

// drop gives up on source s (once) and records why. Called with t.mu held.
func (p *Puller) drop(t *transfer, s *source, dead *atomic.Bool, why string) {
	if dead.Swap(true) {
		return
	}
	s.bad.Store(true)
	t.failed[s.node] = why
	t.reachedFailed = true
	p.failovers.Add(1)
	p.log().Warn("cluster pull: dropping a holder", "object", t.e.Ref().String(), "node", s.node, "err", why,
		"chunks_done", t.done, "chunks", t.want)
}

func (t *transfer) why() string {
	var parts []string
	for _, node := range slices.Sorted(maps.Keys(t.failed)) {
		parts = append(parts, fmt.Sprintf("node %s: %s", node, t.failed[node]))
	}
	if len(parts) == 0 {
		return "no holder failed"
	}
	return strings.Join(parts, "; ")
}

// holderFailed records that a holder could not be opened, and why. A
// holder whose node record is gone or does not verify, or that answers it
// no longer holds the object, is gone; any other failure leaves the
// holder live but unreachable.
func (t *transfer) holderFailed(node string, err error) {
	t.failed[node] = oneLine(err)
	switch {
	case errors.Is(err, ErrChecksum):
		if t.corrupt == nil {
			t.corrupt = map[string]bool{}
		}
		t.corrupt[node] = true
		t.reachedFailed = true
	case !errors.Is(err, errNotLive) && !errors.Is(err, ErrNotFound):
		t.reachedFailed = true
	}
}

// failure is the error of a pull whose every holder failed: wrapping
// ErrNoHolder when they all turned out gone (no live node holds the
// object), ErrChecksum when every one sent bytes that do not verify, else
// ErrUnreachable (one that may still hold it failed).
func (t *transfer) failure(ref Ref) error {
	n := t.want
	switch {
	case !t.reachedFailed:
		return fmt.Errorf("pull %s: %w: every holder failed after %d of %d chunks (%s)", ref, ErrNoHolder, t.done, n, t.why())
	case len(t.corrupt) == len(t.failed):
		return fmt.Errorf("pull %s: %w: every holder sent bytes that fail their checksums (%s)", ref, ErrChecksum, t.why())
	}
	return fmt.Errorf("pull %s: %w: every holder failed after %d of %d chunks in %v (%s)", ref, ErrUnreachable, t.done, n, time.Since(t.start).Round(time.Millisecond), t.why())
}

// errNotLive marks the failure to read a holder's node record: expired,
// or one that does not verify. Such a holder is not a live node.
var errNotLive = errors.New("not a live node")

// notLive is a failure to read node's record, keeping its text and
// matching errNotLive as well.
type notLive struct{ err error }

func (e *notLive) Error() string   { return e.err.Error() }
func (e *notLive) Unwrap() []error { return []error{errNotLive, e.err} }

// liveNode reads node's record, failing with an error that matches
// errNotLive unless the directory did not answer.
func (p *Puller) liveNode(ctx context.Context, node string) (Node, error) {
	n, err := p.Dir.Node(ctx, node)
	if err != nil && !errors.Is(err, ErrUnavailable) && ctx.Err() == nil {
		err = &notLive{err}
	}
	return n, err
}

func holderList(h []string) string {
	if len(h) == 0 {
		return "none"
	}
	return strings.Join(h, ", ")
}

// oneLine keeps an error to its first line.
func oneLine(err error) string {
	s, _, _ := strings.Cut(err.Error(), "\n")
	return s
}
