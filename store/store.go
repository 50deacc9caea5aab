package store

import (
	"cmp"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/cudaipc/cudaipc/internal/loglimit"
	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
	"github.com/cudaipc/cudaipc/store/internal/alloc"
)

// Defaults for the zero values of Config.
const (
	// DefaultCapacity is the capacity of each host device.
	DefaultCapacity = 1 << 30
	// DefaultSpin is how long a connection polls for its next request
	// before sleeping (Config.Spin).
	DefaultSpin = 50 * time.Microsecond
	// DefaultMaxObjectsPerClient bounds the live objects one connection
	// created.
	DefaultMaxObjectsPerClient = 4096
	// DefaultMaxLeasesPerClient bounds the leases (and waiting gets) of one
	// connection.
	DefaultMaxLeasesPerClient = 65536
	// DefaultMaxConns bounds the connections the daemon serves at once (it
	// is lowered to fit the process's descriptor limit).
	DefaultMaxConns = 4096
	// DefaultMaxConnsPerUID bounds the connections of one uid, so that one
	// user cannot take them all.
	DefaultMaxConnsPerUID = 1024
	// DefaultMaxObjectsPerUID bounds the objects of one uid (drafts,
	// sealed, deleted but leased), over all its connections: each costs
	// the daemon about a kilobyte of bookkeeping whatever its size.
	DefaultMaxObjectsPerUID = 65536
)

// How the cuda backend shares GPU arenas (Config.GPUShare).
const (
	// GPUShareIPC allocates arenas with cuMemAlloc and describes each by
	// a legacy CUDA IPC region in every placement: cheapest to open, but
	// only within the daemon's PID namespace.
	GPUShareIPC = "ipc"
	// GPUShareFD allocates arenas with the VMM API (cuMemCreate) and sends
	// each as a POSIX file descriptor with every placement: clients in
	// other PID namespaces (containers) can map it too.
	GPUShareFD = "fd"
)

// Config configures a Store. The zero value is a usable configuration.
type Config struct {
	// Backend is the memory backend: "auto" (or ""), "cuda" or "host".
	// cuda keeps objects on the GPUs (named by UUID) and on "host"; it
	// fails without a CUDA driver and a GPU. auto is cuda when the driver
	// loads and sees a GPU, else host.
	Backend string
	// GPUShare is how GPU arenas of the cuda backend reach clients:
	// GPUShareIPC (or "") or GPUShareFD. It does not matter to the host
	// backend.
	GPUShare string
	// Capacity bounds the memory of each device (host, and every GPU), in
	// bytes; 0 means DefaultCapacity.
	Capacity int64
	// NoEvict turns off the eviction of sealed objects without leases:
	// creates fail with ErrStoreFull instead.
	NoEvict bool
	// AllowUIDs and AllowGIDs admit peers of these uids, and peers whose
	// primary or supplementary groups include these gids, besides the
	// daemon's own uid and root.
	AllowUIDs, AllowGIDs []uint32
	// MaxObjectsPerClient and MaxLeasesPerClient are per-connection
	// limits; 0 means DefaultMaxObjectsPerClient and
	// DefaultMaxLeasesPerClient.
	MaxObjectsPerClient, MaxLeasesPerClient int
	// KeepVersions is how many of a versioned name's newest visible
	// versions are kept without leases (a name may set its own); 0 means
	// DefaultKeepVersions.
	KeepVersions int
	// Quota bounds the bytes of each uid's arenas on each device (host, and
	// every GPU), so that one user's objects cannot evict another's: a
	// create only evicts objects of its own uid, and fails with ErrLimit
	// (protocol limit BYTES_PER_UID), naming the uid, when that uid's
	// quota is full. 0 means
	// a fair share: Capacity divided by the number of uids named
	// (the daemon's own and AllowUIDs, plus one for AllowGIDs), which is
	// all of it when the daemon admits no one else. Root's objects count
	// against root's quota like any uid's.
	Quota int64
	// KeepArenas bounds the bytes of empty GPU arenas each GPU keeps
	// allocated, exported and mapped by its clients, for the next objects
	// of the same owner and sharing (the same pool: docs/architecture.md,
	// "Kept arenas"), so that a put of a large object after the last one
	// went costs no allocation, zeroing or import. Kept arenas count
	// against Capacity and Quota and are given back as soon as a new arena
	// needs their room. 0 means Capacity; negative keeps none. Host arenas
	// are never kept.
	KeepArenas int64
	// MaxConns bounds the connections served at once, and MaxConnsPerUID
	// those of one uid (root's included); 0 means DefaultMaxConns (or less,
	// to fit RLIMIT_NOFILE) and DefaultMaxConnsPerUID. A connection beyond
	// either is answered with a LIMIT error and closed. Peers the store
	// does not admit never count: they are closed as soon as they connect.
	MaxConns, MaxConnsPerUID int
	// MaxObjectsPerUID bounds the objects of one uid over all its
	// connections (drafts, sealed objects, deleted ones still leased,
	// shards); 0 means DefaultMaxObjectsPerUID.
	MaxObjectsPerUID int
	// MaxFDs bounds the descriptors the daemon keeps for objects (host
	// arenas keep two each, VMM GPU arenas and manifests one, a
	// registration one per piece), and MaxFDsPerUID those of one uid. 0
	// means half of what RLIMIT_NOFILE leaves beside MaxConns, and a fair
	// share of that per uid (divided as Quota's default is).
	MaxFDs, MaxFDsPerUID int
	// Spin is how long a connection's receive keeps polling the socket for
	// the next request before its goroutine sleeps in the netpoller, so
	// that a client's back-to-back requests cost no wake-up of the daemon
	// (docs/architecture.md, "The round trip"). It costs up to this much
	// CPU per request received (one window per receive, per connection).
	// 0 means DefaultSpin; negative turns polling off.
	Spin time.Duration
	// Logger receives the store's logs; nil discards them.
	Logger *slog.Logger
	// Registerer receives the store's metrics; nil means a private
	// registry, served by MetricsHandler.
	Registerer prometheus.Registerer
	// Cluster, if set, joins the store to a cluster of daemons: objects
	// created cluster-visible are published, and a get of a name this node
	// lacks may pull a replica (store/cluster.go). nil runs it alone.
	Cluster ClusterHook
}

// Store is the object store daemon: it owns the memory of every object and
// serves clients over a Unix socket (Serve, ListenAndServe). Its methods
// are safe for concurrent use.
type Store struct {
	cfg      Config
	log      *slog.Logger
	backend  backend
	gatherer prometheus.Gatherer
	metrics  *metrics
	uid      uint32 // the daemon's effective uid, always admitted

	// conns counts the connections being served, in all and by uid.
	connMu     sync.Mutex
	conns      int
	connsByUID map[uint32]int
	// refusals bounds the rate of log lines about refused connections.
	refusals *loglimit.Limiter
	// clientLogs are the per-uid rate-limited loggers (logFor).
	logsMu     sync.Mutex
	clientLogs map[uint32]*slog.Logger

	mu          sync.Mutex
	closed      bool
	devices     map[string]*device
	names       map[string]entry    // the name table (names.go): every name taken, whatever holds it
	usage       map[uint32]*usage   // what each uid makes the daemon keep (budget.go)
	fds         int                 // descriptors kept for objects, all uids
	arenaFDs    map[uint64]fdCharge // by arena id: its descriptors' charge, until closed
	waiters     map[string]*waiter  // gets waiting for a name to become readable
	slices      map[string][]string // partial replicas' names, by their bundle's qualified name (slice.go)
	sessions    map[*session]struct{}
	subscribers map[*session]struct{}
	leases      int
	holds       map[uint64]*arenaHold // by arena id: connections that map the arena
	tables      map[*session]struct{} // sessions with a lease table
	nextArena   uint64
	nextSolo    uint64
	nextLease   uint64
	nextSession uint64

	manifests      manifestCache // manifests checked lately (versions.go); its own lock
	sourcesChecked sourcesCache  // no-copy sources tables checked lately (sources.go); its own lock

	pools poolTable // KV block pools (kvpool.go); its own locks
}

// device is the store's state for one device: its allocator and arenas.
type device struct {
	name    string
	alloc   *alloc.Allocator[pool, *object]
	arenas  map[uint64]arena
	deleted int // deleted objects still leased
}

// pool says which objects may share an arena: those of one owner with the
// same sharing, so that whoever may map an arena may read all of it. A
// shared object has an arena of its own (solo, unique): another uid that
// maps it for one object reaches no other object, nor any draft (unsealed
// object) of the owner, nor what freed objects left behind.
type pool struct {
	owner  uint32
	shared bool
	solo   uint64
}

// Exclusive reports whether the pool holds one object at most.
func (p pool) Exclusive() bool { return p.solo != 0 }

// object is a named range of an arena.
type object struct {
	name    string
	size    int64
	shared  bool
	owner   uint32
	created time.Time
	dev     *device
	block   *alloc.Block[pool, *object]

	// state is where o is in its life (state.go): only o.to changes it.
	state   objState
	creator *session // the connection that created it, while it lives
	leases  int
	slotted map[*lease]*session // its leases that have a lease table slot, and their session

	objKind
}

// objKind is what differs between objects, as data: the zero objKind is
// a plain object in the store's memory, and each part set makes it one
// kind more. Kinds combine: a cluster-visible shard of a bundle has ver,
// manifest and cluster set.
type objKind struct {
	ver      *version            // the version it is a shard of; nil for a plain object
	shard    int                 // its shard index in ver
	manifest *manifest           // a bundle's manifest; nil for a plain object
	src      *sources            // a no-copy version's bytes (sources.go), with dev and block nil; nil for memory of the store
	tensor   *storev1.TensorDesc // typed-array descriptor from create (or seal); nil if none; never modified, only replaced
	slice    *sliceOf            // what a partial replica is a slice of (slice.go); nil for every other object
	cluster  *clusterPart        // its place in the cluster (store/cluster.go); nil for a node-local object
	kvpool   *blockPool          // the KV block pool this is the memory of (kvpool.go), never named, leased or evicted; nil for every other object
}

// waiter wakes the gets waiting for one name.
type waiter struct {
	ch chan struct{} // closed when something under that name may have become readable
	n  int           // gets waiting on ch
}

// New returns a store configured by cfg. Call Close when done with it.
func New(cfg Config) (*Store, error) {
	if cfg.Capacity < 0 {
		return nil, invalidf("capacity %d is negative", cfg.Capacity)
	}
	if cfg.Capacity == 0 {
		cfg.Capacity = DefaultCapacity
	}
	if cfg.MaxObjectsPerClient < 0 || cfg.MaxLeasesPerClient < 0 {
		return nil, invalidf("per-client limits must not be negative")
	}
	if cfg.MaxObjectsPerClient == 0 {
		cfg.MaxObjectsPerClient = DefaultMaxObjectsPerClient
	}
	if cfg.MaxLeasesPerClient == 0 {
		cfg.MaxLeasesPerClient = DefaultMaxLeasesPerClient
	}
	if cfg.KeepVersions < 0 {
		return nil, invalidf("keep-versions %d is negative", cfg.KeepVersions)
	}
	if cfg.KeepVersions == 0 {
		cfg.KeepVersions = DefaultKeepVersions
	}
	if cfg.Quota < 0 {
		return nil, invalidf("quota %d is negative", cfg.Quota)
	}
	if cfg.MaxConns < 0 || cfg.MaxConnsPerUID < 0 {
		return nil, invalidf("connection limits must not be negative")
	}
	if cfg.MaxConns == 0 {
		cfg.MaxConns = defaultMaxConns()
	}
	if cfg.MaxConnsPerUID == 0 {
		cfg.MaxConnsPerUID = min(DefaultMaxConnsPerUID, cfg.MaxConns)
	}
	if cfg.MaxObjectsPerUID < 0 || cfg.MaxFDs < 0 || cfg.MaxFDsPerUID < 0 {
		return nil, invalidf("per-uid limits must not be negative")
	}
	if cfg.MaxObjectsPerUID == 0 {
		cfg.MaxObjectsPerUID = DefaultMaxObjectsPerUID
	}
	if cfg.Spin == 0 {
		cfg.Spin = DefaultSpin
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	switch cfg.GPUShare {
	case "":
		cfg.GPUShare = GPUShareIPC
	case GPUShareIPC, GPUShareFD:
	default:
		return nil, invalidf("unknown GPU sharing %q (want %s or %s)", cfg.GPUShare, GPUShareIPC, GPUShareFD)
	}
	b, err := newBackend(cfg.Backend, cfg.GPUShare, cfg.Logger)
	if err != nil {
		return nil, err
	}
	s := &Store{
		cfg:         cfg,
		log:         cfg.Logger,
		backend:     b,
		uid:         uint32(os.Geteuid()),
		connsByUID:  make(map[uint32]int),
		clientLogs:  make(map[uint32]*slog.Logger),
		refusals:    &loglimit.Limiter{Burst: 10, Every: time.Second},
		devices:     make(map[string]*device),
		names:       make(map[string]entry),
		usage:       make(map[uint32]*usage),
		arenaFDs:    make(map[uint64]fdCharge),
		waiters:     make(map[string]*waiter),
		slices:      make(map[string][]string),
		sessions:    make(map[*session]struct{}),
		subscribers: make(map[*session]struct{}),
		holds:       make(map[uint64]*arenaHold),
		tables:      make(map[*session]struct{}),
	}
	total, perUID := fdBudget(rlimitNoFile(), s.cfg.MaxConns, s.uidsNamed())
	if s.cfg.MaxFDs == 0 {
		s.cfg.MaxFDs = total
	}
	if s.cfg.MaxFDsPerUID == 0 {
		s.cfg.MaxFDsPerUID = min(perUID, s.cfg.MaxFDs)
	}
	reg := cfg.Registerer
	if reg == nil {
		r := prometheus.NewRegistry()
		reg, s.gatherer = r, r
	} else if g, ok := reg.(prometheus.Gatherer); ok {
		s.gatherer = g
	} else {
		s.gatherer = prometheus.DefaultGatherer
	}
	s.metrics = newMetrics(s)
	if err := s.metrics.register(reg); err != nil {
		return nil, fmt.Errorf("store: registering metrics: %w", err)
	}
	// The default device exists from the start so that its capacity shows
	// in the metrics before the first object.
	def, err := b.device("")
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	_, err = s.deviceLocked(def)
	s.mu.Unlock()
	if err != nil {
		return nil, err
	}
	return s, nil
}

// deviceLocked returns the state of a canonical device name, creating it on
// first use.
func (s *Store) deviceLocked(name string) (*device, error) {
	if d := s.devices[name]; d != nil {
		return d, nil
	}
	d := &device{name: name, arenas: make(map[uint64]arena)}
	first, most := s.backend.arenaSizes(name)
	a, err := alloc.New(alloc.Config[pool, *object]{
		Capacity:     s.cfg.Capacity,
		Granularity:  s.backend.granularity(name),
		MinArenaSize: first,
		ArenaSize:    most,
		NoEvict:      s.cfg.NoEvict,
		Owner:        func(p pool) uint32 { return p.owner },
		Quota:        s.quota(),
		KeepEmpty:    s.keepArenas(name),
		NewArena: func(p pool, size int64) (uint64, error) {
			s.nextArena++
			id := s.nextArena
			ar, err := s.backend.newArena(name, id, size)
			if err != nil {
				return 0, err
			}
			if err := s.takeFDsLocked(p.owner, ar.descriptors()); err != nil {
				return 0, errors.Join(err, ar.close())
			}
			s.arenaFDs[id] = fdCharge{p.owner, ar.descriptors()}
			d.arenas[id] = ar
			s.log.Debug("arena created", "device", name, "arena", id, "size", size)
			return id, nil
		},
		// An arena is given back when no object is left in it: not
		// sealed, not unsealed, not deleted but still leased. Its memory
		// is freed once no connection maps it (hold.go).
		FreeArena: func(id uint64) {
			ar := d.arenas[id]
			delete(d.arenas, id)
			s.arenaFreedLocked(d, id, ar)
		},
		Evict: func(b *alloc.Block[pool, *object]) { s.evictLocked(b.Value) },
	})
	if err != nil {
		return nil, fmt.Errorf("store: device %s: %w", name, err)
	}
	d.alloc = a
	s.devices[name] = d
	return d, nil
}

// keepArenas returns how many bytes of empty arenas device keeps
// (Config.KeepArenas): none for host memory.
func (s *Store) keepArenas(device string) int64 {
	if !s.backend.keepsArenas(device) || s.cfg.KeepArenas < 0 {
		return 0
	}
	if s.cfg.KeepArenas == 0 {
		return s.cfg.Capacity
	}
	return min(s.cfg.KeepArenas, s.cfg.Capacity)
}

// quota returns each uid's quota on a device: Config.Quota, or a fair
// share of Capacity among the uids named; 0 when that is all of it.
func (s *Store) quota() int64 {
	if s.cfg.Quota > 0 {
		return min(s.cfg.Quota, s.cfg.Capacity)
	}
	n := s.uidsNamed()
	if n <= 1 {
		return 0
	}
	return s.cfg.Capacity / int64(n)
}

// allocLocked places a new object's block on its device: in an arena of
// its owner's pool, a shared object (and a KV block pool's memory) in one of
// its own. Room is made by
// evicting only the owner's objects, and of those a cluster-visible one
// only where vouched names it (with its incarnation): another live node
// holds it too (room.go). A full device is ErrStoreFull and a full quota
// ErrLimit (BYTES_PER_UID), each saying what holds the room; where
// evicting cluster-visible objects might make it and vouched is nil, the
// error is a *roomAsk for them.
//
// With noEvict nothing is evicted: a create whose input may still be
// rejected asks for it (CreateRequest.no_evict).
func (s *Store) allocLocked(d *device, o *object, noEvict bool, vouched map[*object]string) (*alloc.Block[pool, *object], error) {
	p := pool{owner: o.owner, shared: o.shared}
	if o.shared || o.kvpool != nil {
		s.nextSolo++
		p.solo = s.nextSolo
	}
	may := func(b *alloc.Block[pool, *object]) bool { return mayEvictLocked(b.Value, vouched) }
	allocate := func(p pool, size int64, o *object) (*alloc.Block[pool, *object], error) {
		if noEvict {
			return d.alloc.AllocNoEvict(p, size, o)
		}
		return d.alloc.AllocWhere(p, size, o, may)
	}
	if !noEvict && vouched == nil && s.cfg.Cluster != nil && !s.cfg.NoEvict {
		// Eviction keeps its least recently used order over node-local
		// objects and the cluster-visible ones the cluster vouches for: it
		// is asked before anything is evicted.
		b, err := d.alloc.AllocNoEvict(p, o.size, o)
		if errors.Is(err, alloc.ErrFull) && s.sweepLocked() {
			// Leases released through lease tables: their objects may be
			// evicted, and are asked about.
			b, err = d.alloc.AllocNoEvict(p, o.size, o)
		}
		if !errors.Is(err, alloc.ErrFull) {
			return b, err
		}
		if ask := s.roomAskLocked(d, o.owner); ask != nil {
			return nil, ask
		}
	}
	b, err := allocate(p, o.size, o)
	if errors.Is(err, alloc.ErrFull) && s.freeSparesLocked(d) {
		// The memory versioned names keep for their next version goes
		// before anything fails for want of room.
		b, err = allocate(p, o.size, o)
	}
	if errors.Is(err, alloc.ErrFull) && s.sweepLocked() {
		// Leases released through lease tables held the room.
		b, err = allocate(p, o.size, o)
	}
	if !errors.Is(err, alloc.ErrFull) {
		return b, err
	}
	if noEvict && !s.cfg.NoEvict {
		return nil, fmt.Errorf("%w: device %s has no room for %d bytes without evicting, and the create asked not to evict (no_evict): %v", ErrStoreFull, d.name, o.size, err)
	}
	held := s.roomHeldLocked(d, o.owner, vouched)
	if q := s.quota(); q > 0 && d.alloc.QuotaBound(p) {
		return nil, protocol.LimitErrorf(storev1.Error_BYTES_PER_UID,
			"uid %d's quota on device %s is full: its arenas take %d of its %d bytes and evicting its unleased objects would not make room for %d more: delete or release some, or raise the daemon's per-uid quota (its quota setting; by default the capacity divided by the uids it admits): %s",
			o.owner, d.name, d.alloc.Owned(o.owner), q, o.size, held)
	}
	return nil, fmt.Errorf("%w: device %s: %v: %s", ErrStoreFull, d.name, err, held)
}

// evictLocked forgets an object the allocator is about to free.
func (s *Store) evictLocked(o *object) {
	s.deleteLocked(o, eventEvicted)
	s.metrics.evictions.WithLabelValues(o.dev.name).Inc()
	s.logFor(o.owner).Info("object evicted", "name", o.name, "size", o.size, "device", o.dev.name)
}

// freeLocked gives an object's memory back to its device.
func (s *Store) freeLocked(o *object) {
	o.manifest.close()
	if o.src != nil {
		o.src.close()
		if o.src.counted {
			o.src.counted = false
			s.objectGoneLocked(o)
		}
		return
	}
	o.discardLocked()
	o.dev.alloc.Free(o.block)
	o.block = nil
	s.objectGoneLocked(o)
}

// discardLocked tells the backend the object's bytes are no longer needed.
func (o *object) discardLocked() {
	if ar := o.dev.arenas[o.block.Arena().ID]; ar != nil {
		ar.discard(o.block.Offset, o.size)
	}
}

// readableBy reports whether a peer of uid may read o once sealed: its
// owner, root, and anyone when o is shared.
func (o *object) readableBy(uid uint32) bool {
	return o.shared || o.owner == uid || uid == 0
}

// MetricsHandler returns an http.Handler serving the store's metrics in the
// Prometheus exposition format. With a Config.Registerer that is not a
// prometheus.Gatherer, it serves prometheus.DefaultGatherer.
func (s *Store) MetricsHandler() http.Handler {
	return promhttp.HandlerFor(s.gatherer, promhttp.HandlerOpts{})
}

// Close ends every session (aborting unsealed objects, releasing leases)
// and frees the store's memory. Clients keep the mappings they made. Close
// does not stop Serve: cancel its context first. It is idempotent.
func (s *Store) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	sessions := make([]*session, 0, len(s.sessions))
	for ss := range s.sessions {
		sessions = append(sessions, ss)
	}
	s.mu.Unlock()
	for _, ss := range sessions {
		ss.close(errStoreClosed)
	}
	s.closePools()
	s.mu.Lock()
	defer s.mu.Unlock()
	var errs []error
	for _, d := range s.devices {
		for id, ar := range d.arenas {
			errs = append(errs, ar.close())
			delete(d.arenas, id)
		}
	}
	var externals []*external
	for _, e := range s.names {
		switch e.kind {
		case kindObject:
			e.obj.manifest.close()
		case kindSeries:
			for _, v := range e.ser.versions {
				for _, o := range v.shards {
					if o != nil {
						o.manifest.close()
						o.src.close()
					}
				}
			}
		case kindExternal:
			externals = append(externals, e.ext)
		}
	}
	for id, h := range s.holds { // none once every session closed; defensive
		if h.freed != nil {
			errs = append(errs, h.freed.close())
		}
		delete(s.holds, id)
	}
	for _, e := range externals {
		e.leases = 0
		s.dropExternalLocked(e, eventDeleted)
	}
	clear(s.names)
	return errors.Join(errs...)
}

var errStoreClosed = errors.New("store closed")

// info describes an object for list and stat.
type info struct {
	Name     string
	Size     int64
	Device   string
	Sealed   bool
	Leases   int
	Shared   bool
	OwnerUID uint32
	Created  time.Time
	Region   []byte
	// Version, Shards and Shard place a shard of a version (0, 0, 0 for a
	// plain object); ManifestSize and Tensors describe a bundle.
	Version      uint64
	Shards       int
	Shard        int
	ManifestSize int64
	Tensors      int
	Tensor       *storev1.TensorDesc // shared with the object: read only
	// External, Orphaned and ExporterBound describe registered memory and
	// no-copy versions; SourcesSize is a no-copy version's sources table.
	External, Orphaned, ExporterBound bool
	SourcesSize                       int64
	// Space: registered memory's KV space description (opaque here).
	Space []byte
	// Cluster: cluster-visible.
	Cluster bool
	// CreatorCanWrite: the bytes may still change through the creator's
	// writable mapping (docs/hardening.md, "Sealed objects").
	CreatorCanWrite bool
	// Partial: a partial replica (slice.go); Name, Version, Shards and
	// Shard are its bundle's.
	Partial bool
}

// writeSealedLocked reports whether o's arena was sealed against writes
// at o's seal (a shared host object's: sealWrites), so that it can never
// be written again and must not be reused for a new object.
func (o *object) writeSealedLocked() bool {
	ar := o.arenaLocked()
	return o.sealed() && o.shared && ar != nil && ar.placementKind() == storev1.Placement_HOST
}

// arenaLocked returns the arena o's memory is in; nil when o has none.
func (o *object) arenaLocked() arena {
	if o.block == nil {
		return nil
	}
	if ar := o.dev.arenas[o.block.Arena().ID]; ar != nil {
		return ar
	}
	return nil
}

func (o *object) info() info {
	var region []byte
	ar := o.arenaLocked()
	if ar != nil {
		region = ar.objectRegion(o.block.Offset, o.size)
	}
	// Only a shared object's arena, its alone, can be sealed against
	// writes; a private arena holds its owner's drafts too.
	canWrite := !o.sealed() || !o.shared || ar == nil || !ar.sealWrites()
	in := info{
		Region:   region,
		Name:     o.name,
		Size:     o.size,
		Sealed:   o.sealed(),
		Leases:   o.leases - idleLeasesLocked(o.slotted),
		Shared:   o.shared,
		OwnerUID: o.owner,
		Created:  o.created,
		Tensor:   o.tensor,
		Cluster:  o.cluster != nil,

		CreatorCanWrite: canWrite,
	}
	if o.src != nil {
		in.Device, in.External, in.Orphaned, in.ExporterBound = o.src.device, true, o.src.orphaned, o.src.legacy
		if o.manifest != nil {
			in.SourcesSize = o.manifest.sources
		}
	} else {
		in.Device = o.dev.name
	}
	if o.ver != nil {
		in.Version, in.Shards, in.Shard = o.ver.n, len(o.ver.shards), o.shard
	}
	if o.manifest != nil {
		in.ManifestSize, in.Tensors = o.manifest.size, o.manifest.tensors
	}
	if sl := o.slice; sl != nil {
		in.Name, in.Partial = sl.bundle, true
		in.Version, in.Shards, in.Shard = sl.version, int(sl.shards), int(sl.shard)
	}
	return in
}

func sortInfos(infos []info) {
	slices.SortFunc(infos, func(a, b info) int { return cmp.Compare(a.Name, b.Name) })
}
