// Package node is the cluster side of a cudaipc daemon: it joins the
// directory (cluster/etcddir), serves the control channel and the UCX data
// plane (cluster/ucxtransport), pulls replicas (cluster.Puller) into the
// store, and implements store.ClusterHook, so that the store calls it
// where its own name table ends.
//
// A daemon started without --cluster has no Node: nothing here runs and
// nothing needs etcd or UCX.
package node

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sync/errgroup"
	"golang.org/x/sys/unix"

	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/etcddir"
	"github.com/cudaipc/cudaipc/cluster/ucxtransport"
	"github.com/cudaipc/cudaipc/store"
	"github.com/cudaipc/cudaipc/transport/ucx"
)

// DefaultControlPort is the control channel's port unless configured.
const DefaultControlPort = 7946

// Config configures a Node.
type Config struct {
	// Directory configures the etcd directory (endpoints, node name,
	// secret, TLS).
	Directory etcddir.Config
	// Listen is the control channel's listen address; "" means the
	// address the node advertises: Advertise, or else the address this
	// host uses to reach etcd with DefaultControlPort. Never every
	// interface unless asked (":PORT").
	Listen string
	// Advertise is the host:port other daemons reach the control channel
	// at; "" means the address this host uses to reach etcd, with the
	// listening port.
	Advertise string
	// Logger receives the node's logs; nil discards them.
	Logger *slog.Logger
	// StreamsPerHolder is how many reads a pull keeps in flight from one
	// holder (cluster.Puller.StreamsPerHolder); 0 means
	// cluster.DefaultStreamsPerHolder.
	StreamsPerHolder int
	// ReadBytes bounds one read of a pull (cluster.Puller.ReadBytes); 0
	// reads one chunk at a time.
	ReadBytes int64
	// Lanes is how many UCX workers serve and pull
	// (ucxtransport.Options.Lanes); 0 means one.
	Lanes int
	// Read is how the node reads peers' memory
	// (ucxtransport.Options.Read); "" means ucxtransport.ReadFetch.
	Read ucxtransport.ReadMode
	// HostChecksums makes the node compute GPU objects' chunk checksums
	// on the host, at the seal and after each chunk a pull lands: by
	// default the device computes them (cudaipc.Device.ChunkCRC32C), where
	// its driver runs the kernel, and the host reads none of the bytes.
	HostChecksums bool
	// ChunkSize is the chunk of the objects this node seals: a power of
	// two from cluster.MinChunkSize to cluster.MaxChunkSize. 0 means
	// cluster.ChunkSizeFor's; an object too large for this many chunks of
	// it gets ChunkSizeFor's larger one.
	ChunkSize int64
	// StageFirst makes the seal of a GPU object stage it into pinned host
	// memory before the record is published, as where the device cannot
	// checksum. By default (where it can) the record goes out once the
	// device has the checksums and the staging runs behind it, readers'
	// fetches of bytes not staged yet waiting at this node; where both
	// daemons share one machine's memory bandwidth, the staging then
	// competes with the transfer it feeds.
	StageFirst bool
}

// Node is a daemon's membership of a cluster.
type Node struct {
	cfg  Config
	log  *slog.Logger
	dir  *etcddir.Directory
	tr   *ucxtransport.Transport
	ln   net.Listener
	cs   *cluster.ControlServer
	p    *cluster.Puller
	st   *store.Replicas
	stop context.CancelFunc
	wg   sync.WaitGroup

	exposures, exposedBytes atomic.Uint64

	// watchMu is held while the watch handles an event, and watched
	// counts the events handled: tests hold the watch back with them.
	watchMu sync.Mutex
	watched atomic.Uint64
	// withdrawWaits counts publishes that waited for this node's stale
	// claim on their name to go (awaitOwnWithdrawal); tests hold Deleted
	// back with beforeDelete.
	withdrawWaits atomic.Uint64
	beforeDelete  atomic.Pointer[func()]
	// stagedBytes counts bytes of GPU objects copied through pinned host
	// memory (gpu.go): exposed, or landed in a replica.
	stagedBytes atomic.Uint64
	// deviceSummed and hostSummed count bytes of GPU objects whose chunk
	// checksums the device and the host computed (gpu.go); noDeviceSums
	// holds the devices that cannot (logged once).
	deviceSummed, hostSummed atomic.Uint64
	noDeviceSums             sync.Map
	hostSums                 atomic.Bool // Config.HostChecksums
	// stageHook, when set, runs before each slice a filling staging
	// copies (tests slow it down or fail it).
	stageHook atomic.Pointer[func(off int64) error]
	pinned    pinnedPool
	// lastGPUSeal is where the time of the last GPU object's seal went;
	// registerNanos counts the time pinned buffers took to register with
	// UCX (the first exposure of each).
	lastGPUSeal   atomic.Pointer[gpuSealTimes]
	registerNanos atomic.Int64
	// replicaNanos counts the time the store took to make GPU replicas
	// (their device memory).
	replicaNanos atomic.Int64

	// waitingGets counts the gets waiting for the cluster to have their
	// name (untilFetched).
	waitingGets atomic.Int64

	mu      sync.Mutex
	arenas  map[uint64]*arenaReg          // registered arenas, by store arena id
	pins    map[string]*store.ClusterFile // holds for pins, by pin key
	filling map[string]*filling           // GPU objects staged behind their records, by incarnation (filling.go)

	// mirror answers lookups without etcd while it is in sync.
	mirror  *etcddir.Mirror
	slicing slicePulls // partial replicas being read (partial.go)
	spaces  spaceMaps  // KV spaces' memory mapped for reads across nodes (kvspace.go)
	descs   spaceDescs // KV space descriptions parsed, and their registrations (kvhold.go)
	// stageBufs and gpuPieces are staged KV reads' buffers, kvStagedBytes
	// the bytes gathered into them, spaceMode how reads go (kvstage.go).
	stageBufs     stageBufs
	gpuPieces     gpuPieces
	kvStagedBytes atomic.Uint64
	// kvReads, kvReadsFailed and kvReadBytes count the kv_reads this node
	// made for its clients (kvspace.go).
	kvReads, kvReadsFailed, kvReadBytes atomic.Uint64
	spaceMode                           atomic.Int32
	// pools places the keys of cluster-wide KV block pools (kvpool.go);
	// poolGetHook, when set, runs when a node answered a get, before its
	// blocks are fetched (tests kill it there).
	pools       poolPlacement
	poolGetHook atomic.Pointer[func(node string)]
}

// arenaReg is an arena registered with UCX while exposures use it: a host
// arena mapped into the daemon (mem), or a GPU arena (mem nil).
type arenaReg struct {
	mem  []byte
	reg  *ucxtransport.Region
	refs int
}

// Start joins the cluster's data plane and directory: it initializes UCX,
// listens for control connections and opens the directory. Attach then
// binds it to the store and announces the node.
func Start(ctx context.Context, cfg Config) (*Node, error) {
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	cfg.Directory.Logger = log
	if err := cluster.ValidateNodeName(cfg.Directory.Node); err != nil {
		return nil, fmt.Errorf("--node: %w", err)
	}
	if c := cfg.ChunkSize; c != 0 && !cluster.ValidChunkSize(c) {
		return nil, fmt.Errorf("chunk size %d: want a power of two from %d to %d bytes", c, cluster.MinChunkSize, cluster.MaxChunkSize)
	}
	tr, err := ucxtransport.NewWith("cudaipc-"+cfg.Directory.Node, ucxtransport.Options{Lanes: cfg.Lanes, Read: cfg.Read})
	if err != nil {
		return nil, fmt.Errorf("cluster data plane: %w", err)
	}
	if v, err := ucx.Version(); err == nil && (strings.HasPrefix(v, "1.12.") || strings.HasPrefix(v, "1.13.")) {
		// Built with assertions (as Debian's is), UCX 1.12 and 1.13 abort
		// when a peer dies while their endpoint is being wired up
		// (docs/cluster.md, "Failure behaviour").
		log.Warn("this UCX aborts the daemon if a peer dies while its endpoint is being wired up (an assertion UCX 1.14 removed): set ucx-lib to a UCX of 1.14 or later, or a build configured with --disable-assertions",
			"ucx", v, "lib", ucx.Library())
	}
	ln, adv, err := listenControl(cfg.Listen, cfg.Advertise, cfg.Directory.Endpoints)
	if err != nil {
		tr.Close()
		return nil, err
	}
	if err := cluster.ValidateControlAddr(adv); err != nil {
		ln.Close()
		tr.Close()
		return nil, fmt.Errorf("cluster control channel: advertised %w", err)
	}
	cfg.Advertise = adv
	dir, err := etcddir.Open(ctx, cfg.Directory)
	if err != nil {
		ln.Close()
		tr.Close()
		return nil, err
	}
	n := &Node{cfg: cfg, log: log, dir: dir, tr: tr, ln: ln, arenas: map[uint64]*arenaReg{}, pins: map[string]*store.ClusterFile{},
		filling: map[string]*filling{},
		mirror:  dir.Mirror(context.Background())}
	n.pinned.max = DefaultPinnedIdle
	n.hostSums.Store(cfg.HostChecksums)
	feeding := &cluster.Feeding{} // fan-out: replicas being pulled feed other readers (fanout.go)
	n.p = &cluster.Puller{Dir: dir, Transport: tr, Secret: cfg.Directory.Secret, Sink: sink{n}, Logger: log,
		Feeds: dir, Feeding: feeding, StreamsPerHolder: cfg.StreamsPerHolder, ReadBytes: cfg.ReadBytes}
	n.cs = &cluster.ControlServer{Node: cfg.Directory.Node, Secret: cfg.Directory.Secret, Source: source{n}, Logger: log,
		Feeding: feeding}
	return n, nil
}

// listenControl listens for control connections at listen, or, when it
// is "", at the address the node advertises, and returns the listener
// and that address (advertise, or the host's address towards etcd with
// the listening port). A failure to listen names --cluster-listen, which
// chooses another address.
func listenControl(listen, adv string, endpoints []string) (net.Listener, string, error) {
	from := "--cluster-listen"
	if listen == "" {
		if adv != "" {
			listen, from = adv, "from --cluster-advertise, without --cluster-listen"
		} else {
			a, err := advertise(endpoints, DefaultControlPort)
			if err != nil {
				return nil, "", err
			}
			listen, from = a, "this host's address towards etcd, without --cluster-listen"
		}
	}
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		next := strconv.Itoa(portOf(listen) + 1)
		hint := "give this daemon another address with --cluster-listen HOST:PORT"
		switch {
		case errors.Is(err, unix.EADDRINUSE) && listen == adv:
			hint = "another daemon or program holds that port: give this one another, e.g. --cluster-advertise HOST:" + next +
				" (it listens there unless --cluster-listen HOST:PORT says otherwise), or stop the other"
		case errors.Is(err, unix.EADDRINUSE):
			hint = "another daemon or program holds that port: give this one another with --cluster-listen HOST:PORT (e.g. port " + next + "), or stop the other"
		}
		return nil, "", fmt.Errorf("cluster control channel: listen on %s (%s): %w; %s", listen, from, err, hint)
	}
	if adv == "" {
		if adv, err = advertise(endpoints, ln.Addr().(*net.TCPAddr).Port); err != nil {
			ln.Close()
			return nil, "", err
		}
	}
	return ln, adv, nil
}

// portOf is the port of a host:port address, or DefaultControlPort.
func portOf(addr string) int {
	_, p, err := net.SplitHostPort(addr)
	if n, perr := strconv.Atoi(p); err == nil && perr == nil && n > 0 {
		return n
	}
	return DefaultControlPort
}

// advertise finds the address this host reaches etcd from: the control
// channel's host as other nodes see it.
func advertise(endpoints []string, port int) (string, error) {
	for _, ep := range endpoints {
		u, err := url.Parse(ep)
		if err != nil || u.Host == "" {
			continue
		}
		c, err := net.Dial("udp", u.Host)
		if err != nil {
			continue
		}
		ip := c.LocalAddr().(*net.UDPAddr).IP
		c.Close()
		return net.JoinHostPort(ip.String(), strconv.Itoa(port)), nil
	}
	return "", errors.New("cluster control channel: cannot tell which address other nodes reach this one at: give it (--cluster-advertise HOST:PORT)")
}

// Attach binds the node to the store, announces it in the directory and
// starts serving peers. The store must have been made with this node as
// its Config.Cluster.
func (n *Node) Attach(ctx context.Context, st *store.Store) error {
	n.st = st.Replicas()
	// The worker address stays out of the directory: it is a capability
	// (docs/cluster.md, "What UCX does not confine").
	rec := cluster.Node{Name: n.cfg.Directory.Node, Control: n.cfg.Advertise}
	err := n.dir.Join(ctx, rec)
	if errors.Is(err, cluster.ErrExists) {
		// A node restarted after a crash finds its previous record alive
		// until that lease's TTL runs out: wait that long, no more.
		ttl := n.cfg.Directory.TTL
		if ttl <= 0 {
			ttl = etcddir.DefaultTTL
		}
		n.log.Info("waiting for this node's previous record to expire", "node", rec.Name, "ttl", ttl)
		deadline := time.Now().Add(ttl + 2*time.Second)
		for errors.Is(err, cluster.ErrExists) && time.Now().Before(deadline) {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(500 * time.Millisecond):
			}
			err = n.dir.Join(ctx, rec)
		}
	}
	if err != nil {
		return err
	}
	wctx, cancel := context.WithCancel(context.Background())
	n.stop = cancel
	n.wg.Go(func() { _ = n.cs.Serve(n.ln) })
	n.wg.Go(func() { n.watch(wctx) })
	n.wg.Go(func() { n.sweepSpaces(wctx) })
	n.log.Info("joined the cluster", "node", n.cfg.Directory.Node, "control", n.cfg.Advertise, "etcd", n.cfg.Directory.Endpoints)
	n.checkSecret(ctx)
	return nil
}

// checkSecret says loudly, at start, when the other nodes' records do not
// verify with this node's secret: the cluster secrets probably differ, and
// this node can read none of their objects, nor they any of its.
func (n *Node) checkSecret(ctx context.Context) {
	bad, good, err := n.dir.UnverifiedNodes(ctx)
	if err != nil {
		n.log.Warn("could not check the other nodes' records against this node's cluster secret", "err", err)
		return
	}
	if len(bad) == 0 {
		return
	}
	msg := "the records of other nodes do not verify with this node's --cluster-secret: the cluster secrets probably differ (or the records are forged); this node cannot read their objects, nor they this node's"
	if good > 0 {
		msg = "the records of some other nodes do not verify with this node's --cluster-secret: those nodes probably have another cluster secret (or their records are forged); objects they hold cannot be read here"
	}
	n.log.Error(msg, "nodes", bad, "verified", good)
}

// Close leaves the cluster: this node's records go at once, exposures and
// pins end, UCX is released.
func (n *Node) Close() error {
	if n.stop != nil {
		n.stop()
	}
	n.ln.Close()
	n.wg.Wait()
	n.mirror.Close()
	n.mu.Lock()
	for k, f := range n.pins {
		f.Release()
		delete(n.pins, k)
	}
	n.mu.Unlock()
	n.p.Close()
	n.spaces.close()
	n.stageBufs.close()
	n.gpuPieces.close()
	n.pinned.close()
	err := n.dir.Close()
	n.tr.Close()
	return err
}

// Directory is the node's directory, for listings.
func (n *Node) Directory() *etcddir.Directory { return n.dir }

// Mirror is the node's mirror of the directory, for diagnostics and
// tests.
func (n *Node) Mirror() *etcddir.Mirror { return n.mirror }

// Stats are the puller's counters.
func (n *Node) Stats() cluster.PullStats { return n.p.Stats() }

// watch drops replicas of names the cluster deleted, retires replicas of
// versions a commit leaves out of the name's keep_last, and holds replicas
// while readers pin them.
func (n *Node) watch(ctx context.Context) {
	for ev := range n.dir.Watch(ctx) {
		n.watchMu.Lock()
		n.handle(ctx, ev)
		n.watchMu.Unlock()
		n.watched.Add(1)
	}
}

// handle acts on one event of the directory's watch.
func (n *Node) handle(ctx context.Context, ev etcddir.Event) {
	switch {
	case ev.Deleted:
		// The owner's delete, sealed in a tombstone. Only the incarnation
		// deleted: this node may have created the name again before its
		// watch saw the delete.
		if n.st.Drop(ev.Ref.Owner, ev.Ref.Name, ev.ID) {
			n.log.Info("cluster deleted a name: local replica dropped", "object", ev.Ref.String())
		}
	case ev.Committed:
		// Retention is cluster-wide where the publisher gave keep_last
		// (Keep); a record without it leaves it to each node.
		if ev.Keep == 0 || ev.Ref.Version <= uint64(ev.Keep) {
			return
		}
		if k := n.st.Retire(ev.Ref.Owner, ev.Ref.Name, ev.Ref.Version-uint64(ev.Keep)); k > 0 {
			n.log.Debug("versions out of the cluster's keep_last retired", "object", ev.Ref.String(), "keep", ev.Keep, "versions", k)
		}
	case ev.Pinned:
		f, err := n.st.Lease(ev.Ref.Owner, ev.Ref.Name, ev.Ref.Version, ev.Ref.Shard, "")
		if err != nil {
			return // not here (any more): the reader moves on
		}
		n.mu.Lock()
		if old := n.pins[ev.Key]; old != nil {
			old.Release()
		}
		n.pins[ev.Key] = f
		n.mu.Unlock()
		f.File.Close()
	case ev.Unpinned:
		n.mu.Lock()
		if f := n.pins[ev.Key]; f != nil {
			f.Release()
			delete(n.pins, ev.Key)
		}
		n.mu.Unlock()
	}
}

// Fetch implements store.ClusterHook: it pulls owner's name, or the
// version a get asks for, when the cluster has it and the reader may read
// it. A get that waits waits for any node to create it (untilFetched).
func (n *Node) Fetch(ctx context.Context, reader, owner uint32, name string, sel store.ClusterGet) error {
	return n.untilFetched(ctx, owner, name, sel, func() error { return n.fetch(ctx, reader, owner, name, sel) })
}

func (n *Node) fetch(ctx context.Context, reader, owner uint32, name string, sel store.ClusterGet) error {
	return n.withRecord(ctx, owner, name, sel, 0, func(e cluster.Entry) error {
		if e.Version != 0 {
			return n.pullVersion(ctx, reader, e)
		}
		if !readable(e, reader) {
			return fmt.Errorf("%s: %w", e.Ref(), store.ErrNotFound) // not the reader's to pull
		}
		_, err := n.p.PullEntry(ctx, e)
		return err
	})
}

func readable(e cluster.Entry, reader uint32) bool {
	return e.Shared || reader == e.Owner || reader == 0
}

// shardPulls bounds the shards of one version pulled at once. A bundle's
// shards are pulled side by side (each with its own chunks in flight), so
// that the many shards of a large manifest (the MoE shapes: 19 of at most
// 1,000 tensors) do not each wait for the previous one's lookup, exposure
// and last chunk.
const shardPulls = 4

// pullVersion pulls every shard of the version whose shard 0 is e that
// this node lacks, up to shardPulls at once: the version is published here
// when the last is sealed. The first failure stops the others.
func (n *Node) pullVersion(ctx context.Context, reader uint32, e cluster.Entry) error {
	if !readable(e, reader) {
		return fmt.Errorf("%s: %w", e.Ref(), store.ErrNotFound)
	}
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(shardPulls)
	for shard := range e.Shards {
		if n.st.Has(e.Owner, e.Name, e.Version, shard) {
			continue // published here: the version's other shards came from other nodes
		}
		ref := cluster.Ref{Owner: e.Owner, Name: e.Name, Version: e.Version, Shard: shard}
		g.Go(func() error {
			var err error
			if shard == e.Shard {
				_, err = n.p.PullEntry(gctx, e)
			} else {
				err = n.withLookup(gctx, ref, func(e cluster.Entry) error { _, err := n.p.PullEntry(gctx, e); return err })
			}
			if errors.Is(err, cluster.ErrNotFound) {
				return fmt.Errorf("%w: %v", store.ErrNotFound, err)
			}
			return err
		})
	}
	return g.Wait()
}

// Sealed implements store.ClusterHook: it records the object (or shard)
// with the checksums of its chunks, this node as its holder; the last shard
// of a version recorded commits the version as the name's latest.
func (n *Node) Sealed(ctx context.Context, co store.ClusterObject) (string, error) {
	f, err := n.st.Lease(co.Owner, co.Name, co.Version, co.Shard, "")
	if err != nil {
		return "", err
	}
	release := f.Release
	defer func() {
		if release != nil {
			release()
		}
	}()
	chunk := cluster.ChunkSizeFor(co.Size)
	if n.cfg.ChunkSize != 0 {
		chunk = cluster.ChunkSizeFrom(co.Size, n.cfg.ChunkSize)
	}
	id := cluster.NewID()
	var sums []uint32
	var staged *pinned // a GPU object's bytes in pinned memory, for its first exposures
	var times *gpuSealTimes
	filled := false
	if f.GPU != nil && n.fillsAfterPublish(f.GPU.Device) {
		// Published once the device has the checksums, staged behind it.
		start, allocs := time.Now(), n.pinned.allocNanos.Load()
		var started bool
		sums, started, err = n.gpuFilling(ctx, f, chunk, id)
		if started {
			release = nil // the staging releases f when it is done
		}
		switch {
		case err == nil:
			filled = true
			times = &gpuSealTimes{stage: time.Since(start), alloc: time.Duration(n.pinned.allocNanos.Load() - allocs)}
		case !errors.Is(err, errNoDeviceSums):
			return "", err
		}
	}
	switch {
	case filled:
	case f.GPU != nil:
		start, allocs := time.Now(), n.pinned.allocNanos.Load()
		if sums, staged, err = n.gpuChecksums(ctx, f, chunk); err != nil {
			return "", err
		}
		defer func() { n.pinned.put(staged) }()
		times = &gpuSealTimes{stage: time.Since(start), alloc: time.Duration(n.pinned.allocNanos.Load() - allocs)}
	default:
		mem, base, err := mapRange(f.File, f.Offset, f.Size, unix.PROT_READ)
		f.File.Close()
		if err != nil {
			return "", err
		}
		sums = cluster.ChecksumsParallel(mem, chunk)
		unix.Munmap(base)
	}
	o := cluster.Object{Name: co.Name, Owner: co.Owner, Shared: co.Shared, Size: co.Size, ChunkSize: chunk,
		Version: co.Version, Shard: co.Shard, Shards: co.Shards, Keep: co.Keep,
		Sums: sums, Manifest: co.Manifest, GPU: f.GPU != nil, ID: id}
	published := time.Now()
	if _, err := n.dir.Publish(ctx, o); err != nil {
		if !errors.Is(err, cluster.ErrExists) || !n.awaitOwnWithdrawal(ctx, o) {
			return "", err
		}
		if _, err := n.dir.Publish(ctx, o); err != nil {
			return "", err
		}
	}
	if staged != nil {
		staged.tag = o.ID
	}
	if times != nil {
		times.publish = time.Since(published)
		n.lastGPUSeal.Store(times)
		n.log.Debug("GPU object sealed", "object", o.Ref().String(), "size", o.Size,
			"stage", times.stage, "pinned_alloc", times.alloc, "publish", times.publish)
	}
	return o.ID, nil
}

// withdrawWait bounds how long a publish waits for this node's stale claim
// on the name to leave the directory (awaitOwnWithdrawal).
const withdrawWait = 5 * time.Second

// awaitOwnWithdrawal is for a publish of o that found o's name recorded
// with live holders. The store tells the cluster of a delete (or an
// eviction) after answering it, so a put right after a delete of the same
// name finds the deleted incarnation still recorded, with this node among
// its holders. This node cannot hold that incarnation any more (the name
// is o's here now), so its claim is on its way out: wait for it to go,
// bounded, and report whether it went (the publish is then worth trying
// again; it still fails if other nodes hold the old incarnation).
func (n *Node) awaitOwnWithdrawal(ctx context.Context, o cluster.Object) bool {
	self := n.cfg.Directory.Node
	stale := func() (bool, error) {
		e, err := n.dir.Lookup(ctx, o.Ref())
		if errors.Is(err, cluster.ErrNotFound) {
			return false, nil
		}
		if err != nil {
			return false, err
		}
		return e.ID != o.ID && slices.Contains(e.Holders, self), nil
	}
	if ok, err := stale(); err != nil || !ok {
		return false
	}
	n.withdrawWaits.Add(1)
	deadline := time.Now().Add(withdrawWait)
	for wait := time.Millisecond; time.Now().Before(deadline); wait = min(2*wait, 50*time.Millisecond) {
		select {
		case <-ctx.Done():
			return false
		case <-time.After(wait):
		}
		if ok, err := stale(); err == nil && !ok {
			return true
		}
	}
	return false
}

// Deleted implements store.ClusterHook: the name goes from the cluster, and
// every holder drops its replica.
func (n *Node) Deleted(co store.ClusterObject) {
	if f := n.beforeDelete.Load(); f != nil {
		(*f)()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := n.dir.Delete(ctx, co.Owner, co.Name); err != nil && !errors.Is(err, cluster.ErrNotFound) {
		n.log.Warn("cluster delete failed: other nodes keep their replicas until it is deleted again", "object", co.Name, "owner", co.Owner, "err", err)
	}
}

// Dropped implements store.ClusterHook: this node no longer holds the
// object.
func (n *Node) Dropped(co store.ClusterObject) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := n.dir.RemoveHolder(ctx, cluster.Ref{Owner: co.Owner, Name: co.Name, Version: co.Version, Shard: co.Shard}); err != nil {
		n.log.Warn("withdrawing as a holder failed (the record goes with this node's lease)", "object", co.Name, "err", err)
	}
}

// mapRange maps [off, off+size) of f (page-aligned below), returning the
// range and the whole mapping (for Munmap).
func mapRange(f *os.File, off, size int64, prot int) (mem, whole []byte, err error) {
	page := int64(os.Getpagesize())
	start := off &^ (page - 1)
	whole, err = unix.Mmap(int(f.Fd()), start, int(off-start+size), prot, unix.MAP_SHARED)
	if err != nil {
		return nil, nil, fmt.Errorf("map the object: %w", err)
	}
	return whole[off-start : off-start+size], whole, nil
}

// sink makes replicas in the store (cluster.Sink).
type sink struct{ n *Node }

func (s sink) Create(ctx context.Context, o cluster.Object) (cluster.Replica, error) {
	start := time.Now()
	f, err := s.n.st.Create(store.ClusterObject{Owner: o.Owner, Name: o.Name, Size: o.Size, Shared: o.Shared,
		Version: o.Version, Shard: o.Shard, Shards: o.Shards, Keep: o.Keep, ID: o.ID, Manifest: o.Manifest, GPU: o.GPU})
	if err != nil {
		// The reader's error says where the replica did not fit (the
		// store's own message names the device): this node, not the
		// holder the bytes come from.
		return nil, fmt.Errorf("node %s: replica of %s: %w", s.n.cfg.Directory.Node, o.Ref(), err)
	}
	if f.GPU != nil {
		s.n.replicaNanos.Add(int64(time.Since(start)))
		return s.createGPU(f, o)
	}
	mem, whole, err := mapRange(f.File, f.Offset, f.Size, unix.PROT_READ|unix.PROT_WRITE)
	if err != nil {
		f.File.Close()
		f.Release()
		return nil, err
	}
	return &replica{n: s.n, f: f, o: o, mem: mem, whole: whole}, nil
}

type replica struct {
	n      *Node
	f      *store.ClusterFile // f.File stays open for Expose until the end
	o      cluster.Object
	mem    []byte
	whole  []byte
	sealed bool
	feeds  feedRefs // exposures to peers while it is pulled (fanout.go)
}

func (r *replica) Bytes() []byte { return r.mem }

// Seal makes the replica visible. Nothing writes through its mapping any
// more (the pull's reads have completed), and the mapping is unmapped after
// the seal on a goroutine of its own: tearing down the page tables of a
// large replica is then off the get's path.
func (r *replica) Seal() error {
	whole := r.whole
	r.whole, r.mem = nil, nil
	err := r.f.Seal()
	r.end()
	r.sealed = err == nil
	if whole != nil {
		go unix.Munmap(whole) //nolint:errcheck // a mapping of ours: it cannot fail
	}
	return err
}

func (r *replica) Abort() {
	r.unmap()
	r.end()
	if r.sealed {
		r.holdWhileExposed()
		r.n.st.Drop(r.o.Owner, r.o.Name, r.o.ID)
	} else {
		r.detachWhileExposed()
	}
}

func (r *replica) unmap() {
	if r.whole != nil {
		unix.Munmap(r.whole)
		r.whole, r.mem = nil, nil
	}
}

// source exposes local replicas to authenticated peers (cluster.Source):
// each arena is mapped and registered with UCX once while any of its
// objects is exposed.
type source struct{ n *Node }

func (s source) Expose(ref cluster.Ref, id string) (cluster.Exposure, func(), error) {
	n := s.n
	f, err := n.st.Lease(ref.Owner, ref.Name, ref.Version, ref.Shard, id)
	if err != nil {
		if errors.Is(err, store.ErrNotFound) {
			err = fmt.Errorf("%w: %v", cluster.ErrNotFound, err)
		}
		return cluster.Exposure{}, nil, err
	}
	var e cluster.Exposure
	var rel func()
	if f.GPU != nil {
		e, rel, err = n.exposeGPU(f, id)
	} else {
		e, rel, err = n.exposeArena(f)
		f.File.Close()
	}
	if err != nil {
		f.Release()
		return e, nil, err
	}
	var once sync.Once
	return e, func() {
		once.Do(func() {
			rel()
			f.Release()
		})
	}, nil
}

// ReadReplica implements cluster.ReplicaReader: it copies a small replica
// out of its arena while the store's lease holds it.
func (s source) ReadReplica(ref cluster.Ref, id string, max int64) ([]byte, error) {
	n := s.n
	f, err := n.st.Lease(ref.Owner, ref.Name, ref.Version, ref.Shard, id)
	if err != nil {
		if errors.Is(err, store.ErrNotFound) {
			err = fmt.Errorf("%w: %v", cluster.ErrNotFound, err)
		}
		return nil, err
	}
	defer f.Release()
	if f.GPU != nil {
		return nil, fmt.Errorf("replica of %s is in GPU memory: open it", ref)
	}
	defer f.File.Close()
	if f.Size > max {
		return nil, fmt.Errorf("replica of %s is %d bytes, more than %d to read inline", ref, f.Size, max)
	}
	b := make([]byte, f.Size)
	if _, err := f.File.ReadAt(b, f.Offset); err != nil {
		return nil, fmt.Errorf("read the replica of %s: %w", ref, err)
	}
	n.exposures.Add(1)
	n.exposedBytes.Add(uint64(f.Size))
	return b, nil
}

// exposeArena registers f's arena with UCX (mapped and registered once
// while any of its objects is exposed) and says where peers read f's
// object; release ends the exposure. f itself is left to the caller.
func (n *Node) exposeArena(f *store.ClusterFile) (cluster.Exposure, func(), error) {
	return n.exposeRegistered(f, func() (*arenaReg, error) {
		mem, err := unix.Mmap(int(f.File.Fd()), 0, int(f.ArenaSize), unix.PROT_READ, unix.MAP_SHARED)
		if err != nil {
			return nil, fmt.Errorf("map arena %d: %w", f.ArenaID, err)
		}
		reg, err := n.tr.Register(mem)
		if err != nil {
			unix.Munmap(mem)
			return nil, fmt.Errorf("register arena %d with UCX: %w", f.ArenaID, err)
		}
		return &arenaReg{mem: mem, reg: reg}, nil
	})
}

// exposeRegistered says where peers read f's object through its arena's
// UCX registration, which register makes (under n.mu) where none is held;
// release ends the exposure, and the last one of the arena closes the
// registration and unmaps its memory.
func (n *Node) exposeRegistered(f *store.ClusterFile, register func() (*arenaReg, error)) (cluster.Exposure, func(), error) {
	n.mu.Lock()
	a := n.arenas[f.ArenaID]
	if a == nil {
		var err error
		if a, err = register(); err != nil {
			n.mu.Unlock()
			return cluster.Exposure{}, nil, err
		}
		n.arenas[f.ArenaID] = a
	}
	a.refs++
	n.mu.Unlock()
	// unref drops this exposure's reference; the last one closes the
	// registration outside n.mu (the close waits for fetch replies under
	// way, which must not hold up other exposures).
	unref := func() {
		n.mu.Lock()
		a.refs--
		last := a.refs == 0
		if last && n.arenas[f.ArenaID] == a {
			delete(n.arenas, f.ArenaID)
		}
		n.mu.Unlock()
		if last {
			a.reg.Close()
			if a.mem != nil {
				unix.Munmap(a.mem)
			}
		}
	}
	key, closeWindow, err := a.reg.Window(f.Offset, f.Size)
	if err != nil {
		unref()
		return cluster.Exposure{}, nil, err
	}
	e := cluster.Exposure{Worker: n.tr.WorkerAddress(), RKey: key, Addr: a.reg.Addr(f.Offset), Size: f.Size}
	n.exposures.Add(1)
	n.exposedBytes.Add(uint64(f.Size))
	return e, func() {
		closeWindow()
		unref()
	}, nil
}
