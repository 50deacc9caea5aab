package store

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"slices"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cudaipc/cudaipc/bundle"
	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// DefaultKeepVersions is how many of a versioned name's latest visible
// versions the store keeps without leases, unless the name or
// Config.KeepVersions says otherwise.
const DefaultKeepVersions = 1

// MaxShards bounds the shards of one version.
const MaxShards = 1024

// series is a versioned name: its versions, pending and visible.
//
// A version is pending until all of its shards are sealed, then visible
// (atomically: readers see all of its shards or none). The latest visible
// version is what a get without a version returns. Visible versions beyond
// the keep newest are retired: no new lease by "latest", and their memory
// goes once no shard of them is leased. A lease on any shard pins the whole
// version, so a reader that got shard 0 of version v can always get the
// other shards of v.
type series struct {
	name     string
	owner    uint32
	shared   bool
	keep     int // 0: the store's default
	versions map[uint64]*version
	latest   uint64 // latest visible version; 0 when none yet
	last     uint64 // highest version number ever opened
	// spare holds, per shard index, the memory of a reclaimed version,
	// kept for the next version's shard of the same size: double
	// buffering. Readers that cached the arena's mapping then map
	// nothing new (a new GPU allocation costs every reader an import,
	// milliseconds across GPUs).
	spare map[int]*object
}

// version is one version of a series.
type version struct {
	s       *series
	n       uint64
	shards  []*object // nil until created
	sealed  int
	visible bool
	retired bool
	leases  int // over all shards
}

// versionSel says which version and shard a get wants.
type versionSel struct {
	version   uint64 // 0: the latest
	shard     uint32
	newerThan uint64
}

// createOptions are the create request's extensions: versions and
// manifests.
type createOptions struct {
	versioned    bool
	version      uint64
	shards       uint32
	shard        uint32
	keep         uint32
	manifestSize int64
}

// manifest is a bundle's manifest: a memfd the creator writes and the
// daemon seals (F_SEAL_WRITE) and validates before the object is sealed;
// readers get a descriptor of it with every lease.
type manifest struct {
	f       *os.File
	size    int64
	tensors int
	sealed  bool
}

func (m *manifest) close() {
	if m != nil && m.f != nil {
		m.f.Close()
		m.f = nil
	}
}

func newManifest(size int64) (*manifest, error) {
	fd, err := unix.MemfdCreate("cudaipc-manifest", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, fmt.Errorf("memfd_create: %w", err)
	}
	f := os.NewFile(uintptr(fd), "memfd:cudaipc-manifest")
	if err := unix.Ftruncate(fd, size); err != nil {
		f.Close()
		return nil, fmt.Errorf("manifest: ftruncate: %w", err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW); err != nil {
		f.Close()
		return nil, fmt.Errorf("manifest: seal size: %w", err)
	}
	return &manifest{f: f, size: size}, nil
}

// dup returns a new descriptor of the manifest, for a reply.
func (m *manifest) dup() (*os.File, error) {
	fd, err := unix.FcntlInt(m.f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("dup manifest fd: %w", err)
	}
	return os.NewFile(uintptr(fd), m.f.Name()), nil
}

// finish makes the manifest immutable and checks it against an object of
// size bytes, unless checked holds the same bytes checked against the same
// size. It runs without Store.mu: the file is the object's alone.
func (m *manifest) finish(size int64, checked *manifestCache) error {
	if _, err := unix.FcntlInt(m.f.Fd(), unix.F_ADD_SEALS, unix.F_SEAL_WRITE|unix.F_SEAL_SEAL); err != nil {
		if errors.Is(err, unix.EBUSY) {
			return invalidf("the manifest is still mapped writable: unmap it before seal")
		}
		return fmt.Errorf("manifest: seal: %w", err)
	}
	buf := make([]byte, m.size)
	if _, err := m.f.ReadAt(buf, 0); err != nil {
		return fmt.Errorf("manifest: read: %w", err)
	}
	if n, ok := checked.lookup(buf, size); ok {
		m.tensors = n
		m.sealed = true
		return nil
	}
	man, err := bundle.Parse(buf)
	if err == nil {
		err = man.Check(size)
	}
	if err != nil {
		return invalidf("manifest: %v", err)
	}
	m.tensors = len(man.Tensors)
	m.sealed = true
	checked.add(buf, size, m.tensors)
	return nil
}

// manifestCache remembers the last manifests that passed the check (their
// bytes, the object size they were checked against, their tensor count), so
// that the next version of a model, whose header is the same, is not parsed
// again: parsing 18,867 tensors takes tens of milliseconds, and it lies
// between a publish and its readers. Identical bytes and size give the same
// verdict, and comparing 2 MB costs a fraction of a millisecond.
type manifestCache struct {
	mu      sync.Mutex
	entries []checkedManifest // newest last
	bytes   int
	parsed  int // manifests parsed and added (for tests)
	hits    int
}

type checkedManifest struct {
	raw     []byte
	size    int64
	tensors int
}

const (
	manifestCacheEntries = 4
	manifestCacheBytes   = 64 << 20
)

func (c *manifestCache) lookup(raw []byte, size int64) (int, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i := len(c.entries) - 1; i >= 0; i-- {
		e := c.entries[i]
		if e.size == size && bytes.Equal(e.raw, raw) {
			c.hits++
			return e.tensors, true
		}
	}
	return 0, false
}

func (c *manifestCache) add(raw []byte, size int64, tensors int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.parsed++
	if len(raw) > manifestCacheBytes {
		return
	}
	c.entries = append(c.entries, checkedManifest{raw: raw, size: size, tensors: tensors})
	c.bytes += len(raw)
	for len(c.entries) > manifestCacheEntries || c.bytes > manifestCacheBytes {
		c.bytes -= len(c.entries[0].raw)
		c.entries[0] = checkedManifest{}
		c.entries = c.entries[1:]
	}
}

// keepLocked is how many visible versions of sr are kept without leases.
func (s *Store) keepLocked(sr *series) int {
	if sr.keep > 0 {
		return sr.keep
	}
	return s.cfg.KeepVersions
}

// createExt creates an object with the create request's extensions: a
// shard of a version of a versioned name, and/or a bundle's manifest.
func (ss *session) createExt(name string, size int64, dev string, shared bool, opt createOptions) (placement, uint64, error) {
	s := ss.s
	if err := checkName(name); err != nil {
		return placement{}, 0, err
	}
	if size <= 0 {
		return placement{}, 0, invalidf("object size %d is not positive", size)
	}
	if opt.manifestSize < 0 || opt.manifestSize > bundle.MaxHeaderSize {
		return placement{}, 0, invalidf("manifest size %d is outside 0..%d", opt.manifestSize, bundle.MaxHeaderSize)
	}
	shards := max(opt.shards, 1)
	if !opt.versioned && (opt.version != 0 || opt.shards > 1 || opt.shard != 0 || opt.keep != 0) {
		return placement{}, 0, invalidf("version, shards, shard and keep_last need versioned")
	}
	if shards > MaxShards || opt.shard >= shards {
		return placement{}, 0, invalidf("shard %d of %d: want shard < shards <= %d", opt.shard, shards, MaxShards)
	}
	devName, err := s.backend.device(dev)
	if err != nil {
		return placement{}, 0, err
	}
	var man *manifest
	if opt.manifestSize > 0 {
		if man, err = newManifest(opt.manifestSize); err != nil {
			return placement{}, 0, err
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	fail := func(err error) (placement, uint64, error) {
		man.close()
		return placement{}, 0, err
	}
	if ss.closed {
		return fail(errSessionClosed)
	}
	if len(ss.created) >= s.cfg.MaxObjectsPerClient {
		return fail(fmt.Errorf("%w: this connection already has %d objects", ErrLimit, len(ss.created)))
	}
	var v *version
	if opt.versioned {
		if v, err = ss.versionForCreateLocked(name, shared, opt, shards); err != nil {
			return fail(err)
		}
	} else if _, ok := s.objects[name]; ok || s.series[name] != nil {
		return fail(fmt.Errorf("object %q: %w", name, ErrExists))
	}
	d, err := s.deviceLocked(devName)
	if err != nil {
		return fail(err)
	}
	o := &object{name: name, size: size, shared: shared, owner: ss.peer.uid, created: time.Now(), dev: d, creator: ss, manifest: man}
	if sp := s.takeSpareLocked(v, int(opt.shard), o); sp != nil {
		o.block = sp.block
		o.block.Value = o
	} else {
		b, err := s.allocLocked(d, o)
		if err != nil {
			ss.dropEmptyVersionLocked(v)
			return fail(err)
		}
		o.block = b
	}
	p, err := ss.placeLocked(o, true)
	if err == nil && man != nil {
		p.manifest, err = man.dup()
	}
	if err != nil {
		p.closeShare()
		o.manifest = nil
		s.freeLocked(o)
		ss.dropEmptyVersionLocked(v)
		return fail(err)
	}
	var n uint64
	if v != nil {
		o.ver, o.shard = v, int(opt.shard)
		v.shards[opt.shard] = o
		n = v.n
	} else {
		s.objects[name] = o
	}
	ss.created[o] = struct{}{}
	s.log.Debug("object created", "session", ss.id, "name", name, "size", size, "device", devName, "version", n, "shard", opt.shard, "shards", shards, "manifest", opt.manifestSize)
	return p, n, nil
}

// versionForCreateLocked finds or opens the version a versioned create
// puts a shard in.
func (ss *session) versionForCreateLocked(name string, shared bool, opt createOptions, shards uint32) (*version, error) {
	s := ss.s
	if _, ok := s.objects[name]; ok {
		return nil, fmt.Errorf("object %q exists and is not versioned: %w", name, ErrExists)
	}
	sr := s.series[name]
	if sr == nil {
		sr = &series{name: name, owner: ss.peer.uid, shared: shared, versions: make(map[uint64]*version)}
		s.series[name] = sr
	} else if sr.owner != ss.peer.uid && ss.peer.uid != 0 {
		return nil, fmt.Errorf("versioned object %q belongs to uid %d: %w", name, sr.owner, ErrPermission)
	}
	if opt.keep > 0 {
		sr.keep = int(opt.keep)
	}
	if opt.version != 0 {
		if v := sr.versions[opt.version]; v != nil {
			switch {
			case v.visible:
				return nil, fmt.Errorf("version %d of %q is already published: %w", opt.version, name, ErrExists)
			case len(v.shards) != int(shards):
				return nil, invalidf("version %d of %q has %d shards, not %d", opt.version, name, len(v.shards), shards)
			case v.shards[opt.shard] != nil:
				return nil, fmt.Errorf("shard %d of version %d of %q: %w", opt.shard, opt.version, name, ErrExists)
			}
			return v, nil
		}
		if opt.version <= sr.latest {
			return nil, fmt.Errorf("version %d of %q is not above the latest, %d: %w", opt.version, name, sr.latest, ErrExists)
		}
		return sr.openLocked(opt.version, shards), nil
	}
	// The oldest pending version still missing this shard: N ranks that
	// each create "the next version" meet in the same one.
	var pick *version
	for _, v := range sr.versions {
		if !v.visible && len(v.shards) == int(shards) && v.shards[opt.shard] == nil && (pick == nil || v.n < pick.n) {
			pick = v
		}
	}
	if pick != nil {
		return pick, nil
	}
	return sr.openLocked(max(sr.last, sr.latest)+1, shards), nil
}

func (sr *series) openLocked(n uint64, shards uint32) *version {
	v := &version{s: sr, n: n, shards: make([]*object, shards)}
	sr.versions[n] = v
	sr.last = max(sr.last, n)
	return v
}

// dropEmptyVersionLocked forgets a version no shard was created in, after
// a failed create.
func (ss *session) dropEmptyVersionLocked(v *version) {
	if v == nil || slices.ContainsFunc(v.shards, func(o *object) bool { return o != nil }) {
		return
	}
	delete(v.s.versions, v.n)
}

// lookupLocked finds the object a seal or abort names: the plain object
// name, or a shard of a version of it.
func (ss *session) unsealedExtLocked(name string, ver uint64, shard uint32) (*object, error) {
	if ver == 0 {
		return ss.unsealedLocked(name)
	}
	s := ss.s
	if sr := s.series[name]; sr != nil {
		if v := sr.versions[ver]; v != nil && int(shard) < len(v.shards) {
			if o := v.shards[shard]; o != nil && o.creator == ss {
				if o.sealed {
					return nil, fmt.Errorf("shard %d of version %d of %q: %w", shard, ver, name, ErrSealed)
				}
				return o, nil
			}
		}
	}
	return nil, fmt.Errorf("shard %d of version %d of %q: %w", shard, ver, name, ErrNotFound)
}

// sealExt seals an object this session created: a plain one (ver 0) or a
// shard of a version, which publishes the version when it is the last
// shard. A bundle's manifest is sealed and checked first.
func (ss *session) sealExt(name string, ver uint64, shard uint32) error {
	s := ss.s
	s.mu.Lock()
	if ss.closed {
		s.mu.Unlock()
		return errSessionClosed
	}
	o, err := ss.unsealedExtLocked(name, ver, shard)
	if err != nil {
		s.mu.Unlock()
		return err
	}
	if m := o.manifest; m != nil && !m.sealed {
		s.mu.Unlock()
		// Parsing a large manifest takes a while: not under the lock. Only
		// this session may seal o, and its requests are handled in order.
		err := m.finish(o.size, &s.manifests)
		s.mu.Lock()
		if err != nil {
			s.mu.Unlock()
			return err
		}
		if ss.closed {
			s.mu.Unlock()
			return errSessionClosed
		}
		if o, err = ss.unsealedExtLocked(name, ver, shard); err != nil {
			s.mu.Unlock()
			return err
		}
	}
	defer s.mu.Unlock()
	if o.ver == nil {
		ss.sealLocked(o)
		return nil
	}
	o.sealed = true
	v := o.ver
	v.sealed++
	s.log.Debug("shard sealed", "session", ss.id, "name", name, "version", v.n, "shard", shard, "sealed", v.sealed, "shards", len(v.shards))
	if v.sealed == len(v.shards) {
		s.publishLocked(v)
	}
	return nil
}

// publishLocked makes a version whose shards are all sealed visible, and
// retires the versions beyond the series' keep.
func (s *Store) publishLocked(v *version) {
	sr := v.s
	v.visible = true
	if v.n > sr.latest {
		sr.latest = v.n
	}
	s.retireLocked(sr)
	if w := s.waiters[sr.name]; w != nil {
		close(w.ch)
		delete(s.waiters, sr.name)
	}
	close(s.published)
	s.published = make(chan struct{})
	if !v.retired {
		s.emitLocked(eventSealed, v.shards[0])
	}
	s.log.Debug("version published", "name", sr.name, "version", v.n, "shards", len(v.shards))
}

// retireLocked retires the visible versions of sr beyond its keep newest,
// freeing those without leases.
func (s *Store) retireLocked(sr *series) {
	var visible []*version
	for _, v := range sr.versions {
		if v.visible && !v.retired {
			visible = append(visible, v)
		}
	}
	keep := s.keepLocked(sr)
	if len(visible) <= keep {
		return
	}
	slices.SortFunc(visible, func(a, b *version) int {
		if a.n > b.n {
			return -1
		}
		return 1
	})
	for _, v := range visible[keep:] {
		s.retireVersionLocked(v)
	}
}

// retireVersionLocked ends a version's life as a readable version; its
// memory goes now or with its last lease.
func (s *Store) retireVersionLocked(v *version) {
	v.retired = true
	if v.leases == 0 {
		s.freeVersionLocked(v)
	}
}

// freeVersionLocked frees every shard of a version and forgets it.
func (s *Store) freeVersionLocked(v *version) {
	sr := v.s
	for i, o := range v.shards {
		if o == nil {
			continue
		}
		o.deleted = true
		s.forgetCreatorLocked(o)
		if v.visible && s.series[sr.name] == sr && sr.spare[i] == nil {
			// Keep the memory for the next version's shard i.
			o.manifest.close()
			o.manifest = nil
			if sr.spare == nil {
				sr.spare = make(map[int]*object)
			}
			sr.spare[i] = o
		} else {
			s.freeLocked(o)
		}
		v.shards[i] = nil
	}
	delete(v.s.versions, v.n)
	s.log.Debug("version freed", "name", v.s.name, "version", v.n)
}

// abortVersionLocked discards a pending version: every shard, sealed or
// not. A shard's creator that dies before sealing aborts the version this
// way, so that no reader ever sees it.
func (s *Store) abortVersionLocked(v *version) {
	for _, o := range v.shards {
		if o != nil {
			s.emitLocked(eventAborted, o)
			break
		}
	}
	s.freeVersionLocked(v)
	s.log.Info("version aborted", "name", v.s.name, "version", v.n)
}

// abortExt discards an object this session created and has not sealed; for
// a shard, its whole version.
func (ss *session) abortExt(name string, ver uint64, shard uint32) error {
	s := ss.s
	s.mu.Lock()
	defer s.mu.Unlock()
	if ss.closed {
		return errSessionClosed
	}
	o, err := ss.unsealedExtLocked(name, ver, shard)
	if errors.Is(err, ErrNotFound) && ver != 0 {
		// Aborting any shard aborts the version: a client that lost track
		// of its shard index (an abandoned create) may name another.
		if sr := s.series[name]; sr != nil && sr.versions[ver] != nil {
			for _, x := range sr.versions[ver].shards {
				if x != nil && x.creator == ss && !x.sealed {
					o, err = x, nil
				}
			}
		}
	}
	if err != nil {
		return err
	}
	ss.abortLocked(o)
	return nil
}

// tryGetVersion leases a shard of a version, or returns ErrTimeout when
// the version wanted is not (yet) visible.
//
// It also returns the channel that the next publication closes, read under
// the same lock, so that a caller that waits on it misses none.
func (ss *session) tryGetVersion(name string, sel versionSel) (placement, <-chan struct{}, error) {
	s := ss.s
	s.mu.Lock()
	defer s.mu.Unlock()
	p, err := ss.tryGetVersionLocked(name, sel)
	return p, s.published, err
}

func (ss *session) tryGetVersionLocked(name string, sel versionSel) (placement, error) {
	s := ss.s
	if ss.closed {
		return placement{}, errSessionClosed
	}
	sr := s.series[name]
	if sr == nil {
		if o := s.objects[name]; o != nil && o.readableBy(ss.peer.uid) {
			return placement{}, invalidf("object %q is not versioned", name)
		}
		return placement{}, fmt.Errorf("no version of %q yet: %w", name, ErrTimeout)
	}
	if !sr.shared && sr.owner != ss.peer.uid && ss.peer.uid != 0 {
		return placement{}, fmt.Errorf("no version of %q yet: %w", name, ErrTimeout)
	}
	var v *version
	switch {
	case sel.version != 0:
		v = sr.versions[sel.version]
		if v == nil || !v.visible {
			// Gone for good: opened (or superseded) and no longer here.
			if v == nil && sel.version <= max(sr.latest, sr.last) {
				return placement{}, fmt.Errorf("version %d of %q was reclaimed or aborted (latest is %d): %w", sel.version, name, sr.latest, ErrNotFound)
			}
			return placement{}, fmt.Errorf("version %d of %q is not published yet: %w", sel.version, name, ErrTimeout)
		}
	case sr.latest > sel.newerThan:
		v = sr.versions[sr.latest]
	default:
		return placement{}, fmt.Errorf("no version of %q above %d yet: %w", name, sel.newerThan, ErrTimeout)
	}
	if v == nil {
		return placement{}, fmt.Errorf("version %d of %q: %w", sr.latest, name, ErrNotFound)
	}
	if int(sel.shard) >= len(v.shards) {
		return placement{}, invalidf("version %d of %q has %d shards, not shard %d", v.n, name, len(v.shards), sel.shard)
	}
	if len(ss.leases)+ss.waiting >= s.cfg.MaxLeasesPerClient {
		return placement{}, fmt.Errorf("%w: this connection already holds %d leases and %d waiting gets", ErrLimit, len(ss.leases), ss.waiting)
	}
	return ss.leaseLocked(v.shards[sel.shard])
}

// waitPublished waits until ch, from tryGetVersion, is closed by a
// publication (or ctx or the session ends); the caller then tries again.
func (ss *session) waitPublished(ctx context.Context, name string, sel versionSel, ch <-chan struct{}) error {
	s := ss.s
	s.mu.Lock()
	if len(ss.leases)+ss.waiting >= s.cfg.MaxLeasesPerClient {
		s.mu.Unlock()
		return fmt.Errorf("%w: this connection already holds %d leases and %d waiting gets", ErrLimit, len(ss.leases), ss.waiting)
	}
	ss.waiting++
	s.mu.Unlock()
	select {
	case <-ch:
	case <-ctx.Done():
	case <-ss.ctx.Done():
	}
	s.mu.Lock()
	ss.waiting--
	s.mu.Unlock()
	if err := ctx.Err(); err != nil {
		if errors.Is(err, context.DeadlineExceeded) {
			return fmt.Errorf("no version of %q above %d was published in time: %w", name, max(sel.newerThan, sel.version), ErrTimeout)
		}
		return err
	}
	if ss.ctx.Err() != nil {
		return errSessionClosed
	}
	return nil
}

// seriesInfoLocked describes a series by the shard 0 of its latest visible
// version, for list and stat; ok is false when none is visible.
func (ss *session) seriesInfoLocked(sr *series) (info, bool) {
	if sr.latest == 0 || (!sr.shared && sr.owner != ss.peer.uid && ss.peer.uid != 0) {
		return info{}, false
	}
	v := sr.versions[sr.latest]
	if v == nil || v.shards[0] == nil {
		return info{}, false
	}
	return v.shards[0].info(), true
}

// deleteSeriesLocked removes a versioned name: pending versions are
// aborted, visible ones freed now or with their last lease.
func (ss *session) deleteSeriesLocked(sr *series) error {
	s := ss.s
	if sr.owner != ss.peer.uid && ss.peer.uid != 0 {
		return fmt.Errorf("versioned object %q belongs to uid %d: %w", sr.name, sr.owner, ErrPermission)
	}
	delete(s.series, sr.name)
	for i, o := range sr.spare {
		s.freeLocked(o)
		delete(sr.spare, i)
	}
	var latest *object
	if v := sr.versions[sr.latest]; v != nil {
		latest = v.shards[0]
	}
	if latest != nil {
		s.emitLocked(eventDeleted, latest)
	}
	for _, v := range sr.versions {
		if !v.visible {
			s.abortVersionLocked(v)
		} else if !v.retired {
			s.retireVersionLocked(v)
		}
	}
	s.log.Debug("versioned object deleted", "session", ss.id, "name", sr.name)
	return nil
}

// event is what subscribers are told when kind happens to o.
func (o *object) event(kind eventKind) event {
	e := event{kind: kind, name: o.name}
	if o.ver != nil {
		e.version = o.ver.n
	}
	return e
}

// createExt answers a create with extensions (versions, a manifest).
// cn.order must be held.
func (cn *conn) createExt(id uint64, r *storev1.CreateRequest) {
	opt := createOptions{
		versioned: r.GetVersioned(), version: r.GetVersion(), shards: r.GetShards(), shard: r.GetShard(),
		keep: r.GetKeepLast(), manifestSize: int64(r.GetManifestSize()),
	}
	p, n, err := cn.ss.createExt(r.GetName(), int64(r.GetSize()), r.GetDevice(), r.GetShared(), opt)
	if err != nil {
		cn.replyLocked("create", protocol.ErrorResponse(id, err), nil)
		return
	}
	cn.replyLocked("create", &storev1.Response{Id: id, Body: &storev1.Response_Create{Create: &storev1.CreateResponse{
		Placement: p.proto(), Version: n, ManifestAttached: p.manifest != nil}}}, &p)
}

// waitAndGrantVersion answers a get of a version: a lease on the shard
// wanted of the version wanted, once it is published, waiting timeoutMs
// milliseconds (0: not at all, < 0: forever).
func (cn *conn) waitAndGrantVersion(id uint64, name string, sel versionSel, timeoutMs int64) {
	ctx := cn.ss.ctx
	if timeoutMs > 0 && timeoutMs <= math.MaxInt64/int64(time.Millisecond) {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, time.Duration(timeoutMs)*time.Millisecond)
		defer cancel()
	}
	for {
		cn.order.Lock()
		p, published, err := cn.ss.tryGetVersion(name, sel)
		if err == nil {
			cn.replyLocked("get", &storev1.Response{Id: id, Body: &storev1.Response_Get{Get: &storev1.GetResponse{
				LeaseId: p.leaseID, Placement: p.proto(), Info: p.info.proto(), ManifestAttached: p.manifest != nil,
			}}}, &p)
			cn.order.Unlock()
			return
		}
		if !errors.Is(err, ErrTimeout) || timeoutMs == 0 {
			cn.replyLocked("get", protocol.ErrorResponse(id, err), nil)
			cn.order.Unlock()
			return
		}
		cn.order.Unlock()
		if err := cn.ss.waitPublished(ctx, name, sel, published); err != nil {
			if cn.ss.ctx.Err() == nil {
				cn.reply("get", protocol.ErrorResponse(id, err), nil)
			}
			return
		}
	}
}

// takeSpareLocked returns the spare memory of shard of v's series when it
// fits o (same size, device and pool), removing it from the series.
func (s *Store) takeSpareLocked(v *version, shard int, o *object) *object {
	if v == nil {
		return nil
	}
	sp := v.s.spare[shard]
	if sp == nil || sp.size != o.size || sp.dev != o.dev || sp.owner != o.owner || sp.shared != o.shared {
		return nil
	}
	delete(v.s.spare, shard)
	return sp
}

// freeSparesLocked frees every series' spare memory on device d, to make
// room; it reports whether it freed any.
func (s *Store) freeSparesLocked(d *device) bool {
	freed := false
	for _, sr := range s.series {
		for i, o := range sr.spare {
			if o.dev == d {
				s.freeLocked(o)
				delete(sr.spare, i)
				freed = true
			}
		}
	}
	return freed
}
