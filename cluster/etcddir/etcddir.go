// Package etcddir is the cluster directory on etcd v3: node records on
// each node's lease, object records with their chunk checksums, holders,
// versioned names' latest versions committed in one transaction, watches
// for newer versions, and pins on the reader's lease. Every value is a
// cluster record sealed with the cluster secret (cluster.Seal); a value
// that does not verify is reported and ignored, never trusted.
//
// The directory is an index and cannot delete data: a holder drops a
// replica only on the owner's delete, a tombstone sealed with the secret,
// and each node writes back its own records that went or changed
// otherwise (guard.go).
//
// The key layout is in keys.go and docs/cluster.md. A node keeps a Mirror
// of the object, holder and latest records (mirror.go), so that its gets
// of names with a live holder read no etcd.
//
// # Failures
//
// Every call is bounded by Config.CallTimeout. When etcd cannot be reached,
// calls fail with an error wrapping cluster.ErrUnavailable, and for a short
// while after such a failure they fail at once rather than each waiting out
// its timeout. The node's lease is renewed in the background; when it is
// lost (etcd away for longer than the TTL, or renewals late on a loaded
// machine), a new one is granted as soon as etcd answers again and every
// record this node keeps on its lease (its node record, holders, pins) is
// written again on it. The client reconnects within about a second of etcd
// answering (reconnectBackoff). etcd keeps leases across its own restart
// and renews them all when it comes back, so the records on the lost lease
// reappear with etcd for about a TTL; the rewrite, that prompt, normally
// moves them onto the new lease before the lost one runs out, without a
// gap.
package etcddir

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	"go.etcd.io/etcd/client/pkg/v3/transport"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/cudaipc/cudaipc/cluster"
)

// Defaults for the zero values of Config.
const (
	DefaultPrefix      = "/cudaipc/v1/"
	DefaultTTL         = 10 * time.Second
	DefaultCallTimeout = 2 * time.Second
	// DefaultKeepRecords is how many versions of a versioned name keep
	// their records behind (and including) the latest.
	DefaultKeepRecords = 8
	// DefaultTombstoneTTL is how long the tombstone of a deleted name
	// stays in the directory.
	DefaultTombstoneTTL = time.Hour
	// fastFail is how long calls fail at once after one found etcd away.
	fastFail = time.Second
)

// reconnectBackoff bounds the gRPC connection's reconnect backoff: with
// gRPC's default (1 s growing to 120 s) a node whose etcd was away for a
// minute might wait another minute before it notices etcd is back, its
// records missing all that while. Capped at fastFail, a node is back
// within about a second of etcd.
var reconnectBackoff = backoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: fastFail}

// Config configures a Directory.
type Config struct {
	// Endpoints are etcd's client URLs or host:port pairs (ParseURL makes
	// them from --cluster).
	Endpoints []string
	// Prefix is the key prefix of the cluster, ending in '/'; "" means
	// DefaultPrefix. Clusters sharing one etcd use different prefixes.
	Prefix string
	// Node is this node's name (cluster.ValidateNodeName).
	Node string
	// Secret seals and opens every record.
	Secret cluster.Secret
	// TTL is the node lease's time to live; 0 means DefaultTTL. A dead
	// node's records vanish within it.
	TTL time.Duration
	// CallTimeout bounds every call to etcd; 0 means DefaultCallTimeout.
	CallTimeout time.Duration
	// KeepRecords is how many versions of a versioned name, the latest
	// included, keep their records: committing version V deletes the
	// records (and holders) of versions up to V-KeepRecords, so that a
	// name published every training step does not grow etcd without
	// bound. Nodes keep their own replicas by their own keep_last. 0 means
	// DefaultKeepRecords.
	KeepRecords int
	// TombstoneTTL is how long the tombstone of a deleted name stays in
	// the directory (on a lease, so that tombstones do not accumulate): a
	// node cut off from etcd for longer, whose watch then finds its
	// history compacted away, sees no tombstone of a name deleted
	// meanwhile and writes its record back. 0 means DefaultTombstoneTTL.
	TombstoneTTL time.Duration
	// CAFile, CertFile and KeyFile turn on TLS to etcd: the CA that signed
	// etcd's certificate, and this node's client certificate and key
	// (both or neither).
	CAFile, CertFile, KeyFile string
	// TLS, if set, is used as is instead of the files.
	TLS *tls.Config
	// Logger receives the directory's logs; nil discards them.
	Logger *slog.Logger
}

// ParseURL parses the --cluster value: "etcd://host:port[,host:port...]"
// or "etcds://..." (TLS). It returns the endpoints and whether TLS was
// asked for.
func ParseURL(s string) (endpoints []string, useTLS bool, err error) {
	var rest string
	switch {
	case strings.HasPrefix(s, "etcd://"):
		rest = strings.TrimPrefix(s, "etcd://")
	case strings.HasPrefix(s, "etcds://"):
		rest, useTLS = strings.TrimPrefix(s, "etcds://"), true
	default:
		return nil, false, fmt.Errorf("cluster URL %q: want etcd://host:port[,host:port...] (or etcds:// for TLS)", s)
	}
	for _, hp := range strings.Split(strings.TrimSuffix(rest, "/"), ",") {
		if err := cluster.ValidateControlAddr(hp); err != nil {
			return nil, false, fmt.Errorf("cluster URL %q: endpoint %q: want host:port", s, hp)
		}
		scheme := "http://"
		if useTLS {
			scheme = "https://"
		}
		endpoints = append(endpoints, scheme+hp)
	}
	return endpoints, useTLS, nil
}

// Directory is one node's view of the cluster directory. Its methods are
// safe for concurrent use.
type Directory struct {
	cfg  Config
	k    keys
	cli  *clientv3.Client
	log  *slog.Logger
	name string // endpoints, for errors

	downUntil atomic.Int64 // unix nanos: fail fast until then

	mu    sync.Mutex
	lease clientv3.LeaseID // 0 while none is held
	owned map[string][]byte
	// deferred holds the holder records AddHolder could not write for want
	// of a lease, each with its guard: the next lease writes those whose
	// object record is still the one the pull read.
	deferred map[string]deferredHold
	// orphans holds the keys this node gave up (deleteOwned) whose delete
	// etcd did not answer: they stay on a lost lease that etcd may keep
	// across its restart for a TTL, or on this node's lease if it outlived
	// the outage, so the next lease, or the next publish, deletes them
	// first (a version whose put failed while etcd was away can then be
	// put again at once).
	orphans map[string]struct{}
	// beforeGrant, when set (tests), runs before each grant.
	beforeGrant func()
	// leaseUp is closed while a lease is held, replaced when it is lost.
	leaseUp chan struct{}

	// The guard's state (guard.go): the objects this node holds, by
	// object key; the latest records of their names; the keys to look at;
	// the keys whose rewrite was logged, and the rewrites since.
	held                   map[string]*heldObj
	latestSeen             map[string]latestSeen
	dirty                  map[string]struct{}
	kick                   chan struct{}
	logged                 map[string]bool
	rewrites, rewriteTotal uint64
	summarized             time.Time
	// guardMu is held by a rewrite from its read to its write, and by
	// whatever stops guarding a record before it deletes it, so that no
	// rewrite brings back a record its node withdrew.
	guardMu sync.Mutex
	// guardPause stops the guard's watch (tests: holdGuard).
	guardPause chan pauseReq
	// tombLease carries tombstones, granted at tombGranted for
	// TombstoneTTL and used for half of it.
	tombLease   clientv3.LeaseID
	tombGranted time.Time

	stop context.CancelFunc
	done chan struct{}
	// guarding counts the guard's goroutines.
	guarding sync.WaitGroup
}

// Open connects to etcd, grants this node's lease and keeps it alive until
// Close. It fails, wrapping cluster.ErrUnavailable, when etcd does not
// answer within CallTimeout.
func Open(ctx context.Context, cfg Config) (*Directory, error) {
	if err := cluster.ValidateNodeName(cfg.Node); err != nil {
		return nil, err
	}
	if !cfg.Secret.Valid() {
		return nil, fmt.Errorf("%w: the directory needs the cluster secret", cluster.ErrSecret)
	}
	if len(cfg.Endpoints) == 0 {
		return nil, errors.New("etcd directory: no endpoints")
	}
	if cfg.Prefix == "" {
		cfg.Prefix = DefaultPrefix
	}
	if !strings.HasSuffix(cfg.Prefix, "/") {
		cfg.Prefix += "/"
	}
	if cfg.TTL <= 0 {
		cfg.TTL = DefaultTTL
	}
	if cfg.TTL < 2*time.Second {
		return nil, fmt.Errorf("etcd directory: lease TTL %v is below etcd's minimum of 2s", cfg.TTL)
	}
	if cfg.CallTimeout <= 0 {
		cfg.CallTimeout = DefaultCallTimeout
	}
	if cfg.KeepRecords <= 0 {
		cfg.KeepRecords = DefaultKeepRecords
	}
	if cfg.TombstoneTTL <= 0 {
		cfg.TombstoneTTL = DefaultTombstoneTTL
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	tlsCfg := cfg.TLS
	if tlsCfg == nil && (cfg.CAFile != "" || cfg.CertFile != "" || cfg.KeyFile != "") {
		if (cfg.CertFile == "") != (cfg.KeyFile == "") {
			return nil, errors.New("etcd TLS: give both the client certificate and its key, or neither")
		}
		info := transport.TLSInfo{CertFile: cfg.CertFile, KeyFile: cfg.KeyFile, TrustedCAFile: cfg.CAFile}
		c, err := info.ClientConfig()
		if err != nil {
			return nil, fmt.Errorf("etcd TLS: %w", err)
		}
		tlsCfg = c
	}
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:            cfg.Endpoints,
		DialTimeout:          cfg.CallTimeout,
		DialKeepAliveTime:    cfg.TTL / 2,
		DialKeepAliveTimeout: cfg.CallTimeout,
		TLS:                  tlsCfg,
		Logger:               zap.NewNop(),
		DialOptions: []grpc.DialOption{grpc.WithConnectParams(grpc.ConnectParams{
			Backoff: reconnectBackoff, MinConnectTimeout: cfg.CallTimeout,
		})},
	})
	if err != nil {
		return nil, fmt.Errorf("etcd at %s: %w", strings.Join(cfg.Endpoints, ","), err)
	}
	d := &Directory{
		cfg: cfg, k: keys{cfg.Prefix}, cli: cli, log: log.With("etcd", strings.Join(cfg.Endpoints, ",")),
		name: strings.Join(cfg.Endpoints, ","), owned: map[string][]byte{}, deferred: map[string]deferredHold{}, orphans: map[string]struct{}{}, leaseUp: make(chan struct{}),
		held: map[string]*heldObj{}, latestSeen: map[string]latestSeen{}, dirty: map[string]struct{}{}, kick: make(chan struct{}, 1), guardPause: make(chan pauseReq),
		logged: map[string]bool{}, done: make(chan struct{}),
	}
	if err := d.grant(ctx); err != nil {
		cli.Close()
		return nil, err
	}
	kctx, cancel := context.WithCancel(context.Background())
	d.stop = cancel
	go d.keep(kctx)
	d.guarding.Go(func() { d.guardWatch(kctx) })
	d.guarding.Go(func() { d.guardWork(kctx) })
	return d, nil
}

// Close stops renewing the lease and revokes it, so that this node's
// records vanish at once, and closes the connection.
func (d *Directory) Close() error {
	d.stop()
	<-d.done
	d.guarding.Wait()
	d.mu.Lock()
	lease := d.lease
	d.lease = 0
	d.mu.Unlock()
	if lease != 0 {
		ctx, cancel := context.WithTimeout(context.Background(), d.cfg.CallTimeout)
		_, _ = d.cli.Revoke(ctx, lease)
		cancel()
	}
	return d.cli.Close()
}

// NodeName returns this node's name.
func (d *Directory) NodeName() string { return d.cfg.Node }

// Secret returns the cluster secret the directory seals records with.
func (d *Directory) Secret() cluster.Secret { return d.cfg.Secret }

// deferredHold is a holder record waiting for a lease, and the guard its
// write keeps: its object record unchanged since the pull read it.
type deferredHold struct {
	val   []byte
	guard clientv3.Cmp
	// ref, id and obj are the object held and its record, for the guard.
	ref cluster.Ref
	id  string
	obj []byte
}

// grant takes a new lease and writes every owned key on it (deleting the
// orphans), then the deferred holder records whose guards still hold.
func (d *Directory) grant(ctx context.Context) error {
	d.mu.Lock()
	before := d.beforeGrant
	d.mu.Unlock()
	if before != nil {
		before()
	}
	ctx, cancel := context.WithTimeoutCause(ctx, d.cfg.CallTimeout, errCallTimeout)
	defer cancel()
	g, err := d.cli.Grant(ctx, int64((d.cfg.TTL+time.Second-1)/time.Second))
	if err != nil {
		return d.fail(ctx, "grant a lease", err)
	}
	d.mu.Lock()
	owned := maps.Clone(d.owned)
	var orphans []string
	for k := range d.orphans {
		if _, ok := owned[k]; !ok {
			orphans = append(orphans, k)
		}
	}
	d.mu.Unlock()
	var ops []clientv3.Op
	for _, k := range orphans {
		ops = append(ops, clientv3.OpDelete(k))
	}
	for k, v := range owned {
		ops = append(ops, clientv3.OpPut(k, string(v), clientv3.WithLease(g.ID)))
	}
	for len(ops) > 0 {
		n := min(len(ops), 100) // etcd's default --max-txn-ops is 128
		if _, err := d.cli.Txn(ctx).Then(ops[:n]...).Commit(); err != nil {
			_, _ = d.cli.Revoke(context.WithoutCancel(ctx), g.ID)
			return d.fail(ctx, "rewrite this node's records", err)
		}
		ops = ops[n:]
	}
	d.mu.Lock()
	for _, k := range orphans {
		delete(d.orphans, k)
	}
	d.lease = g.ID
	close(d.leaseUp)
	deferred := maps.Clone(d.deferred)
	d.mu.Unlock()
	d.downUntil.Store(0)
	if len(owned) > 0 {
		d.log.Info("cluster lease granted; records restored", "records", len(owned))
	}
	d.writeDeferred(ctx, g.ID, deferred)
	return nil
}

// writeDeferred writes the holder records AddHolder deferred, each on
// lease if its guard holds (the name neither deleted nor replaced since);
// those that fail to write for want of etcd wait for the next lease, and
// those whose guard fails are dropped (the node's watch drops the replica).
func (d *Directory) writeDeferred(ctx context.Context, lease clientv3.LeaseID, deferred map[string]deferredHold) {
	for key, h := range deferred {
		d.mu.Lock()
		_, still := d.deferred[key] // not withdrawn meanwhile (RemoveHolder)
		if still {
			d.owned[key] = h.val
		}
		d.mu.Unlock()
		if !still {
			continue
		}
		r, err := d.cli.Txn(ctx).If(h.guard).Then(clientv3.OpPut(key, string(h.val), clientv3.WithLease(lease))).Commit()
		d.mu.Lock()
		if err != nil || !r.Succeeded {
			delete(d.owned, key)
		}
		if err == nil {
			delete(d.deferred, key) // written, or its name deleted or replaced
		}
		d.mu.Unlock()
		if err == nil && r.Succeeded {
			d.hold(h.ref, h.id, h.obj, key, h.val)
		}
		if err != nil {
			d.log.Warn("a deferred holder record is not written yet (the next lease writes it)", "key", key, "err", err)
		}
	}
}

// keep renews the lease until ctx is done, and grants a new one whenever it
// is lost.
func (d *Directory) keep(ctx context.Context) {
	defer close(d.done)
	for ctx.Err() == nil {
		d.mu.Lock()
		lease := d.lease
		d.mu.Unlock()
		if lease != 0 {
			ch, err := d.cli.KeepAlive(ctx, lease)
			if err == nil {
				for range ch {
				}
			}
			if ctx.Err() != nil {
				return
			}
			// Calls that need no lease go on: the lease may have lapsed
			// with etcd answering (renewals late under load); a call that
			// finds etcd away makes the others fail fast (fail).
			d.mu.Lock()
			d.lease = 0
			d.leaseUp = make(chan struct{})
			d.mu.Unlock()
			d.log.Warn("cluster lease lost: this node's records are gone until etcd answers again", "lease", int64(lease))
		}
		if err := d.grant(ctx); err != nil {
			select {
			case <-ctx.Done():
				return
			case <-time.After(fastFail / 2):
			}
		}
	}
}

// fail wraps an etcd error: unreachable etcd (or a timeout) wraps
// cluster.ErrUnavailable and makes calls fail fast for a while.
func (d *Directory) fail(ctx context.Context, what string, err error) error {
	if ctx.Err() != nil && context.Cause(ctx) != errCallTimeout {
		return fmt.Errorf("%s: %w", what, ctx.Err()) // the caller's deadline or cancel, not etcd's fault
	}
	c := status.Code(err)
	if errors.Is(err, context.DeadlineExceeded) || c == codes.Unavailable || c == codes.DeadlineExceeded {
		d.downUntil.Store(time.Now().Add(fastFail).UnixNano())
		return fmt.Errorf("%w: etcd at %s did not answer (%s): %v", cluster.ErrUnavailable, d.name, what, err)
	}
	return fmt.Errorf("etcd at %s: %s: %w", d.name, what, err)
}

// call bounds ctx by CallTimeout, or fails at once while etcd is known to
// be away.
func (d *Directory) call(ctx context.Context, what string) (context.Context, context.CancelFunc, error) {
	if until := d.downUntil.Load(); until != 0 && time.Now().UnixNano() < until {
		return nil, nil, fmt.Errorf("%w: etcd at %s is not answering (%s)", cluster.ErrUnavailable, d.name, what)
	}
	ctx, cancel := context.WithTimeoutCause(ctx, d.cfg.CallTimeout, errCallTimeout)
	return ctx, cancel, nil
}

// leased returns the current lease, or fails when none is held.
func (d *Directory) leased(what string) (clientv3.LeaseID, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.lease == 0 {
		return 0, fmt.Errorf("%w: %s: %w until etcd at %s answers", cluster.ErrUnavailable, what, errNoLease, d.name)
	}
	return d.lease, nil
}

// putOwned writes key on the lease and remembers it, so that it is written
// again on a new lease. cmps, if any, guard the write: when they fail, it
// returns errGuard and keeps nothing.
func (d *Directory) putOwned(ctx context.Context, what, key string, val []byte, cmps ...clientv3.Cmp) error {
	lease, err := d.leased(what)
	if err != nil {
		return err
	}
	ctx, cancel, err := d.call(ctx, what)
	if err != nil {
		return err
	}
	defer cancel()
	d.mu.Lock()
	d.owned[key] = val
	d.mu.Unlock()
	r, err := d.cli.Txn(ctx).If(cmps...).Then(clientv3.OpPut(key, string(val), clientv3.WithLease(lease))).Commit()
	if err != nil || !r.Succeeded {
		d.mu.Lock()
		delete(d.owned, key)
		d.mu.Unlock()
	}
	if err != nil {
		return d.fail(ctx, what, err)
	}
	if !r.Succeeded {
		return errGuard
	}
	return nil
}

var errGuard = errors.New("guard failed")

// errNoLease is why a write that needs this node's lease failed while it
// held none.
var errNoLease = errors.New("this node's etcd lease is lost")

// errCallTimeout is the cause of a call's context when CallTimeout ran out.
var errCallTimeout = errors.New("etcd call timeout")

// deleteOrphans deletes the keys this node gave up while etcd was away
// (orphans) when etcd answers, before a publish that may find one of them.
// Those it cannot delete wait for the next try.
func (d *Directory) deleteOrphans(ctx context.Context) {
	d.mu.Lock()
	var ops []clientv3.Op
	for k := range d.orphans {
		if _, ok := d.owned[k]; !ok && len(ops) < 100 {
			ops = append(ops, clientv3.OpDelete(k))
		}
	}
	d.mu.Unlock()
	if len(ops) == 0 {
		return
	}
	ctx, cancel, err := d.call(ctx, "delete this node's given-up records")
	if err != nil {
		return
	}
	defer cancel()
	if _, err := d.cli.Txn(ctx).Then(ops...).Commit(); err != nil {
		_ = d.fail(ctx, "delete this node's given-up records", err)
		return
	}
	d.mu.Lock()
	for _, op := range ops {
		delete(d.orphans, string(op.KeyBytes()))
	}
	d.mu.Unlock()
}

// deleteOwned forgets key and deletes it; a delete etcd does not answer is
// made by the next lease's grant or before the next publish (orphans).
func (d *Directory) deleteOwned(ctx context.Context, what, key string) error {
	d.guardMu.Lock()
	d.mu.Lock()
	delete(d.owned, key)
	delete(d.logged, key)
	d.mu.Unlock()
	d.guardMu.Unlock()
	orphan := func() {
		d.mu.Lock()
		if _, ok := d.owned[key]; !ok {
			d.orphans[key] = struct{}{}
		}
		d.mu.Unlock()
	}
	ctx, cancel, err := d.call(ctx, what)
	if err != nil {
		orphan()
		return err
	}
	defer cancel()
	if _, err := d.cli.Delete(ctx, key); err != nil {
		orphan()
		return d.fail(ctx, what, err)
	}
	d.mu.Lock()
	delete(d.orphans, key)
	d.mu.Unlock()
	return nil
}

// Join writes this node's record on its lease. It fails with
// cluster.ErrExists while another live node has the same name (a node that
// died frees its name within the TTL). A record under the name that is no
// live node's (one without a lease, or that does not verify: no node
// wrote it) is replaced at once.
func (d *Directory) Join(ctx context.Context, n cluster.Node) error {
	if n.Name != d.cfg.Node {
		return fmt.Errorf("join: record of node %q on the directory of node %q", n.Name, d.cfg.Node)
	}
	if n.Started.IsZero() {
		n.Started = time.Now().UTC()
	}
	key := d.k.node(n.Name)
	val, err := cluster.Seal(d.cfg.Secret, key, &n)
	if err != nil {
		return err
	}
	lease, err := d.leased("join")
	if err != nil {
		return err
	}
	err = d.putOwned(ctx, "join", key, val, clientv3.Compare(clientv3.LeaseValue(key), "=", lease))
	for try := 0; errors.Is(err, errGuard) && try < 3; try++ {
		err = d.putOwned(ctx, "join", key, val, clientv3.Compare(clientv3.CreateRevision(key), "=", 0))
		if !errors.Is(err, errGuard) {
			break
		}
		var cur *mvccpb.KeyValue
		if cur, err = d.get(ctx, "join", key); err != nil {
			return err
		}
		if cur == nil {
			err = errGuard // gone meanwhile: create it
			continue
		}
		var old cluster.Node
		why := ""
		if oerr := cluster.Open(d.cfg.Secret, key, cur.Value, &old); oerr != nil {
			why = oerr.Error()
		} else if cur.Lease == 0 {
			why = "it has no lease, so it never expires: no node wrote it"
		}
		if why == "" {
			return fmt.Errorf("join: %w: node %q is live in the cluster (if it died, its record expires within %v)", cluster.ErrExists, n.Name, d.cfg.TTL)
		}
		d.log.Warn("replacing a record under this node's name that is no live node's", "key", key, "why", why)
		err = d.putOwned(ctx, "join", key, val, clientv3.Compare(clientv3.ModRevision(key), "=", cur.ModRevision))
	}
	if errors.Is(err, errGuard) {
		return fmt.Errorf("join: the record of node %q kept changing under this node", n.Name)
	}
	return err
}

// get reads key, nil when it is not there.
func (d *Directory) get(ctx context.Context, what, key string) (*mvccpb.KeyValue, error) {
	ctx, cancel, err := d.call(ctx, what)
	if err != nil {
		return nil, err
	}
	defer cancel()
	r, err := d.cli.Get(ctx, key)
	if err != nil {
		return nil, d.fail(ctx, what, err)
	}
	if len(r.Kvs) == 0 {
		return nil, nil
	}
	return r.Kvs[0], nil
}

// Nodes returns the records of the live nodes. Records that do not verify,
// or have no lease (no node wrote them), are logged and left out.
func (d *Directory) Nodes(ctx context.Context) ([]cluster.Node, error) {
	ctx, cancel, err := d.call(ctx, "list nodes")
	if err != nil {
		return nil, err
	}
	defer cancel()
	r, err := d.cli.Get(ctx, d.k.nodes(), clientv3.WithPrefix())
	if err != nil {
		return nil, d.fail(ctx, "list nodes", err)
	}
	var out []cluster.Node
	for _, kv := range r.Kvs {
		var n cluster.Node
		if err := openNode(d.cfg.Secret, kv, &n); err != nil {
			d.log.Warn("ignoring a node record", "err", err)
			continue
		}
		out = append(out, n)
	}
	return out, nil
}

// Node returns the record of a live node, or an error wrapping
// cluster.ErrNotFound (a dead node's record has expired) or
// cluster.ErrBadRecord (it does not verify, or has no lease).
func (d *Directory) Node(ctx context.Context, name string) (cluster.Node, error) {
	var n cluster.Node
	if err := cluster.ValidateNodeName(name); err != nil {
		return n, err
	}
	ctx, cancel, err := d.call(ctx, "look up node "+name)
	if err != nil {
		return n, err
	}
	defer cancel()
	key := d.k.node(name)
	r, err := d.cli.Get(ctx, key)
	if err != nil {
		return n, d.fail(ctx, "look up node "+name, err)
	}
	if len(r.Kvs) == 0 {
		return n, fmt.Errorf("node %s: %w (not live)", name, cluster.ErrNotFound)
	}
	return n, openNode(d.cfg.Secret, r.Kvs[0], &n)
}

// openNode opens a node record: it must verify and live on a lease, as
// every node writes its record; one without a lease never expires, so it
// says nothing of a live node.
func openNode(s cluster.Secret, kv *mvccpb.KeyValue, n *cluster.Node) error {
	if err := cluster.Open(s, string(kv.Key), kv.Value, n); err != nil {
		return err
	}
	if kv.Lease == 0 {
		return fmt.Errorf("%w: %s: no lease (nodes write their records on their lease): not a live node", cluster.ErrBadRecord, kv.Key)
	}
	return nil
}

// UnverifiedNodes returns the names of the other nodes whose records do
// not verify with this node's secret (or are not valid records), and how
// many others verify: where none verifies, the cluster secrets probably
// differ.
func (d *Directory) UnverifiedNodes(ctx context.Context) (bad []string, good int, err error) {
	ctx, cancel, err := d.call(ctx, "list nodes")
	if err != nil {
		return nil, 0, err
	}
	defer cancel()
	r, err := d.cli.Get(ctx, d.k.nodes(), clientv3.WithPrefix())
	if err != nil {
		return nil, 0, d.fail(ctx, "list nodes", err)
	}
	for _, kv := range r.Kvs {
		name := strings.TrimPrefix(string(kv.Key), d.k.nodes())
		if name == d.cfg.Node {
			continue
		}
		var n cluster.Node
		if cluster.Open(d.cfg.Secret, string(kv.Key), kv.Value, &n) != nil {
			bad = append(bad, name)
		} else {
			good++
		}
	}
	return bad, good, nil
}

// Entry is an object's record with its live holders.
type Entry = cluster.Entry

// Publish records a newly sealed object with this node as its holder. It
// fails with cluster.ErrExists when the name (that version's shard) is
// recorded already and some node still holds it; a record no live node
// holds is replaced. For a shard of a version, latest is committed once
// every shard of the version is recorded: committed reports whether this
// call did it.
func (d *Directory) Publish(ctx context.Context, o cluster.Object) (committed bool, err error) {
	if o.Origin == "" {
		o.Origin = d.cfg.Node
	}
	if o.Sealed.IsZero() {
		o.Sealed = time.Now().UTC()
	}
	ref := o.Ref()
	key := d.k.obj(ref)
	val, err := cluster.Seal(d.cfg.Secret, key, &o)
	if err != nil {
		return false, err
	}
	hkey := d.k.hold(ref, d.cfg.Node)
	hval, err := cluster.Seal(d.cfg.Secret, hkey, &cluster.Holder{Node: d.cfg.Node, ID: o.ID})
	if err != nil {
		return false, err
	}
	d.deleteOrphans(ctx)
	for range 3 {
		lease, err := d.leased("publish " + ref.String())
		if err != nil {
			return false, err
		}
		cctx, cancel, err := d.call(ctx, "publish "+ref.String())
		if err != nil {
			return false, err
		}
		d.mu.Lock()
		d.owned[hkey] = hval
		d.mu.Unlock()
		r, err := d.cli.Txn(cctx).
			If(clientv3.Compare(clientv3.CreateRevision(key), "=", 0)).
			Then(clientv3.OpPut(key, string(val)), clientv3.OpPut(hkey, string(hval), clientv3.WithLease(lease))).
			Else(clientv3.OpGet(key), clientv3.OpGet(d.k.holdRef(ref), clientv3.WithPrefix(), clientv3.WithCountOnly())).
			Commit()
		if err == nil && !r.Succeeded {
			// Recorded already: replace it only if nobody holds it.
			if r.Responses[1].GetResponseRange().Count > 0 {
				cancel()
				d.mu.Lock()
				delete(d.owned, hkey)
				d.mu.Unlock()
				return false, fmt.Errorf("publish %s: %w", ref, cluster.ErrExists)
			}
			rev := r.Responses[0].GetResponseRange().Kvs[0].ModRevision
			r, err = d.cli.Txn(cctx).
				If(clientv3.Compare(clientv3.ModRevision(key), "=", rev)).
				Then(clientv3.OpPut(key, string(val)), clientv3.OpPut(hkey, string(hval), clientv3.WithLease(lease))).
				Commit()
		}
		cancel()
		if err != nil || !r.Succeeded {
			d.mu.Lock()
			delete(d.owned, hkey)
			d.mu.Unlock()
		}
		if err != nil {
			return false, d.fail(cctx, "publish "+ref.String(), err)
		}
		if r.Succeeded {
			d.hold(ref, o.ID, val, hkey, hval)
			if o.Version == 0 {
				return false, nil
			}
			return d.commit(ctx, o)
		}
	}
	return false, fmt.Errorf("publish %s: the record kept changing under this node", ref)
}

// commit makes o's version the name's latest if all of its shards are
// recorded, each has a live holder, and no newer version is latest. A
// shard whose publisher died before the version was complete has its
// record but no holder (holders go with their node's lease): the version
// waits until a live node publishes that shard again (Publish replaces an
// unheld record), whose commit then completes it. The holders are read
// with the records; one dying between that read and the commit is as one
// dying just after it.
func (d *Directory) commit(ctx context.Context, o cluster.Object) (bool, error) {
	what := fmt.Sprintf("commit %s version %d", o.Name, o.Version)
	lkey := d.k.latest(o.Owner, o.Name)
	latest := cluster.Latest{Name: o.Name, Owner: o.Owner, Version: o.Version, Shards: o.Shards, Keep: o.Keep}
	keep := uint64(d.cfg.KeepRecords)
	if o.Version > keep {
		latest.Pruned = o.Version - keep
	}
	for range 8 {
		cctx, cancel, err := d.call(ctx, what)
		if err != nil {
			return false, err
		}
		r, err := d.cli.Txn(cctx).Then(
			clientv3.OpGet(d.k.objVersion(o.Owner, o.Name, o.Version), clientv3.WithPrefix(), clientv3.WithCountOnly()),
			clientv3.OpGet(lkey),
			clientv3.OpGet(d.k.holdVersion(o.Owner, o.Name, o.Version), clientv3.WithPrefix(), clientv3.WithKeysOnly())).Commit()
		if err != nil {
			cancel()
			return false, d.fail(cctx, what, err)
		}
		if r.Responses[0].GetResponseRange().Count < int64(o.Shards) {
			cancel()
			return false, nil // the last shard's publisher commits
		}
		held := map[uint32]bool{}
		for _, kv := range r.Responses[2].GetResponseRange().Kvs {
			if ref, _, err := parseRef(strings.TrimPrefix(string(kv.Key), d.k.holders())); err == nil && ref.Shard < o.Shards {
				held[ref.Shard] = true
			}
		}
		if len(held) < int(o.Shards) {
			cancel()
			var missing []uint32
			for shard := range o.Shards {
				if !held[shard] {
					missing = append(missing, shard)
				}
			}
			d.log.Warn("version not committed: shards recorded by nodes gone, without a live holder; publish them again",
				"name", o.Name, "owner", o.Owner, "version", o.Version, "shards", missing)
			return false, nil
		}
		cmp := clientv3.Compare(clientv3.CreateRevision(lkey), "=", 0)
		l := latest
		if kvs := r.Responses[1].GetResponseRange().Kvs; len(kvs) > 0 {
			var prev cluster.Latest
			if err := cluster.Open(d.cfg.Secret, lkey, kvs[0].Value, &prev); err == nil {
				if prev.Version >= o.Version {
					cancel()
					return false, nil
				}
				l.Pruned = max(l.Pruned, prev.Pruned) // nodes keeping more versions pruned less
			}
			cmp = clientv3.Compare(clientv3.ModRevision(lkey), "=", kvs[0].ModRevision)
		}
		lval, err := cluster.Seal(d.cfg.Secret, lkey, &l)
		if err != nil {
			cancel()
			return false, err
		}
		ops := []clientv3.Op{clientv3.OpPut(lkey, string(lval))}
		if o.Version > keep {
			// Versions up to o.Version-keep lose their records: the keys
			// sort by version (20 digits), so one range each.
			upTo := fmt.Sprintf("%020d/", o.Version-keep+1)
			ops = append(ops,
				clientv3.OpDelete(d.k.objName(o.Owner, o.Name), clientv3.WithRange(d.k.objName(o.Owner, o.Name)+upTo)),
				clientv3.OpDelete(d.k.holdName(o.Owner, o.Name), clientv3.WithRange(d.k.holdName(o.Owner, o.Name)+upTo)))
		}
		t, err := d.cli.Txn(cctx).If(cmp).Then(ops...).Commit()
		cancel()
		if err != nil {
			return false, d.fail(cctx, what, err)
		}
		if t.Succeeded {
			d.seeLatest(lkey, lval, o.Version)
			return true, nil
		}
	}
	return false, fmt.Errorf("%s: latest kept changing under this node", what)
}

// Lookup returns an object's record and its live holders, read in one
// transaction. It fails with cluster.ErrNotFound when the name is not
// recorded; an entry with no holders is returned with its record.
func (d *Directory) Lookup(ctx context.Context, ref cluster.Ref) (Entry, error) {
	var e Entry
	what := "look up " + ref.String()
	ctx, cancel, err := d.call(ctx, what)
	if err != nil {
		return e, err
	}
	defer cancel()
	key := d.k.obj(ref)
	r, err := d.cli.Txn(ctx).Then(clientv3.OpGet(key), clientv3.OpGet(d.k.holdRef(ref), clientv3.WithPrefix())).Commit()
	if err != nil {
		return e, d.fail(ctx, what, err)
	}
	kvs := r.Responses[0].GetResponseRange().Kvs
	if len(kvs) == 0 {
		return e, fmt.Errorf("%s: %w", ref, cluster.ErrNotFound)
	}
	if err := cluster.Open(d.cfg.Secret, key, kvs[0].Value, &e.Object); err != nil {
		return e, err
	}
	if e.Ref() != ref {
		return e, fmt.Errorf("%w: %s holds the record of %s", cluster.ErrBadRecord, key, e.Ref())
	}
	e.Revision = kvs[0].ModRevision
	for _, kv := range r.Responses[1].GetResponseRange().Kvs {
		var h cluster.Holder
		if err := cluster.Open(d.cfg.Secret, string(kv.Key), kv.Value, &h); err != nil {
			d.log.Warn("ignoring a holder record", "err", err)
			continue
		}
		if h.ID == e.ID && strings.HasSuffix(string(kv.Key), "/"+h.Node) && kv.Lease != 0 {
			e.Holders = append(e.Holders, h.Node)
		}
	}
	return e, nil
}

// AddHolder records this node as a holder of the incarnation e (a replica
// pulled and sealed here). It fails with cluster.ErrNotFound when the name
// was deleted or replaced meanwhile: the replica must then be dropped.
func (d *Directory) AddHolder(ctx context.Context, e Entry) error {
	ref := e.Ref()
	hkey := d.k.hold(ref, d.cfg.Node)
	hval, err := cluster.Seal(d.cfg.Secret, hkey, &cluster.Holder{Node: d.cfg.Node, ID: e.ID})
	if err != nil {
		return err
	}
	oval, err := cluster.Seal(d.cfg.Secret, d.k.obj(ref), &e.Object)
	if err != nil {
		return err
	}
	guard := clientv3.Compare(clientv3.ModRevision(d.k.obj(ref)), "=", e.Revision)
	err = d.putOwned(ctx, "advertise "+ref.String(), hkey, hval, guard)
	if err == nil {
		d.hold(ref, e.ID, oval, hkey, hval)
	}
	if errors.Is(err, errGuard) {
		return fmt.Errorf("advertise %s: %w (deleted or replaced during the pull)", ref, cluster.ErrNotFound)
	}
	if errors.Is(err, errNoLease) {
		// The next lease writes it, guarded as here: a replica pulled while
		// this node's lease was lost is advertised once etcd answers.
		d.mu.Lock()
		if d.lease == 0 {
			d.deferred[hkey] = deferredHold{val: hval, guard: guard, ref: ref, id: e.ID, obj: oval}
			err = fmt.Errorf("%w (deferred: written when this node has a lease again)", err)
		} else {
			err = nil // granted meanwhile: write it now
		}
		d.mu.Unlock()
		if err == nil {
			return d.AddHolder(ctx, e)
		}
	}
	return err
}

// RemoveHolder withdraws this node as a holder of ref (its replica is
// going).
func (d *Directory) RemoveHolder(ctx context.Context, ref cluster.Ref) error {
	key := d.k.hold(ref, d.cfg.Node)
	d.guardMu.Lock()
	d.mu.Lock()
	delete(d.deferred, key)
	if h := d.held[d.k.obj(ref)]; h != nil && h.hkey == key {
		d.forgetLocked(d.k.obj(ref))
	}
	d.mu.Unlock()
	d.guardMu.Unlock()
	return d.deleteOwned(ctx, "withdraw "+ref.String(), key)
}

// Delete removes a name from the cluster: every version's records, their
// holders and the latest pointer, in one transaction that writes the
// name's tombstone, sealed with the cluster secret and naming every
// incarnation deleted. Holders drop their replicas when they see the
// tombstone (Watch), never because records went. It fails with
// cluster.ErrNotFound when nothing was recorded and this node held
// nothing of the name.
func (d *Directory) Delete(ctx context.Context, owner uint32, name string) error {
	what := fmt.Sprintf("delete %d:%s", owner, name)
	mine := d.forgetName(owner, name)
	tkey := d.k.tomb(owner, name)
	for range 8 {
		cctx, cancel, err := d.call(ctx, what)
		if err != nil {
			return err
		}
		r, err := d.cli.Txn(cctx).Then(
			clientv3.OpGet(d.k.objName(owner, name), clientv3.WithPrefix()),
			clientv3.OpGet(tkey)).Commit()
		if err != nil {
			cancel()
			return d.fail(cctx, what, err)
		}
		objs := r.Responses[0].GetResponseRange().Kvs
		ids := slices.Clone(mine)
		for _, kv := range objs {
			var o cluster.Object
			if err := cluster.Open(d.cfg.Secret, string(kv.Key), kv.Value, &o); err == nil && !slices.Contains(ids, o.ID) {
				ids = append(ids, o.ID)
			}
		}
		if len(objs) == 0 && len(ids) == 0 {
			cancel()
			return fmt.Errorf("%s: %w", what, cluster.ErrNotFound)
		}
		tcmp := clientv3.Compare(clientv3.CreateRevision(tkey), "=", 0)
		if kvs := r.Responses[1].GetResponseRange().Kvs; len(kvs) > 0 {
			// Deleted before, within the tombstones' life: keep naming
			// the incarnations deleted then, for holders not yet told.
			var t cluster.Tombstone
			if cluster.Open(d.cfg.Secret, tkey, kvs[0].Value, &t) == nil {
				for _, id := range t.IDs {
					if !slices.Contains(ids, id) {
						ids = append(ids, id)
					}
				}
			}
			tcmp = clientv3.Compare(clientv3.ModRevision(tkey), "=", kvs[0].ModRevision)
		}
		if len(ids) > cluster.MaxTombstoneIDs {
			ids = ids[:cluster.MaxTombstoneIDs] // this delete's first, then the newest before
		}
		var ops []clientv3.Op
		if len(ids) > 0 {
			lease, err := d.tombstoneLease(cctx)
			if err != nil {
				cancel()
				return err
			}
			tval, err := cluster.Seal(d.cfg.Secret, tkey, &cluster.Tombstone{Owner: owner, Name: name, IDs: ids, Node: d.cfg.Node, Deleted: time.Now().UTC()})
			if err != nil {
				cancel()
				return err
			}
			ops = append(ops, clientv3.OpPut(tkey, string(tval), clientv3.WithLease(lease)))
		}
		ops = append(ops,
			clientv3.OpDelete(d.k.objName(owner, name), clientv3.WithPrefix()),
			clientv3.OpDelete(d.k.holdName(owner, name), clientv3.WithPrefix()),
			clientv3.OpDelete(d.k.latest(owner, name)))
		// No record may have come since the read: its incarnation would
		// not be in the tombstone.
		t, err := d.cli.Txn(cctx).If(tcmp,
			clientv3.Compare(clientv3.ModRevision(d.k.objName(owner, name)), "<", r.Header.Revision+1).WithPrefix()).
			Then(ops...).Commit()
		cancel()
		if err != nil {
			if errors.Is(err, rpctypes.ErrLeaseNotFound) {
				d.mu.Lock()
				d.tombLease = 0
				d.mu.Unlock()
				continue
			}
			return d.fail(cctx, what, err)
		}
		if t.Succeeded {
			return nil
		}
	}
	return fmt.Errorf("%s: the name's records kept changing under this node", what)
}

// tombstoneLease returns the lease tombstones are written on: granted for
// TombstoneTTL and used for half of it, so that a tombstone lives from
// half the TTL to all of it.
func (d *Directory) tombstoneLease(ctx context.Context) (clientv3.LeaseID, error) {
	d.mu.Lock()
	lease, at := d.tombLease, d.tombGranted
	d.mu.Unlock()
	if lease != 0 && time.Since(at) < d.cfg.TombstoneTTL/2 {
		return lease, nil
	}
	g, err := d.cli.Grant(ctx, int64((d.cfg.TombstoneTTL+time.Second-1)/time.Second))
	if err != nil {
		return 0, d.fail(ctx, "grant a tombstone lease", err)
	}
	d.mu.Lock()
	d.tombLease, d.tombGranted = g.ID, time.Now()
	d.mu.Unlock()
	return g.ID, nil
}

// Latest returns a versioned name's latest committed version, or an error
// wrapping cluster.ErrNotFound when none is committed.
func (d *Directory) Latest(ctx context.Context, owner uint32, name string) (cluster.Latest, error) {
	l, _, err := d.latest(ctx, owner, name)
	return l, err
}

func (d *Directory) latest(ctx context.Context, owner uint32, name string) (cluster.Latest, int64, error) {
	var l cluster.Latest
	what := fmt.Sprintf("latest of %d:%s", owner, name)
	ctx, cancel, err := d.call(ctx, what)
	if err != nil {
		return l, 0, err
	}
	defer cancel()
	key := d.k.latest(owner, name)
	r, err := d.cli.Get(ctx, key)
	if err != nil {
		return l, 0, d.fail(ctx, what, err)
	}
	if len(r.Kvs) == 0 {
		return l, r.Header.Revision, fmt.Errorf("%s: %w", what, cluster.ErrNotFound)
	}
	if err := cluster.Open(d.cfg.Secret, key, r.Kvs[0].Value, &l); err != nil {
		return l, 0, err
	}
	return l, r.Header.Revision, nil
}

// Pin records that this node is pulling ref's incarnation id from holder,
// on this node's lease: the holder keeps its replica while the pin exists.
// unpin removes it; a reader that dies loses its pins with its lease.
func (d *Directory) Pin(ctx context.Context, holder string, ref cluster.Ref, id string) (unpin func(), err error) {
	pid := cluster.NewID()
	key := d.k.pin(holder, ref, d.cfg.Node, pid)
	val, err := cluster.Seal(d.cfg.Secret, key, &cluster.Pin{Reader: d.cfg.Node, Holder: holder, ID: id, Since: time.Now().UTC()})
	if err != nil {
		return nil, err
	}
	if err := d.putOwned(ctx, "pin "+ref.String()+" on "+holder, key, val); err != nil {
		return nil, err
	}
	return func() {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), d.cfg.CallTimeout)
		defer cancel()
		_ = d.deleteOwned(ctx, "unpin", key)
	}, nil
}

// Pinned reports how many readers pin this node's replica of ref.
func (d *Directory) Pinned(ctx context.Context, ref cluster.Ref) (int, error) {
	what := "pins of " + ref.String()
	ctx, cancel, err := d.call(ctx, what)
	if err != nil {
		return 0, err
	}
	defer cancel()
	r, err := d.cli.Get(ctx, d.k.pinsRef(d.cfg.Node, ref), clientv3.WithPrefix(), clientv3.WithCountOnly())
	if err != nil {
		return 0, d.fail(ctx, what, err)
	}
	return int(r.Count), nil
}

// Event is a change the directory reports to a node's watch.
type Event struct {
	// Ref is the object concerned.
	Ref cluster.Ref
	// Deleted: the owner deleted the name (a tombstone sealed with the
	// cluster secret names the incarnation ID); every node drops its
	// replica of that incarnation. Ref names the name (Version 0).
	Deleted bool
	// ID is the incarnation deleted, so that a node drops only a replica
	// of the object that went, never one of the name created again since.
	ID string
	// Pinned and Unpinned: a reader pinned or unpinned this node's
	// replica; Reader names it.
	Pinned, Unpinned bool
	Reader           string
	// Key is the etcd key, for Unpinned events to match their Pinned.
	Key string
	// Committed: Ref.Version became the latest version of the versioned
	// name Ref names; Keep is its Latest.Keep (0: retention is each
	// node's own).
	Committed bool
	Keep      uint32
}

// Watch reports the owners' deletions of names (their tombstones, one
// event per incarnation deleted), commits of versions (the latest records
// written) and pins of this node's replicas until ctx is done, on a
// channel it closes then. A record that went from the directory, or a
// tombstone that does not verify, is no deletion: nothing is reported. It reports
// every such change made after Watch returns (it reads the directory's
// revision first, when etcd answers), and after etcd was away it resumes
// from the revision after the last event it reported, so changes made
// meanwhile are replayed too (unless etcd compacted them away: then it
// resumes from the present).
func (d *Directory) Watch(ctx context.Context) <-chan Event {
	out := make(chan Event, 64)
	var nextO, nextP, nextL int64 // revisions each watch resumes from; 0: the present
	if cctx, cancel, err := d.call(ctx, "watch"); err == nil {
		if r, err := d.cli.Get(cctx, d.k.nodes(), clientv3.WithCountOnly()); err == nil {
			nextO, nextP, nextL = r.Header.Revision+1, r.Header.Revision+1, r.Header.Revision+1
		}
		cancel()
	}
	from := func(rev int64, opts ...clientv3.OpOption) []clientv3.OpOption {
		opts = append(opts, clientv3.WithPrefix())
		if rev > 0 {
			opts = append(opts, clientv3.WithRev(rev))
		}
		return opts
	}
	go func() {
		defer close(out)
		send := func(ev Event) bool {
			select {
			case out <- ev:
				return true
			case <-ctx.Done():
				return false
			}
		}
		pins := d.k.pinsOf(d.cfg.Node)
		for ctx.Err() == nil {
			wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
			wo := d.cli.Watch(wctx, d.k.tombs(), from(nextO, clientv3.WithFilterDelete())...)
			wp := d.cli.Watch(wctx, pins, from(nextP, clientv3.WithPrevKV())...)
			wl := d.cli.Watch(wctx, d.k.latests(), from(nextL, clientv3.WithFilterDelete())...)
			for wo != nil || wp != nil || wl != nil {
				var wr clientv3.WatchResponse
				var ok bool
				next := &nextO
				select {
				case wr, ok = <-wo:
					if !ok {
						wo = nil
						continue
					}
				case wr, ok = <-wp:
					if !ok {
						wp = nil
						continue
					}
					next = &nextP
				case wr, ok = <-wl:
					if !ok {
						wl = nil
						continue
					}
					next = &nextL
				}
				if wr.CompactRevision != 0 {
					d.log.Warn("the directory's watch lost history to compaction: resuming from the present", "revision", wr.CompactRevision)
					nextO, nextP, nextL = 0, 0, 0
					break
				}
				if wr.Err() != nil {
					break
				}
				for _, ev := range wr.Events {
					*next = ev.Kv.ModRevision + 1
					key := string(ev.Kv.Key)
					var e Event
					e.Key = key
					switch {
					case strings.HasPrefix(key, d.k.tombs()):
						var t cluster.Tombstone
						if err := cluster.Open(d.cfg.Secret, key, ev.Kv.Value, &t); err != nil || d.k.tomb(t.Owner, t.Name) != key {
							continue // logged by the guard
						}
						for _, id := range t.IDs {
							if !send(Event{Ref: cluster.Ref{Owner: t.Owner, Name: t.Name}, Deleted: true, ID: id, Key: key}) {
								cancel()
								return
							}
						}
						continue
					case strings.HasPrefix(key, d.k.latests()):
						var l cluster.Latest
						if err := cluster.Open(d.cfg.Secret, key, ev.Kv.Value, &l); err != nil || d.k.latest(l.Owner, l.Name) != key {
							d.log.Warn("ignoring a latest record", "key", key, "err", err)
							continue
						}
						e.Ref = cluster.Ref{Owner: l.Owner, Name: l.Name, Version: l.Version}
						e.Committed, e.Keep = true, l.Keep
					case strings.HasPrefix(key, pins):
						r, rest, err := parseRef(strings.TrimPrefix(key, pins))
						if err != nil {
							continue
						}
						reader, _, _ := strings.Cut(rest, "/")
						e.Ref, e.Reader = r, reader
						if ev.Type == mvccpb.DELETE {
							e.Unpinned = true
						} else {
							var p cluster.Pin
							if err := cluster.Open(d.cfg.Secret, key, ev.Kv.Value, &p); err != nil {
								d.log.Warn("ignoring a pin", "err", err)
								continue
							}
							e.Pinned = true
						}
					}
					if !send(e) {
						cancel()
						return
					}
				}
			}
			cancel()
			select {
			case <-ctx.Done():
			case <-time.After(fastFail / 2):
			}
		}
	}()
	return out
}

// Listing is one name of ls --cluster.
type Listing struct {
	Entry
	// Latest is the name's latest committed version (0 for plain
	// objects).
	Latest uint64
}

// List returns every object record under the directory with its holders,
// in key order (owner, name, version, shard). Records that do not verify
// are logged and left out.
func (d *Directory) List(ctx context.Context) ([]Listing, error) {
	ctx, cancel, err := d.call(ctx, "list")
	if err != nil {
		return nil, err
	}
	defer cancel()
	r, err := d.cli.Txn(ctx).Then(
		clientv3.OpGet(d.k.objects(), clientv3.WithPrefix()),
		clientv3.OpGet(d.k.holders(), clientv3.WithPrefix()),
		clientv3.OpGet(d.k.latests(), clientv3.WithPrefix()),
	).Commit()
	if err != nil {
		return nil, d.fail(ctx, "list", err)
	}
	holders := map[cluster.Ref][]cluster.Holder{}
	for _, kv := range r.Responses[1].GetResponseRange().Kvs {
		var h cluster.Holder
		ref, _, err := parseRef(strings.TrimPrefix(string(kv.Key), d.k.holders()))
		if err == nil {
			err = cluster.Open(d.cfg.Secret, string(kv.Key), kv.Value, &h)
		}
		if err != nil {
			d.log.Warn("ignoring a holder record", "err", err)
			continue
		}
		if kv.Lease == 0 {
			continue // no node's: holders write theirs on their lease
		}
		holders[ref] = append(holders[ref], h)
	}
	latest := map[string]uint64{}
	for _, kv := range r.Responses[2].GetResponseRange().Kvs {
		var l cluster.Latest
		if err := cluster.Open(d.cfg.Secret, string(kv.Key), kv.Value, &l); err != nil {
			d.log.Warn("ignoring a latest record", "err", err)
			continue
		}
		latest[d.k.latest(l.Owner, l.Name)] = l.Version
	}
	var out []Listing
	for _, kv := range r.Responses[0].GetResponseRange().Kvs {
		var l Listing
		if err := cluster.Open(d.cfg.Secret, string(kv.Key), kv.Value, &l.Object); err != nil {
			d.log.Warn("ignoring an object record", "err", err)
			continue
		}
		l.Revision = kv.ModRevision
		for _, h := range holders[l.Ref()] {
			if h.ID == l.ID {
				l.Holders = append(l.Holders, h.Node)
			}
		}
		l.Latest = latest[d.k.latest(l.Owner, l.Name)]
		out = append(out, l)
	}
	return out, nil
}
